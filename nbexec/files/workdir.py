"""A sandbox's working folder on the host: removed without following links (and never through a mount), and
swept when the nbexec process that made it is gone. Any backend that keeps a sandbox's files in a host folder
uses it, and so do the engine and the service for their own folders."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from . import statefolder
from .folders import work_root
from .mounts import unmount_all

WORKDIR_PREFIX = "nbexec-"
CLAIMED_PREFIX = WORKDIR_PREFIX + "state-"  # a working folder a state folder keeps: judged by its claim, not a pid
CLAIM_FILE = "claim"  # in a working folder a state folder keeps past its owner: that folder's claim


def remove_tree(path: Path) -> None:
    """Delete a folder the sandbox could write into, without following links and despite read-only modes; a
    data filesystem still mounted inside is unmounted first (never deleted through, never left mounted)."""
    if not os.path.lexists(path):
        return
    unmount_all(Path(path))

    def make_writable(func: Any, target: str, _exc: Any) -> None:
        parent = os.path.dirname(target)
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IRWXU)
        with contextlib.suppress(OSError):
            if not os.path.islink(target) and os.path.isdir(target):
                os.chmod(target, stat.S_IRWXU)
        func(target)

    with contextlib.suppress(FileNotFoundError):
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=make_writable)
        else:
            shutil.rmtree(path, onerror=make_writable)


def remove_stale_workdirs() -> list[Path]:
    """Remove working folders of nbexec processes on this machine that no longer run."""
    removed = []
    for entry in work_root().iterdir():
        if entry.name.startswith(CLAIMED_PREFIX):
            if not _claimed(entry):  # its state folder's holder is gone for good (see nbexec.files.statefolder)
                remove_tree(entry)
                removed.append(entry)
            continue
        pid = entry.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not entry.name.startswith(WORKDIR_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        remove_tree(entry)  # a dead process's data filesystems are unmounted first
        removed.append(entry)
    return removed


def claim_of(workdir: Path) -> str:
    """The state folder's claim on a working folder (its claim file, read without following links), or ""."""
    try:
        fd = os.open(workdir / CLAIM_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        return os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def _claimed(workdir: Path) -> bool:
    """Whether a state folder still wants this working folder."""
    claim = claim_of(workdir)
    return bool(claim) and statefolder.claim_alive(claim)
