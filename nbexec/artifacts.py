"""Files the code left in /mnt/data, read on the host side without ever following a link.

Every host-side access under a run's folders goes through directory file descriptors with O_NOFOLLOW, and
each file is checked with fstat after it is opened, so links, FIFOs, sockets and devices planted by the code
(or swapped in while we look) are reported and never read.
"""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import FileTransferError
from .folders import OutputFolder
from .outputs import ImageData
from .result import File, Image, SkippedFile

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_KINDS = [(stat.S_ISLNK, "symbolic link (not followed)"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
MAX_DEPTH = 32


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


@dataclass(frozen=True)
class _Entry:
    parts: tuple[bytes, ...]
    st: os.stat_result


def _walk(dir_fd: int, parts: tuple[bytes, ...], skipped: list[SkippedFile]) -> Iterator[_Entry]:
    try:
        names = sorted(os.listdir(dir_fd))
    except OSError as exc:
        skipped.append(SkippedFile(display_name(b"/".join(parts)) or ".", f"unreadable folder: {exc.strerror}"))
        return
    for name in names:
        raw = os.fsencode(name)
        try:
            st = os.stat(raw, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if len(parts) >= MAX_DEPTH:
                skipped.append(SkippedFile(display_name(b"/".join((*parts, raw))), "folder nested too deep"))
                continue
            try:
                child = os.open(raw, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                skipped.append(SkippedFile(display_name(b"/".join((*parts, raw))), f"unreadable: {exc.strerror}"))
                continue
            try:
                yield from _walk(child, (*parts, raw), skipped)
            finally:
                os.close(child)
        else:
            yield _Entry((*parts, raw), st)


def _open_parent(root_fd: int, parts: tuple[bytes, ...]) -> int:
    fd = os.dup(root_fd)
    for part in parts[:-1]:
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def _digest(root_fd: int, entry: _Entry) -> tuple[str, int] | str:
    """(sha256, size) of a regular file, opened safely; or why it was not read."""
    parent = _open_parent(root_fd, entry.parts)
    try:
        fd = os.open(entry.parts[-1], _READ_FLAGS, dir_fd=parent)
    except OSError as exc:
        return f"could not be opened: {exc.strerror}"
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != entry.st.st_ino:
            return "changed while being read"
        sha = hashlib.sha256()
        size = 0
        while chunk := os.read(fd, 1 << 20):
            sha.update(chunk)
            size += len(chunk)
        return sha.hexdigest(), size
    finally:
        os.close(fd)


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def collect(data_dir: Path, *, max_file: int = 0, max_total: int = 0) -> tuple[list[File], list[SkippedFile]]:
    """List the regular files under ``data_dir`` with size, MIME type and sha256; report everything else."""
    files: list[File] = []
    skipped: list[SkippedFile] = []
    try:
        root_fd = os.open(data_dir, _DIR_FLAGS)
    except OSError as exc:
        return files, [SkippedFile(".", f"the data folder is unreadable: {exc.strerror}")]
    try:
        entries = list(_walk(root_fd, (), skipped))
        links: dict[tuple[int, int], int] = {}
        for entry in entries:
            if stat.S_ISREG(entry.st.st_mode):
                key = (entry.st.st_dev, entry.st.st_ino)
                links[key] = links.get(key, 0) + 1
        total = 0
        for entry in entries:
            rel = b"/".join(entry.parts)
            name = display_name(rel)
            reason = _why_skip(entry, links, _valid_name(rel))
            if reason is None and max_file and entry.st.st_size > max_file:
                reason = f"larger than the {max_file:,}-byte per-file cap"
            if reason is None and max_total and total + entry.st.st_size > max_total:
                reason = f"over the {max_total:,}-byte total cap"
            if reason is None:
                digest = _digest(root_fd, entry)
                if isinstance(digest, str):
                    reason = digest
                else:
                    total += digest[1]
                    mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
                    files.append(File(name, str(Path(data_dir) / name), digest[1], mime, digest[0]))
                    continue
            skipped.append(SkippedFile(name, reason))
    finally:
        os.close(root_fd)
    return files, skipped


def _why_skip(entry: _Entry, links: dict[tuple[int, int], int], bad_name: str | None) -> str | None:
    mode = entry.st.st_mode
    for check, kind in _KINDS:
        if check(mode):
            return kind
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if entry.st.st_nlink > links.get((entry.st.st_dev, entry.st.st_ino), 0):
        return "hard link to a file outside /mnt/data"
    if mode & (stat.S_ISUID | stat.S_ISGID):
        return "setuid or setgid file"
    return bad_name


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


def put(data_dir: Path, name: str, content: bytes, *, owner: tuple[int, int] | None = None) -> None:
    """Write ``content`` to /mnt/data/``name`` from the host, replacing any entry there but never following it."""
    parts = _relative_parts(name)
    root = os.open(data_dir, _DIR_FLAGS)
    try:
        fd = os.dup(root)
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner:
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise FileTransferError(f"cannot create {name!r}: {os.fsdecode(part)} is not a folder") from exc
            finally:
                os.close(fd)
            fd = child
        temp = b".nbexec-upload-" + os.urandom(6).hex().encode()
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as handle:
                handle.write(content)
            if owner:
                os.chown(temp, *owner, dir_fd=fd, follow_symlinks=False)
            os.rename(temp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            raise FileTransferError(f"cannot write {name!r}: {exc.strerror}") from exc
        finally:
            os.close(fd)
    finally:
        os.close(root)


def get(data_dir: Path, name: str, *, max_bytes: int = 0) -> bytes:
    """Read /mnt/data/``name`` from the host: a regular file only, never through a link."""
    parts = _relative_parts(name)
    root = os.open(data_dir, _DIR_FLAGS)
    try:
        try:
            parent = _open_parent(root, parts)
            fd = os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
            os.close(parent)
        except OSError as exc:
            raise FileTransferError(f"{name!r} is not a readable regular file in /mnt/data ({exc.strerror})") from exc
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise FileTransferError(f"{name!r} is not a regular file")
            if max_bytes and st.st_size > max_bytes:
                raise FileTransferError(f"{name!r} is larger than {max_bytes:,} bytes")
            return handle.read()
    finally:
        os.close(root)


def copy_tree(source: Path, target: Path) -> None:
    """Copy the regular files under ``source`` to ``target`` (links and special files are left out)."""
    target.mkdir(parents=True, exist_ok=True)
    files, _ = collect(source)
    for item in files:
        put(target, item.name, get(source, item.name))


def open_stream(data_dir: Path, name: str, *, max_bytes: int = 0, chunk: int = 1 << 20) -> tuple[int, Iterator[bytes]]:
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
    handle = os.fdopen(fd, "rb", buffering=0)  # closed with the iterator, or when it is collected unread

    def chunks() -> Iterator[bytes]:
        with handle:
            left = st.st_size
            while left > 0 and (data := handle.read(min(chunk, left))):
                left -= len(data)
                yield data

    return st.st_size, chunks()
