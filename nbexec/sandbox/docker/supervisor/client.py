"""The host's client of a sandbox's process supervisor (`agent`), reached by `docker exec`.

One supervisor per sandbox, started when first asked for, as the sandbox user, inside the container's cgroups: it
lives and dies with the sandbox. It starts processes (pipes or a pty, each in its own process group), streams their
output, takes stdin and signals, and runs file operations as the sandbox user, so the kernel's permissions decide.
Everything it sends is hostile input: Docker's stream headers and the supervisor's frames are sized before they are
read, JSON is parsed only after sizing, every wait has a deadline, and each subscriber's queue is bounded (output a
slow subscriber cannot take is dropped and counted). A supervisor that dies, stops answering or breaks the protocol
is closed, and every waiter gets `SupervisorLostError` at once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import docker.errors

from nbexec.sandbox.source import DATA_MOUNT

from .. import daemon
from . import wire
from .agent import LOADER
from .events import (
    ERRORS,
    MAX_TEXT,
    BadArgumentError,
    Demux,
    End,
    FsEvent,
    LimitError,
    NotFoundError,
    Output,
    ProcessNotFoundError,
    Started,
    Subscription,
    SupervisorError,
    SupervisorLostError,
    TooLargeError,
    Violation,
    check_size,
    check_spawn,
    number,
    process,
    text,
)
from .files import Files
from .ports import Ports

if TYPE_CHECKING:
    from ..container import Sandbox

__all__ = ["MAX_PROCESSES", "MAX_STDIN_CALL", "Supervisor"]

log = logging.getLogger(__name__)

MAX_PROCESSES = wire.MAX_PROCESSES  # running processes per sandbox; the 65th spawn is refused (LimitError)
MAX_STDIN_CALL = 1 << 20  # bytes of one send_input
REQUEST_TIMEOUT = 30.0  # seconds a request may wait for its answer (remove of a large tree included)
SEND_TIMEOUT = 10.0  # seconds a write to the supervisor may block


class _Waiter:
    def __init__(self, on_reply: Callable[[dict[str, Any]], None] | None) -> None:
        self.done, self.on_reply = threading.Event(), on_reply
        self.head: dict[str, Any] = {}
        self.data = b""
        self.error: SupervisorError | None = None


AGENT_MODULES = ("wire", "agentfiles", "agentwatch", "agentports", "agent")  # in the order they import each other


@functools.lru_cache(maxsize=1)
def _program() -> tuple[str, ...]:
    """The agent's command line: the loader, then each module's name and source."""
    folder = importlib.resources.files(__package__)
    modules = [(name, folder.joinpath(f"{name}.py").read_text()) for name in AGENT_MODULES]
    return ("python3", "-I", "-S", "-c", LOADER, *(part for module in modules for part in module))


class Supervisor:
    """One sandbox's supervisor (thread-safe). Made by `Supervisor.start`; `close` kills it and its processes."""

    def __init__(self, sock: socket.socket, label: str, raw: Any = None) -> None:
        self._sock, self._label = sock, label
        self._raw = raw  # docker-py's wrapper of the socket: closed with it
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Waiter] = {}
        self._next_id = 1
        self._subs: dict[int, list[Subscription]] = {}  # running processes it started: their subscribers
        self._watches: dict[int, Subscription] = {}  # folder watches by id
        self._spawning = 0
        self._muted: set[int] = set()  # processes whose output stays in the sandbox (see mute)
        self._lost: SupervisorLostError | None = None
        self._ready = threading.Event()
        self.request_timeout = REQUEST_TIMEOUT
        self.files = Files(self)
        self.ports = Ports(self)
        self.stderr_bytes = 0  # what the supervisor wrote to stderr: counted, never kept
        self.received_bytes = 0  # all it sent
        self._reader = threading.Thread(target=self._read_loop, name=f"nbexec-supervisor-{label}", daemon=True)

    @classmethod
    def start(cls, sandbox: Sandbox, *, timeout: float = 10.0, cwd: str = DATA_MOUNT,
              env: dict[str, str] | None = None, program: str | None = None) -> Supervisor:
        """Start the supervisor in ``sandbox`` as its user. ``cwd``: where relative paths and processes without a
        cwd start; ``env``: variables over the container's, for every process; ``program`` replaces its code
        (tests of a hostile one)."""
        client = daemon.connect()
        command = ["python3", "-I", "-S", "-c", program] if program else list(_program())
        try:
            exec_id = client.api.exec_create(sandbox.container.id, command, stdin=True, stdout=True, stderr=True,
                                             tty=False, user=f"{sandbox.uid}:{sandbox.gid}", workdir=cwd,
                                             environment=env)
            raw = client.api.exec_start(exec_id["Id"], socket=True)
        except docker.errors.DockerException as exc:
            raise SupervisorLostError(f"the sandbox's process supervisor could not start: {exc}") from exc
        sock = getattr(raw, "_sock", raw)
        sock.settimeout(SEND_TIMEOUT)
        supervisor = cls(sock, sandbox.id, raw)
        supervisor._reader.start()
        ready = supervisor._ready.wait(timeout)
        lost = supervisor._lost
        if not ready or lost is not None:
            supervisor.close()
            raise lost or SupervisorLostError(f"the process supervisor did not start within {timeout} s")
        return supervisor

    # -- the wire --------------------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        demux, frames, reason = Demux(), wire.FrameReader(), "the process supervisor ended"
        try:
            while True:
                try:
                    chunk = self._sock.recv(wire.OUTPUT_CHUNK)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                self.received_bytes += len(chunk)
                for stream, part in demux.feed(chunk):
                    if stream == 2:
                        self.stderr_bytes += len(part)
                        continue
                    for head, data in frames.feed(part):
                        (self.ports.feed if head.get("ev") == "port" else self._dispatch)(head, data)
        except (Violation, ValueError) as exc:
            reason = f"the process supervisor broke the protocol: {str(exc)[:200]}"
        except OSError as exc:
            reason = f"the process supervisor's stream failed: {exc}"
        self._lose(reason)

    def _dispatch(self, head: dict[str, Any], data: bytes) -> None:
        if "id" in head:
            with self._lock:
                waiter = self._pending.pop(head["id"], None) if isinstance(head["id"], int) else None
            if waiter is not None:  # an answer nobody waits for any more is dropped
                waiter.head, waiter.data = head, data
                try:
                    if waiter.on_reply is not None and "error" not in head:
                        waiter.on_reply(head)
                except Violation as exc:
                    waiter.error = SupervisorLostError(f"the process supervisor broke the protocol: {exc}")
                    raise
                finally:
                    waiter.done.set()
            return
        event = head.get("ev")
        if event == "ready":
            self._ready.set()
        elif event == "out" and head.get("fd") in ("stdout", "stderr", "pty"):
            with self._lock:
                subs = list(self._subs.get(number(head.get("pid")), ()))
            for sub in subs:
                sub.push(Output(head["fd"], data))
        elif event == "fs":
            with self._lock:
                watch = self._watches.get(number(head.get("watch")))
            if watch is not None:
                watch.push(FsEvent(text(head.get("name")), text(head.get("type"))))
        elif event == "end":
            end = End(number(head.get("exit_code")), bool(head.get("exited")), text(head.get("status")),
                      text(head.get("error"), optional=True))
            with self._lock:
                subs = self._subs.pop(number(head.get("pid")), [])
            for sub in subs:
                sub.push(end)

    def _send(self, head: dict[str, Any], data: bytes = b"") -> None:
        frame = wire.encode(head, data)
        if len(frame) > wire.HEADER.size + wire.MAX_JSON + wire.MAX_DATA:
            raise BadArgumentError("the request is over the frame cap")
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as exc:  # a supervisor that stops reading its stdin holds no thread past SEND_TIMEOUT
            self._lose(f"the process supervisor did not take a request: {exc}")
            raise self._lost or SupervisorLostError("lost") from exc

    def request(self, head: dict[str, Any], data: bytes = b"", *, missing: type[SupervisorError] = NotFoundError,
              on_reply: Callable[[dict[str, Any]], None] | None = None,
              timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        waiter = _Waiter(on_reply)
        with self._lock:
            if self._lost is not None:
                raise self._lost
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[request_id] = waiter
        self._send({**head, "id": request_id}, data)
        timeout = self.request_timeout if timeout is None else timeout
        if not waiter.done.wait(timeout):
            self._lose(f"the process supervisor did not answer within {timeout} s")
        if waiter.error is not None:
            raise waiter.error
        error = waiter.head.get("error")
        if error is not None:
            kind = missing if error == "not_found" else ERRORS.get(str(error), SupervisorError)
            raise kind(str(waiter.head.get("message", error))[:MAX_TEXT])
        return waiter.head, waiter.data

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._lost is None:
                self._lost = SupervisorLostError(reason)
                log.info("sandbox %s: %s", self._label, reason)
            lost, waiters = self._lost, list(self._pending.values())
            subs = [s for v in self._subs.values() for s in v] + list(self._watches.values())
            self._pending.clear()
            self._subs.clear()
            self._watches.clear()
        for waiter in waiters:
            waiter.error = lost
            waiter.done.set()
        for sub in subs:
            sub.fail(lost)
        self.ports.fail(lost)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the supervisor reads stdin's end: it kills its processes

    def close(self) -> None:
        """Kill the supervisor and, with it, every process it started; end every wait with SupervisorLostError."""
        self._lose("the process supervisor was closed")
        with contextlib.suppress(OSError):
            if self._raw is not None and self._raw is not self._sock:
                self._raw.close()
            self._sock.close()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    # -- processes -------------------------------------------------------------------------------------------------

    def spawn(self, argv: list[str], *, cwd: str | None = None, envs: dict[str, str] | None = None,
              pty: tuple[int, int] | None = None, stdin: bool = False, tag: str | None = None,
              timeout: float | None = None) -> Subscription:
        """Start ``argv`` in its own process group; its subscription sees everything from the start (`.pid`).
        ``pty``: (cols, rows); ``timeout``: seconds until its group is killed."""
        envs = dict(envs or {})
        check_spawn(argv, cwd, envs, pty, tag)
        sub = Subscription(self._unsubscribe)

        def register(head: dict[str, Any]) -> None:  # in the reader thread, before any output of the pid
            sub.pid = number(head.get("pid"))
            with self._lock:
                self._subs.setdefault(sub.pid, []).append(sub)
            sub.push(Started(sub.pid))

        with self._lock:
            if len(self._subs) + self._spawning >= MAX_PROCESSES:
                raise LimitError(f"{MAX_PROCESSES} processes are running in this sandbox already")
            self._spawning += 1
        try:
            self.request({"op": "spawn", "argv": argv, "cwd": cwd, "envs": envs, "pty": pty, "stdin": stdin,
                        "tag": tag, "timeout": timeout}, on_reply=register)
        finally:
            with self._lock:
                self._spawning -= 1
        return sub

    def subscribe(self, pid: int) -> Subscription:
        """The events of the running process ``pid`` from now on, `Started` first."""
        sub = Subscription(self._unsubscribe, pid)
        with self._lock:
            if pid not in self._subs:
                raise ProcessNotFoundError(f"process {pid} is not running")
            first = not self._subs[pid] or pid in self._muted
            self._muted.discard(pid)
            self._subs[pid].append(sub)
        sub.push(Started(pid))
        if first:
            self.notify({"op": "watch", "pid": pid, "on": True})
        return sub

    def mute(self, sub: Subscription) -> None:
        """Stop the process's output crossing to the host while ``sub`` still waits for its end (its reader has
        had all it may keep); only while it is the process's one subscriber (a new one turns the output on)."""
        with self._lock:
            alone = self._subs.get(sub.pid) == [sub]
            if alone:
                self._muted.add(sub.pid)
        if alone:
            self.notify({"op": "watch", "pid": sub.pid, "on": False})

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.pid)
            if subs is None or sub not in subs:
                return
            subs.remove(sub)
            last = not subs
        if last:  # nobody reads it: the supervisor drops its output instead of sending it
            self.notify({"op": "watch", "pid": sub.pid, "on": False})

    def notify(self, head: dict[str, Any], data: bytes = b"") -> None:
        with contextlib.suppress(SupervisorError):
            self._send(head, data)

    def _running(self, pid: int) -> None:
        if not self.running(pid):
            raise ProcessNotFoundError(f"process {pid} is not running")

    def running(self, pid: int) -> bool:
        """Whether ``pid``, a process this supervisor started, still runs (its end not yet seen)."""
        with self._lock:
            return pid in self._subs

    def send_input(self, pid: int, data: bytes, *, pty: bool = False) -> None:
        """Write ``data`` (at most MAX_STDIN_CALL bytes) to the process's stdin or pty."""
        self._running(pid)
        if len(data) > MAX_STDIN_CALL:
            raise TooLargeError(f"input of {len(data)} bytes is over the cap of {MAX_STDIN_CALL}")
        for start in range(0, len(data), wire.FILE_CHUNK):
            self.request({"op": "input", "pid": pid, "pty": pty}, data[start:start + wire.FILE_CHUNK],
                       missing=ProcessNotFoundError)

    def close_stdin(self, pid: int) -> None:
        self._running(pid)
        self.request({"op": "close_stdin", "pid": pid}, missing=ProcessNotFoundError)

    def signal(self, pid: int, sig: int) -> None:
        """Send SIGTERM, SIGKILL or SIGINT (a kernel's interrupt) to the process group of ``pid``."""
        if sig not in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT):
            raise BadArgumentError("only SIGTERM, SIGKILL and SIGINT are sent")
        self._running(pid)
        self.request({"op": "signal", "pid": pid, "sig": int(sig)}, missing=ProcessNotFoundError)

    def resize(self, pid: int, cols: int, rows: int) -> None:
        check_size((cols, rows))
        self._running(pid)
        self.request({"op": "resize", "pid": pid, "cols": cols, "rows": rows}, missing=ProcessNotFoundError)

    def processes(self) -> list[dict[str, Any]]:
        """The running processes it started: pid, tag, cmd, args, envs, cwd."""
        head, _ = self.request({"op": "list"})
        raw = head.get("processes")
        if not isinstance(raw, list):
            raise self.broken("a process list that is not a list")
        with self._lock:
            known = set(self._subs)
        try:
            return [process(item) for item in raw if isinstance(item, dict) and item.get("pid") in known]
        except Violation as exc:
            raise self.broken(str(exc)) from None

    def watch(self, path: str, recursive: bool) -> Subscription:
        """Events (`FsEvent`) of the folder ``path`` from now on; `Files.watch_dir` is the public door."""
        sub = Subscription(self._unwatch)

        def register(head: dict[str, Any]) -> None:
            sub.pid = number(head.get("watch"))
            with self._lock:
                self._watches[sub.pid] = sub

        self.request({"op": "watch_dir", "path": path, "recursive": recursive}, on_reply=register)
        return sub

    def _unwatch(self, sub: Subscription) -> None:
        with self._lock:
            known = self._watches.pop(sub.pid, None)
        if known is not None:
            self.notify({"op": "unwatch_dir", "watch": sub.pid})

    def broken(self, reason: str) -> SupervisorLostError:
        self._lose(f"the process supervisor broke the protocol: {reason}")
        assert self._lost is not None
        return self._lost

