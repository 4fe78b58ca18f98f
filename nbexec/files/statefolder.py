"""A state folder: where durable sessions keep their records, held by one live process at a time.

The folder is made private (0700, checked through a descriptor when it exists). Each record is a file of its own
(0600). It is written atomically through the folder's descriptor (a new file, fsynced, renamed over the old one),
and read back within a size cap, never through a link. One process holds the folder: an exclusive ``flock`` on
its ``lock`` file, taken without waiting. A second holder is refused with what to do. The holder writes who it is
(``holder``: boot id, pid and start time) and touches it with every record. So another process's sweep can tell a
live holder, a dead one that may come back (within ``grace`` of its last write), and one that never came back.

Sandboxes a state folder keeps carry its ``claim``: ``<identity>:<path>``, the identity a random id written once.
A sweep keeps them while `claim_alive` says so, and afterwards removes them as any dead owner's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

from nbexec.errors import ConfigError, SessionLimitError

from .folders import DIR_FLAGS, make_output_dir

GRACE = 24 * 3600.0  # seconds a dead holder's sandboxes are kept for it to come back (NBEXEC_STATE_GRACE)
# A record past this is not read: a session's record stays within 2 x (max_output + max_display) + 8 MiB (75 MiB at
# the default budgets; see `engine.budget.CODE_ALLOWANCE`), so only budgets raised past them reach it.
MAX_RECORD = 96 * 1024**2
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def grace() -> float:
    raw = os.environ.get("NBEXEC_STATE_GRACE", "")
    try:
        return float(raw) if raw else GRACE
    except ValueError:
        raise ConfigError(f"NBEXEC_STATE_GRACE={raw!r} is not a number of seconds") from None


def _boot_and_start(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}/{fields[19]}"


def valid_name(name: str) -> bool:
    """Whether ``name`` may name a record (and so a durable session): letters, digits, ``_.-``, no path."""
    return bool(_NAME.fullmatch(name)) and ".." not in name


class StateFolder:
    """A state folder held by this process (see the module docstring). Use `hold`: one per path per process."""

    def __init__(self, path: Path, fd: int, lock_fd: int, identity: str) -> None:
        self.path = path
        self.fd = fd
        self._lock_fd = lock_fd
        self.identity = identity
        self._mutex = threading.Lock()

    @property
    def claim(self) -> str:
        return f"{self.identity}:{self.path}"

    @classmethod
    def open(cls, path: Path) -> StateFolder:
        path = Path(path).absolute()
        if not os.path.lexists(path):
            make_output_dir(path, may_exist=False)
        fd = _open_private(path)
        try:
            lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot open the state folder's lock {path}/lock: {exc.strerror}") from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            os.close(fd)
            raise SessionLimitError(f"the state folder {path} is held by another live process; give each "
                                    "process a state folder of its own, or stop the other one") from None
        folder = cls(path, fd, lock_fd, "")
        try:
            folder.identity = folder._identity()
            folder.touch()
        except BaseException:
            folder.close()
            raise
        return folder

    def _identity(self) -> str:
        found = self.read("identity", limit=64)
        if found is not None and re.fullmatch(rb"[0-9a-f]{32}", found):
            return found.decode()
        identity = secrets.token_hex(16)
        self.write("identity", identity.encode())
        return identity

    def touch(self) -> None:
        """Say that this process holds the folder, now (see the module docstring)."""
        start = _boot_and_start(os.getpid()) or ""
        self.write("holder", f"{os.getpid()} {start}".encode())

    # -- records ----------------------------------------------------------------------------------

    def write(self, name: str, content: bytes) -> None:
        """Write ``name`` atomically (0600, fsynced, through the folder's descriptor)."""
        if not valid_name(name):
            raise ConfigError(f"{name!r} cannot name a record of a state folder")
        with self._mutex:
            temp = f".{name}.{secrets.token_hex(4)}.tmp"
            out = os.open(temp, _WRITE, 0o600, dir_fd=self.fd)
            try:
                with os.fdopen(out, "wb") as handle:
                    handle.write(content)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=self.fd)
                raise
            os.fsync(self.fd)

    def read(self, name: str, *, limit: int = MAX_RECORD) -> bytes | None:
        """The bytes of record ``name``, or None when there is none.

        None too when it is not a regular file of ours, or is larger than ``limit`` (such a record is not read)."""
        if not valid_name(name):
            return None
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > limit:
                return None
            return handle.read(limit + 1)[:limit]

    def size(self, name: str) -> int | None:
        """The size of record ``name`` as it is on disk (None when there is none), to say why it was not read."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size if valid_name(name) else None
        except OSError:
            return None

    def age(self, name: str) -> float | None:
        """Seconds since record ``name`` was last written (None when there is none)."""
        try:
            written = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime if valid_name(name) else None
        except OSError:
            return None
        return None if written is None else time.time() - written

    def remove(self, name: str) -> None:
        if valid_name(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)

    def names(self, suffix: str) -> list[str]:
        """The records whose names end with ``suffix``."""
        return sorted(n for n in os.listdir(self.fd) if n.endswith(suffix) and valid_name(n))

    def child(self, name: str) -> Path:
        """A private sub-folder ``name`` (made when missing, checked when there)."""
        if not valid_name(name):
            raise ConfigError(f"{name!r} cannot name a folder of a state folder")
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self.fd)
        os.close(_open_private(name, dir_fd=self.fd))
        return self.path / name

    def close(self) -> None:
        for fd in (self._lock_fd, self.fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self.fd = -1


def _open_private(path: Path | str, *, dir_fd: int | None = None) -> int:
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise ConfigError(f"the state folder {path} is not a folder of ours: {exc.strerror}") from exc
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise ConfigError(f"the state folder {path} must be a private folder (0700) owned by this user")
    return fd


_held: dict[Path, StateFolder] = {}
_held_lock = threading.Lock()


def hold(path: str | os.PathLike[str]) -> StateFolder:
    """The state folder at ``path``, held by this process from now on (the same object for every caller)."""
    key = Path(path).absolute()
    with _held_lock:
        if key not in _held:
            _held[key] = StateFolder.open(key)
        return _held[key]


def claim_alive(claim: str, *, now: float | None = None) -> bool:
    """Whether the state folder a sandbox's ``claim`` names still wants it.

    It does while the folder is there with that identity and its holder runs, or died less than `grace` seconds
    after its last write."""
    identity, _, path = claim.partition(":")
    if not re.fullmatch(r"[0-9a-f]{32}", identity) or not path.startswith("/"):
        return False
    try:
        fd = _open_private(path)
    except ConfigError:
        return False
    try:
        found = _read_small(fd, "identity")
        holder = _read_small(fd, "holder")
        last = os.stat("holder", dir_fd=fd, follow_symlinks=False).st_mtime if holder else 0.0
    except OSError:
        return False
    finally:
        os.close(fd)
    if found != identity.encode():
        return False
    pid, _, start = (holder or b"").decode("ascii", "replace").partition(" ")
    if pid.isdigit() and start and _boot_and_start(int(pid)) == start:
        return True
    return ((time.time() if now is None else now) - last) < grace()


def _read_small(fd: int, name: str) -> bytes:
    try:
        handle = os.open(name, _READ, dir_fd=fd)
    except FileNotFoundError:
        return b""
    try:
        return os.read(handle, 256).strip()
    finally:
        os.close(handle)
