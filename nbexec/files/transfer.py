"""One file at a time through directory descriptors, never through a link.

Files go into /mnt/data from the host (``put``), out of it (``open_stream``, ``get``), and into nbexec's own
output folders (``write_new``, ``replace``, images).

A name is a plain relative path (no ``..``, UTF-8, printable). Each component is opened with O_NOFOLLOW from its
parent's descriptor. What is read must be a regular file by fstat, and is never read past the size seen there.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

from nbexec.errors import FileTooLargeError, FileTransferError
from nbexec.notebook.outputs import ImageData
from nbexec.result import Image

from .folders import OutputFolder

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
CHUNK = 1 << 20
DATA_DIR = "/mnt/data"  # the sandbox's name for the folder every name here is inside


def valid_name(raw: bytes) -> str | None:
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


def write_all(fd: int, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


def open_parent(root_fd: int, parts: tuple[bytes, ...]) -> int:
    fd = os.dup(root_fd)
    for part in parts[:-1]:
        try:
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd

def save_images(images: Iterable[ImageData], folder: OutputFolder, *,
                max_bytes: int = 0) -> tuple[list[Image], list[str]]:
    """Write image outputs into ``folder``/images as ``images`` yields them, one decoded image at a time.

    Names are made here, never taken from the code. The same bytes shown again (a display update reaching many
    outputs) are written once and listed again. Past ``max_bytes`` of distinct images (0: no cap) the rest are not
    saved. The images listed are always the first ones, and a note says so."""
    saved: list[Image] = []
    written: dict[bytes, tuple[Path, int]] = {}  # sha256 -> the file that holds those bytes, its size
    counts: dict[int, int] = {}
    total = 0
    with contextlib.ExitStack() as stack:
        target: OutputFolder | None = None
        for image in images:
            digest = hashlib.sha256(image.content).digest()
            if digest not in written:
                if max_bytes and total + len(image.content) > max_bytes:
                    return saved, [f"images past {max_bytes:,} bytes in total (the max_display cap) were not saved; "
                                   f"the first {len(saved):,} were"]
                target = target or stack.enter_context(folder.child("images"))
                counts[image.cell_index] = counts.get(image.cell_index, 0) + 1
                name = f"cell{image.cell_index}-{counts[image.cell_index]}.{image.extension}"
                written[digest] = (write_new(target, name, image.content), len(image.content))
                total += len(image.content)
            path, size = written[digest]
            saved.append(Image(image.mime, str(path), image.cell_index, size))
    return saved, []


def write_new(folder: OutputFolder, name: str, content: bytes) -> Path:
    """Create ``name`` in ``folder`` exclusively, through its descriptor; returns its shown path.

    A taken name gets a suffix. The file is private (0600) unless the folder is shared."""
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

def relative_parts(name: str) -> tuple[bytes, ...]:
    """The components of ``name`` inside /mnt/data: relative, or absolute under /mnt/data (``/mnt/data/x`` is ``x``).

    Any other absolute name is refused, never read as relative: ``/etc/x`` is not ``etc/x``."""
    plain = name.replace("\\", "/")
    if plain.startswith("/"):
        inside = plain.removeprefix(DATA_DIR)
        if inside == plain or inside[:1] not in ("", "/"):
            raise FileTransferError(f"{name!r} is outside /mnt/data: give a name relative to it, like "
                                    f"{plain.rstrip('/').rsplit('/', 1)[-1] or 'data.csv'!r}")
        plain = inside
    parts = tuple(p for p in plain.split("/") if p not in ("", "."))
    if not parts or any(p == ".." for p in parts):
        raise FileTransferError(f"{name!r} is not a plain relative name inside /mnt/data")
    raw = tuple(os.fsencode(p) for p in parts)
    if valid_name(b"/".join(raw)):
        raise FileTransferError(f"{name!r}: {valid_name(b'/'.join(raw))}")
    return raw


def put(data_dir: Path, name: str, content: bytes | BinaryIO, *, owner: tuple[int, int] | None = None) -> None:
    """Write ``content`` (bytes, or a binary file streamed in chunks) to /mnt/data/``name`` from the host.

    It replaces any entry there but never follows it. Past the data filesystem's space or inodes it fails with a
    FileTransferError that says so, and leaves nothing behind."""
    parts = relative_parts(name)
    root = os.open(data_dir, DIR_FLAGS)
    try:
        fd = os.dup(root)
        for part in parts[:-1]:
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
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
    out = os.open(temp, WRITE_FLAGS, 0o644, dir_fd=folder_fd)
    try:
        if isinstance(content, bytes):
            write_all(out, content)
        else:
            while chunk := content.read(CHUNK):
                write_all(out, chunk)
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
    """Read /mnt/data/``name`` from the host: a regular file only, never through a link.

    Over ``max_bytes`` at fstat it is refused, and it is never read past that size."""
    _, chunks = open_stream(data_dir, name, max_bytes=max_bytes)
    try:
        return b"".join(chunks)
    finally:
        chunks.close()


def open_stream(data_dir: Path, name: str, *, max_bytes: int = 0, chunk: int = 1 << 20) -> tuple[int, FileChunks]:
    """Open ``data_dir/name`` for streaming: (its size at open, an iterator of at most that many bytes).

    Opened through directory descriptors without following links, a regular file by fstat. A size over
    ``max_bytes`` (0: no cap) raises FileTooLargeError before anything is read. The file is closed when the
    iterator ends or is dropped.
    """
    parts = relative_parts(name)
    try:
        root = os.open(data_dir, DIR_FLAGS)
    except OSError as exc:
        raise FileTransferError(f"{name!r}: the folder is unreadable ({exc.strerror})") from exc
    try:
        parent = open_parent(root, parts)
        try:
            fd = os.open(parts[-1], READ_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:
        raise FileTransferError(f"{name!r} is not a readable regular file ({exc.strerror})") from exc
    finally:
        os.close(root)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileTransferError(f"{name!r} is not a regular file")
    if max_bytes and st.st_size > max_bytes:
        os.close(fd)
        raise FileTooLargeError(f"{name!r} is larger than {max_bytes:,} bytes ({st.st_size:,} bytes by its apparent "
                                "size; nothing was read)")
    return st.st_size, FileChunks(os.fdopen(fd, "rb", buffering=0), st.st_size, chunk)


class Readable(Protocol):
    """What FileChunks reads: an open binary file, or a body arriving from a node (`sandbox.remote.handle`)."""

    @property
    def closed(self) -> bool: ...

    def read(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


class FileChunks:
    """At most ``size`` bytes of an open file, ``chunk`` at a time.

    The file is closed at the end, by ``close()``, or when the iterator is dropped unread (a client left)."""

    def __init__(self, handle: Readable, size: int, chunk: int) -> None:
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
