"""Snapshots kept in a blob store that nodes share (``NBEXEC_SNAPSHOT_STORE=azure``).

A session whose node died is restored on any node with the same store settings and key.

A snapshot is the folder `snapshots.SnapshotStore` makes (``files/``, ``notebook.ipynb``, ``manifest.json``,
``manifest.sig``). It is made in a private staging folder and uploaded as blobs under ``<prefix>/<owner tag>/<raw>/``.
The owner tag is an HMAC of the owner, so names in the store say nothing about who.

The key that signs manifests and binds ids to owners is NEVER in the blob store: whoever can write there could
forge snapshots. It comes from configuration (``NBEXEC_SNAPSHOT_KEY``, 32 bytes or more), the same on every node.
Everything read back is hostile. The manifest is capped (`MAX_MANIFEST`) before it is parsed, and its signature
checked before it is trusted. The blobs must be exactly the manifest's. Each streams into a private staging folder
within its signed size, its sha256 checked as read; a larger blob is never held or written past that size.
The local store's own `open` then checks the staged copy again. The staging folder is removed once the files are
in the new sandbox, or on any refusal.
An owner's expired snapshots (past ``ttl``, by the signed making time) go whenever that owner lists, counts, takes
or restores. A lifecycle rule on the prefix is the backstop for owners who never come back.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError, SnapshotError, StorageError
from nbexec.files import folders, space, transfer
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.source import SandboxHandle
from nbexec.stores import blobspace, gcs, s3
from nbexec.stores.storage import AzureBlobSettings

from . import durable, snapshots
from .snapshots import MAX_MANIFEST, MAX_SNAPSHOTS, Restored, SnapshotStore

MIN_KEY_BYTES = 32
KINDS = ("local", "azure", "s3", "gcs")
_RAW = re.compile(r"[0-9a-f]{32}")
_FIXED = ("manifest.json", "manifest.sig", "notebook.ipynb")


def key_from(text: str | None) -> bytes:
    """``NBEXEC_SNAPSHOT_KEY`` as bytes: hex or base64 of 32 bytes or more (ConfigError, never echoing it)."""
    text = (text or "").strip()
    if not text:
        raise ConfigError("a shared snapshot store needs NBEXEC_SNAPSHOT_KEY (the same on every node; make one "
                          "with: python -c 'import secrets; print(secrets.token_hex(32))')")
    try:
        key = bytes.fromhex(text) if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", text) else base64.b64decode(
            text.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("NBEXEC_SNAPSHOT_KEY is neither hex nor base64") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"NBEXEC_SNAPSHOT_KEY holds {len(key)} bytes; it needs {MIN_KEY_BYTES} or more")
    return key


class BlobSnapshotStore:
    """Snapshots as blobs of a shared `blobspace.BlobSpace` (see the module docstring)."""

    def __init__(self, space: blobspace.BlobSpace, key: bytes, *, prefix: str = "snapshots",
                 max_snapshots: int = MAX_SNAPSHOTS, ttl: float = snapshots.TTL) -> None:
        self.space = space
        self.prefix = prefix.strip("/")
        self.max_snapshots = max_snapshots
        self.ttl = ttl
        self._secret = key

    def __repr__(self) -> str:
        return f"BlobSnapshotStore({self.space!r}, prefix={self.prefix!r})"

    def _folder(self, owner: str) -> str:
        tag = hmac.new(self._secret, f"owner\0{owner}".encode(), hashlib.sha256).hexdigest()[:32]
        return f"{self.prefix}/{tag}/"

    def count(self, owner: str) -> int:
        return len(self.listing(owner))

    def listing(self, owner: str) -> list[snapshots.Listed]:
        """``owner``'s snapshots, oldest first; their expired ones are removed on the way."""
        found = []
        for raw in (name for name in self.space.folders(self._folder(owner)) if _RAW.fullmatch(name)):
            base = f"{self._folder(owner)}{raw}/"
            try:
                created = json.loads(self._fetch(base, "manifest.json", MAX_MANIFEST))["created"]
            except (SnapshotError, ValueError, TypeError, KeyError):
                continue  # still being uploaded (its manifest comes last), or not ours to judge
            if snapshots.expired(created, self.ttl):
                self._remove(base)
            else:
                snapshot_id = f"{raw}.{snapshots.mac(self._secret, owner, raw)}"
                found.append(snapshots.Listed(snapshot_id, float(created), float(created) + self.ttl))
        return sorted(found, key=lambda listed: listed.created)

    def _remove(self, base: str) -> None:
        for name in sorted(self.space.names(base), key=lambda n: n.endswith("manifest.json")):  # manifest last
            self.space.delete(name)

    def sweep(self) -> None:
        """Nothing to sweep in the store: a take is uploaded from a private staging folder of its own."""

    def take(self, owner: str, config: SandboxConfig, nb: NotebookNode, sandbox: SandboxHandle) -> str:
        """Snapshot ``sandbox``'s /mnt/data and ``nb`` for ``owner`` into the blob store; its id."""
        with snapshots.place(f"blobs:{self._folder(owner)}", owner, lambda: self.count(owner), self.max_snapshots):
            staging = _staging()
            try:
                snapshot_id = SnapshotStore(staging / "s", key=self._secret, ttl=self.ttl).take(owner, config, nb,
                                                                                                sandbox)
                raw = snapshot_id.split(".", 1)[0]
                self._upload(staging / "s" / raw, f"{self._folder(owner)}{raw}/")
            finally:
                remove_tree(staging)
            return snapshot_id

    def _upload(self, local: Path, base: str) -> None:
        names = sorted(str(p.relative_to(local)) for p in (local / "files").rglob("*") if p.is_file())
        done: list[str] = []
        try:
            for name in [*names, "notebook.ipynb", "manifest.sig", "manifest.json"]:  # the manifest last
                with open(local / name, "rb") as handle:
                    self.space.put(base + name, handle, os.fstat(handle.fileno()).st_size)
                done.append(base + name)
        except BaseException:
            for name in done:
                self.space.delete(name)
            raise

    def delete(self, owner: str, snapshot_id: str) -> None:
        base = f"{self._folder(owner)}{snapshots.raw_of(self._secret, owner, snapshot_id)}/"
        if not self.space.names(base):
            raise SnapshotError(f"no snapshot {snapshot_id[:80]!r} of yours")
        self._remove(base)

    # -- restoring --------------------------------------------------------------------------------

    def open(self, owner: str, snapshot_id: str) -> Restored:
        """The checked contents of ``snapshot_id`` for ``owner``, in a private staging folder.

        The returned `Restored.release` removes the folder. SnapshotError when unknown, not theirs or tampered."""
        raw = snapshots.raw_of(self._secret, owner, snapshot_id)
        base = f"{self._folder(owner)}{raw}/"
        staging = _staging()
        try:
            target = staging / "s" / raw
            self._download(base, target, owner, raw)
            restored = SnapshotStore(staging / "s", key=self._secret, ttl=self.ttl).open(owner, snapshot_id)
        except BaseException:
            remove_tree(staging)
            raise
        return replace(restored, release=lambda: remove_tree(staging))

    def _download(self, base: str, target: Path, owner: str, raw: str) -> None:
        manifest = self._fetch(base, "manifest.json", MAX_MANIFEST)
        signature = self._fetch(base, "manifest.sig", 128)
        if not hmac.compare_digest(signature, hmac.new(self._secret, manifest, hashlib.sha256).hexdigest().encode()):
            raise SnapshotError("the snapshot's manifest was changed: refused")
        body: dict[str, Any] = json.loads(manifest)
        if body.get("id") != raw or body.get("owner") != owner:
            raise SnapshotError("the snapshot's manifest names another snapshot or owner: refused")
        if snapshots.expired(body.get("created"), self.ttl):
            self._remove(base)
            raise SnapshotError("no snapshot of yours with that id (it expired and was removed)")
        wanted = {"notebook.ipynb": (int(body["notebook"]["size"]), str(body["notebook"]["sha256"]))}
        wanted.update({f"files/{e['name']}": (int(e["size"]), str(e["sha256"])) for e in body["files"]})
        listed = {n[len(base):] for n in self.space.names(base)} - {"manifest.json", "manifest.sig"}
        if listed != set(wanted):
            raise SnapshotError("the snapshot's blobs are not the ones its manifest names (added, removed or "
                                "renamed): refused")
        margin = durable.config_from(body["config"]).disk_margin_bytes
        held = space.reserve([space.Need(target.parent.parent, sum(n for n, _ in wanted.values()) + len(manifest),
                                         "a snapshot's download")], margin)  # admitted before a byte is written
        try:
            folders.make_output_dir(target, may_exist=False)
            _write(target, "manifest.json", [manifest])
            _write(target, "manifest.sig", [signature])
            for name, (size, digest) in sorted(wanted.items()):
                _write(target, name, self._checked(base, name, size, digest))
        finally:
            held.release()  # what was written is gone from the free space

    def _fetch(self, base: str, name: str, limit: int) -> bytes:
        return b"".join(self._checked(base, name, limit, None))

    def _checked(self, base: str, name: str, size: int, digest: str | None) -> Any:
        """The chunks of blob ``name``: never more than ``size`` bytes, and (with ``digest``) exactly them."""
        hasher, seen = hashlib.sha256(), 0
        try:
            for chunk in self.space.get(base + name, size):
                seen += len(chunk)
                if seen > size:
                    raise SnapshotError(f"the snapshot's {name[:200]!r} is larger than its manifest says: refused")
                hasher.update(chunk)
                yield chunk
        except StorageError as exc:
            raise SnapshotError(f"the snapshot's {name[:200]!r} cannot be read: {exc}") from None
        if digest is not None and (seen != size or not hmac.compare_digest(hasher.hexdigest(), digest)):
            raise SnapshotError(f"the snapshot's {name[:200]!r} was changed: refused")


def _staging() -> Path:
    """A new private (0700) folder for one snapshot's host copy."""
    return Path(tempfile.mkdtemp(prefix="snap-", dir=folders.private_root("nbexec-snapshot-staging")))


def _write(target: Path, name: str, chunks: Any) -> None:
    """Write ``chunks`` to ``target/name`` (0600; folders 0700), never following a link; the name is checked."""
    try:
        parts = transfer.relative_parts(name)
    except NbexecError:
        raise SnapshotError(f"the snapshot names a file {name[:200]!r} outside it: refused") from None
    fd = os.open(target, transfer.DIR_FLAGS)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            child = os.open(part, transfer.DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        with os.fdopen(out, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
    finally:
        os.close(fd)


def from_env(environ: Mapping[str, str]) -> BlobSnapshotStore:
    """The shared snapshot store NBEXEC_SNAPSHOT_STORE names, keyed by NBEXEC_SNAPSHOT_KEY (see .env.example).

    Blobs go under NBEXEC_SNAPSHOT_PREFIX (default snapshots). Each store reads its artifact store's settings.
    Azure adds NBEXEC_SNAPSHOT_CONTAINER (default nbexec-snapshots, made on the first snapshot).
    S3 and GCS add NBEXEC_SNAPSHOT_BUCKET, an existing bucket (default NBEXEC_S3_BUCKET or NBEXEC_GCS_BUCKET)."""
    kind = environ.get("NBEXEC_SNAPSHOT_STORE", "local")
    if kind not in KINDS[1:]:
        raise ConfigError(f"NBEXEC_SNAPSHOT_STORE={kind[:40]!r} is not one of {', '.join(KINDS)}")
    if environ.get("NBEXEC_SNAPSHOT_DIR"):
        raise ConfigError(f"set NBEXEC_SNAPSHOT_DIR or NBEXEC_SNAPSHOT_STORE={kind}, not both")
    key = key_from(environ.get("NBEXEC_SNAPSHOT_KEY"))
    prefix = environ.get("NBEXEC_SNAPSHOT_PREFIX") or "snapshots"
    if not re.fullmatch(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*", prefix) or ".." in prefix.split("/"):
        raise ConfigError(f"NBEXEC_SNAPSHOT_PREFIX={prefix[:80]!r} is not a plain blob folder (letters, digits, "
                          "._- and single slashes)")
    return BlobSnapshotStore(_space(kind, environ), key, prefix=prefix, ttl=snapshots.ttl_from(environ))


def _space(kind: str, environ: Mapping[str, str]) -> blobspace.BlobSpace:
    if kind == "s3":
        bucket = environ.get("NBEXEC_SNAPSHOT_BUCKET") or environ.get("NBEXEC_S3_BUCKET") or ""
        return blobspace.S3BlobSpace(s3.from_env({**environ, "NBEXEC_S3_BUCKET": bucket}))
    if kind == "gcs":
        bucket = environ.get("NBEXEC_SNAPSHOT_BUCKET") or environ.get("NBEXEC_GCS_BUCKET") or ""
        return blobspace.GCSBlobSpace(gcs.from_env({**environ, "NBEXEC_GCS_BUCKET": bucket}))
    return blobspace.AzureBlobSpace(AzureBlobSettings(
        connection_string=environ.get("AZURE_STORAGE_CONNECTION_STRING") or None,
        account_name=environ.get("AZURE_STORAGE_ACCOUNT_NAME") or None,
        account_key=environ.get("AZURE_STORAGE_ACCOUNT_KEY") or None,
        container=environ.get("NBEXEC_SNAPSHOT_CONTAINER") or "nbexec-snapshots"))


def store_for(state_dir: str | Path | None,
              snapshot_dir: str | Path | None = None) -> SnapshotStore | BlobSnapshotStore:
    """The snapshot store: the shared blob store NBEXEC_SNAPSHOT_STORE names (`from_env`), or a folder.

    A folder (`snapshots.store_for`) when ``snapshot_dir`` is given, or the variable is unset or ``local``."""
    if snapshot_dir is None and os.environ.get("NBEXEC_SNAPSHOT_STORE", "local") != "local":
        return from_env(os.environ)
    return snapshots.store_for(state_dir, snapshot_dir)
