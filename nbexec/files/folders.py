"""nbexec's folders on the host: private roots in the temporary folder, output folders held by descriptor, retention.

Every folder nbexec makes is created with mode 0700 (its files 0600). One that already exists is checked before
use, through a descriptor opened with O_NOFOLLOW: a real folder, owned by this uid, not writable by group or
others. An output folder is opened once, and every later write goes through that descriptor (``openat``-style).
So no component of its path can be swapped for a link between two writes.

A folder that receives a sandbox's files carries `MARK`: an output folder, before its ``data`` sub-folder is
made, and a sandbox's working folder. Whatever lies below it came from a sandbox, so `nbexec.cli.envfile` never
loads a `.env` from there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from nbexec.errors import ConfigError
from nbexec.hostconfig import host_from_env

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MARK = ".nbexec-sandbox-files"  # in a folder whose contents came out of a sandbox (see the module docstring)
DATA = "data"  # the sub-folder of an output folder that receives the sandbox's files
_MARK_TEXT = b"nbexec copied files out of a sandbox below this folder; it never loads a .env from here.\n"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _open_checked(path: Path | str, *, dir_fd: int | None = None, what: str = "folder") -> int:
    """A descriptor of the folder at ``path``: a real folder (no link), owned by us, writable only by us."""
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise ConfigError(f"The {what} {path} is not a real folder (a link or a file?): {exc.strerror}. "
                          "Remove it, or choose another place.") from exc
    st = os.fstat(fd)
    problem = None
    if st.st_uid != _uid():
        problem = f"belongs to another user (uid {st.st_uid}), not to you (uid {_uid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        os.close(fd)
        raise ConfigError(f"The {what} {path} {problem}; nbexec does not write into it. Remove it (or run "
                          "`chmod go-w` on it if it is yours), or point TMPDIR / the output folder elsewhere.")
    return fd


def private_root(name: str) -> Path:
    """``<temporary folder>/<name>-<uid>``: made with mode 0700, or checked (and made 0700) when it exists."""
    path = Path(tempfile.gettempdir()) / f"{name}-{_uid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = _open_checked(path, what=f"nbexec folder ({name})")
    try:
        os.fchmod(fd, 0o700)  # ours and not writable by others: only tighten what others may read
    finally:
        os.close(fd)
    return path


def work_root() -> Path:
    """The private folder that holds every sandbox's working folder."""
    return private_root("nbexec")


def output_root() -> Path:
    """The private folder that holds output folders made when the caller names none."""
    return private_root("nbexec-output")


def _dir_mode() -> int:
    return 0o755 if host_from_env().shared_output else 0o700


def make_output_dir(path: Path, *, may_exist: bool) -> Path:
    """Create ``path`` (and missing parents) privately; an existing one must be ours, a real folder, and empty."""
    mode = _dir_mode()
    missing = []
    parent = path.parent
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    try:
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, mode)
        os.mkdir(path, mode)
        return path
    except FileExistsError:
        if not may_exist:
            raise ConfigError(f"output folder {path} already exists; choose a new one.") from None
    except OSError as exc:
        raise ConfigError(f"cannot create the output folder {path}: {exc.strerror}") from exc
    fd = _open_checked(path, what="output folder")
    try:
        if os.listdir(fd):
            raise ConfigError(f"output_dir {path} exists and is not an empty folder; choose a new one.")
    finally:
        os.close(fd)
    return path


def output_dir(requested: str | os.PathLike[str] | None, name: str) -> Path:
    """A run's output folder (0700): ``<tmp>/nbexec-output-<uid>/<name>`` when none is ``requested``.

    A requested one that exists must be an empty real folder of ours, else ConfigError."""
    if requested is None:
        prune_outputs()
        return make_output_dir(output_root() / name, may_exist=False)
    return make_output_dir(Path(requested).absolute(), may_exist=True)


class OutputFolder:
    """An output folder held open by a descriptor; names below it are resolved from the descriptor, never a path.

    ``path`` is what results show; it may lead elsewhere later (a parent renamed), the descriptor does not."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        shared = host_from_env().shared_output
        self.file_mode = 0o644 if shared else 0o600
        self.dir_mode = 0o755 if shared else 0o700

    @classmethod
    def open(cls, path: Path) -> OutputFolder:
        """Open a folder made by `make_output_dir` (checked again through the new descriptor)."""
        return cls(path, _open_checked(path, what="output folder"))

    def child(self, name: str) -> OutputFolder:
        """The sub-folder ``name``, made when missing; it must be a real folder of ours.

        Before the sandbox's files get a ``data`` sub-folder, this folder is marked as holding them (`mark`).
        A folder above may be marked already: then a sandbox's own sub-folder named data gets no mark."""
        if name == DATA and marked(self.path) is None:
            mark(self.fd)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, self.dir_mode, dir_fd=self.fd)
        return OutputFolder(self.path / name, _open_checked(name, dir_fd=self.fd, what=f"folder {self.path / name}"))

    def still_at_path(self) -> bool:
        """Whether ``path`` still leads to this folder (nobody renamed it or a parent since it was opened)."""
        try:
            here, there = os.fstat(self.fd), os.stat(self.path)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"<OutputFolder {self.path} fd={self.fd}>"


def mark(folder: int | Path) -> None:
    """Leave `MARK` in ``folder`` (a descriptor or a path made by nbexec): what lies below came from a sandbox."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(MARK if isinstance(folder, int) else Path(folder) / MARK, flags, 0o600,
                     dir_fd=folder if isinstance(folder, int) else None)
    except FileExistsError:
        return
    try:
        os.write(fd, _MARK_TEXT)
    finally:
        os.close(fd)


def marked(folder: Path) -> Path | None:
    """The folder at or above ``folder`` (its real path) that carries `MARK`, or None."""
    real = folder.resolve()
    return next((place for place in (real, *real.parents) if os.path.lexists(place / MARK)), None)


def older_than(seconds: float) -> list[Path]:
    """Folders in nbexec's private roots (working and output folders) last changed more than ``seconds`` ago."""
    cutoff = time.time() - seconds
    found = []
    for root in (work_root(), output_root()):
        with os.scandir(root) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff:
                    found.append(Path(entry.path))
    return sorted(found)


KEEP_OUTPUTS_DAYS = 7  # a folder in output_root() unchanged this long is removed (docs/cli.md, "The output folder")
_pruned = False


def prune_outputs(days: float = KEEP_OUTPUTS_DAYS) -> list[Path]:
    """Remove the folders in `output_root` unchanged for ``days``; returns those removed.

    It runs once per process, before its first default output folder is made. Only the library's own folders are
    there: a folder the caller named never is."""
    global _pruned
    if _pruned:
        return []
    _pruned = True
    root, cutoff, removed = output_root(), time.time() - days * 86400, []
    with os.scandir(root) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff:
                _remove(Path(entry.path))
                removed.append(Path(entry.path))
    return removed


def _remove(path: Path) -> None:
    """Delete a folder of sandbox files without following links, despite read-only modes a sandbox gave them."""
    def writable(func: Any, target: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), stat.S_IRWXU)
        with contextlib.suppress(OSError):
            func(target)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=writable)
    else:
        shutil.rmtree(path, onerror=writable)


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """The address to bind or connect the Unix socket at ``path`` by, however long its folder's name.

    An address holds 107 bytes, so it goes through a descriptor of the folder (/proc/self/fd/N/name). That is
    short and never re-resolves the folder. The descriptor is open for the block: bind or connect inside it."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}" if os.path.isdir("/proc/self/fd") else str(path)
    finally:
        os.close(folder)
