"""Mounts under nbexec's own host folders: found in this process's mount table and unmounted, deepest first, so
a folder a sandbox wrote into is never deleted through a mount nor left mounted. Backends mount; this unmounts
whatever any of them left (`workdir.remove_tree`)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

_COMMAND_TIMEOUT = 30.0


def run_tool(*command: str) -> None:
    """Run a host tool (mount, umount, mkfs) within a time limit; OSError when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command[:2])} failed ({done.returncode}): {done.stderr.strip()[-300:]}")


def unmount(mountpoint: Path) -> None:
    """Unmount a data filesystem (its loop device is released with it: mounted with -o loop, autoclear)."""
    try:
        run_tool("umount", str(mountpoint))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not unmount %s (%s); detaching it lazily", mountpoint, exc)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            run_tool("umount", "-l", str(mountpoint))


def unmount_all(root: Path) -> list[Path]:
    """Unmount every mount point at or below ``root``, deepest first; the points that were mounted."""
    found = mounts_under(root)
    for point in found:
        unmount(point)
    return found


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root`` in this process's mount table, deepest first."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
        for line in table:
            fields = line.split(" ")
            if len(fields) > 4:
                # mountinfo escapes space, tab, newline and backslash as octal (\040 ...)
                point = fields[4].encode().decode("unicode_escape")
                if point == str(root) or point.startswith(prefix):
                    found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def is_mounted(path: Path) -> bool:
    return path in mounts_under(path)
