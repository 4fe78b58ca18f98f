"""The reset between two items of judge_many(reuse="batch"): shipped as text into the sandbox and run in its kernel,
never imported on the host.

Before the sandbox's first item, `remember` records what the kernel's own start left in the places a test can
write (its ~/.ipython, its runtime folder, Matplotlib's settings), those places' own mode, times and extended
attributes, and the kernel's process settings (limits, scheduling, CPU affinity, OOM score), which a test of the
same user can change and every later test inherits. After each item, `reset` ends every process but init and the
kernel, removes every path not remembered, puts the places and settings back, and checks the remembered files
are as they were. Anything it cannot undo is said. The host then closes the sandbox instead of handing it to the
next item. Standard library only.
"""

import errno
import hashlib
import os
import resource
import stat
import time
from collections.abc import Callable
from typing import Any

MAX_REMEMBERED = 10_000  # paths of the kernel's own: past it the sandbox is not reused
_kept: dict[str, Any] = {}  # path: what it was (see _state)
_places_were: dict[str, Any] = {}  # place: (mode, atime_ns, mtime_ns, xattrs)
_settings_were: dict[str, Any] = {}
_LIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
_until = [0.0]  # when the reset under way must stop removing


def _named(places: list[str]) -> list[str]:
    """The places and the kernel's home."""
    return [p for p in [*places, os.environ.get("HOME", "")] if p.startswith("/") and p != "/"]


def _places(places: list[str]) -> list[str]:
    """The places that exist (gVisor has no /dev/mqueue), and the kernel's home."""
    return [p for p in _named(places) if os.path.lexists(p)]


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        return {name: os.getxattr(path, name, follow_symlinks=False)
                for name in os.listxattr(path, follow_symlinks=False)}
    except OSError:  # a filesystem without them
        return {}


def _state(path: str) -> Any:
    """What a remembered path is: its type and mode, xattrs, and for a file its size and digest, for a symlink
    its target (a folder's times change as the reset empties it: they are put back instead)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return ("link", os.readlink(path))
    shown = (info.st_mode, _xattrs(path))
    if not stat.S_ISREG(info.st_mode):
        return shown
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return (*shown, info.st_size, digest.hexdigest())


def _threads() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/task")]


def _oom() -> str:
    with open("/proc/self/oom_score_adj") as handle:
        return handle.read().strip()


def _ioprio(tid: int, value: int | None = None) -> int:
    """ioprio_get, or ioprio_set to ``value`` (x86-64's syscalls; the judge runs on no other); -1 on failure."""
    import ctypes  # here, as in the runner: never imported from a place a test writes
    if os.uname().machine != "x86_64":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(252, 1, tid) if value is None else libc.syscall(251, 1, tid, value))  # WHO_PROCESS


def _sched(tid: int) -> bytes:
    """sched_getattr (x86-64's 315): the policy's parameters and utilization clamps a same-user test can lower."""
    import ctypes
    if os.uname().machine != "x86_64":
        return b""
    attr = ctypes.create_string_buffer(56)
    return attr.raw if ctypes.CDLL(None, use_errno=True).syscall(315, tid, attr, 56, 0) == 0 else b"?"


def _settings(tid: int) -> dict[str, Any]:
    """The settings of one of the kernel's threads that its children inherit."""
    found: dict[str, Any] = {name: resource.getrlimit(getattr(resource, name)) for name in _LIMITS}
    found["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
    found["policy"] = os.sched_getscheduler(tid)
    found["affinity"] = sorted(os.sched_getaffinity(tid))
    found["ioprio"] = _ioprio(tid)
    found["sched"] = _sched(tid)
    found["oom"] = _oom()
    return found


def remember(places: list[str]) -> bool:
    """Record the places, what is in them now (before any test) and the kernel's settings; False if too much."""
    _kept.clear()
    _places_were.clear()
    _settings_were.clear()
    _settings_were.update(_settings(os.getpid()))
    for place in _places(places):
        info = os.stat(place)
        _places_were[place] = (stat.S_IMODE(info.st_mode), info.st_atime_ns, info.st_mtime_ns, _xattrs(place))
        for root, folders, files in os.walk(place):  # symlinks are listed, never followed
            for name in folders + files:
                path = os.path.join(root, name)
                _kept[path] = _state(path)
            for name in folders:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    info = os.lstat(path)
                    _places_were[path] = (stat.S_IMODE(info.st_mode), info.st_atime_ns, info.st_mtime_ns,
                                          _xattrs(path))
            if len(_kept) > MAX_REMEMBERED:
                return False
    return True


def _remove(top: str) -> None:
    """Remove ``top`` and what is under it, without recursion (a test may nest folders deeply), giving back the
    bits a test took off its own folders. A path past the system's length limit raises: said, not reused. So does
    the reset's time running out."""
    stack = [(top, False)]
    while stack:
        if time.monotonic() > _until[0]:
            raise TimeoutError(errno.ETIME, "the reset ran out of time")
        path, emptied = stack.pop()
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            os.unlink(path)
        elif emptied:
            os.rmdir(path)
        else:
            if stat.S_IMODE(mode) & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(path, stat.S_IRWXU)
            stack.append((path, True))
            with os.scandir(path) as entries:
                stack.extend((entry.path, False) for entry in entries)


def _empty(place: str, left: list[str]) -> None:
    """Remove what is in ``place`` and was not remembered; check what was, and look inside it."""
    try:
        with os.scandir(place) as entries:
            found = list(entries)
    except OSError as exc:
        left.append(f"{place}: {exc.strerror}")
        return
    for entry in found:
        try:
            if entry.path not in _kept:
                _remove(entry.path)
            elif not _same(entry.path):
                left.append(f"{entry.path}: changed")
            elif entry.is_dir(follow_symlinks=False):
                _empty(entry.path, left)
                _restore_place(entry.path, left)  # its times
        except TimeoutError:
            raise
        except OSError as exc:
            left.append(f"{entry.path}: {exc.strerror}")


def _same(path: str) -> bool:
    """Whether a remembered path is as it was; a file's size first, so a file swapped for a huge one is not read."""
    was = _kept[path]
    if len(was) == 4:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size != was[2]:
            return False
    return bool(_state(path) == was)


def _restore_place(place: str, left: list[str]) -> None:
    """The place's own mode, extended attributes (default ACLs among them) and times, as remembered: only what
    differs is touched."""
    mode, atime, mtime, xattrs = _places_were[place]
    try:
        if os.stat(place).st_uid != os.getuid():  # root's (/tmp, /dev/shm): sticky, a test cannot mark it
            return
        if stat.S_IMODE(os.stat(place).st_mode) != mode:  # first: the xattrs need the write bit
            os.chmod(place, mode)
        now = _xattrs(place)
        for name in set(now) - set(xattrs):
            os.removexattr(place, name)
        for name, value in xattrs.items():
            if now.get(name) != value:
                os.setxattr(place, name, value)
        info = os.stat(place)
        if (info.st_atime_ns, info.st_mtime_ns) != (atime, mtime):
            os.utime(place, ns=(atime, mtime))
    except OSError as exc:
        left.append(f"{place}: {exc.strerror}")


def _restore_settings(left: list[str]) -> None:
    """The kernel's limits and each thread's scheduling back as remembered; what cannot be (a hard limit lowered,
    a priority that only a privileged process may raise) is said."""
    were = _settings_were
    for name in _LIMITS:
        if resource.getrlimit(getattr(resource, name)) != were[name]:
            try:
                resource.setrlimit(getattr(resource, name), were[name])
            except (OSError, ValueError) as exc:
                left.append(f"the kernel's {name}: {exc}")
    for tid in _threads():
        try:
            if os.sched_getaffinity(tid) != set(were["affinity"]):
                os.sched_setaffinity(tid, were["affinity"])
            if os.sched_getscheduler(tid) != were["policy"]:
                os.sched_setscheduler(tid, were["policy"], os.sched_param(0))
            if os.getpriority(os.PRIO_PROCESS, tid) != were["nice"]:
                os.setpriority(os.PRIO_PROCESS, tid, were["nice"])
            if _ioprio(tid) != were["ioprio"] and _ioprio(tid, were["ioprio"]) != 0:
                left.append(f"the kernel's I/O priority (thread {tid}) could not be put back")
            if _sched(tid) != were["sched"]:  # after the policy and nice: what is left is a clamp, not put back
                left.append(f"the kernel's scheduling attributes (thread {tid}) changed")
        except OSError as exc:
            left.append(f"the kernel's scheduling (thread {tid}): {exc.strerror}")
    if _oom() != were["oom"]:
        left.append("the kernel's oom_score_adj changed")


def _ipc_removed(left: list[str]) -> None:
    """Remove the System V shared memory, message queues and semaphores a test made: they outlive processes."""
    import ctypes  # here, as in the runner: never imported from a place a test writes
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, remove in (("shm", lambda i: libc.shmctl(i, 0, None)), ("msg", lambda i: libc.msgctl(i, 0, None)),
                         ("sem", lambda i: libc.semctl(i, 0, 0))):  # 0: IPC_RMID
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                ids = [int(line.split()[1]) for line in table.read().splitlines()[1:] if line.strip()]
        except (OSError, ValueError, IndexError):
            continue
        for ident in ids:
            if remove(ident) != 0:
                left.append(f"System V {kind} {ident}: {os.strerror(ctypes.get_errno())}")


def reset(places: list[str], blob: int, end_all: Callable[[], bool], seconds: float = 30.0) -> list[str]:
    """Close the last item's tests (``blob``), end its processes, empty ``places`` and the kernel's home of what
    the kernel did not have (within ``seconds``), put the places and the kernel's settings back, and remove
    System V objects; what is left ([] once clean)."""
    _until[0] = time.monotonic() + seconds
    if blob >= 0:
        os.close(blob)
    if not end_all():
        return ["a process of the last item could not be ended"]
    now, every = _places(places), _named(places)
    left = [f"{place} appeared" for place in now if place not in _places_were]
    left += [f"{place} is gone" for place in every if place in _places_were and place not in now]
    try:
        for place in (place for place in now if place in _places_were):
            _restore_place(place, left)  # its mode first: a test may have taken its write bit
            _empty(place, left)
            _restore_place(place, left)  # its times, which emptying changed
    except TimeoutError:
        return ["the reset ran out of time removing what the last item left"]
    left += [f"{path}: gone" for path in _kept if not os.path.lexists(path)][:8]
    _restore_settings(left)
    _ipc_removed(left)
    return left[:8]
