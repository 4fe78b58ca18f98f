"""A node's server-sent events, re-framed as they arrive and never held. Pure.

The router passes a node's run on to its client without assembling a line or an event: ``Framer.feed`` turns each
chunk into pieces (an ``event:`` name, the start, bytes and end of a ``data:`` line, a comment, the blank line that
dispatches an event), and ``encode`` writes them out again. CR, LF and CRLF all end a line (as the SSE standard
says), so a bare CR from a node can never start a line of its own at the client; fields other than ``event`` and
``data`` are dropped; every byte of an event counts against ``max_event`` while it is read. Memory stays that of one
chunk, whatever the node sends.
"""

from __future__ import annotations

import re

Piece = tuple[str, bytes]  # (kind, bytes): event, data-start, data, data-end, comment, dispatch
FINAL = (b"result", b"error", b"end")  # the events that end a run's stream, and a batch's
_EOL = re.compile(rb"[\r\n]")
_EVENT_NAME = re.compile(rb"[A-Za-z0-9_-]{1,32}")
_FIELD = 32  # bytes of a field name worth reading; a longer one is skipped


class EventError(ValueError):
    """A node's event stream that is not one: an event over the cap, or a malformed event name."""


class Framer:
    """Splits a node's event stream into pieces as it arrives (see the module docstring)."""

    def __init__(self, max_event: int) -> None:
        self.max_event = max_event
        self.size = 0  # bytes of the event being read
        self.name = b"message"
        self.had_data = False
        self.lines = 0  # lines of the event being read
        self._mode = "head"  # head (the field name), data, event, comment, skip
        self._head = bytearray()
        self._value = bytearray()
        self._space = False  # a value's first space is not part of it
        self._line = False  # the current line has a byte
        self._after_cr = False

    @property
    def pending(self) -> bool:
        """Whether part of an event was read and not yet dispatched."""
        return self.lines > 0 or self._line

    def feed(self, chunk: bytes) -> list[Piece]:
        if not chunk:  # an empty read between the CR and LF of a CRLF must not end a second line
            return []
        out: list[Piece] = []
        at = 1 if self._after_cr and chunk[:1] == b"\n" else 0  # the LF of a CRLF split across chunks
        self._after_cr = False
        while at < len(chunk):
            match = _EOL.search(chunk, at)
            end = match.start() if match else len(chunk)
            if end > at:
                self._take(chunk[at:end], out)
            if match is None:
                break
            self._line_end(out)
            at = end + 1
            if chunk[end] == 0x0D:
                if at == len(chunk):
                    self._after_cr = True
                elif chunk[at] == 0x0A:
                    at += 1
        return out

    def _take(self, part: bytes, out: list[Piece]) -> None:
        self.size += len(part)
        if self.size > self.max_event:
            raise EventError(f"a node sent an event over {self.max_event} bytes")
        self._line = True
        if self._mode == "head":
            colon = part.find(b":")
            if colon < 0:
                self._head += part[:_FIELD + 1]
                if len(self._head) > _FIELD:
                    self._mode = "skip"
                return
            self._head += part[:colon]
            self._start_field(out)
            part = part[colon + 1:]
        if self._space and part:
            self._space = False
            part = part[1:] if part[:1] == b" " else part
        if not part:
            return
        if self._mode == "data":
            out.append(("data", part))
        elif self._mode == "event":
            self._value += part[:64]
            if len(self._value) > 32:
                raise EventError("a node sent a malformed event name")

    def _start_field(self, out: list[Piece]) -> None:
        field = bytes(self._head)
        self._head.clear()
        self._space = True
        self._mode = {b"data": "data", b"event": "event", b"": "comment"}.get(field, "skip")
        if self._mode == "data":
            out.append(("data-start", b""))
            self.had_data = True
        elif self._mode == "event":
            self._value.clear()

    def _line_end(self, out: list[Piece]) -> None:
        if not self._line:
            if self.lines:  # a blank line ends the event
                out.append(("dispatch", self.name if self.had_data else b""))
            self.size, self.lines, self.name, self.had_data = 0, 0, b"message", False
            return
        if self._mode == "head":  # a field name alone: its value is empty
            self._start_field(out)
        if self._mode == "data":
            out.append(("data-end", b""))
        elif self._mode == "event":
            if not _EVENT_NAME.fullmatch(self._value):
                raise EventError("a node sent a malformed event name")
            self.name = bytes(self._value)
            out.append(("event", self.name))
        elif self._mode == "comment":
            out.append(("comment", b""))
        self._head.clear()  # a field name skipped as overlong must not prefix the next line's
        self._mode, self._line, self._space = "head", False, False
        self.lines += 1


_ENCODED = {"data-start": b"data: ", "data-end": b"\n", "comment": b": keep-alive\n", "dispatch": b"\n"}


def encode(piece: Piece) -> bytes:
    """The bytes that carry ``piece`` to a client."""
    kind, value = piece
    if kind == "event":
        return b"event: " + value + b"\n"
    if kind == "data":
        return value
    return _ENCODED[kind]


def frame(kind: str, data: bytes) -> bytes:
    """A whole event the router writes itself (``data`` is one line of JSON)."""
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
