"""The judge's runner: shipped as text into a judging sandbox and run in its kernel, never imported on the host.

It holds the tests and verdicts in the kernel's memory and runs each test as a subprocess, so nothing the
program does can reach them:
- Init (PID 1), which kill(-1) spares, is made non-dumpable too (`judgeinit`): no test can trace or write it.
- The kernel is made non-dumpable first: a process of the same uid cannot ptrace it or read its memory, its
  environment or its descriptors, so the kernel's key (to speak to it) and the expected outputs stay out of reach.
- The tests' files are opened and unlinked before any test runs: the program never reads an expected output.
- After each test every process of the sandbox but init and the kernel is killed (kill(-1); the fork server of
  `judgefork` is spared while single kills keep up): a child the program left behind never sees the next test.
  A test that leaves one that cannot be ended stops the judging.
- The verdicts go back to the host in the reply to the host's own request (user_expressions), a channel only
  the kernel writes; nothing a test prints or writes is read as a verdict.
- The kernel leaves /mnt/data (its folder and its import path) before the first test: a file a test plants is
  never imported by the kernel.
Limits per test are rlimits (address space, CPU, file size, no core) and a wall-clock deadline; stdout and stderr
are read within a cap. Standard library only: this runs on the sandbox's Python.
"""

import base64
import contextlib
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # in the kernel, `judgecompare` is run into this namespace first
    from nbexec.engine.judgecompare import compare, diff

_PR_SET_DUMPABLE = 4
_STDERR_KEPT = 2048  # bytes of a test's stderr kept for its record (its end)
_MEMORY_MARKS = (b"MemoryError", b"std::bad_alloc", b"out of memory", b"OutOfMemoryError", b"memory allocation",
                 b"annot allocate memory")  # ENOMEM, as Go (and perror) say it
_FILE_TOO_LARGE = b"File too large"  # EFBIG: past RLIMIT_FSIZE where SIGXFSZ is ignored (Python ignores it)
_ENV = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _undumpable() -> None:
    import ctypes  # imported here, before any test runs (see sys.path below)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _leave_data() -> None:
    """Never import what a test could write: the kernel's cwd and import path leave writable places."""
    os.chdir("/")
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and not p.startswith(("/mnt", "/tmp", "/home"))]
    sys.path_importer_cache.clear()


def _encode(value: Any) -> str:
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode("ascii")


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


_SPARED: list[int] = []  # the fork server (`judgefork`), which _end_all leaves while it can


def _end_all(wait: float = 2.0) -> bool:
    """Kill every process but init and the kernel (kill(-1) skips the caller); True once none is left.
    The fork server is spared while that holds: every process is stopped at once first (kill(-1, SIGSTOP): a
    process with a stop pending cannot finish a fork), so a listing misses none, then each but the server is
    killed and the server continued. Past a tenth of ``wait``, kill(-1) ends the server too."""
    end = time.monotonic() + wait
    while True:
        spare = bool(_SPARED) and time.monotonic() < end - wait * 0.9
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGSTOP if spare else signal.SIGKILL)
        left = [pid for pid in _others() if pid not in _SPARED or not spare]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in _SPARED if spare else ():
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


def _memfd(name: str, chunks: Any) -> int:
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
        self.status, self.wall = 0, 0.0
        self.usage: Any = None
        self.cap, self.limit = int(limits["output"]), float(limits["time"])
        self.zygote, files = zygote, int(limits.get("files", self.cap + 1))
        started, out, err = time.monotonic(), os.pipe(), os.pipe()
        try:
            if zygote is None:
                self._popen = subprocess.Popen(argv, cwd=cwd, stdin=stdin_fd, stdout=out[1], stderr=err[1],
                                               env=dict(_ENV), close_fds=True, pass_fds=pass_fds,
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
            _end_all()
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


class Judge:
    """The tests of one program, held in the kernel's memory; `setup` once, then `run` each chunk."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.index: list[dict[str, Any]] = []
        self.blob = -1
        self.build = plan["build"]
        self.fork: Any = None

    def setup(self, seal: Any = None, fork: Any = None) -> str:
        """Seal the kernel, init (``seal``: judgeinit's, "" once sealed) and the tests; compile the program.
        ``fork``: judgefork's `current`, when Python tests may be forked from a warm server."""
        self.fork = fork if self.plan.get("warm") is not None else None
        _undumpable()
        _leave_data()
        exposed = seal() if seal is not None else ""
        if exposed:
            return _encode({"exposed": exposed})
        _ENV.update(self.plan["env"])
        folder = self.plan["folder"]
        with open(os.path.join(folder, "index.json"), "rb") as handle:
            self.index = json.loads(handle.read())
        self.blob = os.open(os.path.join(folder, "tests.bin"), os.O_RDONLY | os.O_NOFOLLOW)
        os.unlink(os.path.join(folder, "index.json"))
        os.unlink(os.path.join(folder, "tests.bin"))
        for command in (self.plan["compile"], self.plan["run"]):
            tool = command[0] if command else "/"
            if not tool.startswith(("/", ".")) and shutil.which(tool, path=_ENV["PATH"]) is None:
                return _encode({"missing": command[0]})
        if not self.plan["compile"]:
            return _encode({"compiled": None})
        _end_all()
        stdin = _memfd("stdin", [])
        try:
            run = Process(self.plan["compile"], self.build, stdin, self.plan["compile_limits"])
        finally:
            os.close(stdin)
        failed = run.verdict(int(self.plan["compile_limits"]["memory"]))
        if failed is None and self.plan["output"] and not os.path.isfile(os.path.join(self.build, self.plan["output"])):
            failed = "no_output"
        log = (bytes(run.out[-4096:]) + bytes(run.err)).decode("utf-8", "replace")[-4096:]
        return _encode({"compiled": {"ok": failed is None, "why": failed, "log": log, "time": run.wall}})

    def _read(self, span: list[int] | None) -> bytes | None:
        if span is None:  # no expected output: never a sentinel an expected output could equal
            return None
        offset, length = span
        return os.pread(self.blob, length, offset) if length else b""

    def run(self, first: int, last: int, seconds: float, budget: int) -> str:
        """Run tests ``first`` to ``last`` (excluded) within ``seconds``; their records, ``budget`` bytes at most."""
        end, records, used, number = time.monotonic() + seconds, [], 0, first
        try:
            for number in range(first, last):
                if time.monotonic() >= end:
                    records.append({"v": "timeout", "why": "not run: the program's time limit was used up"})
                    continue
                record = self._fit(self._one(self.index[number], end), budget - used, last - number)
                used += len(json.dumps(record))
                records.append(record)
                if record.get("v") == "judge_error":
                    break
        except KeyboardInterrupt:  # the host's, or a test's SIGINT: the test under way is not judged
            _end_all()
            records = [*records[:number - first], {"v": "judge_error", "why": "interrupted"}]
        return _encode(records)

    @staticmethod
    def _fit(record: dict[str, Any], room: int, left: int) -> dict[str, Any]:
        if len(json.dumps(record)) * left > room:  # keep room for the rest: the details go first
            record.pop("diff", None)
            record.pop("err", None)
            if "why" in record:
                record["why"] = record["why"][:100]
        return record

    def _one(self, test: dict[str, Any], end: float) -> dict[str, Any]:
        limits = dict(self.plan["limits"])  # the program's limit ends a test whose own limit is longer
        limits["time"] = min(float(limits["time"]), max(0.01, end - time.monotonic()))
        zygote = self.fork(self.plan["warm"], dict(_ENV)) if self.fork is not None else None
        _SPARED[:] = [zygote.pid] if zygote is not None else []  # before the sweep, which must spare it
        if not _end_all():
            return {"v": "judge_error", "why": "processes of an earlier test could not be ended"}
        if zygote is not None and self.fork(self.plan["warm"], dict(_ENV)) is None:  # changed before the sweep
            zygote = None
        given = self._read(test["stdin"]) or b""
        stdin = _memfd("stdin", [given])
        try:
            run = Process([*self.plan["run"], *test["args"]], self.build, stdin, limits, zygote=zygote)
        except OSError as exc:
            if zygote is not None:  # the server was stopped or killed, most likely by a test: nothing is judged
                _end_all()
                return {"v": "judge_error", "why": f"the fork server failed: {exc}"}
            return {"v": "runtime_error", "why": f"could not start: {exc.strerror}"}
        finally:
            os.close(stdin)
        record: dict[str, Any] = {"t": round(run.wall, 4), "cpu": round(run.cpu, 4), "mem": run.peak,
                                  "exit": run.exit_code, "err": bytes(run.err[-512:]).decode("utf-8", "replace")}
        failed = run.verdict(int(limits["memory"]))
        if not _end_all():
            return {**record, "v": "judge_error", "why": "the test's processes could not be ended"}
        if failed is not None:
            return {**record, "v": failed}
        want = self._read(test["expected"])
        mode = self.plan["compare"]
        if mode == "checker":
            return {**record, **self._check(given, bytes(run.out), want)}
        if want is None:
            return {**record, "v": "accepted"}
        if compare(mode, bytes(run.out), want, float(self.plan["tolerance"])):
            return {**record, "v": "accepted"}
        return {**record, "v": "wrong_answer", "diff": diff(bytes(run.out), want)}

    def _check(self, given: bytes, output: bytes, want: bytes | None) -> dict[str, Any]:
        """Run the caller's check() in a subprocess of its own (the program's processes are gone by now)."""
        fds = [_memfd(name, [data]) for name, data in (("checker", self.plan["checker"].encode()), ("input", given),
                                                       ("output", output), ("expected", want)) if data is not None]
        reader, writer = os.pipe()
        stdin = _memfd("stdin", [])
        try:
            # -I: no folder a test could write (its cwd, ~/.local) is on the checker's import path.
            argv = [sys.executable, "-I", "-c", self.plan["checker_wrapper"], *map(str, fds),
                    *(() if want is not None else ("-",)), str(writer)]  # "-": no expected output
            run = Process(argv, "/", stdin, self.plan["checker_limits"], pass_fds=(*fds, writer))
            os.close(writer)
            writer = -1
            os.set_blocking(reader, False)
            try:
                answer = os.read(reader, 4096)
            except BlockingIOError:
                answer = b""
        finally:
            for fd in (*fds, stdin, reader, *((writer,) if writer >= 0 else ())):
                os.close(fd)
        _end_all()
        try:
            accepted, message = json.loads(answer) if run.status == 0 else (None, "")
        except ValueError:
            accepted, message = None, ""
        if accepted is None or not isinstance(accepted, bool) or not isinstance(message, str):
            tail = bytes(run.err[-400:]).decode("utf-8", "replace")
            return {"v": "checker_error", "why": f"the checker failed ({run.verdict(0) or 'no answer'}): {tail}"}
        return {"v": "accepted" if accepted else "wrong_answer", **({"why": message} if message else {})}
