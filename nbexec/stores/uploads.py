"""Hand every produced file and image to an ArtifactStore, and say what became of each. Nothing is lost: a file
that cannot be stored keeps its place on disk and the result says why."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

from nbexec.errors import FileTransferError, StorageError
from nbexec.files import transfer
from nbexec.notebook import links
from nbexec.result import ExecutionResult, File, Image, Upload

from .storage import ArtifactStore, blob_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploadLimits:
    """Caps on what one execution uploads."""

    max_file: int = 256 * 1024**2
    max_total: int = 1024**3


@dataclasses.dataclass(frozen=True)
class Stored:
    """Files and images with the URLs the store gave them, and what happened to each."""

    files: tuple[File, ...]
    images: tuple[Image, ...]
    uploads: tuple[Upload, ...]


def store_all(files: Sequence[File], images: Sequence[Image], store: ArtifactStore, *, execution_id: str,
              data_dir: Path, limits: UploadLimits = UploadLimits(),
              already: MutableMapping[str, str] | None = None) -> Stored:
    """Hand every file (read from its copy in ``data_dir``) and image to ``store``.

    ``already`` maps names to the sha256 last uploaded (a session's memory): unchanged files are not sent again
    and are left out of the uploads."""
    uploads: list[Upload] = []
    job = _Job(store, store.prefix, execution_id, data_dir, limits, [limits.max_total], already, uploads)
    stored_files = tuple(job.file(f) for f in files)
    stored_images = tuple(job.image(i) for i in images)
    return Stored(stored_files, stored_images, tuple(uploads))


def publish(result: ExecutionResult, store: ArtifactStore, *, limits: UploadLimits = UploadLimits(),
            already: MutableMapping[str, str] | None = None) -> ExecutionResult:
    """A result's files and images stored in another ``store``: the result with their URLs and the links in its
    text views rewritten (runs build their results with their store's links already; this re-publishes one, or
    one made elsewhere: a node's). ``already`` as in `store_all`."""
    stored = store_all(result.files, result.images, store, execution_id=result.execution_id,
                       data_dir=Path(result.output_dir) / "data", limits=limits, already=already)
    urls = {f.name: f.url for f in stored.files if f.url}
    return dataclasses.replace(result, files=stored.files, images=stored.images, uploads=stored.uploads,
                               stdout=links.rewrite(result.stdout, urls), stderr=links.rewrite(result.stderr, urls),
                               text=links.rewrite(result.text, urls))


@dataclasses.dataclass
class _Job:
    store: ArtifactStore
    prefix: str
    execution_id: str
    data_dir: Path
    limits: UploadLimits
    budget: list[int]
    already: MutableMapping[str, str] | None
    uploads: list[Upload]
    images: dict[str, Image] = dataclasses.field(default_factory=dict)  # path -> as stored: one file, one upload

    def file(self, item: File) -> File:
        local = self.store.local_url(Path(item.path))
        if local is not None:
            self.uploads.append(Upload(item.name, "file", "kept", local))
            return dataclasses.replace(item, url=local)
        if self.already is not None and self.already.get(item.name) == item.sha256:
            return item
        reason = _over_cap(item.size, self.limits, self.budget)
        if reason:
            self.uploads.append(Upload(item.name, "file", "skipped", None, reason))
            return item
        name = blob_name(self.prefix, self.execution_id, item.name)
        try:
            size, chunks = transfer.open_stream(self.data_dir, item.name, max_bytes=self.limits.max_file)
            if size != item.size:
                chunks.close()
                raise StorageError(f"the file changed after the run ({size:,} bytes, not {item.size:,}); it was "
                                   "not uploaded")
            with io.BufferedReader(_Checked(chunks, item.sha256)) as stream:
                url = self.store.upload(name, stream, item.mime, length=size)
        except (StorageError, FileTransferError) as exc:
            log.warning("%s stays on disk: %s", item.name, exc)
            self.uploads.append(Upload(item.name, "file", "failed", None, str(exc), name))
            return item
        self.budget[0] -= item.size
        if self.already is not None:
            self.already[item.name] = item.sha256
        self.uploads.append(Upload(item.name, "file", "uploaded", url, None, name))
        return dataclasses.replace(item, url=url)

    def image(self, image: Image) -> Image:
        """Store an image file once, however many outputs show it (`transfer.save_images` shares the file)."""
        if image.path in self.images:
            return dataclasses.replace(image, url=self.images[image.path].url)
        self.images[image.path] = stored = self._image(image)
        return stored

    def _image(self, image: Image) -> Image:
        path = Path(image.path)
        label = f"images/{path.name}"
        local = self.store.local_url(path)
        if local is not None:
            self.uploads.append(Upload(label, "image", "kept", local))
            return dataclasses.replace(image, url=local)
        reason = _over_cap(image.size, self.limits, self.budget)
        if reason:
            self.uploads.append(Upload(label, "image", "skipped", None, reason))
            return image
        name = blob_name(self.prefix, self.execution_id, f".outputs/{path.name}")
        try:
            with open(path, "rb") as handle:  # made by nbexec in its private output folder
                url = self.store.upload(name, handle, image.mime, length=image.size)
        except (StorageError, OSError) as exc:
            self.uploads.append(Upload(label, "image", "failed", None, str(exc), name))
            return image
        self.budget[0] -= image.size
        self.uploads.append(Upload(label, "image", "uploaded", url, None, name))
        return dataclasses.replace(image, url=url)


class _Checked(io.RawIOBase):
    """A file's chunks as a stream for the store, read once and never held whole (one chunk ahead). The bytes
    handed out are the bytes hashed; the read that would hand out the last of them fails instead when their
    sha256 is not the one the result lists, so a changed file is never stored under the listed hash, whether
    or not the store reads on to the end of the stream."""

    def __init__(self, chunks: transfer.FileChunks, sha256: str) -> None:
        self._chunks, self._expected, self._hash = chunks, sha256, hashlib.sha256()
        self._rest, self._next = b"", self._pull()

    def _pull(self) -> bytes:
        chunk = next(self._chunks, b"")
        self._hash.update(chunk)
        return chunk

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._chunks.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        if not self._rest:
            self._rest, self._next = self._next, self._pull() if self._next else b""
            if not self._next and self._hash.hexdigest() != self._expected:  # _rest is the last chunk
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
