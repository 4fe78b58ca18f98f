"""Hand every produced file and image to an ArtifactStore and put the links on the result. Nothing is lost:
a file that cannot be stored keeps its place on disk and the result says why."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from . import artifacts, links
from .errors import FileTransferError, StorageError
from .result import ExecutionResult, File, Image, Upload
from .storage import ArtifactStore, blob_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploadLimits:
    """Caps on what one execution uploads."""

    max_file: int = 256 * 1024**2
    max_total: int = 1024**3


def publish(result: ExecutionResult, store: ArtifactStore, *, prefix: str = "nbexec",
            limits: UploadLimits = UploadLimits(),
            already: MutableMapping[str, str] | None = None) -> ExecutionResult:
    """Store the result's files and images and return the result with URLs, upload statuses and rewritten links.

    ``already`` maps names to the sha256 last uploaded (a session's memory): unchanged files are not sent again
    and are left out of this result's uploads.
    """
    uploads: list[Upload] = []
    budget = [limits.max_total]
    files = [_publish_file(result, f, store, prefix, limits, budget, already, uploads) for f in result.files]
    images = [_publish_image(result, i, store, prefix, limits, budget, uploads) for i in result.images]
    updated = dataclasses.replace(result, files=tuple(files), images=tuple(images), uploads=tuple(uploads))
    urls = links.url_map(updated)
    return dataclasses.replace(updated, stdout=links.rewrite(updated.stdout, urls),
                               stderr=links.rewrite(updated.stderr, urls), text=links.rewrite(updated.text, urls))


def _publish_file(result: ExecutionResult, item: File, store: ArtifactStore, prefix: str, limits: UploadLimits,
                  budget: list[int], already: MutableMapping[str, str] | None, uploads: list[Upload]) -> File:
    local = store.local_url(Path(item.path))
    if local is not None:
        uploads.append(Upload(item.name, "file", "kept", local))
        return dataclasses.replace(item, url=local)
    if already is not None and already.get(item.name) == item.sha256:
        return item
    reason = _over_cap(item.size, limits, budget)
    if reason:
        uploads.append(Upload(item.name, "file", "skipped", None, reason))
        return item
    name = blob_name(prefix, result.execution_id, item.name)
    try:
        size, chunks = artifacts.open_stream(Path(result.output_dir) / "data", item.name, max_bytes=limits.max_file)
        with io.BufferedReader(_Checked(chunks, item.sha256)) as stream:
            url = store.upload(name, stream, item.mime, length=size)
    except (StorageError, FileTransferError) as exc:
        log.warning("%s stays on disk: %s", item.name, exc)
        uploads.append(Upload(item.name, "file", "failed", None, str(exc), name))
        return item
    budget[0] -= item.size
    if already is not None:
        already[item.name] = item.sha256
    uploads.append(Upload(item.name, "file", "uploaded", url, None, name))
    return dataclasses.replace(item, url=url)


def _publish_image(result: ExecutionResult, image: Image, store: ArtifactStore, prefix: str, limits: UploadLimits,
                   budget: list[int], uploads: list[Upload]) -> Image:
    path = Path(image.path)
    label = f"images/{path.name}"
    local = store.local_url(path)
    if local is not None:
        uploads.append(Upload(label, "image", "kept", local))
        return dataclasses.replace(image, url=local)
    reason = _over_cap(image.size, limits, budget)
    if reason:
        uploads.append(Upload(label, "image", "skipped", None, reason))
        return image
    name = blob_name(prefix, result.execution_id, f".outputs/{path.name}")
    try:
        with open(path, "rb") as handle:  # made by nbexec in its private output folder
            url = store.upload(name, handle, image.mime, length=image.size)
    except (StorageError, OSError) as exc:
        uploads.append(Upload(label, "image", "failed", None, str(exc), name))
        return image
    budget[0] -= image.size
    uploads.append(Upload(label, "image", "uploaded", url, None, name))
    return dataclasses.replace(image, url=url)


class _Checked(io.RawIOBase):
    """A file's chunks as a stream for the store, never held whole; the last read fails when their sha256 is
    not the one the result lists (so a changed file is never stored under the listed hash)."""

    def __init__(self, chunks: artifacts.FileChunks, sha256: str) -> None:
        self._chunks, self._expected, self._hash, self._rest = chunks, sha256, hashlib.sha256(), b""

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._chunks.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        if not self._rest:
            self._rest = next(self._chunks, b"")
            self._hash.update(self._rest)
            if not self._rest and self._hash.hexdigest() != self._expected:
                raise StorageError("the file changed after the run; it was not uploaded")
        size = min(len(buffer), len(self._rest))
        buffer[:size], self._rest = self._rest[:size], self._rest[size:]
        return size


def _over_cap(size: int, limits: UploadLimits, budget: list[int]) -> str | None:
    if limits.max_file and size > limits.max_file:
        return f"larger than the {limits.max_file:,}-byte per-file upload cap"
    if limits.max_total and size > budget[0]:
        return f"over the {limits.max_total:,}-byte per-execution upload cap"
    return None
