"""The process supervisor that runs INSIDE a sandbox (stdlib only, Python 3.9+).

The host starts it by `docker exec` as the sandbox user (see `client`), with this package's wire, agentfiles and
agent sources handed to a small loader (``LOADER``), and speaks frames (`wire`) over the exec's stdin and stdout.
Each process it starts gets a session and process group of its own; on stdin's end it kills them all and exits. It
gives the sandbox's code nothing the code could not do itself: it runs as the same user, within the same cgroups.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import selectors
import signal
import struct
import subprocess
import sys
import termios
import time
from typing import Any

from .agentfiles import Answer, Failure, FileOps, error_code
from .agentports import Ports
from .agentwatch import Watches
from .wire import MAX_PENDING_STDIN, MAX_PROCESSES, OUTPUT_CHUNK, FrameReader, encode

# Runs the modules given as arguments (name, source, ...) as one package, then the agent's main.
LOADER = """import sys, types
package = types.ModuleType('nbexec_supervisor')
package.__path__ = []
sys.modules['nbexec_supervisor'] = package
for name, source in zip(sys.argv[1::2], sys.argv[2::2]):
    module = types.ModuleType('nbexec_supervisor.' + name)
    module.__package__ = 'nbexec_supervisor'
    sys.modules[module.__name__] = module
    exec(compile(source, module.__name__, 'exec'), module.__dict__)
module.main()
"""

class Process:
    """One process the supervisor started: its fds, pending stdin and deadline."""

    def __init__(self, popen: subprocess.Popen[bytes], msg: dict[str, Any], master: int | None) -> None:
        self.popen, self.master = popen, master
        self.info = {"pid": popen.pid, "tag": msg.get("tag"), "cmd": msg["argv"][0], "args": msg["argv"][1:],
                     "envs": msg.get("envs") or {}, "cwd": msg.get("cwd") or os.getcwd()}
        self.outputs: dict[int, str] = {}
        if master is not None:
            self.outputs[master] = "pty"
        else:
            self.outputs = {_take(popen, "stdout"): "stdout", _take(popen, "stderr"): "stderr"}
        self.stdin = master if master is not None else (_take(popen, "stdin") if popen.stdin else None)
        self.pending = bytearray()
        self.close_after = False
        timeout = msg.get("timeout")
        self.deadline = time.monotonic() + float(timeout) if timeout else None
        self.error: str | None = None
        for fd in [*self.outputs, *([self.stdin] if self.stdin is not None else [])]:
            os.set_blocking(fd, False)


def _take(popen: subprocess.Popen[bytes], name: str) -> int:
    """The fd of one of ``popen``'s pipes, owned by the supervisor alone (the file object would close it again)."""
    pipe = getattr(popen, name)
    fd = os.dup(pipe.fileno())
    pipe.close()
    setattr(popen, name, None)
    return fd


def _take_terminal() -> None:  # in the child, after setsid: the pty on fd 0 becomes its controlling terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Agent:
    """The loop: frames from the host, output of the processes, their ends and deadlines."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.processes: dict[int, Process] = {}
        self.watched: set[int] = set()
        self.files = FileOps()
        self.watches = Watches(self.selector)
        self.ports = Ports(self.selector, self.send)
        self.frames = FrameReader()
        wake_read, wake_write = os.pipe()
        for fd in (wake_read, wake_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.wake = wake_read
        self.selector.register(0, selectors.EVENT_READ)
        self.selector.register(wake_read, selectors.EVENT_READ)

    def send(self, head: dict[str, Any], data: bytes = b"") -> None:
        view = memoryview(encode(head, data))
        while view:
            view = view[os.write(1, view):]

    def run(self) -> None:
        self.send({"ev": "ready", "pid": os.getpid()})
        while True:
            deadlines = [p.deadline for p in self.processes.values() if p.deadline is not None]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, events in self.selector.select(wait):
                self.ready(key.fd, events)
            self.reap()
            self.expire()

    def ready(self, fd: int, events: int) -> None:
        if fd == 0:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                self.shutdown()
            for head, data in self.frames.feed(chunk):
                self.handle(head, data)
        elif fd == self.wake:
            self.drain_wake()
        elif fd in self.watches.by_fd:
            watch, found = self.watches.read(fd)
            for name, kind in found:
                self.send({"ev": "fs", "watch": watch, "name": name, "type": kind})
        elif fd in self.ports.by_fd:
            self.ports.ready(fd, events)
        else:
            process = next((p for p in self.processes.values() if fd in p.outputs or fd == p.stdin), None)
            if process is None:  # closed by an earlier event of this round
                return
            if events & selectors.EVENT_READ and fd in process.outputs:
                self.read_output(process, fd)
            if events & selectors.EVENT_WRITE and fd == process.stdin:
                self.flush_stdin(process)

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake, 512):
                pass

    def interest(self, process: Process, fd: int) -> None:
        events = (selectors.EVENT_READ if fd in process.outputs else 0) | (
            selectors.EVENT_WRITE if fd == process.stdin and process.pending else 0)
        with contextlib.suppress(KeyError):
            self.selector.unregister(fd)
        if events:
            self.selector.register(fd, events)

    def read_output(self, process: Process, fd: int) -> None:
        try:
            chunk = os.read(fd, OUTPUT_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: a pty whose other side is closed
            chunk = b""
        if not chunk:
            name = process.outputs.pop(fd)
            self.interest(process, fd)
            if not (name == "pty" and process.stdin == fd):
                os.close(fd)
            return
        if process.popen.pid in self.watched:
            self.send({"ev": "out", "pid": process.popen.pid, "fd": process.outputs[fd]}, chunk)

    def flush_stdin(self, process: Process) -> None:
        fd = process.stdin
        if fd is None:
            return
        try:
            if process.pending:
                del process.pending[:os.write(fd, process.pending)]
        except BlockingIOError:
            pass
        except OSError:
            process.pending.clear()
        if process.close_after and not process.pending:
            self.close_stdin(process)
        elif fd == process.stdin:
            self.interest(process, fd)

    def close_stdin(self, process: Process) -> None:
        fd, process.stdin = process.stdin, None
        if fd is not None:
            self.interest(process, fd)
            if fd not in process.outputs:
                os.close(fd)

    def reap(self) -> None:
        for pid, process in list(self.processes.items()):
            if process.popen.poll() is None:
                continue
            for fd in list(process.outputs):
                for _ in range(16):  # what it wrote before it ended; a child it left may write on: not waited for
                    if fd not in process.outputs or not select.select([fd], [], [], 0)[0]:
                        break
                    self.read_output(process, fd)
            self.finish(pid, process)

    def finish(self, pid: int, process: Process) -> None:
        for fd in {*process.outputs, *([process.stdin] if process.stdin is not None else [])}:
            with contextlib.suppress(KeyError):
                self.selector.unregister(fd)
            os.close(fd)
        code = process.popen.returncode
        if code < 0:
            name = signal.strsignal(-code) or f"signal {-code}"
            end = {"exit_code": -1, "exited": False, "status": f"signal: {name.lower()}"}
        else:
            end = {"exit_code": code, "exited": True, "status": f"exit status {code}"}
        del self.processes[pid]
        self.watched.discard(pid)
        self.send({"ev": "end", "pid": pid, **end, "error": process.error})

    def expire(self) -> None:
        now = time.monotonic()
        for pid, process in self.processes.items():
            if process.deadline is not None and process.deadline <= now:
                process.deadline, process.error = None, "the process ran past its timeout and was killed"
                self.kill(pid, signal.SIGKILL)

    @staticmethod
    def kill(pid: int, sig: int) -> None:
        with contextlib.suppress(OSError):
            os.killpg(pid, sig)

    def shutdown(self) -> None:
        for pid in self.processes:
            self.kill(pid, signal.SIGKILL)
        sys.exit(0)

    def handle(self, head: dict[str, Any], data: bytes) -> None:
        op = head.get("op")
        name = f"op_{op}" if isinstance(op, str) and op.isidentifier() else ""
        method = (getattr(self, name, None) or getattr(self.files, name, None)
                  or getattr(self.watches, name, None) or getattr(self.ports, name, None))
        try:
            if method is None:
                raise Failure("invalid_argument", f"unknown operation {op!r}")
            reply, payload = method(head, data)
        except Failure as exc:
            reply, payload = {"error": exc.code, "message": str(exc)[:1000]}, b""
        except OSError as exc:
            reply, payload = {"error": error_code(exc), "message": f"{exc.strerror}: {exc.filename}"[:1000]}, b""
        except (KeyError, TypeError, ValueError) as exc:
            reply, payload = {"error": "invalid_argument", "message": str(exc)[:1000]}, b""
        if "id" in head:
            self.send({"id": head["id"], **reply}, payload)

    def process(self, head: dict[str, Any]) -> Process:
        process = self.processes.get(head.get("pid"))  # type: ignore[arg-type]
        if process is None:
            raise Failure("not_found", f"process {head.get('pid')} is not running")
        return process

    def op_spawn(self, head: dict[str, Any], _: bytes) -> Answer:
        if len(self.processes) >= MAX_PROCESSES:
            raise Failure("resource_exhausted", f"{MAX_PROCESSES} processes are running already")
        env = {**os.environ, **head.get("envs", {})}
        size, master = head.get("pty"), None
        if size:
            master, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
            try:
                popen = subprocess.Popen(head["argv"], stdin=slave, stdout=slave, stderr=slave, cwd=head.get("cwd"),
                                         env=env, start_new_session=True, preexec_fn=_take_terminal)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
        else:
            stdin = subprocess.PIPE if head.get("stdin") else subprocess.DEVNULL
            popen = subprocess.Popen(head["argv"], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=head.get("cwd"), env=env, start_new_session=True)
        process = Process(popen, head, master)
        self.processes[popen.pid] = process
        self.watched.add(popen.pid)
        for fd in process.outputs:
            self.interest(process, fd)
        return {"pid": popen.pid}, b""

    def op_watch(self, head: dict[str, Any], _: bytes) -> Answer:
        pid = self.process(head).popen.pid
        (self.watched.add if head.get("on") else self.watched.discard)(pid)
        return {}, b""

    def op_input(self, head: dict[str, Any], data: bytes) -> Answer:
        process = self.process(head)
        if process.stdin is None or process.close_after:
            raise Failure("invalid_argument", "the process has no open stdin")
        if len(process.pending) + len(data) > MAX_PENDING_STDIN:
            raise Failure("resource_exhausted", "the process does not read its stdin: input is refused")
        process.pending += data
        self.flush_stdin(process)
        return {}, b""

    def op_close_stdin(self, head: dict[str, Any], _: bytes) -> Answer:
        process = self.process(head)
        if process.master is not None:
            raise Failure("invalid_argument", "a pty has no stdin to close")
        process.close_after = True
        self.flush_stdin(process)
        return {}, b""

    def op_signal(self, head: dict[str, Any], _: bytes) -> Answer:
        process = self.process(head)
        if head.get("sig") not in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT):
            raise Failure("invalid_argument", "only SIGTERM, SIGKILL and SIGINT are sent")
        self.kill(process.popen.pid, int(head["sig"]))
        return {}, b""

    def op_resize(self, head: dict[str, Any], _: bytes) -> Answer:
        process = self.process(head)
        if process.master is None:
            raise Failure("invalid_argument", "the process has no pty")
        fcntl.ioctl(process.master, termios.TIOCSWINSZ, struct.pack("HHHH", head["rows"], head["cols"], 0, 0))
        return {}, b""

    def op_list(self, head: dict[str, Any], _: bytes) -> Answer:
        return {"processes": [p.info for p in self.processes.values()]}, b""


def main() -> None:
    # Not dumpable: code of the same user cannot open this process's stdout through /proc, nor ptrace it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    Agent().run()


if __name__ == "__main__":
    main()
