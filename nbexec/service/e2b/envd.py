"""E2B's processes (envd's ``process.Process`` over Connect, port 49983): commands and ptys run by the sandbox's
process supervisor (`nbexec.sandbox.docker.supervisor`), as the sandbox's user, within its pids, memory and time.

A Start or Connect stream relays one process's events as they come: its start, its output (within the per-call
allowance, max_output: past it, or while the client reads too slowly, output is dropped, counted and said in the
end event, while the process runs on), a
keepalive on a quiet stream, and its end. A client that goes away leaves the process running (as in E2B); the
process ends at its own ``Connect-Timeout-Ms``, a signal, or the sandbox's end. The user named by
``Authorization: Basic`` must be the sandbox's own (``user``); root is refused on purpose."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import signal
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nbexec.errors import NbexecError
from nbexec.sandbox.docker.container import Sandbox as LocalSandbox
from nbexec.sandbox.docker.contexts import TAG as CONTEXT_TAG
from nbexec.sandbox.docker.supervisor import (
    AlreadyExistsError,
    BadArgumentError,
    End,
    LimitError,
    NotFoundError,
    Output,
    PermissionDeniedError,
    Started,
    Subscription,
    Supervisor,
    SupervisorError,
    SupervisorLostError,
    TooLargeError,
)

from . import connect, paths, wire
from .boxes import Box
from .connect import ConnectError
from .control import Control

PACKAGE = "process.Process/"
SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM, 9: signal.SIGKILL,
           15: signal.SIGTERM}
PUMP_QUEUE = 64  # events between the supervisor's reader and a slow client; past it the subscription drops
USERS = ("", "user")
MAX_STREAM_INPUT = 64 * 1024**2  # bytes of input one StreamInput call carries
MAX_STREAMS = 16  # open process and watch streams per sandbox: each holds a host thread
_streams_lock = threading.Lock()
CODES: dict[type, str] = {NotFoundError: "not_found", AlreadyExistsError: "already_exists",
                          BadArgumentError: "invalid_argument", PermissionDeniedError: "permission_denied",
                          TooLargeError: "resource_exhausted", LimitError: "resource_exhausted",
                          SupervisorLostError: "unavailable"}


def code_of(exc: SupervisorError) -> str:
    return next((code for kind, code in CODES.items() if isinstance(exc, kind)), "internal")


def user_of(request: Request) -> None:
    """The Unix user a call names (``Authorization: Basic base64("<user>:")``): only the sandbox's own."""
    scheme, _, value = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "basic":
        return
    try:
        name = base64.b64decode(value, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ConnectError("invalid_argument", "the Authorization header is not Basic user:") from None
    if name == "root":
        raise ConnectError("permission_denied", "nbexec never runs code as root: every process runs as the "
                                                "sandbox's user (`user`)")
    if name not in USERS:
        raise ConnectError("unauthenticated", f"invalid username: {name[:64]!r}")


def supervisor(box: Box) -> Supervisor:
    """The sandbox's supervisor, started on first use and again after the sandbox slept and woke (blocking)."""
    handle = box.session._started_handle()
    if not isinstance(handle, LocalSandbox):
        raise ConnectError("unimplemented", "processes and files need a sandbox of this node's Docker engine")
    with box.lock:
        found = box.extra.get("supervisor")
        if found is not None and found[0] is handle and not found[1].lost:
            return found[1]
        if found is not None:
            found[1].close()
        made = Supervisor.start(handle)
        box.extra["supervisor"] = (handle, made)
        return made


def close(box: Box) -> None:
    found = box.extra.pop("supervisor", None)
    if found is not None:
        found[1].close()


def _selected(sup: Supervisor, selector: Any) -> int:
    """The pid a ``{"pid"}`` or ``{"tag"}`` selector names."""
    if not isinstance(selector, dict):
        raise ConnectError("invalid_argument", "process must be an object with pid or tag")
    pid = selector.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool):
        return pid
    tag = selector.get("tag")
    if isinstance(tag, str):
        for found in sup.processes():
            if found.get("tag") == tag:
                return int(found["pid"])
        raise ConnectError("not_found", f"no running process has the tag {tag[:64]!r}")
    raise ConnectError("invalid_argument", "process must name a pid or a tag")


def _spawn(box: Box, message: dict[str, Any], limit: float | None) -> Subscription:
    process, pty = message.get("process"), message.get("pty")
    if not isinstance(process, dict) or not isinstance(process.get("cmd"), str):
        raise ConnectError("invalid_argument", "process.cmd must be a command")
    args, envs, cwd, tag = process.get("args") or [], process.get("envs") or {}, process.get("cwd"), message.get("tag")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or not _strings(envs):
        raise ConnectError("invalid_argument", "process.args must be a list of strings and process.envs an object "
                                               "of strings")
    if not isinstance(cwd, (str, type(None))) or not isinstance(tag, (str, type(None))):
        raise ConnectError("invalid_argument", "process.cwd and tag must be strings")
    size = None if pty is None else _size(pty)
    return supervisor(box).spawn([process["cmd"], *args], cwd=paths.inward(cwd) if cwd else paths.HOME,
                                 envs={**box.envs, **envs}, pty=size, stdin=bool(message.get("stdin")),
                                 tag=tag, timeout=limit)


def _strings(found: Any) -> bool:
    return isinstance(found, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in found.items())


def _size(pty: Any) -> tuple[int, int]:
    """A pty's (cols, rows) from ``{"size": {"cols", "rows"}}``; invalid_argument for any other shape."""
    found = pty.get("size") if isinstance(pty, dict) else None
    if not isinstance(found, dict):
        raise ConnectError("invalid_argument", "pty.size must be an object with cols and rows")
    cols, rows = found.get("cols", 80), found.get("rows", 24)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (cols, rows)):
        raise ConnectError("invalid_argument", "pty.size's cols and rows must be integers")
    return cols, rows


def _event(event: Any, kept: list[int], allowance: int) -> dict[str, Any] | None:
    """The wire message of one supervisor event; output past the allowance is dropped and counted."""
    if isinstance(event, Started):
        return {"event": {"start": {"pid": event.pid}}}
    if isinstance(event, Output):
        room = max(0, allowance - kept[0])  # the head of a chunk that crosses the allowance is kept, to the byte
        data = event.data[:room]
        kept[0] += len(data)
        kept[1] += len(event.data) - len(data)
        if not data:
            return None
        return {"event": {"data": {event.stream: base64.b64encode(data).decode()}}}
    if isinstance(event, End):
        end: dict[str, Any] = {"exitCode": event.exit_code, "exited": event.exited, "status": event.status}
        notes = [event.error] if event.error else []
        if kept[1]:
            notes.append(f"{kept[1]} bytes of output were dropped: past this call's allowance of {allowance} bytes "
                         "(max_output), or while the client read slowly")
        if notes:
            end["error"] = "; ".join(notes)
        return {"event": {"end": end}}
    return None


def stream_place(box: Box) -> Callable[[], None]:
    """One of the sandbox's MAX_STREAMS places, taken before anything starts (a refused Start runs nothing);
    what it returns gives it back, once however often it is called."""
    with _streams_lock:
        if box.streams >= MAX_STREAMS:
            raise ConnectError("resource_exhausted", f"{MAX_STREAMS} streams are open on this sandbox")
        box.streams += 1
    given = threading.Event()

    def give_back() -> None:
        with _streams_lock:
            if not given.is_set():
                given.set()
                box.streams -= 1
    return give_back


def streamed(events: AsyncIterator[bytes], give_back: Callable[[], None]) -> StreamingResponse:
    """The answer of a process or watch stream; its place is given back when the stream ends, or when its answer
    is dropped unread (a client gone before the first byte)."""

    async def held() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            give_back()
    answer = held()
    weakref.finalize(answer, give_back)
    return StreamingResponse(answer, media_type=connect.STREAM_TYPE)


class Pump:
    """A subscription's events read on a thread of its own (a quiet process holds no shared worker) and handed to
    the event loop a few at a time. The thread ends with the stream, with the sandbox, or at the process's end,
    even while a client has stopped reading; waiting on it never cancels a read in progress."""

    def __init__(self, sub: Subscription, ended: Callable[[], bool]) -> None:
        self.sub, self.ended = sub, ended
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue(PUMP_QUEUE)
        self.stop = threading.Event()
        threading.Thread(target=self._read, name="nbexec-e2b-stream", daemon=True).start()

    def _read(self) -> None:
        while not self.stop.is_set():
            try:
                event: Any = self.sub.next(1.0)
            except SupervisorError as exc:
                event = exc
            if event is None and self.ended():
                event = SupervisorLostError("the sandbox ended")
            if event is None:
                continue
            future = asyncio.run_coroutine_threadsafe(self.queue.put(event), self.loop)
            while not self._gone():
                with contextlib.suppress(TimeoutError):
                    future.result(1.0)
                    break
            else:
                future.cancel()
                return
            if isinstance(event, (End, SupervisorError)):
                return

    def _gone(self) -> bool:
        return self.stop.is_set() or self.ended()

    async def get(self, timeout: float) -> Any:
        """The next event, or None when none came within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        self.stop.set()
        self.sub.close()


async def stream(control: Control, box: Box, sub: Subscription, keepalive: float) -> AsyncIterator[bytes]:
    """Envelopes of one process's events, then the end of the stream (with an error if the supervisor was lost).
    Past the allowance the process's output stays in the sandbox (`Supervisor.mute`): it costs the host nothing."""
    allowance, kept = box.session.config.max_output_bytes, [0, 0]
    pump, muted = Pump(sub, lambda: box.session.status == "closed" or box.id not in control.boxes.ids()), False
    try:
        while True:
            event = await pump.get(keepalive)
            if event is None:
                yield connect.envelope({"event": {"keepalive": {}}})
                continue
            if isinstance(event, SupervisorError):
                yield connect.end(ConnectError("unavailable", f"the sandbox's processes were lost: {event}"))
                return
            if isinstance(event, End):
                kept[1] += sub.lost  # what this stream's queue dropped while the client read slowly: said too
            message = _event(event, kept, allowance)
            if message is not None:
                yield connect.envelope(message)
            if not muted and isinstance(event, Output) and kept[0] >= allowance:
                muted = True
                await call(control, box, _mute, box, sub)
            if isinstance(event, End):
                yield connect.end()
                return
    finally:
        pump.close()


def _mute(box: Box, sub: Subscription) -> None:
    found = box.extra.get("supervisor")
    if found is not None:
        found[1].mute(sub)


async def route(control: Control, box: Box, request: Request, method: str) -> Response:
    """Dispatch one ``process.Process`` call."""
    user_of(request)
    cap = max(1.0, box.end - time.time())
    if method in ("Start", "Connect"):
        message = await connect.Envelopes(request.stream()).only(time.monotonic() + connect.READ_DEADLINE)
        limit = connect.timeout_ms(request.headers.get("connect-timeout-ms"), cap)
        keepalive = min(control.settings.keepalive, _interval(request.headers.get("keepalive-ping-interval")))
        give_back = stream_place(box)
        try:
            if method == "Start":
                sub = await call(control, box, _spawn, box, message, limit)
            else:
                sup = await call(control, box, supervisor, box)
                sub = await call(control, box, lambda: sup.subscribe(_selected(sup, message.get("process"))))
        except BaseException:
            give_back()
            raise
        return streamed(stream(control, box, sub, keepalive), give_back)
    if method == "StreamInput":
        return await _stream_input(control, box, request)
    message = await connect.unary_body(request.stream())
    sup = await call(control, box, supervisor, box)
    answer = await call(control, box, _unary, sup, method, message)
    return JSONResponse(answer)


def _interval(raw: str | None) -> float:
    return float(str(raw)) if wire.digits(raw, 4) and 0 < int(str(raw)) <= 3600 else 50.0


def _data(found: Any) -> tuple[bytes, bool]:
    """The bytes of an input message (``{"stdin": b64}`` or ``{"pty": b64}``) and whether they go to the pty."""
    if not isinstance(found, dict) or not any(k in found for k in ("stdin", "pty")):
        raise ConnectError("invalid_argument", "input must carry stdin or pty bytes")
    pty = "pty" in found
    try:
        return base64.b64decode(found["pty" if pty else "stdin"] or "", validate=True), pty
    except (binascii.Error, TypeError, ValueError):
        raise ConnectError("invalid_argument", "input bytes must be base64") from None


def _unary(sup: Supervisor, method: str, message: dict[str, Any]) -> dict[str, Any]:
    if method == "List":
        return {"processes": [{"pid": p["pid"], **({"tag": p["tag"]} if p.get("tag") else {}),
                               "config": {"cmd": p["cmd"], "args": p["args"], "envs": p["envs"],
                                          "cwd": paths.outward(p["cwd"])}}
                              for p in sup.processes() if p.get("tag") != CONTEXT_TAG]}  # contexts' kernels
    pid = _selected(sup, message.get("process"))
    if method == "SendInput":
        data, pty = _data(message.get("input"))
        sup.send_input(pid, data, pty=pty)
    elif method == "CloseStdin":
        sup.close_stdin(pid)
    elif method == "SendSignal":
        wanted = message.get("signal")
        chosen = SIGNALS.get(wanted) if isinstance(wanted, (str, int)) else None
        if chosen is None:
            raise ConnectError("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
        sup.signal(pid, chosen)
    elif method == "Update":
        sup.resize(pid, *_size(message.get("pty")))
    else:
        raise ConnectError("unimplemented", f"process.Process/{method[:64]} is not offered")
    return {}


async def _stream_input(control: Control, box: Box, request: Request) -> Response:
    """The client-streaming StreamInput: a start naming the process, then data and keepalives, each within the
    message cap and an idle deadline, all of it within MAX_STREAM_INPUT bytes."""
    reader, total = connect.Envelopes(request.stream()), 0
    sup = await call(control, box, supervisor, box)
    first = await reader.next(time.monotonic() + connect.READ_DEADLINE)
    start = (first or {}).get("start")
    if not isinstance(start, dict):
        raise ConnectError("invalid_argument", "StreamInput begins with a start message naming the process")
    pid = await call(control, box, _selected, sup, start.get("process"))
    while (message := await reader.next(time.monotonic() + connect.READ_DEADLINE)) is not None:
        if "data" in message:
            data, pty = _data((message.get("data") or {}).get("input"))
            total += len(data)
            if total > MAX_STREAM_INPUT:
                raise ConnectError("resource_exhausted", f"input over {MAX_STREAM_INPUT} bytes in one stream")
            await call(control, box, sup.send_input, pid, data, pty)
    body = connect.envelope({}) + connect.end()
    return Response(body, media_type=connect.STREAM_TYPE)


async def call(control: Control, box: Box, func: Callable[..., Any], *args: Any) -> Any:
    """Blocking supervisor work on the owner's I/O threads, its errors as Connect's codes."""
    try:
        return await asyncio.wrap_future(control.folders.lanes(box.owner).io.submit(func, *args))
    except SupervisorError as exc:
        raise ConnectError(code_of(exc), str(exc)) from None
    except NbexecError as exc:
        raise ConnectError("unavailable", str(exc)) from None


