"""What the container engine leaves on the host around gVisor checkpoints, found and removed.

Two engine bugs turn every hibernate into a leak unless the host cleans up after them:
- containerd unpacks each checkpoint it restores from (in some versions, each one it takes too) into a folder
  made with ``MkdirTemp($XDG_RUNTIME_DIR or $TMPDIR or /tmp, "ctrd-checkpoint")``. It never removes it
  (containerd/containerd#10166, Debian's 1.6 among them). Each wake leaves a copy of the memory image on the host.
- A container restored from a checkpoint and checkpointed again stays "paused" in runsc's state. Its containerd
  shim then never exits after the container is removed: each cycle leaves a process and a stopped task. Killed,
  the shim is reaped by containerd, which then removes the task and runsc's state.

`remove_copies` removes the folders that hold exactly a checkpoint's files: each name, size and sha256 equal.
Nothing else is removed, so a concurrent checkpoint's folder, still being written, stays. `stop_shim` kills the
shim whose ``-id`` is a removed container's. Where nbexec is not root it cannot do either, and says so once in
the log: the leak is the engine's, the cure needs root.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "ctrd-checkpoint"
_SHIM = b"containerd-shim"
_warned: set[str] = set()


def remove_copies(files: Mapping[str, Sequence[Any]]) -> int:
    """Remove containerd's scratch folders holding exactly ``files`` ({name: (size, sha256)}); how many."""
    return sum(1 for folder in scratch_folders() for entry in _candidates(folder) if _remove_if_copy(entry, files))


def stop_shim(container_id: str) -> None:
    """Stop the shim still serving ``container_id``, a container already removed."""
    for pid in shims_of(container_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except PermissionError:
            _warn_once("shim", "the engine's shim of a re-checkpointed container cannot be stopped by this user: "
                               "it stays until the engine restarts (run nbexec as root to clean it up)")
        except ProcessLookupError:
            pass


def scratch_folders() -> list[Path]:
    """Where each containerd process makes its checkpoint folders, seen through its own root."""
    folders = []
    for pid in _pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "containerd":
                continue
            environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in item)
        except PermissionError:
            _warn_once("scratch", "containerd's environment cannot be read by this user: the copy it keeps of "
                                  "each checkpoint (ctrd-checkpoint*) stays on the host (run nbexec as root)")
            continue
        except OSError:
            continue
        base = (environ.get(b"XDG_RUNTIME_DIR") or environ.get(b"TMPDIR") or b"/tmp").decode(errors="replace")
        seen = Path(f"/proc/{pid}/root") / base.lstrip("/")  # its mount namespace's view (a private /tmp too)
        folders.append(seen if os.access(seen, os.R_OK | os.X_OK) else Path(base))
    return list(dict.fromkeys(folders))


def shims_of(container_id: str) -> list[int]:
    """The containerd shims serving ``container_id`` (matched on their exact ``-id`` argument)."""
    found = []
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and _SHIM in Path(argv[0].decode(errors="replace")).name.encode() \
                and container_id.encode() in [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == b"-id"]:
            found.append(pid)
    return found


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                yield int(name)


def _candidates(folder: Path) -> Iterator[Path]:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    yield from (folder / name for name in names if name.startswith(PREFIX))


def _remove_if_copy(entry: Path, files: Mapping[str, Sequence[Any]]) -> bool:
    """Remove ``entry`` when it is a real folder holding exactly ``files`` (names, sizes, sha256)."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if sorted(os.listdir(fd)) != sorted(files):
            return False
        for name, (size, digest) in files.items():
            if _digest(fd, name, int(size)) != digest:
                return False
    except OSError:
        return False
    finally:
        os.close(fd)
    shutil.rmtree(entry, ignore_errors=True)  # fd-based: never follows a link inside
    log.debug("removed containerd's leftover checkpoint copy %s", entry)
    return True


def _digest(folder: int, name: str, size: int) -> str | None:
    """sha256 of a regular file of exactly ``size`` bytes in ``folder``; None for anything else."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message)
