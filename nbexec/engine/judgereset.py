"""The reset between two items of judge_many(reuse="batch"): shipped as text into the sandbox and run in its kernel,
never imported on the host.

Before the sandbox's first item, `remember` lists what the kernel's own start left in the places a test can write
(its ~/.ipython, its runtime folder). After each item, `reset` ends every process but init and the kernel, then
removes every path not in that list. Anything it cannot do is said. The host then closes the sandbox instead of
handing it to the next item. Standard library only.
"""

import os
import stat
from collections.abc import Callable

MAX_REMEMBERED = 10_000  # paths of the kernel's own: past it the sandbox is not reused
_kept: set[str] = set()


def _places(places: list[str]) -> list[str]:
    return [p for p in [*places, os.environ.get("HOME", "")] if p.startswith("/") and p != "/"]


def remember(places: list[str]) -> bool:
    """List what is in ``places`` (and the kernel's home) now, before any test; False if it is too much."""
    _kept.clear()
    for place in _places(places):
        for root, folders, files in os.walk(place):  # symlinks are listed, never followed
            _kept.update(os.path.join(root, name) for name in folders + files)
            if len(_kept) > MAX_REMEMBERED:
                return False
    return True


def _remove(top: str) -> None:
    """Remove ``top`` and what is under it, without recursion (a test may nest folders deeply), giving back the
    bits a test took off its own folders. A path past the system's length limit raises: said, not reused."""
    stack = [(top, False)]
    while stack:
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
    """Remove what is in ``place`` and was not remembered; look inside what was."""
    try:
        with os.scandir(place) as entries:
            found = list(entries)
    except FileNotFoundError:
        return
    except OSError as exc:
        left.append(f"{place}: {exc.strerror}")
        return
    for entry in found:
        try:
            if entry.path not in _kept:
                _remove(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                _empty(entry.path, left)
        except OSError as exc:
            left.append(f"{entry.path}: {exc.strerror}")


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


def reset(places: list[str], blob: int, end_all: Callable[[], bool]) -> list[str]:
    """Close the last item's tests (``blob``), end its processes, empty ``places`` and the kernel's home of what
    the kernel did not have, and remove System V objects; what is left ([] once clean)."""
    if blob >= 0:
        os.close(blob)
    if not end_all():
        return ["a process of the last item could not be ended"]
    left: list[str] = []
    for place in _places(places):
        _empty(place, left)
    _ipc_removed(left)
    return left[:8]
