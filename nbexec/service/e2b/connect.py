"""The Connect protocol's JSON codec as envd's clients speak it: unary calls (a JSON body in, a JSON body out, an
error as an HTTP status and ``{"code", "message"}``) and streams (envelopes: one flag byte, a 4-byte big-endian
length, that many bytes of JSON; flag 2 ends the stream, carrying ``{}`` or ``{"error": ...}``).

Request bytes are hostile: every envelope's length is checked against a cap before its bytes are read, a
compressed envelope (flag 1) is refused, a body that stops short or sends more than it should is
``invalid_argument``, and the whole read has a deadline (a client that sends five bytes and stops holds nothing
for long)."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

MAX_MESSAGE = 1024 * 1024  # bytes of one request message: envd's requests carry paths, argv and small inputs
READ_DEADLINE = 30.0  # seconds for a request's body to arrive
END = 2  # the end-of-stream flag
STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
          "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
          "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
          "data_loss": 500, "unauthenticated": 401}
STREAM_TYPE = "application/connect+json"


class ConnectError(Exception):
    """An answer with one of Connect's codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        assert code in STATUS
        self.code, self.message = code, message

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def unary(self) -> Response:
        return Response(json.dumps(self.wire()).encode(), status_code=STATUS[self.code],
                        media_type="application/json")


def envelope(message: dict[str, Any], flag: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flag, len(data)) + data


def end(error: ConnectError | None = None) -> bytes:
    return envelope({} if error is None else {"error": error.wire()}, END)


def _message(data: bytes) -> dict[str, Any]:
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):
        raise ConnectError("invalid_argument", "the message is not JSON") from None
    if not isinstance(found, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return found


class Envelopes:
    """Envelopes read off a request body as they arrive (see the module docstring)."""

    def __init__(self, chunks: AsyncIterator[bytes], *, limit: int = MAX_MESSAGE) -> None:
        self._chunks, self._limit, self._buffer, self._done = chunks, limit, bytearray(), False

    async def _fill(self, size: int, deadline: float) -> bool:
        """Until ``size`` bytes are buffered; False at the end of the body."""
        while len(self._buffer) < size and not self._done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectError("deadline_exceeded", "the request body did not arrive in time")
            try:
                chunk = await asyncio.wait_for(self._chunks.__anext__(), left)
            except StopAsyncIteration:
                self._done = True
            except asyncio.TimeoutError:
                raise ConnectError("deadline_exceeded", "the request body did not arrive in time") from None
            else:
                self._buffer += chunk
        return len(self._buffer) >= size

    async def next(self, deadline: float) -> dict[str, Any] | None:
        """The next message; None at a clean end of the body."""
        if not await self._fill(5, deadline):
            if self._buffer:
                raise ConnectError("invalid_argument", "the body ends inside an envelope's header")
            return None
        flag, length = struct.unpack(">BI", bytes(self._buffer[:5]))
        if flag & 1:
            raise ConnectError("invalid_argument", "compressed envelopes are not accepted")
        if length > self._limit:
            raise ConnectError("resource_exhausted", f"a message of {length} bytes is over {self._limit}")
        if not await self._fill(5 + length, deadline):
            raise ConnectError("invalid_argument", "the body ends inside a message")
        data = bytes(self._buffer[5:5 + length])
        del self._buffer[:5 + length]
        if flag & END:
            return None
        return _message(data)

    async def only(self, deadline: float) -> dict[str, Any]:
        """The one message of a server-streaming call: exactly one, nothing after it."""
        found = await self.next(deadline)
        if found is None:
            raise ConnectError("invalid_argument", "the call needs one request message")
        if await self._fill(1, deadline):
            raise ConnectError("invalid_argument", "the call takes one request message only")
        return found


async def unary_body(chunks: AsyncIterator[bytes], *, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    """A unary call's JSON body, sized as it arrives, within the read deadline."""
    deadline, body = time.monotonic() + READ_DEADLINE, bytearray()
    iterator = chunks.__aiter__()
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(iterator.__anext__(), max(left, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ConnectError("deadline_exceeded", "the request body did not arrive in time") from None
        body += chunk
        if len(body) > limit:
            raise ConnectError("resource_exhausted", f"the request is over {limit} bytes")
    return _message(bytes(body)) if body.strip() else {}


def timeout_ms(raw: str | None, cap: float) -> float | None:
    """The ``Connect-Timeout-Ms`` header in seconds, within ``cap``; None when absent (or zero)."""
    if raw is None:
        return None
    if re.fullmatch("[0-9]{1,10}", raw) is None:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be a number of milliseconds")
    return min(int(raw) / 1000, cap) if int(raw) else None
