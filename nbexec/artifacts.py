"""Files the code left in /mnt/data, read on the host side without ever following a link.

Every host-side access under a run's folders goes through directory file descriptors with O_NOFOLLOW, and
each file is checked with fstat after it is opened, so links, FIFOs, sockets and devices planted by the code
(or swapped in while we look) are reported and never read. The size that counts is the apparent size seen at
fstat: nothing past it is read, files are hashed and copied in chunks, and a sparse file over the cap is
skipped unread. Copies on the host are 0600, so no set-id or exec bit carries over.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mimetypes
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .errors import FileTransferError
from .folders import OutputFolder
from .outputs import ImageData
from .result import File, Image, SkippedFile

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_KINDS = [(stat.S_ISLNK, "symbolic link (not followed)"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20
MAX_DEPTH = 64  # deeper folders are listed as skipped, not walked
MAX_SKIPPED = 200  # entries listed in skipped_files; the rest are counted in a note


def display_name(raw: bytes) -> str:
    """A name safe to print and to put in JSON: undecodable bytes and control characters escaped."""
    text = raw.decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _valid_name(raw: bytes) -> str | None:
    """Why a relative name cannot be handed on as it is, or None when it is fine."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "name is not UTF-8"
    if any(not c.isprintable() for c in text):
        return "name contains control characters"
    if len(raw) > 1024:
        return "name is longer than 1024 bytes"
    return None


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Caps on what one collection keeps (0: no cap). Sizes are apparent sizes (``st_size``)."""

    max_file: int = 0
    max_total: int = 0
    max_files: int = 0


@dataclass
class Collection:
    """What a collection kept, what it left out (at most MAX_SKIPPED listed) and nbexec's notes on it."""

    files: list[File] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# name -> (identity of the source file when copied: inode, size, mtime, ctime; sha256 of the copy)
Known = dict[str, tuple[tuple[int, int, int, int], str]]


@dataclass
class _Folder:
    fd: int
    parts: tuple[bytes, ...]
    names: list[str]
    parent: _Folder | None
    target: int | None = None  # the matching host folder, opened when a file in it is copied


class _Collector:
    """One walk of a data folder with directory descriptors (no recursion), copying kept files to ``target``."""

    def __init__(self, source: Path, target: Path | None, limits: Limits, known: Known | None) -> None:
        self.source, self.target, self.limits = source, target, limits
        self.known, self.now_known = known, Known()
        self.out = Collection()
        self.more_skipped = self.not_kept = self.total = self.examined = 0
        self.seen: dict[int, int] = {}  # inode -> entries seen that name it (hard links)
        self.kept: dict[int, tuple[int, list[File]]] = {}  # inode -> (its link count, files kept for it)

    def skip(self, parts: tuple[bytes, ...], reason: str) -> None:
        if len(self.out.skipped) < MAX_SKIPPED:
            self.out.skipped.append(SkippedFile(display_name(b"/".join(parts))[:300] or ".", reason))
        else:
            self.more_skipped += 1

    def run(self, root: _Folder) -> None:
        stack = [root]
        budget = max(self.limits.max_files, 1000) * 10
        try:
            while stack:
                folder = stack[-1]
                if not folder.names:
                    _close(folder)
                    stack.pop()
                    continue
                self.examined += 1
                if self.examined > budget:
                    self.out.notes.append(f"the walk of /mnt/data stopped after {budget:,} entries")
                    break
                child = self._visit(folder, os.fsencode(folder.names.pop()))
                if child is not None:
                    stack.append(child)
        finally:
            for folder in stack:
                _close(folder)

    def _visit(self, folder: _Folder, raw: bytes) -> _Folder | None:
        parts = (*folder.parts, raw)
        try:
            st = os.stat(raw, dir_fd=folder.fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return self._enter(folder, parts, st)
        if stat.S_ISREG(st.st_mode):
            self.seen[st.st_ino] = self.seen.get(st.st_ino, 0) + 1
        reason = _why_skip(st.st_mode, _valid_name(b"/".join(parts)))
        if reason is None and self.limits.max_file and st.st_size > self.limits.max_file:
            reason = f"larger than the {self.limits.max_file:,}-byte per-file cap (apparent size, not read)"
        if reason is not None:
            self.skip(parts, reason)
        elif self.limits.max_files and len(self.out.files) >= self.limits.max_files:
            self.not_kept += 1
        else:
            self._take(folder, parts, st)
        return None

    def _enter(self, folder: _Folder, parts: tuple[bytes, ...], st: os.stat_result) -> _Folder | None:
        if len(parts) > MAX_DEPTH:
            self.skip(parts, f"folder nested deeper than {MAX_DEPTH} levels (not walked)")
            return None
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=folder.fd)
        except OSError as exc:
            self.skip(parts, f"unreadable folder: {exc.strerror}")
            return None
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise OSError(0, "changed while being read")
            return _Folder(fd, parts, sorted(os.listdir(fd), reverse=True), folder)
        except OSError as exc:
            os.close(fd)
            self.skip(parts, f"unreadable folder: {exc.strerror}")
            return None

    def _take(self, folder: _Folder, parts: tuple[bytes, ...], st: os.stat_result) -> None:
        name = display_name(b"/".join(parts))
        try:
            fd = os.open(parts[-1], _READ_FLAGS, dir_fd=folder.fd)
        except OSError as exc:
            self.skip(parts, f"could not be opened: {exc.strerror}")
            return
        try:
            now = os.fstat(fd)
            size = now.st_size  # the size that counts, and the most that is ever read
            reason = _why_skip(now.st_mode, None) or ("changed while being read" if now.st_ino != st.st_ino else None)
            if reason is None and self.limits.max_file and size > self.limits.max_file:
                reason = f"larger than the {self.limits.max_file:,}-byte per-file cap (apparent size, not read)"
            if reason is None and self.limits.max_total and self.total + size > self.limits.max_total:
                reason = f"over the {self.limits.max_total:,}-byte total cap"
            if reason is not None:
                self.skip(parts, reason)
                return
            key = (now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns)
            previous = (self.known or {}).get(name)
            if previous is not None and previous[0] == key:
                digest = previous[1]  # unchanged since the host copy was made
            else:
                digest, size = self._copy(fd, size, folder, parts[-1])
        except OSError as exc:
            self.skip(parts, f"could not be copied: {exc.strerror}")
            return
        finally:
            os.close(fd)
        self.total += size
        self.now_known[name] = (key, digest)
        base = self.source if self.target is None else self.target
        item = File(name, str(base / name), size, mimetypes.guess_type(name)[0] or "application/octet-stream",
                    digest)
        self.out.files.append(item)
        self.kept.setdefault(st.st_ino, (st.st_nlink, []))[1].append(item)

    def _copy(self, fd: int, size: int, folder: _Folder, leaf: bytes) -> tuple[str, int]:
        """Hash (and copy to the host, 0600, never through a link) at most ``size`` bytes, in chunks."""
        sha, done = hashlib.sha256(), 0
        target = _target_dir(folder) if self.target is not None else None
        temp = b".nbexec-copy-" + os.urandom(6).hex().encode()
        out = os.open(temp, _WRITE_FLAGS, 0o600, dir_fd=target) if target is not None else None
        try:
            while done < size:
                chunk = os.read(fd, min(_CHUNK, size - done))
                if not chunk:
                    break  # it shrank: what was read is what is handed over
                sha.update(chunk)
                if out is not None:
                    _write_all(out, chunk)
                done += len(chunk)
            if out is not None:
                os.rename(temp, leaf, src_dir_fd=target, dst_dir_fd=target)
        except OSError:
            if out is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=target)
            raise
        finally:
            if out is not None:
                os.close(out)
        return sha.hexdigest(), done

    def finish(self) -> Collection:
        """Drop hard links to files outside the walk, remove stale host copies, write the notes."""
        for ino, (nlink, items) in self.kept.items():
            if nlink > self.seen.get(ino, 0):
                for item in items:
                    self.out.files.remove(item)
                    self.now_known.pop(item.name, None)
                    self.skip((os.fsencode(item.name),), "hard link to a file outside /mnt/data")
                    if self.target is not None:
                        _unlink(self.target, item.name)
        if self.target is not None:
            for name in set(self.known or {}) - set(self.now_known):
                _unlink(self.target, name)
        if self.known is not None:
            self.known.clear()
            self.known.update(self.now_known)
        self.out.files.sort(key=lambda f: f.name)
        if self.not_kept:
            self.out.notes.append(f"{self.not_kept:,} more files in /mnt/data were not kept: a result lists at "
                                  f"most {self.limits.max_files:,} files (max_files)")
        if self.more_skipped:
            self.out.notes.append(f"{self.more_skipped:,} more entries of /mnt/data were not collected (only the "
                                  f"first {MAX_SKIPPED} are listed in skipped_files)")
        return self.out


def _write_all(fd: int, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


def _close(folder: _Folder) -> None:
    for fd in (folder.fd, folder.target):
        if fd is not None and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    folder.fd, folder.target = -1, None


def _target_dir(folder: _Folder) -> int:
    """The host folder matching ``folder``, made (0700) and opened along the way, never through a link."""
    chain = []
    walk: _Folder | None = folder
    while walk is not None and walk.target is None:
        chain.append(walk)
        walk = walk.parent
    assert walk is not None and walk.target is not None, "the root folder has its target open"
    parent_fd = walk.target
    for item in reversed(chain):
        with contextlib.suppress(FileExistsError):
            os.mkdir(item.parts[-1], 0o700, dir_fd=parent_fd)
        item.target = os.open(item.parts[-1], _DIR_FLAGS, dir_fd=parent_fd)
        parent_fd = item.target
    return parent_fd


def _unlink(root_path: Path, name: str) -> None:
    with contextlib.suppress(OSError, FileTransferError):
        parts = _relative_parts(name)
        root = os.open(root_path, _DIR_FLAGS)
        try:
            parent = _open_parent(root, parts)
        finally:
            os.close(root)
        try:
            os.unlink(parts[-1], dir_fd=parent)
        finally:
            os.close(parent)


def snapshot(source: Path, target: OutputFolder | None, limits: Limits = Limits(), *,
             known: Known | None = None) -> Collection:
    """Collect the regular files under ``source``: sha256, apparent size, MIME type; everything else is listed
    as skipped with a reason. With ``target`` (a host folder made by nbexec), each kept file is copied there
    (0600, hashed in the same pass) and ``File.path`` points at the copy. ``known`` (a session's memory of the
    last copy) spares copying unchanged files and removes copies of files that are gone."""
    out = Collection()
    try:
        root_fd = os.open(source, _DIR_FLAGS)
    except OSError as exc:
        out.skipped.append(SkippedFile(".", f"the data folder is unreadable: {exc.strerror}"))
        return out
    try:
        names = sorted(os.listdir(root_fd), reverse=True)
        target_fd = os.dup(target.fd) if target is not None else None  # the folder held open, never re-resolved
    except OSError as exc:
        os.close(root_fd)
        out.skipped.append(SkippedFile(".", f"the data folder is unreadable: {exc.strerror}"))
        return out
    collector = _Collector(source, target.path if target is not None else None, limits, known)
    collector.run(_Folder(root_fd, (), names, None, target_fd))
    return collector.finish()


def collect(data_dir: Path, *, max_file: int = 0, max_total: int = 0) -> tuple[list[File], list[SkippedFile]]:
    """The regular files under ``data_dir`` (hashed where they lie, nothing copied) and what was skipped."""
    found = snapshot(data_dir, None, Limits(max_file=max_file, max_total=max_total))
    return found.files, found.skipped


def _why_skip(mode: int, bad_name: str | None) -> str | None:
    for check, kind in _KINDS:
        if check(mode):
            return kind
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if mode & (stat.S_ISUID | stat.S_ISGID):
        return "setuid or setgid file"
    return bad_name


def _open_parent(root_fd: int, parts: tuple[bytes, ...]) -> int:
    fd = os.dup(root_fd)
    for part in parts[:-1]:
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def save_images(images: list[ImageData], folder: OutputFolder) -> list[Image]:
    """Write image outputs into ``folder``/images; names are made here, never taken from the code."""
    if not images:
        return []
    saved = []
    counts: dict[int, int] = {}
    with folder.child("images") as images_dir:
        for image in images:
            counts[image.cell_index] = counts.get(image.cell_index, 0) + 1
            name = f"cell{image.cell_index}-{counts[image.cell_index]}.{image.extension}"
            path = write_new(images_dir, name, image.content)
            saved.append(Image(image.mime, str(path), image.cell_index, len(image.content)))
    return saved


def write_new(folder: OutputFolder, name: str, content: bytes) -> Path:
    """Create ``name`` in ``folder`` exclusively (through its descriptor, never through a link), adding a suffix
    if the name is taken; the file is private (0600) unless the folder is shared. Returns its shown path."""
    stem, dot, ext = name.rpartition(".") if "." in name else (name, "", "")
    candidate = name
    for attempt in range(1, 1000):
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         folder.file_mode, dir_fd=folder.fd)
        except FileExistsError:
            candidate = f"{stem}-{attempt}{dot}{ext}"
            continue
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        return folder.path / candidate
    raise FileTransferError(f"cannot find a free name for {name} in {folder.path}")


def replace(folder: OutputFolder, name: str, content: bytes) -> Path:
    """Write ``name`` in ``folder`` atomically (a new file renamed over the old one, through the descriptor)."""
    temp = write_new(folder, f".{name}.tmp", content).name
    os.replace(temp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    return folder.path / name


def _relative_parts(name: str) -> tuple[bytes, ...]:
    parts = tuple(p for p in name.replace("\\", "/").split("/") if p not in ("", "."))
    if not parts or any(p == ".." for p in parts):
        raise FileTransferError(f"{name!r} is not a plain relative name inside /mnt/data")
    raw = tuple(os.fsencode(p) for p in parts)
    if _valid_name(b"/".join(raw)):
        raise FileTransferError(f"{name!r}: {_valid_name(b'/'.join(raw))}")
    return raw


def put(data_dir: Path, name: str, content: bytes | BinaryIO, *, owner: tuple[int, int] | None = None) -> None:
    """Write ``content`` (bytes, or a binary file streamed in chunks) to /mnt/data/``name`` from the host,
    replacing any entry there but never following it. Past the data filesystem's space or inodes it fails
    with a FileTransferError that says so, and leaves nothing behind."""
    parts = _relative_parts(name)
    root = os.open(data_dir, _DIR_FLAGS)
    try:
        fd = os.dup(root)
        for part in parts[:-1]:
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                raise _put_error(name, exc) from exc
            os.close(fd)
            fd = child
        try:
            _put_file(fd, parts[-1], content, owner)
        except OSError as exc:
            raise _put_error(name, exc) from exc
        finally:
            os.close(fd)
    finally:
        os.close(root)


def _put_file(folder_fd: int, leaf: bytes, content: bytes | BinaryIO, owner: tuple[int, int] | None) -> None:
    temp = b".nbexec-upload-" + os.urandom(6).hex().encode()
    out = os.open(temp, _WRITE_FLAGS, 0o644, dir_fd=folder_fd)
    try:
        if isinstance(content, bytes):
            _write_all(out, content)
        else:
            while chunk := content.read(_CHUNK):
                _write_all(out, chunk)
        if owner:
            os.fchown(out, *owner)
        os.rename(temp, leaf, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder_fd)
        raise
    finally:
        os.close(out)


def _put_error(name: str, exc: OSError) -> FileTransferError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FileTransferError(f"{name!r} does not fit in /mnt/data: its filesystem is full (max_data and "
                                 "max_files cap it). Delete files there, or raise max_data / max_files.")
    if exc.errno == errno.ENOTDIR or exc.errno == errno.ELOOP:
        return FileTransferError(f"cannot create {name!r}: a part of it is not a folder")
    return FileTransferError(f"cannot write {name!r}: {exc.strerror}")


def get(data_dir: Path, name: str, *, max_bytes: int = 0) -> bytes:
    """Read /mnt/data/``name`` from the host: a regular file only, never through a link; refused by its size
    at fstat when over ``max_bytes``, and never read past that size."""
    _, chunks = open_stream(data_dir, name, max_bytes=max_bytes)
    try:
        return b"".join(chunks)
    finally:
        chunks.close()


def open_stream(data_dir: Path, name: str, *, max_bytes: int = 0, chunk: int = 1 << 20) -> tuple[int, FileChunks]:
    """Open ``data_dir/name`` for streaming: (its size at open, an iterator of at most that many bytes).

    Opened through directory descriptors without following links, a regular file by fstat; a size over
    ``max_bytes`` (0: no cap) raises FileTransferError before anything is read. The file is closed when the
    iterator ends or is dropped.
    """
    parts = _relative_parts(name)
    try:
        root = os.open(data_dir, _DIR_FLAGS)
    except OSError as exc:
        raise FileTransferError(f"{name!r}: the folder is unreadable ({exc.strerror})") from exc
    try:
        parent = _open_parent(root, parts)
        try:
            fd = os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:
        raise FileTransferError(f"{name!r} is not a readable regular file ({exc.strerror})") from exc
    finally:
        os.close(root)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (max_bytes and st.st_size > max_bytes):
        os.close(fd)
        why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"is larger than {max_bytes:,} bytes"
        raise FileTransferError(f"{name!r} {why}")
    return st.st_size, FileChunks(os.fdopen(fd, "rb", buffering=0), st.st_size, chunk)


class FileChunks:
    """At most ``size`` bytes of an open file, ``chunk`` at a time; the file is closed at the end, by ``close()``,
    or when the iterator is dropped unread (a client that left, an upload that failed)."""

    def __init__(self, handle: BinaryIO, size: int, chunk: int) -> None:
        self._handle, self._left, self._chunk = handle, size, chunk

    def __iter__(self) -> FileChunks:
        return self

    def __next__(self) -> bytes:
        data = self._handle.read(min(self._chunk, self._left)) if self._left > 0 and not self._handle.closed else b""
        if not data:
            self.close()
            raise StopIteration
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._handle.close()

    def __del__(self) -> None:
        self.close()
