"""Snapshots of a session: its files and notebook, kept private, restorable only by their owner, checked on restore.

A snapshot is hostile data (the files came from the sandbox). It is a folder of a private snapshot store (0700;
files 0600): ``files/`` (the regular files of /mnt/data as a run collects them: within max_data and max_files,
never following a link), ``notebook.ipynb``, and ``manifest.json`` (its id, owner, config, and the sha256 and size
of every file and of the notebook), signed with the store's key (``manifest.sig``, an HMAC-SHA256; the key is a
random 32 bytes made once, 0600).

Its id is ``<random>.<mac>``, the mac bound to the owner (as session ids of a router are): another owner's id, or
an id changed by one character, is "no such snapshot". On restore the signature is checked, then the manifest's
own id and owner against the id asked for (a renamed or replayed snapshot folder is refused), then each file's
size and sha256 as it is read (before a byte reaches the new sandbox); the notebook is re-validated. Memory comes
back by replaying the notebook's executed cells into the new sandbox (`hibernation.replay`). Caps: snapshots per
owner (``max_snapshots``) and the files' total (the config's max_data), checked before anything is written.
A snapshot lives ``ttl`` seconds (NBEXEC_SNAPSHOT_TTL, default 7 days) from its making: past it, it is refused as
unknown and removed with its files, at the latest on the store's next use by anyone. One being made is out of
expiry's reach: made under another name, locked, renamed into place whole. One whose process died is swept at the
store's next use (a node's start and janitor too): made and locked under a shared flock of the store's folder (its
gate), it has no live maker when the gate is held exclusively and its own lock is free, whatever its age."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from nbformat import NotebookNode

from nbexec import notebook
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError, SessionLimitError, SnapshotError
from nbexec.files import folders, space, transfer
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.source import SandboxHandle

from . import collect, durable

MAX_SNAPSHOTS = 8  # per owner
TTL = 7 * 24 * 3600.0  # seconds a snapshot is kept (NBEXEC_SNAPSHOT_TTL), then removed with its files
MAX_MANIFEST = 4 * 1024**2
MAKING = ".making"  # a snapshot's folder while it is made
GATE_WAIT = 10.0  # seconds a take waits for the store's gate (its folder's flock; see the module docstring)
_ID = re.compile(r"([0-9a-f]{32})\.([0-9a-f]{32})")


_taking: collections.Counter[tuple[str, str]] = collections.Counter()  # (store, owner) -> snapshots being made
_taking_lock = threading.Lock()


@contextlib.contextmanager
def place(store: str, owner: str, count: Callable[[], int], cap: int) -> Iterator[None]:
    """Hold one of ``owner``'s ``cap`` places in ``store`` while a snapshot is made. Taken with the check: takes
    running at once (HTTP's threads, MCP's calls) would all pass a count made before they wrote anything."""
    with _taking_lock:
        if count() + _taking[(store, owner)] >= cap:
            raise SessionLimitError(f"{cap} snapshots are kept for this owner; delete one first")
        _taking[(store, owner)] += 1
    try:
        yield
    finally:
        with _taking_lock:
            _taking[(store, owner)] -= 1
            if not _taking[(store, owner)]:
                del _taking[(store, owner)]


@dataclass(frozen=True)
class Restored:
    """What a restore gives the new session: its config, notebook and the files to put into /mnt/data."""

    config: SandboxConfig
    notebook: NotebookNode
    files: list[tuple[str, int, str]]  # (name in /mnt/data, size, sha256)
    open_file: Callable[[str], BinaryIO]  # a file's host copy, opened without following any link
    release: Callable[[], None] = lambda: None  # drops the host copy (a blob store's private download)


class SnapshotStore:
    """A private folder of snapshots (see the module docstring)."""

    def __init__(self, root: Path, max_snapshots: int = MAX_SNAPSHOTS, *, key: bytes | None = None,
                 ttl: float = TTL) -> None:
        self.root = Path(root)
        self.max_snapshots = max_snapshots
        self.ttl = ttl
        self._given_key = key  # a shared key from configuration (a blob store's staging); else the folder's own

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r})"

    def _key(self) -> bytes:
        if self._given_key is not None:
            return self._given_key
        path = self._private_root() / "key"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise SnapshotError(f"the snapshot key {path} is not a private file of ours")
            key = handle.read(64)
        if len(key) != 32:
            raise SnapshotError(f"the snapshot key {path} is damaged; remove the snapshot folder to start anew")
        return key

    def _private_root(self) -> Path:
        if not os.path.lexists(self.root):
            folders.make_output_dir(self.root, may_exist=False)
        folders.OutputFolder.open(self.root).close()  # a real folder of ours, private
        if stat.S_IMODE(os.lstat(self.root).st_mode) & 0o077:
            raise SnapshotError(f"the snapshot folder {self.root} must be private (0700)")
        return self.root

    # -- making -----------------------------------------------------------------------------------

    def take(self, owner: str, config: SandboxConfig, nb: NotebookNode, sandbox: SandboxHandle) -> str:
        """Snapshot ``sandbox``'s /mnt/data and ``nb`` for ``owner``; its id (SnapshotError past the caps)."""
        key = self._key()
        with place(str(self.root), owner, lambda: self.count(owner), self.max_snapshots):
            return self._make(key, owner, config, nb, sandbox)

    def _make(self, key: bytes, owner: str, config: SandboxConfig, nb: NotebookNode, sandbox: SandboxHandle) -> str:
        raw = secrets.token_hex(16)
        snapshot_id = f"{raw}.{mac(key, owner, raw)}"
        # Admitted before a byte is written: its files (max_data) and notebook (the output budgets) plus the margin.
        held = space.reserve([space.Need(self.root, config.max_data_bytes + 2 * (
            config.max_output_bytes + config.max_display_bytes), "a snapshot of /mnt/data and the notebook")],
            config.disk_margin_bytes)
        # Made under a name no listing, expiry or restore reads, locked while made, and published whole by a rename.
        making = self.root / f"{raw}{MAKING}"
        try:
            with _gate(self._private_root(), fcntl.LOCK_SH, GATE_WAIT):  # no sweep between the mkdir and the lock
                folders.make_output_dir(making, may_exist=False)
                target = folders.OutputFolder.open(making)
                fcntl.flock(target.fd, fcntl.LOCK_EX)
        except BaseException:
            held.release()
            remove_tree(making)
            raise
        try:
            self._fill(target, raw, owner, config, nb, sandbox, key)
            os.rename(making, self.root / raw)
        except BaseException:
            remove_tree(making)  # still locked: no sweep removes it under us
            raise
        finally:
            target.close()
            held.release()  # what was written is gone from the free space; nothing more is held
        return snapshot_id

    def _fill(self, target: folders.OutputFolder, raw: str, owner: str, config: SandboxConfig, nb: NotebookNode,
              sandbox: SandboxHandle, key: bytes) -> None:
        with target.child("files") as files:
            collection = sandbox.snapshot(files, collect.limits(config))
        if collection.skipped:
            raise SnapshotError(f"/mnt/data holds what a snapshot cannot keep ({collection.skipped[0].name}:"
                                f" {collection.skipped[0].reason}); remove it and snapshot again")
        body = notebook.dumps(nb)
        transfer.replace(target, "notebook.ipynb", body)
        manifest = json.dumps({
            "id": raw, "owner": owner, "created": time.time(), "config": durable.config_dict(config),
            "notebook": {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)},
            "files": [{"name": f.name, "sha256": f.sha256, "size": f.size} for f in collection.files],
        }, sort_keys=True).encode()
        transfer.replace(target, "manifest.json", manifest)
        transfer.replace(target, "manifest.sig", hmac.new(key, manifest, hashlib.sha256).hexdigest().encode())

    def count(self, owner: str) -> int:
        return len(self.listing(owner))

    def listing(self, owner: str) -> list[Listed]:
        """``owner``'s snapshots, oldest first; every expired snapshot (anyone's) is removed on the way."""
        key, found = self._key(), []
        self.sweep()
        for raw in self._raws():
            who, created = self._header(raw)
            if expired(created, self.ttl):
                remove_tree(self.root / raw)
            elif who == owner:
                found.append(Listed(f"{raw}.{mac(key, owner, raw)}", created, created + self.ttl))
        return sorted(found, key=lambda listed: listed.created)

    def _raws(self) -> list[str]:
        return [n for n in os.listdir(self._private_root()) if re.fullmatch(r"[0-9a-f]{32}", n)]

    def sweep(self) -> None:
        """Remove the folders of takes whose process died (see the module docstring); left to the next use when
        the gate stays busy for a second."""
        dead: list[tuple[int, str]] = []
        with contextlib.suppress(SnapshotError), _gate(self._private_root(), fcntl.LOCK_EX, 1.0):
            for name in filter(re.compile(r"[0-9a-f]{32}" + re.escape(MAKING)).fullmatch, os.listdir(self.root)):
                with contextlib.suppress(OSError):
                    fd = os.open(self.root / name, folders.DIR_FLAGS)
                    if not _locked(fd, fcntl.LOCK_EX):  # its take is under way
                        os.close(fd)
                        continue
                    dead.append((fd, name))
        for fd, name in dead:  # still locked by this sweep: another one leaves them alone
            remove_tree(self.root / name)
            os.close(fd)

    def _header(self, raw: str) -> tuple[str | None, float]:
        """The owner and making time a snapshot's manifest names; a folder still being made (no manifest yet)
        has no owner and its folder's time."""
        try:
            body = json.loads(self._read(raw, "manifest.json", MAX_MANIFEST))
            return str(body["owner"]), float(body["created"])
        except (SnapshotError, ValueError, TypeError, KeyError):
            try:
                return None, os.lstat(self.root / raw).st_mtime
            except OSError:
                return None, time.time()

    def delete(self, owner: str, snapshot_id: str) -> None:
        """Remove ``owner``'s snapshot and its files (SnapshotError, "no snapshot", for any other id)."""
        remove_tree(self.root / self._check_id(owner, snapshot_id))

    def _check_id(self, owner: str, snapshot_id: str) -> str:
        """The folder name of ``owner``'s snapshot ``snapshot_id``; "no snapshot" for another owner's, a changed,
        a deleted or an expired-and-removed id."""
        raw = raw_of(self._key(), owner, snapshot_id)
        if not os.path.lexists(self.root / raw):
            raise SnapshotError(f"no snapshot {snapshot_id[:80]!r} of yours")
        return raw

    # -- restoring --------------------------------------------------------------------------------

    def _read(self, raw: str, name: str, limit: int) -> bytes:
        try:
            fd = os.open(self.root / raw / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            raise SnapshotError(f"the snapshot's {name} is missing") from None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
                raise SnapshotError(f"the snapshot's {name} is not a file within its cap")
            return handle.read(limit + 1)

    def open(self, owner: str, snapshot_id: str) -> Restored:
        """The checked contents of ``snapshot_id`` for ``owner`` (SnapshotError: unknown, not theirs, tampered)."""
        raw = self._check_id(owner, snapshot_id)
        manifest = self._read(raw, "manifest.json", MAX_MANIFEST)
        signature = self._read(raw, "manifest.sig", 128)
        if not hmac.compare_digest(signature, hmac.new(self._key(), manifest, hashlib.sha256).hexdigest().encode()):
            raise SnapshotError("the snapshot's manifest was changed: refused")
        body: dict[str, Any] = json.loads(manifest)
        if body.get("id") != raw or body.get("owner") != owner:
            raise SnapshotError("the snapshot's manifest names another snapshot or owner: refused")
        if expired(body.get("created"), self.ttl):
            remove_tree(self.root / raw)
            raise SnapshotError(f"no snapshot {snapshot_id[:80]!r} of yours (it expired and was removed)")
        config = durable.config_from(body["config"])
        nb_bytes = self._read(raw, "notebook.ipynb", int(body["notebook"]["size"]))
        if hashlib.sha256(nb_bytes).hexdigest() != body["notebook"]["sha256"]:
            raise SnapshotError("the snapshot's notebook was changed: refused")
        try:
            nb = notebook.from_json(nb_bytes.decode("utf-8"), "snapshot")
        except (NbexecError, UnicodeDecodeError) as exc:
            raise SnapshotError(f"the snapshot's notebook is not valid: {exc}") from None
        files = [(str(e["name"]), int(e["size"]), str(e["sha256"])) for e in body["files"]]
        opener = functools.partial(self._open_file, raw)
        for name, size, digest in files:
            with opener(name) as handle:
                _check(handle, name, size, digest)
        return Restored(config, nb, files, opener)

    def _open_file(self, raw: str, name: str) -> BinaryIO:
        """A file of the snapshot, reached through folder descriptors: no link followed on the way."""
        try:
            parts = transfer.relative_parts(name)
            root = os.open(self.root / raw / "files", transfer.DIR_FLAGS)
            try:
                parent = transfer.open_parent(root, parts)
            finally:
                os.close(root)
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=parent)
            finally:
                os.close(parent)
        except (OSError, NbexecError):
            raise SnapshotError(f"the snapshot's file {name[:200]!r} is missing or was replaced: refused") from None
        return os.fdopen(fd, "rb")


@dataclass(frozen=True)
class Listed:
    """One snapshot of an owner, as listed: its id, and when it was made and expires (Unix seconds)."""

    id: str
    created: float
    expires: float


@contextlib.contextmanager
def _gate(root: Path, mode: int, wait: float) -> Iterator[None]:
    """Hold ``root``'s gate (fcntl ``mode``) within ``wait`` seconds; SnapshotError when it stays busy."""
    fd = os.open(root, folders.DIR_FLAGS)  # the folder, not a file in it (deleted or planted, a live take was swept)
    try:
        give_up = time.monotonic() + wait
        while not _locked(fd, mode):
            if time.monotonic() > give_up:
                raise SnapshotError("the snapshot store stayed busy; try again")
            time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _locked(fd: int, mode: int) -> bool:
    """Whether the lock ``mode`` on ``fd`` was had at once."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def expired(created: Any, ttl: float) -> bool:
    """Whether a snapshot made at ``created`` (a manifest's value: anything) is past ``ttl``."""
    try:
        return time.time() - float(created) > ttl
    except (TypeError, ValueError):
        return True


def ttl_from(environ: Mapping[str, str]) -> float:
    """NBEXEC_SNAPSHOT_TTL in seconds (default `TTL`); ConfigError unless a number above 0."""
    raw = environ.get("NBEXEC_SNAPSHOT_TTL", "").strip()
    try:
        ttl = float(raw) if raw else TTL
    except ValueError:
        ttl = -1.0
    if not 0 < ttl < float("inf"):
        raise ConfigError(f"NBEXEC_SNAPSHOT_TTL={raw[:40]!r} is not a number of seconds above 0")
    return ttl


def mac(key: bytes, owner: str, raw: str) -> str:
    """The second half of a snapshot id: ``raw`` bound to ``owner`` under ``key``."""
    return hmac.new(key, f"snapshot\0{owner}\0{raw}".encode(), hashlib.sha256).hexdigest()[:32]


def raw_of(key: bytes, owner: str, snapshot_id: str) -> str:
    """The random part of ``snapshot_id`` when it is ``owner``'s under ``key``; else SnapshotError ("no snapshot")."""
    found = _ID.fullmatch(snapshot_id) if isinstance(snapshot_id, str) else None
    if found is None or not hmac.compare_digest(found[2], mac(key, owner, found[1])):
        raise SnapshotError(f"no snapshot {str(snapshot_id)[:80]!r} of yours")
    return found[1]


def _check(handle: BinaryIO, name: str, size: int, digest: str) -> None:
    info = os.fstat(handle.fileno())
    hasher = hashlib.sha256()
    if stat.S_ISREG(info.st_mode) and info.st_size == size:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    if hasher.hexdigest() != digest:
        raise SnapshotError(f"the snapshot's file {name[:200]!r} was changed: refused")


def put_files(sandbox: SandboxHandle, restored: Restored) -> None:
    """Put a checked snapshot's files into a new sandbox's /mnt/data, each checked again just before it is sent
    (from the same descriptor)."""
    for name, size, digest in restored.files:
        with restored.open_file(name) as handle:
            _check(handle, name, size, digest)
            handle.seek(0)
            sandbox.put_file(name, handle)


def store_for(state_dir: str | Path | None, snapshot_dir: str | Path | None = None) -> SnapshotStore:
    """The snapshot store: ``snapshot_dir``, else NBEXEC_SNAPSHOT_DIR, else the state folder's ``snapshots``,
    else a private temporary folder."""
    chosen = snapshot_dir or os.environ.get("NBEXEC_SNAPSHOT_DIR")
    ttl = ttl_from(os.environ)
    if chosen:
        return SnapshotStore(Path(chosen).absolute(), ttl=ttl)
    if state_dir is not None:
        return SnapshotStore(Path(state_dir).absolute() / "snapshots", ttl=ttl)
    return SnapshotStore(folders.private_root("nbexec-snapshots"), ttl=ttl)

