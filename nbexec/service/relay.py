"""The router's one forwarding path: a client's call, signed for that client, to one node, and the node's answer
passed on while it is read, within caps, never held.

The router sends the method, the path (with the node's own id, every segment checked and percent-encoded), the
query with ``stream=true`` added (so runs come back as event streams, whose keep-alives bound every wait; routes
without a stream ignore it), ``Content-Type`` and the body, and signs whom the call is for (`identity`). What comes
back is judged by its status and type, not by its route:

- an error (4xx, 5xx): at most ``ERROR_BODY`` bytes of it are read and passed on (a refused node token is 502);
- an event stream: re-framed piece by piece (`sse`), each event within ``max_event`` bytes, up to the first
  ``result`` or ``error`` event; for a client that did not ask for a stream the ``result`` event's data becomes
  the body, and an ``error`` event's status the answer's status;
- anything else: its bytes, up to ``max_download`` (JSON as JSON, the rest as an attachment).

A node lost during a call is an explicit error naming it (410 ``session_lost`` on a session's routes, else 502
``node_lost``), and a client that hangs up closes the node's stream, which interrupts the run there. A node that
breaks a cap mid-answer has the client's answer cut off (never completed with what did not come).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import HTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Receive

from . import identity, sse, streaming
from .fleet import Fleet

log = logging.getLogger(__name__)
ERROR_BODY = 64 * 1024  # bytes of a node's error answer (or error event) read and passed on
NOT_REACHED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # safe to send elsewhere
_SAFE = {"X-Content-Type-Options": "nosniff"}
_EXECUTION_HEADER = "X-Nbexec-Execution-Id"  # a streamed one-shot run's id (the node made it the client's)
_PLAIN_ID = re.compile(r"[0-9A-Za-z_.-]{1,128}")


class CutOff(Exception):
    """A node broke a cap or its stream; ``midway`` when part of an event had been passed on already."""

    def __init__(self, message: str, midway: bool = False) -> None:
        super().__init__(message)
        self.midway = midway


@dataclass(frozen=True)
class Call:
    """One client call as the router sends it to a node."""

    who: str  # the client's token id
    method: str
    path: str  # percent-encoded, with the node's own id
    query: str  # percent-encoded, with stream=true
    stream: bool  # the client asked for an event stream
    session: bool  # a session's route: a lost node is 410 session_lost
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # more headers, set last (E2B's: see router_e2b)
    node_auth: bool = True  # False: no node token in Authorization (E2B's data plane sends the client's own)


class Upstream:
    """A node's answer being relayed; ``close`` (idempotent) frees the node's and the client's counts."""

    def __init__(self, relay: Relay, name: str, call: Call, response: Any) -> None:
        self.relay, self.name, self.call, self.response = relay, name, call, response
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            self.relay.release(self.name, self.call.who)
            with anyio.CancelScope(shield=True):  # even when the client's task is being cancelled: the node must
                await self.response.aclose()  # see its connection close, which interrupts the run there

    def streamed(self, body: AsyncIterator[bytes], status: int = 200, **options: Any) -> StreamingResponse:
        """A streamed answer whose end, however it comes (done, cut off, the client gone), closes this upstream."""
        return StreamingResponse(body, status, background=BackgroundTask(self.close), **options)


class Relay:
    """Sends calls to nodes and relays their answers (see the module docstring)."""

    def __init__(self, fleet: Fleet, *, max_event: int, max_download: int, max_calls: int) -> None:
        self.fleet = fleet
        self.max_event = max_event
        self.max_download = max_download  # 0: no cap
        self.max_calls = max_calls
        self.calls: dict[str, int] = {}  # client -> calls in flight through this router

    def release(self, name: str, who: str) -> None:
        self.fleet.inflight[name] -= 1
        self.calls[who] -= 1
        if not self.calls[who]:  # a client with nothing in flight takes no room (E2B's data plane has many)
            del self.calls[who]

    async def open(self, name: str, call: Call, content: Any) -> Upstream:
        """Send ``call`` to node ``name``. Raises one of NOT_REACHED when it never reached the node (the caller
        may try another); a later failure raises CutOff."""
        if self.calls.get(call.who, 0) >= self.max_calls:
            raise HTTPException(429, f"{self.max_calls} calls of this token are in flight through this router",
                                headers={"Retry-After": "2"})
        url = f"{self.fleet.urls[name]}{call.path}" + (f"?{call.query}" if call.query else "")
        request = self.fleet.http.build_request(call.method, url, content=content)
        if call.content_type:
            request.headers["Content-Type"] = call.content_type
        if not call.node_auth:
            del request.headers["Authorization"]
        for header, value in call.headers:
            request.headers[header] = value
        target = request.url.raw_path.decode("ascii")
        request.headers[identity.FOR_HEADER] = identity.sign(self.fleet.token, call.method, target, call.who, name)
        self.calls[call.who] = self.calls.get(call.who, 0) + 1
        self.fleet.inflight[name] += 1
        try:
            response = await self.fleet.http.send(request, stream=True)
        except NOT_REACHED:
            self.release(name, call.who)
            raise
        except httpx.HTTPError as exc:
            self.release(name, call.who)
            raise CutOff(f"lost while it took the call ({type(exc).__name__})") from exc
        except BaseException:  # the client's streamed body broke a cap or ended: its counts are given back too
            self.release(name, call.who)
            raise
        return Upstream(self, name, call, response)

    async def answer(self, upstream: Upstream, receive: Receive) -> Response:
        """The client's answer to ``upstream`` (see the module docstring); the upstream is closed when it is done."""
        status = upstream.response.status_code
        kind = upstream.response.headers.get("content-type", "").split(";")[0].strip().lower()
        where = {"X-Nbexec-Node": upstream.name, **_SAFE}
        if not 200 <= status < 300:
            return await self._error(upstream, where)
        if kind == "text/event-stream":
            if upstream.call.stream or upstream.call.path.endswith("/events"):  # a batch's results are a stream
                return upstream.streamed(self._events(upstream), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-store", **where, **execution_header(upstream)})
            return await self._collect(upstream, receive, where)
        if status == 204:
            await upstream.close()
            return Response(status_code=204, headers=where)
        headers = where if kind == "application/json" else {"Content-Disposition": "attachment", **where}
        return upstream.streamed(self._bytes(upstream), status, headers=headers,
                                 media_type="application/json" if kind == "application/json" else
                                 "application/octet-stream")

    async def _error(self, upstream: Upstream, where: dict[str, str]) -> Response:
        """A node's error answer: its status and at most ERROR_BODY bytes of its body."""
        response = upstream.response
        try:
            body = await _read(response, ERROR_BODY)
        except (httpx.HTTPError, CutOff):
            body = b""
        finally:
            await upstream.close()
        if response.status_code == 401:
            return JSONResponse({"detail": "a node refused the router's NBEXEC_NODE_TOKEN"}, 502, headers=where)
        if response.status_code < 400:
            return JSONResponse({"detail": f"node {upstream.name} answered HTTP {response.status_code}"}, 502,
                                headers=where)
        retry = response.headers.get("retry-after", "")
        headers = {**where, **({"Retry-After": retry} if retry.isdigit() and len(retry) <= 6 else {})}
        json_body = response.headers.get("content-type", "").startswith("application/json")
        return Response(body, response.status_code, headers=headers,
                        media_type="application/json" if json_body else "text/plain; charset=utf-8")

    async def _bytes(self, upstream: Upstream) -> AsyncIterator[bytes]:
        sent = 0
        try:
            async for chunk in upstream.response.aiter_raw():
                sent += len(chunk)
                if self.max_download and sent > self.max_download:
                    raise CutOff(f"node {upstream.name} sent an answer over {self.max_download} bytes")
                yield chunk
        except httpx.HTTPError as exc:
            raise CutOff(f"node {upstream.name} was lost mid-answer ({type(exc).__name__})") from exc
        finally:
            await upstream.close()

    async def _pieces(self, upstream: Upstream) -> AsyncIterator[sse.Piece]:
        """The node's events as pieces; ends after the first final event, raises CutOff when the stream breaks."""
        framer = sse.Framer(self.max_event)
        try:
            async for chunk in upstream.response.aiter_raw():
                for piece in framer.feed(chunk):
                    yield piece
                    if piece[0] == "dispatch" and piece[1] in sse.FINAL:
                        return
        except (httpx.HTTPError, sse.EventError) as exc:
            raise CutOff(f"node {upstream.name}: {exc or type(exc).__name__}", framer.pending) from exc
        raise CutOff(f"node {upstream.name} ended the stream without a result", framer.pending)

    async def _events(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """Relay a run's events to a streaming client; a node lost between events becomes an error event."""
        try:
            async for piece in self._pieces(upstream):
                yield sse.encode(piece)
        except CutOff as exc:
            log.warning("%s", exc)
            if exc.midway:  # mid-event: the client's stream is cut off, nothing invented
                raise
            status, body = lost(upstream.name, "was lost during the run", upstream.call.session)
            yield sse.frame("error", json.dumps({"status": status, **body}).encode())
        finally:
            await upstream.close()

    async def _collect(self, upstream: Upstream, receive: Receive, where: dict[str, str]) -> Response:
        """A non-streaming client's answer from a run's events: the result's data as the body, or the error."""
        pieces = self._pieces(upstream)
        decision = asyncio.ensure_future(_final(pieces))
        try:
            if not await streaming.first_or_gone(decision, receive):
                decision.cancel()  # the client hung up: closing the stream interrupts the run on the node
                with contextlib.suppress(asyncio.CancelledError, CutOff):
                    await decision
                await upstream.close()
                return Response(status_code=499)
            kind, first = decision.result()
        except CutOff as exc:
            await upstream.close()
            log.warning("%s", exc)
            return lost_answer(upstream.name, "was lost during the run", upstream.call.session)
        if kind == "error":
            await upstream.close()
            return _error_event(first, where)
        return upstream.streamed(self._rest(first, pieces, upstream), media_type="application/json", headers=where)

    async def _rest(self, first: bytes, pieces: AsyncIterator[sse.Piece], upstream: Upstream) -> AsyncIterator[bytes]:
        """The rest of a result event's data, as the body of a non-streaming answer."""
        try:
            yield first
            async for kind, value in pieces:
                if kind == "data":
                    yield value
                elif kind == "data-start":
                    yield b"\n"  # data lines of one event are joined with a line feed
                elif kind == "dispatch":
                    return
        finally:
            await upstream.close()


def lost(name: str, what: str, session: bool) -> tuple[int, dict[str, Any]]:
    """The status and body for a call whose node ``name`` was lost (``what`` says when)."""
    if session:
        return 410, {"detail": f"session lost: node {name} {what}; its kernel state is gone, files already "
                     "downloaded stay. Start a new session.", "error": "session_lost", "node": name}
    return 502, {"detail": f"node {name} {what}; the execution was not retried, since it may have run",
                 "error": "node_lost", "node": name}


def lost_answer(name: str, what: str, session: bool) -> JSONResponse:
    status, body = lost(name, what, session)
    return JSONResponse(body, status, headers={"X-Nbexec-Node": name, **_SAFE})


async def _read(response: Any, limit: int) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk[:limit + 1 - len(body)]
        if len(body) > limit:
            return bytes(body[:limit])
    return bytes(body)


async def _final(pieces: AsyncIterator[sse.Piece]) -> tuple[str, bytes]:
    """Read events up to the final one: ("result", its first data bytes) once a result's data starts, or
    ("error", the error event's data, at most ERROR_BODY bytes)."""
    name, data = b"message", bytearray()
    async for kind, value in pieces:
        if kind == "event":
            name, data = value, bytearray()
        elif kind == "data-start" and name == b"result":
            return "result", b""
        elif kind == "data" and name == b"error":
            data += value[:ERROR_BODY + 1 - len(data)]
        elif kind == "dispatch":
            if value == b"error":
                return "error", bytes(data)
            name, data = b"message", bytearray()
    raise CutOff("the stream ended without a result", False)


def _error_event(data: bytes, where: dict[str, str]) -> Response:
    """A node's error event as an HTTP answer with the status it carries."""
    try:
        body = json.loads(data) if len(data) <= ERROR_BODY else None
        status = int(body.pop("status", 502)) if isinstance(body, dict) else 502
    except (ValueError, TypeError, RecursionError):
        body, status = None, 502
    if not isinstance(body, dict) or not 400 <= status < 600:
        return JSONResponse({"detail": "a node sent a malformed error event"}, 502, headers=where)
    return JSONResponse(body, status, headers=where)


def execution_header(upstream: Upstream) -> dict[str, str]:
    """The run's id header of a node's stream, passed on only when it is one plain id (a node is not trusted)."""
    found = upstream.response.headers.get_list(_EXECUTION_HEADER)
    return {_EXECUTION_HEADER: found[0]} if len(found) == 1 and _PLAIN_ID.fullmatch(found[0]) else {}
