"""A sandbox's /mnt/data: a filesystem of fixed size and inode count the kernel enforces, and its snapshot.

When nbexec runs as root, each sandbox gets its own ext4 image (sparse, made while the sandbox waits in the
pool), loop-mounted nosuid,nodev on the host folder that is bind-mounted at /mnt/data. Writes past its size or
inode count fail with ENOSPC inside the sandbox, between cells and from background processes too, and the host
never holds more than the image's size for it. It is unmounted and deleted with the sandbox.

Without root (no mount), /mnt/data is a plain folder and a `Watch` thread samples its size once a second and
stops the sandbox past the cap: a fallback that can be outrun between samples (`nbexec doctor` reports it).

A one-shot execution's sandbox is frozen (cgroup freezer) before its files are collected, so the manifest is
a snapshot; `Freezer` finds the container's cgroup from its init process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nbexec.config import running_as_root
from nbexec.files.mounts import run_tool as _run

log = logging.getLogger(__name__)

INODE_HEADROOM = 64  # folders and the filesystem's own inodes, on top of max_files * 5 / 4
_MIN_SIZE = 1024**2  # ext4 needs a few blocks of its own


def can_mount() -> bool:
    """Whether this process can make per-sandbox filesystems (root, mkfs.ext4, mount and loop devices)."""
    return (running_as_root() and os.path.exists("/dev/loop-control")
            and all(shutil.which(tool) for tool in ("mkfs.ext4", "mount", "umount")))


def fallback_reason() -> str | None:
    """Why /mnt/data would be a plain folder with a sampled size check, or None when its limit is enforced."""
    if can_mount():
        return None
    return ("nbexec cannot mount (it needs root, mkfs.ext4 and /dev/loop-control): /mnt/data is a plain folder "
            "whose size is sampled once a second, so a fast writer can pass max_data between samples and the "
            "file count is not capped by the kernel")


def inode_count(max_files: int) -> int:
    """Inodes of a data filesystem: the files one execution may keep, a quarter more for folders, headroom."""
    return max_files + max_files // 4 + INODE_HEADROOM


def create(mountpoint: Path, image: Path, *, size: int, inodes: int, owner: tuple[int, int]) -> None:
    """Make a sparse ext4 image of ``size`` bytes and ``inodes`` inodes owned by ``owner``; mount it.

    Raises OSError when a step fails (the image is then removed again)."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, max(size, _MIN_SIZE))
    finally:
        os.close(fd)
    try:
        # No journal and lazy init keep mkfs at ~10 ms; -m 0: no blocks reserved for root.
        _run("mkfs.ext4", "-q", "-F", "-N", str(inodes), "-m", "0", "-O", "^has_journal",
             "-E", f"lazy_itable_init=1,lazy_journal_init=1,root_owner={owner[0]}:{owner[1]}", str(image))
        _run("mount", "-o", "loop,nosuid,nodev", str(image), str(mountpoint))
    except (OSError, subprocess.SubprocessError):
        image.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        os.rmdir(mountpoint / "lost+found")  # root-only; it would show up in every manifest
    os.chmod(mountpoint, 0o755)


def mount_small(mountpoint: Path, *, size: int, inodes: int) -> None:
    """Mount a tmpfs of ``size`` bytes and ``inodes`` inodes (root's, 0700) on ``mountpoint``: a host folder the
    sandbox may write into for a while, whose size the kernel caps whatever the sandbox names or unlinks there.
    Unmounted with the working folder (`nbexec.files.workdir.remove_tree`). Raises OSError when the mount fails."""
    try:
        _run("mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=0700,nosuid,nodev,noexec",
             "nbexec-run", str(mountpoint))
    except subprocess.SubprocessError as exc:  # mount did not end in time
        raise OSError(f"mount -t tmpfs failed: {exc}") from exc


@dataclass(frozen=True)
class Usage:
    """What statvfs says about a data filesystem."""

    free_bytes: int
    total_bytes: int
    free_inodes: int

    @property
    def full(self) -> bool:
        """Out of inodes, or within 1% (at least 1 MiB) of its size: ext4 keeps a few blocks back, so a
        write that failed with ENOSPC can leave a little free space."""
        return self.free_inodes <= 0 or self.free_bytes < max(self.total_bytes // 100, _MIN_SIZE)


def usage(mountpoint: Path) -> Usage | None:
    try:
        st = os.statvfs(mountpoint)
    except OSError:
        return None
    return Usage(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, st.f_favail)


def size_on_disk(path: Path) -> int:
    """Bytes allocated under ``path`` (sparse files count for what they use); no link is followed."""
    total = 0
    stack = [str(path)]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
    return total


def report(path: Path, *, mounted: bool, watch: Watch | None, cap: str) -> tuple[list[str], bool]:
    """A note when /mnt/data ran out of space or inodes (its filesystem ``mounted`` at ``path``), and whether the
    sampled fallback (``watch``) stopped the sandbox for it."""
    if watch is not None and watch.hit:
        return [f"/mnt/data grew past its {cap} cap, so the sandbox was stopped (sampled check: nbexec cannot "
                "mount a filesystem of fixed size here)"], True
    use = usage(path) if mounted else None
    if use is None or not use.full:
        return [], False
    what = "file count cap (max_files)" if use.free_inodes <= 0 else f"{cap} cap"
    return [f"/mnt/data reached its {what}; writes past it failed with 'No space left on device'"], False


class Watch:
    """The fallback without mounts: sample the folder's size once a second, call ``stop`` past ``limit``."""

    def __init__(self, path: Path, limit: int, stop: Callable[[], None]) -> None:
        self.path, self.limit, self._stop = path, limit, stop
        self.hit = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbexec-data-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(1.0):
            if size_on_disk(self.path) > self.limit:
                self.hit = True
                with contextlib.suppress(Exception):
                    self._stop()
                return

    def close(self) -> None:
        self._done.set()


class Freezer:
    """The cgroup freezer of a container, found from its init process (v1 freezer.state or v2 cgroup.freeze)."""

    def __init__(self, state: Path, version: int) -> None:
        self.state, self.version = state, version
        self.frozen = False

    @classmethod
    def of_process(cls, pid: int) -> Freezer | None:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "freezer" in controllers.split(","):
                state = Path("/sys/fs/cgroup/freezer") / path.lstrip("/") / "freezer.state"
                return cls(state, 1) if state.exists() else None
        for line in lines:
            if line.startswith("0::"):
                state = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cgroup.freeze"
                return cls(state, 2) if state.exists() else None
        return None

    def freeze(self, timeout: float = 2.0) -> bool:
        """Stop every process of the cgroup; True once all are frozen."""
        try:
            self.state.write_text("FROZEN" if self.version == 1 else "1")
            self.frozen = True
            deadline = time.monotonic() + timeout
            delay = 0.0002
            while not self._is_frozen():
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        except OSError:
            return False
        return True

    def _is_frozen(self) -> bool:
        if self.version == 1:
            return self.state.read_text().strip() == "FROZEN"
        return "frozen 1" in (self.state.parent / "cgroup.events").read_text()

    def thaw(self) -> None:
        """Let the processes run again (needed before they can be killed: a frozen task ignores SIGKILL)."""
        if self.frozen:
            with contextlib.suppress(OSError):
                self.state.write_text("THAWED" if self.version == 1 else "0")
            self.frozen = False
