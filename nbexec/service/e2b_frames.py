"""Caps on E2B data-plane answers a router relays from a node. Pure: bytes in, the same bytes out, or a Cut.

A node's answer is passed on as it comes, never re-framed. What is checked depends on its type: a Connect stream
(``application/connect+json``) envelope by envelope (a flag, a 4-byte length, that many bytes), each within
``max_frame`` bytes, judged on its header before any of it is passed on; the interpreter's JSON lines
(``application/json``) line by line; and every answer within ``max_total`` bytes (0: no total cap).
"""

from __future__ import annotations

import json
import struct

CONNECT_STREAM = "application/connect+json"
JSON_LINES = "application/json"
_MESSAGE, _END = 0, 2  # Connect's envelope flags a node may send (1, compressed, is never negotiated here)


class Cut(Exception):
    """A node broke a cap. ``boundary``: nothing of the offending frame was passed on, so a Connect client can be
    given a proper end of stream."""

    def __init__(self, message: str, boundary: bool) -> None:
        super().__init__(message)
        self.boundary = boundary


def end_of_stream(code: str, message: str) -> bytes:
    """A Connect end-of-stream envelope carrying an error (what a cut Connect stream ends with)."""
    data = json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode()
    return struct.pack(">BI", _END, len(data)) + data


class Framer:
    """Checks one answer's bytes as they come (see the module docstring); ``done`` once a Connect stream ended."""

    def __init__(self, kind: str, *, max_frame: int, max_total: int) -> None:
        self.kind, self.max_frame, self.max_total = kind, max_frame, max_total
        self.sent = 0  # bytes passed on
        self.done = False
        self._header = b""  # a Connect envelope's header, while it arrives
        self._left = 0  # bytes of the current envelope (or line) still to come
        self._last = False  # the current envelope ends the stream

    @property
    def midway(self) -> bool:
        """Whether part of an envelope was passed on and the rest is still to come."""
        return bool(self._left)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The bytes of ``chunk`` that may be passed on now; raises Cut past a cap."""
        if self.done:
            return []
        if self.kind == CONNECT_STREAM:
            return self._envelopes(chunk)
        if self.kind == JSON_LINES:
            self._line(chunk)
        self._count(len(chunk), boundary=False)
        return [chunk]

    def _count(self, size: int, boundary: bool) -> None:
        if self.max_total and self.sent + size > self.max_total:
            raise Cut(f"the answer is over the router's cap of {self.max_total} bytes", boundary)
        self.sent += size

    def _line(self, chunk: bytes) -> None:
        """Follow the line being received (its bytes so far in ``_left``); Cut when one grows past max_frame."""
        first, newline, rest = chunk.partition(b"\n")
        longest = self._left + len(first)
        if newline:
            lines = rest.split(b"\n")
            self._left = len(lines[-1])
            longest = max(longest, *map(len, lines))
        else:
            self._left = longest
        if longest > self.max_frame:
            raise Cut(f"a line of the answer is over the router's cap of {self.max_frame} bytes", False)

    def _envelopes(self, chunk: bytes) -> list[bytes]:
        out: list[bytes] = []
        while chunk and not self.done:
            if self._left:
                piece, chunk = chunk[:self._left], chunk[self._left:]
                self._left -= len(piece)
                out.append(piece)
                self.done = self._last and not self._left
                continue
            need = 5 - len(self._header)
            self._header, chunk = self._header + chunk[:need], chunk[need:]
            if len(self._header) == 5:
                out.append(self._opened())
        return out

    def _opened(self) -> bytes:
        """A whole envelope header: judged, counted, and passed on with the envelope's bytes to follow."""
        header, self._header = self._header, b""
        flag, length = struct.unpack(">BI", header)
        if flag not in (_MESSAGE, _END):
            raise Cut(f"the node sent a Connect envelope with flag {flag}", True)
        if length > self.max_frame:
            raise Cut(f"the node sent a message of {length} bytes, over the router's cap of {self.max_frame}",
                      True)
        self._count(5 + length, boundary=True)  # the whole envelope, charged before any of it is passed on
        self._left, self._last = length, flag == _END
        self.done = self._last and not length
        return header
