"""A run relayed from a node: its kernel messages as length-prefixed frames, sized before anything is parsed. Pure.

A node answers ``POST /v1/sandboxes/{id}/run`` with a stream of frames. Each is one header line, ``<kind> <JSON
object>\\n`` (at most ``MAX_LINE`` bytes), then exactly ``length`` bytes of payload (the header's ``length``)::

    B {"sandbox": id, "length": 0}                       the run began on sandbox ``id``
    M {"type", "channel", "id", "parent", "size", "complete", "content", "buffers": [n | null, ...], "length"}
        content bytes, then each buffer's bytes          one kernel output message, as the node's kernel client kept it
    K {"length": 0}                                      keep-alive (every few seconds while the kernel is quiet)
    E {"sandbox": id, "length": n}  + n bytes of JSON    the run's end: its `kernel.Execution`
    X {"kind", "kernel_lost", "length": n}  + n bytes    the run failed on the node (``kind``: protocol or node)

A message's ``size`` is what the kernel sent (metadata, content and buffers), ``length`` what the node relays of
it: the node relays the content of a run's messages only within its own allowance (``Allowance``: the output
budget and one frame beyond, for the error that ends the run) and their header alone past it, so what a cap drops
is still counted. The reader (``Reader``) charges every frame by the bytes that arrive: a payload over its own
frame limit or allowance is read past unkept (an incomplete `Message` of that size), a header line over
``MAX_LINE``, a frame larger than ``MAX_FRAME``, a ``size`` smaller than the bytes sent, a malformed header, or a
run that names another sandbox are ``FrameError``. Memory is one frame, whatever a node sends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbexec.errors import NodeError, ProtocolError
from nbexec.sandbox import kernel
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.lasterror import LastError
from nbexec.sandbox.messages import Message, parse

MAX_LINE = 4096  # bytes of one header line
MAX_FRAME = 1 << 30  # bytes of one frame's payload: more is no honest node's (its own frame limit is far below)
MAX_END = 4 * 1024 * 1024  # bytes of the end frame's Execution (a last error is at most ~1.3 MB)
MAX_DETAIL = 64 * 1024  # bytes of a failure's detail
MAX_BUFFERS = 64  # buffers of one message (the kernel's own frame cap)
MAX_TIMING = 16  # entries of an Execution's timing
KINDS = b"BMKEX"
STATUSES = ("ok", "error", "timeout", "gone")
STOPS = ("", "interrupted", "killed")
MEDIA_TYPE = "application/x-nbexec-frames"


RELAYED = kernel.OUTPUT_KINDS | kernel.COMM_KINDS  # what a node may relay of a run


class FrameError(ProtocolError):
    """A node's run stream that is not one (see the module docstring)."""


class RelayedProtocolError(ProtocolError):
    """The node's kernel client found the sandbox breaking the protocol (an X frame of kind "protocol")."""

    def __init__(self, detail: str, kernel_lost: bool) -> None:
        super().__init__(detail)
        self.kernel_lost = kernel_lost


# -- the node's side -------------------------------------------------------------------------------------------

def _line(kind: str, header: dict[str, Any]) -> bytes:
    return kind.encode() + b" " + json.dumps(header, separators=(",", ":")).encode() + b"\n"


def begin(sandbox: str) -> bytes:
    return _line("B", {"sandbox": sandbox, "length": 0})


def keepalive() -> bytes:
    return b'K {"length":0}\n'


def message(msg: Message, keep: bool) -> bytes:
    """One output message: its content and buffers with ``keep``, else its header alone (still counted)."""
    buffers = [b for b in msg.buffers] if keep and msg.complete else []
    content = bytes(msg.raw_content) if keep and msg.complete else b""
    header = {"type": msg.msg_type, "channel": msg.channel, "id": msg.msg_id, "parent": msg.parent_id,
              "size": msg.size, "complete": bool(keep and msg.complete), "content": len(content),
              "buffers": [None if b is None else len(b) for b in buffers],
              "length": len(content) + sum(len(b) for b in buffers if b is not None)}
    return b"".join([_line("M", header), content, *(bytes(b) for b in buffers if b is not None)])


def end(sandbox: str, run: Execution) -> bytes:
    body = json.dumps(dump_execution(run), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _line("E", {"sandbox": sandbox, "length": len(body)}) + body


def failure(kind: str, detail: str, kernel_lost: bool) -> bytes:
    body = detail.encode("utf-8", "replace")[:MAX_DETAIL]
    return _line("X", {"kind": kind, "kernel_lost": kernel_lost, "length": len(body)}) + body


def dump_execution(run: Execution) -> dict[str, Any]:
    error = run.error
    return {"status": run.status, "execution_count": run.execution_count, "stop": run.stop, "timing": run.timing,
            "reply": run.reply, "errors_read": run.errors_read, "errors_dropped": run.errors_dropped,
            "error": None if error is None else {"raised": error.raised, "ename": error.ename,
                                                 "evalue": error.evalue, "traceback": list(error.traceback)},
            "exit_value": run.exit_value, "late_unread": run.late_unread}


@dataclass
class Allowance:
    """What a node relays whole of one run: messages while ``left`` bytes last, and the first error message
    whatever is left (the error that ends the run is always kept); headers alone past that."""

    left: int
    error_sent: bool = False

    def keep(self, msg: Message) -> bool:
        cost = msg.size
        if msg.msg_type == "error" and not self.error_sent:
            self.error_sent = True
            return True
        if cost > self.left:
            self.left = 0
            return False
        self.left -= cost
        return True


# -- the client's side -----------------------------------------------------------------------------------------

@dataclass
class Frame:
    """One frame as read: its kind, its header, and (M) the message or (E) the execution or (X) the detail."""

    kind: str
    header: dict[str, Any]
    message: Message | None = None
    execution: Execution | None = None
    detail: str = ""


@dataclass
class Reader:
    """Frames out of a node's run stream as its bytes arrive (see the module docstring). ``max_message`` is this
    side's frame limit, ``allowance`` the content it keeps of the whole run; ``sandbox`` the id it asked about."""

    sandbox: str
    max_message: int
    allowance: int
    read: int = 0  # bytes of the stream so far
    _buffer: bytearray = field(default_factory=bytearray)
    _header: tuple[str, dict[str, Any]] | None = None
    _skip: int = 0  # payload bytes still to read past, unkept
    began: bool = False
    error_kept: bool = False

    def feed(self, chunk: bytes) -> list[Frame]:
        self.read += len(chunk)
        out: list[Frame] = []
        view = memoryview(chunk)
        while view:
            if self._skip:
                step = min(self._skip, len(view))
                self._skip, view = self._skip - step, view[step:]
                continue
            if self._header is None:
                view = self._read_line(view)
                continue
            need = self._header[1]["length"] - len(self._buffer)
            self._buffer += view[:need]
            view = view[need:]
            if len(self._buffer) == self._header[1]["length"]:
                out.append(self._finish())
        if self._header is not None and self._header[1]["length"] == 0 and not self._skip:
            out.append(self._finish())
        return out

    def _read_line(self, view: memoryview) -> memoryview:
        end = bytes(view[:MAX_LINE + 1 - len(self._buffer)]).find(b"\n")
        if end < 0:
            self._buffer += view[:MAX_LINE + 1 - len(self._buffer)]
            if len(self._buffer) > MAX_LINE:
                raise FrameError(f"a frame header over {MAX_LINE} bytes")
            return view[len(view):]
        line = bytes(self._buffer) + bytes(view[:end])
        self._buffer.clear()
        self._start(line)
        return view[end + 1:]

    def _start(self, line: bytes) -> None:
        kind, _, text = line.partition(b" ")
        if len(kind) != 1 or kind not in KINDS:
            raise FrameError("a frame of an unknown kind (a frame that carried more than its length said?)")
        header = parse(text, "frame header")
        length = header.get("length") if isinstance(header, dict) else None
        if not isinstance(length, int) or not _count(length) or length > MAX_FRAME:
            raise FrameError(f"a {kind.decode()} frame without a length (or over {MAX_FRAME:,} bytes)")
        self._header = (kind.decode(), header)
        if kind == b"M":
            self._check_message(header)
        elif length > {b"B": 0, b"K": 0, b"E": MAX_END, b"X": MAX_DETAIL}[kind]:
            raise FrameError(f"a {kind.decode()} frame of {length:,} bytes")

    def _check_message(self, header: dict[str, Any]) -> None:
        sizes, size, content = header.get("buffers"), header.get("size"), header.get("content")
        if not all(isinstance(header.get(k), str) for k in ("type", "channel", "id", "parent")) \
                or not isinstance(size, int) or not _count(size) or not isinstance(content, int) \
                or not _count(content) or not isinstance(header.get("complete"), bool) \
                or not isinstance(sizes, list) or len(sizes) > MAX_BUFFERS \
                or not all(s is None or _count(s) for s in sizes):
            raise FrameError("a message frame with a malformed header")
        carried = content + sum(s for s in sizes if s is not None)
        if carried != header["length"] or size < carried:
            raise FrameError("a message frame whose size or length is smaller than the bytes it carries")
        if carried and not header["complete"]:
            raise FrameError("a message frame that carries the content of a message it says was dropped")
        first_error = header["type"] == "error" and not self.error_kept
        if carried > self.max_message or (carried > self.allowance and not first_error):
            self._skip, self._header = carried, ("M", {**header, "complete": False, "length": 0})
            self.allowance = 0 if carried <= self.max_message else self.allowance  # spent, as the node's
        elif first_error and header["complete"]:
            self.error_kept = True  # the error that ends the run is kept whatever the allowance (as the node does)
        else:
            self.allowance -= carried

    def _finish(self) -> Frame:
        assert self._header is not None
        (kind, header), payload = self._header, bytes(self._buffer)
        self._header = None
        self._buffer.clear()
        if kind in "BE" and header.get("sandbox") != self.sandbox:
            raise FrameError(f"the node answered for sandbox {str(header.get('sandbox'))[:64]!r}, not the one asked "
                             "about")
        if kind == "B":
            self.began = True
        elif kind in "ME" and not self.began:
            raise FrameError("a run's frames before its beginning")
        if kind == "M":
            return Frame(kind, header, message=_message(header, payload))
        if kind == "E":
            return Frame(kind, header, execution=load_execution(parse(payload, "run's end")))
        if kind == "X":
            return Frame(kind, header, detail=payload.decode("utf-8", "replace"))
        return Frame(kind, header)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _message(header: dict[str, Any], payload: bytes) -> Message:
    complete, size = header["complete"], header["size"]
    if not complete:
        return Message(header["channel"], header["type"], header["id"], header["parent"], size, b"", False, ())
    content, at, buffers = payload[:header["content"]], header["content"], []
    for length in header["buffers"]:
        buffers.append(None if length is None else payload[at:at + length])
        at += length or 0
    return Message(header["channel"], header["type"], header["id"], header["parent"], size, content, True,
                   tuple(buffers))


def load_execution(data: Any) -> Execution:
    """A node's account of how the run ended, every field checked (FrameError for one of the wrong shape)."""
    if not isinstance(data, dict):
        raise FrameError("the run's end is not an object")
    timing, error = data.get("timing"), data.get("error")
    count, exit_value = data.get("execution_count"), data.get("exit_value")
    if data.get("status") not in STATUSES or data.get("stop") not in STOPS \
            or data.get("reply") not in ("", "ok", "error") or not (count is None or _count(count)) \
            or not isinstance(timing, dict) or len(timing) > MAX_TIMING \
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) + len(v) < 256 for k, v in timing.items()) \
            or not (exit_value is None or (isinstance(exit_value, str) and len(exit_value) <= 200)) \
            or not isinstance(data.get("late_unread", False), bool):
        raise FrameError("the run's end has a field of the wrong shape")
    return Execution(status=data["status"], execution_count=count, stop=data["stop"], timing=dict(timing),
                     reply=data["reply"], error=_last_error(error), exit_value=exit_value,
                     late_unread=data.get("late_unread", False))


def _last_error(error: Any) -> LastError | None:
    if error is None:
        return None
    lines = error.get("traceback") if isinstance(error, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("raised"), bool) \
            or not isinstance(error.get("ename"), str) or not isinstance(error.get("evalue"), str) \
            or not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise FrameError("the run's end has an error of the wrong shape")
    return LastError(error["raised"], error["ename"], error["evalue"], tuple(lines))


def take(frame: Frame, seen: Execution, on_output: Callable[[Message], None], node: str) -> Execution | None:
    """Hand one frame of a run read from ``node`` to the engine: an output message to ``on_output`` (only the
    kinds a run relays), the run's end (None before it). An error message seen fails the cell whatever the end
    says; an X frame is the node's failure (NodeError) or the sandbox's (RelayedProtocolError)."""
    if frame.kind == "M":
        msg = frame.message
        assert msg is not None
        if msg.msg_type not in RELAYED:
            raise FrameError(f"node {node} relayed a {msg.msg_type[:40]!r} message, not an output")
        if msg.msg_type == "error":  # known by its header: an error past a cap still fails the cell
            seen.errors_read += msg.complete
            seen.errors_dropped += 0 if msg.complete else msg.size
        on_output(msg)
    elif frame.kind == "E":
        ended = frame.execution
        assert ended is not None
        ended.errors_read, ended.errors_dropped = seen.errors_read, seen.errors_dropped
        if ended.status == "ok" and (seen.errors_read or seen.errors_dropped):
            ended.status = "error"  # an error message came: the cell failed, whatever the node says
        return ended
    elif frame.kind == "X":
        if frame.header.get("kind") == "protocol":
            raise RelayedProtocolError(f"{frame.detail[:2000]} (on node {node})",
                                       frame.header.get("kernel_lost") is True)
        raise NodeError(f"node {node} could not run the cell: {frame.detail[:2000]}")
    return None
