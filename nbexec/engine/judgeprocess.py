"""The judge's processes: shipped as text into a judging sandbox and run into the runner's namespace
(`judgerunner`) before it, never imported on the host.

`Process` runs one test (or a compile, or a checker) within its limits: rlimits (address space, CPU, file size,
no core) and a wall-clock deadline, its stdout and stderr read within a cap. `end_all` is the sweep after each
one: every process of the sandbox but init and the kernel is killed, so a child a test left behind never sees the
next test. Standard library only: this runs on the sandbox's Python.
"""

import contextlib
import os
import resource
import selectors
import signal
import subprocess
import time
from typing import Any

_STDERR_KEPT = 2048  # bytes of a test's stderr kept for its record (its end)
_MEMORY_MARKS = (b"MemoryError", b"std::bad_alloc", b"out of memory", b"OutOfMemoryError", b"memory allocation",
                 b"annot allocate memory")  # ENOMEM, as Go (and perror) say it
_FILE_TOO_LARGE = b"File too large"  # EFBIG: past RLIMIT_FSIZE where SIGXFSZ is ignored (Python ignores it)
ENV = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _state(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(512).rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b"X"


def _others() -> list[int]:
    """The live processes of the sandbox besides init and this kernel. A process whose first thread ended is a
    zombie in /proc while its other threads run: it is live."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        if _state(f"/proc/{name}/stat") not in (b"Z", b"X"):
            found.append(int(name))
            continue
        with contextlib.suppress(OSError):
            if any(_state(f"/proc/{name}/task/{tid}/stat") not in (b"Z", b"X")
                   for tid in os.listdir(f"/proc/{name}/task")):
                found.append(int(name))
    return found


SPARED: list[int] = []  # the fork server (`judgefork`), which end_all leaves while it can


def end_all(wait: float = 2.0) -> bool:
    """Kill every process but init and the kernel (kill(-1) skips the caller); True once none is left.
    The fork server is spared while that holds: every process is stopped at once first (kill(-1, SIGSTOP): a
    process with a stop pending cannot finish a fork), so a listing misses none, then each but the server is
    killed and the server continued. Past a tenth of ``wait``, kill(-1) ends the server too."""
    end = time.monotonic() + wait
    while True:
        spare = bool(SPARED) and time.monotonic() < end - wait * 0.9
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGSTOP if spare else signal.SIGKILL)
        left = [pid for pid in _others() if pid not in SPARED or not spare]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in SPARED if spare else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if not left:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.001)


def _limits(memory: int, cpu: float, fsize: int, data: int = 0) -> Any:
    """``data``: RLIMIT_DATA, for a runtime that reserves far more address space than it writes (Go)."""
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, data)):
            if value:
                resource.setrlimit(limit, (value, value))
        seconds = max(1, int(cpu + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


def memfd(name: str, chunks: Any) -> int:
    fd = os.memfd_create(name)
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Process:
    """One subprocess run within its limits: its stdout (capped), the end of its stderr, how it ended."""

    def __init__(self, argv: list[str], cwd: str, stdin_fd: int, limits: dict[str, Any],
                 pass_fds: tuple[int, ...] = (), zygote: Any = None) -> None:
        self.out, self.err, self.err_total = bytearray(), bytearray(), 0
        self.err_head = b""  # where a runtime says it ran out of memory (Go's trace of every goroutine follows)
        self.over = self.late = False
        self.status, self.wall, self.swept = 0, 0.0, False
        self.usage: Any = None
        self.cap, self.limit = int(limits["output"]), float(limits["time"])
        self.zygote, files = zygote, int(limits.get("files", self.cap + 1))
        started, out, err = time.monotonic(), os.pipe(), os.pipe()
        try:
            if zygote is None:
                self._popen = subprocess.Popen(argv, cwd=cwd, stdin=stdin_fd, stdout=out[1], stderr=err[1],
                                               env=dict(ENV), close_fds=True, pass_fds=pass_fds,
                                               preexec_fn=_limits(int(limits["memory"]), self.limit, files,
                                                                  int(limits.get("data", 0))))
                self.pid = self._popen.pid
            else:  # forked by the server (`judgefork`), which reports its end
                self.pid = zygote.start(argv[1:], cwd, (stdin_fd, out[1], err[1]), {**limits, "fsize": files})
        except BaseException:
            os.close(out[0])
            os.close(err[0])
            raise
        finally:
            os.close(out[1])
            os.close(err[1])
        self.pipes = (out[0], err[0])
        try:
            self._watch(started)
        finally:
            os.close(out[0])
            os.close(err[0])

    def _exit_fd(self) -> int:
        """A descriptor readable once the process ended; -1 where there is none (then its exit is polled)."""
        if self.zygote is not None:
            return os.dup(self.zygote.sock.fileno())  # the server reports the end
        try:
            return os.pidfd_open(self.pid)
        except OSError:  # gVisor has none (ENOSYS): the exit is polled, never blamed on the program
            return -1

    def _reap(self) -> None:
        if self.zygote is None:
            _, self.status, self.usage = os.wait4(self.pid, 0)
            self._popen.returncode = 0  # reaped here: Popen must not wait for it again
            return
        ended = self.zygote.ended()
        if ended is None:
            raise OSError("the fork server did not report the end of a test")
        self.status, self.usage = ended

    def _watch(self, started: float) -> None:
        pidfd = self._exit_fd()
        selector = selectors.DefaultSelector()
        for fd, kept in zip(self.pipes, (self.out, self.err), strict=True):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, kept)
        if pidfd >= 0:
            selector.register(pidfd, selectors.EVENT_READ, None)
        deadline, exited = started + self.limit, False
        try:
            while not exited and not self.over:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.late = True
                    break
                for key, _ in selector.select(left if pidfd >= 0 else min(left, 0.005)):
                    if key.data is None:
                        exited = True
                    elif self._read(key.fd, key.data):  # at its end: never polled again (it stays readable)
                        selector.unregister(key.fd)
                if pidfd < 0:  # WNOWAIT: still reaped by wait4 below, with its usage
                    exited = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            self.wall = time.monotonic() - started
            self.swept = end_all()  # False: a process it left could not be ended
            for key in list(selector.get_map().values()):  # what the ended processes wrote last
                if key.data is not None:
                    self._read(key.fd, key.data)
            self._reap()
        finally:
            selector.close()
            if pidfd >= 0:
                os.close(pidfd)

    def _read(self, fd: int, kept: bytearray) -> bool:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            if kept is self.out:
                room = self.cap - len(kept)
                kept += chunk[:max(room, 0)]
                if len(chunk) > room:
                    self.over = True
                    return False
            else:
                self.err_total += len(chunk)
                self.err_head += chunk[:max(0, _STDERR_KEPT - len(self.err_head))]
                kept += chunk
                del kept[:max(0, len(kept) - _STDERR_KEPT)]
                if self.err_total > self.cap:
                    self.over = True
                    return False

    @property
    def signal(self) -> int:
        return os.WTERMSIG(self.status) if os.WIFSIGNALED(self.status) else 0

    @property
    def exit_code(self) -> int:
        return os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else -self.signal

    @property
    def cpu(self) -> float:
        return (self.usage.ru_utime + self.usage.ru_stime) if self.usage else 0.0

    @property
    def peak(self) -> int:
        return int(self.usage.ru_maxrss) * 1024 if self.usage else 0

    def verdict(self, memory: int) -> str | None:
        """How the run failed, or None when it exited 0 within its limits."""
        if self.over or self.signal == signal.SIGXFSZ or _FILE_TOO_LARGE in self.err:
            return "output_limit"
        if self.late or self.signal == signal.SIGXCPU or self.cpu >= self.limit:
            return "timeout"
        if self.status == 0:
            return None
        base = self.zygote.extra_rss if self.zygote is not None else 0  # the warm server's pages: not the test's
        said = self.err_head + bytes(self.err)
        if any(mark in said for mark in _MEMORY_MARKS) or (memory and self.peak - base >= memory * 0.9):
            return "memory"
        return "runtime_error"
