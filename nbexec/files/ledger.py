"""The record of host disk held for sandboxes, shared by every nbexec process of this uid and temporary folder.

One small file per reservation in a private folder (``<tmp>/nbexec-disk-<uid>``, 0700), named by the holding
process (pid and start time) and written, read and counted under an exclusive lock on that folder: admissions in
several processes (parallel `nbexec run`s, a service and the CLI) cannot pass on the same free space. A record of
a process that no longer runs (killed before it released its disk) is dropped at the next read. Pure bookkeeping:
what is held where is decided in `space`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .folders import DIR_FLAGS, private_root

Held = tuple[int, int, str | None]  # (filesystem, bytes, a file whose written blocks no longer count as held)
MAX_RECORD = 65536  # bytes of one record: a few entries
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def root() -> Path:
    return private_root("nbexec-disk")


@contextlib.contextmanager
def locked() -> Iterator[int]:
    """The ledger's folder, opened and locked exclusively (threads and processes alike) until the block ends."""
    fd = os.open(root(), DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def records(fd: int) -> list[list[Held]]:
    """What every live holder holds; records of processes that are gone are deleted."""
    found = []
    for name in os.listdir(fd):
        if not _alive(name):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
            continue
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(_read(fd, name))
    return found


def add(fd: int, held: list[Held]) -> str:
    """Record ``held`` for this process; returns the record's name."""
    name = f"{os.getpid()}-{_start_time(os.getpid())}-{os.urandom(6).hex()}"
    out = os.open(name, _WRITE, 0o600, dir_fd=fd)
    with os.fdopen(out, "w") as handle:
        json.dump(held, handle)
    return name


def remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root() / name)


def _read(fd: int, name: str) -> list[Held]:
    handle = os.open(name, _READ, dir_fd=fd)
    try:
        data = json.loads(os.read(handle, MAX_RECORD))
    finally:
        os.close(handle)
    return [(int(device), int(count), None if grows is None else str(grows)) for device, count, grows in data]


def _alive(name: str) -> bool:
    pid, _, rest = name.partition("-")
    start = rest.partition("-")[0]
    return pid.isdigit() and _start_time(int(pid)) == start


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot), "" when it does not run; "x" where /proc is missing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    if os.path.isdir("/proc/self"):
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return "x"
