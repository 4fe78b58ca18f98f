"""The judge's fork server for Python tests with reuse="batch": shipped as text into a judging sandbox, never
imported on the host.

Run by the kernel as `python3 -c <this text>`, it imports what the image warms once, then forks one child per
test on the kernel's request. The child runs the program as `python3 main.py` would. Each test starts from the
same state, because the server never runs a program's code and never holds a test.

A server starts only where no test has run yet: before a sandbox's first program, or after a clean reset
(`prepare`), never on a program's time. It inherits the kernel's settings and reads the places a test can write
at its start, so it must not start where a test could have changed them.

A test runs as the same user as the server. It cannot trace it or read it (the server is non-dumpable), but it
can signal it and change its limits and scheduling, which the next child would inherit. So before each test the
kernel checks the server (`Zygote.intact`); one that changed is closed, and the program's later tests run the
usual way. Standard library only: this runs on the sandbox's Python. The server imports little: each module it
holds makes every fork dearer (subprocess's threading hooks doubled its cost).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import gc
import json
import operator
import os
import resource
import signal
import socket
import sys
import time
import types

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_PR_SET_DUMPABLE = 4
_LIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
_ANSWER = 2.0  # seconds the server may take to fork a child, or to report its end
SOURCE = ""  # this file's text, set by the host where it runs it in the kernel
# The handlers as Python's start leaves them; every other one is SIG_DFL.
_STARTED: dict[int, Any] = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                             signal.SIGXFSZ: signal.SIG_IGN}
_NO_SIGNALS = ctypes.create_string_buffer(128)  # an empty sigset_t
_SWEPT = 1 << (signal.SIGCONT - 1)  # what the sweep leaves waiting (a child's SIGCHLD is taken after its end)
_DRAINED = 64  # signals the server takes after a test; past them it is replaced
# Before a fork, where only what came between a test's end and the sweep can wait: more than gVisor lets be queued
# (32 of each real-time signal); runc shows the rest in /proc (`intact`).
_DRAINED_BEFORE = 2048
_WARM = b"n = int('7')\nvalues = [str(i * i) for i in range(n)]\ntotal = sum(int(v) for v in values)\n"


def _vm() -> tuple[int, int]:
    """This process's address space and resident set, in bytes."""
    with open("/proc/self/statm") as handle:
        size, resident = handle.read().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(size) * page, int(resident) * page


_X86_64 = os.uname().machine == "x86_64"
_libc: list[Any] = []  # the C library, loaded once (each load makes a class)


def _c() -> Any:
    if not _libc:
        _libc.append(ctypes.CDLL(None, use_errno=True))
    return _libc[0]


def _syscall(*args: Any) -> int:
    return int(_c().syscall(*args))


def _sched(pid: int) -> bytes:
    """sched_getattr of ``pid`` (x86-64's syscall 315): policy, nice, priority and the rest a child inherits."""
    if not _X86_64:
        return b""
    attr = ctypes.create_string_buffer(56)
    return attr.raw if _syscall(315, pid, attr, 56, 0) == 0 else b"?"


def _ioprio(pid: int) -> int:
    return _syscall(252, 1, pid) if _X86_64 else 0  # ioprio_get(IOPRIO_WHO_PROCESS)


def settings(pid: int) -> dict[str, Any]:
    """What a forked child inherits from ``pid`` that another process of the same user can change."""
    found: dict[str, Any] = {name: resource.prlimit(pid, getattr(resource, name)) for name in _LIMITS}
    found["affinity"] = sorted(os.sched_getaffinity(pid))
    found["nice"], found["policy"] = os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid)
    found["sched"] = _sched(pid)
    found["ioprio"] = _ioprio(pid)
    return found


class Zygote:
    """The kernel's side: the server's process, what it inherits, and one request at a time."""

    def __init__(self, source: str, warm: list[str], env: dict[str, str], end: float) -> None:
        import subprocess  # the kernel's side only

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        own = dict(env)  # Matplotlib's settings and font cache: the kernel's folder (in its home), never /tmp
        own.update({name: os.environ[name] for name in ("MPLCONFIGDIR",) if name in os.environ})
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", source, json.dumps(warm), str(theirs.fileno()),
                                          json.dumps(env)], cwd="/", env=own,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.calm = True  # no signal was left waiting after the last test
        try:
            ready = self._answer(max(0.0, end - time.monotonic()))
            if not isinstance(ready, dict) or ready.get("threads") != 1:
                raise OSError("the fork server did not start")
            self.extra_vm, self.extra_rss = int(ready["extra_vm"]), int(ready["extra_rss"])
            self.were = settings(self.pid)
        except BaseException:
            self.close()
            raise

    def _answer(self, seconds: float) -> Any:
        self.sock.settimeout(max(seconds, 0.001))
        try:
            data = self.sock.recv(4096)
        except OSError:
            return None
        try:
            return json.loads(data) if data else None
        except ValueError:
            return None

    def intact(self) -> bool:
        """Alive, asleep waiting for the kernel, with no signal waiting but those every test sends it, and with
        what a child inherits unchanged since its start. Signals it blocks wait: a test could queue them to fill
        the user's quota, or leave bits the next program reads."""
        try:
            with open(f"/proc/{self.pid}/status", "rb") as handle:
                fields = dict(line.split(b":", 1) for line in handle.read(4096).splitlines() if b":" in line)
            # gVisor shows no pending signals: the server's own count after each test (calm) stands for them.
            waiting = (int(fields.get(b"ShdPnd", b"0"), 16) | int(fields.get(b"SigPnd", b"0"), 16)) & ~_SWEPT
            return fields[b"State"].split()[0] in (b"S", b"R") and not waiting and self.calm \
                and self.proc.poll() is None and settings(self.pid) == self.were
        except (OSError, KeyError, IndexError, ValueError):
            return False

    def start(self, args: list[str], cwd: str, fds: tuple[int, int, int], limits: dict[str, Any]) -> int:
        """Fork a child that runs the program in ``cwd`` with ``args`` on stdin, stdout, stderr ``fds``."""
        request = {"args": args, "cwd": cwd, "memory": int(limits["memory"]) and int(limits["memory"]) + self.extra_vm,
                   "cpu": float(limits["time"]), "fsize": int(limits["fsize"])}
        self.sock.sendmsg([json.dumps(request).encode()],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        answer = self._answer(_ANSWER)
        if not isinstance(answer, dict) or not isinstance(answer.get("pid"), int):
            raise OSError("the fork server did not answer")
        return int(answer["pid"])

    def ended(self) -> Any:
        """How the child ended: (wait status, its resource usage), or None when the server did not say."""
        answer = self._answer(_ANSWER)
        if not isinstance(answer, dict) or not isinstance(answer.get("status"), int):
            return None
        self.calm = answer.get("calm") is True
        return answer["status"], resource.struct_rusage([*answer["usage"], *[0] * 13])

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


START = "a fork server is to start"  # prepare()'s answer where it may not start one (judgemany says it too)
_current: list[Any] = []  # the server in use, and the warm imports and environment it started with
_failed: list[Any] = []  # what a server could not start with (its imports start threads, say): never tried again


def _drop() -> None:
    if _current:
        _current.pop(0).close()
        _current.clear()


def prepare(warm: list[str], env: dict[str, str], seconds: float | None, spared: list[int]) -> list[str]:
    """Where no test has run since the places and the kernel were made clean: keep an intact server for ``warm``
    and ``env``, or start one within ``seconds``; ``spared`` (the runner's sweep spares it) then holds its pid.
    [] whatever happens (without one, tests run the usual way). ``seconds`` None: no start here, where the
    request has no time for one; [START] then says one is to start (in a request of its own)."""
    if _current and (_current[1:] != [warm, env] or not _current[0].intact()):
        _drop()
    if not _current and [warm, env] not in _failed:
        if seconds is None:
            spared[:] = []
            return [START]
        try:
            _current[:] = [Zygote(SOURCE, warm, env, time.monotonic() + seconds), warm, env]
        except OSError:
            _failed.append([warm, env])
    spared[:] = [_current[0].pid] if _current else []
    return []


def current(warm: list[str], env: dict[str, str]) -> Any:
    """The server for ``warm`` and ``env`` if it is intact; else None, and a changed one closed."""
    if _current and _current[1:] == [warm, env] and _current[0].intact():
        return _current[0]
    _drop()
    return None


def _serve(sock: socket.socket) -> dict[str, Any]:
    """Fork a child per request; return (in the child only) what it must run."""
    while True:
        fds = array.array("i")
        try:
            data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(3 * fds.itemsize))
        except OSError:
            os._exit(0)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not data or len(fds) != 3:
            os._exit(0)  # the kernel closed, or spoke out of protocol: it starts another server
        with contextlib.suppress(ChildProcessError):  # no child of an earlier test is left a zombie here
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not _calm(_DRAINED_BEFORE):  # sent after the last test's end, before the sweep: never seen by a child
            os._exit(1)
        pid = os.fork()
        if pid == 0:
            request = json.loads(data)
            request["fds"] = list(fds)
            return request
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        while True:  # a child that asked to be traced (PTRACE_TRACEME) reports its stops: not its end
            _, status, usage = os.wait4(pid, 0)
            if not os.WIFSTOPPED(status):
                break
        ended = {"status": status, "usage": [usage.ru_utime, usage.ru_stime, usage.ru_maxrss],
                 "calm": _calm(_DRAINED)}
        sock.send(json.dumps(ended).encode())


def _calm(most: int) -> bool:
    """Take the signals a test sent (they wait, blocked), ``most`` at most: whether none is left. A test could
    queue them until the user's quota is full, or leave bits or counts the next program reads."""
    for _ in range(most):
        waiting = signal.sigpending()
        if not waiting:
            return True
        signal.sigtimedwait(waiting, 0)
    return not signal.sigpending()


def _become(request: dict[str, Any], sock: socket.socket, env: tuple[list[str], dict[str, str]]) -> str:
    """In the child: the test's descriptors, session, limits, signals, environment (``env``: the server's names
    to remove, and what to set) and folder; its program's path."""
    sock.close()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    # Dumpable again, as after the exec of a fresh interpreter (its own /proc/self/mem): it holds no secret.
    _c().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    os.setsid()
    _c().sigprocmask(2, _NO_SIGNALS, None)  # SIG_SETMASK; the handlers are those of Python's start already
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if request["memory"]:
        resource.setrlimit(resource.RLIMIT_AS, (request["memory"], request["memory"]))
    seconds = max(1, int(request["cpu"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
    for name in env[0]:
        del os.environ[name]
    os.environ.update(env[1])
    os.chdir(request["cwd"])
    path = os.path.join(request["cwd"], request["args"][0])
    sys.argv[:] = [path, *request["args"][1:]]
    if sys.path[:1] == [""]:  # the server's (`-c`, in /): the program's folder, as for `python3 main.py`
        sys.path[0] = request["cwd"]
    else:
        sys.path.insert(0, request["cwd"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh interpreter seeds it anew; `random` reseeds itself after a fork
        numpy.random.seed()
    return path


def _main() -> None:
    if _c().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os._exit(1)
    # A test's signal other than KILL and STOP waits, blocked, and is never delivered: the server stays as it was.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    sock = socket.socket(fileno=int(sys.argv[2]))
    env = json.loads(sys.argv[3])  # the tests' (the server's own may add Matplotlib's folder)
    vm, rss = _vm()
    for name in json.loads(sys.argv[1]):
        with contextlib.suppress(Exception):  # what the image lacks is not warmed, as in the kernel
            __import__(name)
    after_vm, after_rss = _vm()
    threads = len(os.listdir("/proc/self/task"))
    sock.send(json.dumps({"threads": threads, "extra_vm": after_vm - vm, "extra_rss": after_rss - rss}).encode())
    if threads != 1:
        os._exit(1)  # a fork copies one thread of many: never served
    for number in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:  # what a child starts with
        with contextlib.suppress(OSError, ValueError):  # once here, so a child only unblocks them
            signal.signal(number, _STARTED.get(number, signal.SIG_DFL))
    exec(compile(_WARM, "<warm>", "exec"), {})  # a compile's first use in a child costs it milliseconds
    tests = ([name for name in os.environ if name not in env],  # worked out once: each change is a call
             {name: value for name, value in env.items() if os.environ.get(name) != value})
    gc.freeze()  # a child's collections skip what the server holds, and leave its pages shared
    request = _serve(sock)
    path = _become(request, sock, tests)
    del request, sock, env, tests
    main = types.ModuleType("__main__")
    status, interrupted = _run(path, main)
    _finish(status, interrupted, main)


def _code(code: Any) -> int:
    """The exit status of SystemExit(code), as the interpreter makes it."""
    if code is None:
        return 0
    try:
        value = operator.index(code)
    except TypeError:
        print(code, file=sys.stderr)
        return 1
    return value & 0xFF if -(1 << 63) <= value < 1 << 63 else 255


def _run(path: str, main: types.ModuleType) -> tuple[int, bool]:
    """Run the program as `python3 main.py` would (its module is __main__): its exit status, and whether an
    uncaught KeyboardInterrupt ended it."""
    main.__file__ = path
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as handle:
            code = compile(handle.read(), path, "exec")
        exec(code, main.__dict__)
    except SystemExit as exc:
        return _code(exc.code), False
    except BaseException as exc:  # shown from the program's first frame, as python3 would
        trace = exc.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != path:
            trace = trace.tb_next
        exc.__traceback__ = trace or exc.__traceback__
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1, isinstance(exc, KeyboardInterrupt)
    return 0, False


def _finish(status: int, interrupted: bool, main: types.ModuleType) -> None:
    """End as the interpreter would: threads joined, atexit run, the program's module cleared (its objects'
    finalizers run, its files flushed), output flushed; without tearing down the modules the server imported."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # python3 ends with 120 when its output cannot be flushed
            status = status or 120
    if interrupted:  # killed by SIGINT, as python3 is by an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    _main()
