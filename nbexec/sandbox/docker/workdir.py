"""A sandbox's working folder on the host: removed without following links (and never through a mount), and
swept when the nbexec process that made it is gone; the wheels handed to its /mnt/wheels."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbexec.errors import PackageError
from nbexec.files import statefolder, transfer
from nbexec.files.folders import work_root
from nbexec.sandbox.source import WheelFile

from . import datafs

WORKDIR_PREFIX = "nbexec-"
CLAIMED_PREFIX = WORKDIR_PREFIX + "state-"  # a working folder a state folder keeps: judged by its claim, not a pid
CLAIM_FILE = "claim"  # in a working folder a state folder keeps past its owner: that folder's claim


def remove_tree(path: Path) -> None:
    """Delete a folder the sandbox could write into, without following links and despite read-only modes; a
    data filesystem still mounted inside is unmounted first (never deleted through, never left mounted)."""
    if not os.path.lexists(path):
        return
    datafs.unmount_all(Path(path))

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


def provide_wheels(folder: Path, wheels: Sequence[WheelFile]) -> None:
    """Link (or copy) each wheel into ``folder`` (a sandbox's /mnt/wheels) under its own file name."""
    fd = os.open(folder, transfer.DIR_FLAGS)
    try:
        present = set(os.listdir(fd))
        for wheel in wheels:
            if wheel.filename not in present:
                _add_wheel(fd, wheel)
                present.add(wheel.filename)
    finally:
        os.close(fd)


def _add_wheel(folder_fd: int, wheel: WheelFile) -> None:
    """Hard-link ``wheel`` (checked by the host that resolved it) into the folder; a copy on another filesystem."""
    if "/" in wheel.filename or not wheel.filename.endswith(".whl") or wheel.filename.startswith("."):
        raise PackageError(f"{wheel.filename!r} is not a wheel's file name")
    try:
        os.link(wheel.path, wheel.filename, dst_dir_fd=folder_fd)
        return
    except OSError:  # another filesystem (or no hard links): copy
        pass
    with open(wheel.path, "rb") as blob:
        out = os.open(wheel.filename, transfer.WRITE_FLAGS, 0o644, dir_fd=folder_fd)
        with os.fdopen(out, "wb") as copy:
            shutil.copyfileobj(blob, copy)


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
