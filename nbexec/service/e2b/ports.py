"""Servers the code starts inside a sandbox, reached through the E2B door's data plane: a request to the sandbox URL
with ``E2b-Sandbox-Port: <port>`` (any port but envd's and the interpreter's) is relayed as HTTP/1.1 to
127.0.0.1:<port> inside the sandbox, and the answer streamed back. Off unless the operator turns it on
(``NBEXEC_E2B_PORTS=1``): until then every such port answers as E2B answers a closed one, saying how.

Who can reach it: the sandbox's owner, by one of the sandbox's own tokens (the data plane's `dataplane.resolve`
judges them before this module sees the request). The sandbox gets no network for it: the bytes cross through its
process supervisor (`Supervisor.ports`), which connects to loopback from inside.

What the server in the sandbox sends is hostile: its answer's head is parsed by h11 within MAX_HEAD bytes and
HEAD_TIMEOUT seconds, each read waits at most READ_TIMEOUT, the body is cut at MAX_RESPONSE bytes or MAX_CHUNKS
chunks (passed on a read at a time), the whole exchange ends by EXCHANGE_TIMEOUT (and the sandbox's end), and at
most MAX_RELAYS requests per sandbox are in flight. A cut answer is aborted, never passed off as whole. Nothing
follows a redirect: a 3xx goes back as it came. The request goes without hop-by-hop headers and without nbexec's
own (the sandbox's tokens, the routing headers, an nbexec API token); websockets (``Upgrade``) are not relayed."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nbexec.errors import NbexecError
from nbexec.sandbox.docker.supervisor import LimitError, NotFoundError, Relay, RelayEndedError, SupervisorError

from . import envd
from .boxes import Box
from .connect import ConnectError
from .control import Control
from .wire import E2bError

MAX_RELAYS = 8  # requests relayed to one sandbox at once (E2B answers 429 past its own limit)
CONNECT_TIMEOUT = 10.0  # seconds for the server in the sandbox to accept the connection
READ_TIMEOUT = 30.0  # seconds each read from (or write to) the server may wait
HEAD_TIMEOUT = 30.0  # seconds for the whole head of its answer
EXCHANGE_TIMEOUT = 600.0  # seconds one relayed request may last in all (never past the sandbox's end)
MAX_HEAD = 64 * 1024  # bytes of the answer's status line and headers
MAX_RESPONSE = 16 * 1024**2  # bytes of one answer's body
MAX_INFORMATIONAL = 8  # 1xx answers before the final one
MAX_CHUNKS = 65536  # pieces of one answer's body as h11 hands them over (a chunked body costs one per 6 wire bytes)
HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
                 b"te", b"trailer", b"transfer-encoding", b"upgrade"})
OWN = frozenset({b"x-access-token", b"e2b-traffic-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port",
                 b"x-api-key"})
CLOSED = "The sandbox is running but port is not open"  # E2B's proxy's words for a closed port
OFF = ("the port relay is off on this server: the operator turns it on with NBEXEC_E2B_PORTS=1 "
       "(ports 49983 and 49999 are always open)")
_places = threading.Lock()


class PortError(E2bError):
    """An answer in E2B's proxy's shape (``sandboxId``, ``port``, ``message``, ``code``)."""

    def __init__(self, status: int, message: str, box: Box, port: int, **more: Any) -> None:
        super().__init__(status, message, **more)
        self.sandbox, self.port = box.id, port

    def body(self) -> bytes:
        return json.dumps({"sandboxId": self.sandbox, "message": self.message, "port": str(self.port),
                           "code": self.status}).encode()


class RelayCutError(Exception):
    """The answer broke off (a cap, a deadline, the sandbox's end): the client's connection is aborted."""


async def route(control: Control, box: Box, request: Request, port: int) -> Response:
    """Relay ``request`` to the server on ``port`` inside ``box``."""
    if not control.settings.e2b_ports:
        raise PortError(502, f"{CLOSED}: {OFF}", box, port)
    if not 0 < port < 65536:
        raise PortError(502, f"{CLOSED}: {port} is no port", box, port)
    give_back = _place(box, port)
    exchange = Exchange(control, box, port)
    try:
        await exchange.open()
        await exchange.send(request)
        answer = await exchange.head()
    except BaseException:
        exchange.close()
        give_back()
        raise
    body = exchange.body(give_back)
    weakref.finalize(body, _abandoned, exchange, give_back)  # an answer dropped before its first byte
    response = StreamingResponse(body, status_code=answer.status_code)
    chunked = any(name.lower() == b"transfer-encoding" for name, _ in answer.headers)  # then h11 read by chunks:
    dropped = HOP | {b"content-length"} if chunked else HOP  # a Content-Length beside them lies (RFC 9112 6.3)
    response.raw_headers = [(name, value) for name, value in answer.headers if name.lower() not in dropped]
    return response


def _abandoned(exchange: Exchange, give_back: Callable[[], None]) -> None:
    exchange.close()
    give_back()


def _place(box: Box, port: int) -> Callable[[], None]:
    """One of the sandbox's MAX_RELAYS places; what it returns gives it back, once."""
    with _places:
        held = box.extra.get("relays", 0)
        if held >= MAX_RELAYS:
            raise PortError(429, "The sandbox has too many concurrent incoming connections "
                                 f"(limit: {MAX_RELAYS})", box, port, after=1)
        box.extra["relays"] = held + 1
    given = threading.Event()

    def give_back() -> None:
        with _places:
            if not given.is_set():
                given.set()
                box.extra["relays"] = box.extra.get("relays", 1) - 1
    return give_back


def forwarded(request: Request, tokens: tuple[str, ...], port: int) -> list[tuple[bytes, bytes]]:
    """The request's headers for the server in the sandbox: without hop-by-hop ones (and those ``Connection``
    names), nbexec's own, or an ``Authorization`` that carries one of this server's API tokens."""
    named = {part.strip().lower().encode("latin-1") for part in request.headers.get("connection", "").split(",")}
    found = []
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower in HOP or lower in OWN or lower in named or (lower == b"authorization" and _ours(value, tokens)):
            continue
        found.append((name, value))
    if not any(name.lower() == b"host" for name, _ in found):
        found.append((b"host", f"127.0.0.1:{port}".encode()))
    if "transfer-encoding" in request.headers and "content-length" not in request.headers:
        found.append((b"transfer-encoding", b"chunked"))
    return [*found, (b"connection", b"close")]


def _ours(value: bytes, tokens: tuple[str, ...]) -> bool:
    """Whether ``value`` (with or without a scheme) is one of this server's API tokens."""
    given = (value.strip(), value.partition(b" ")[2].strip())
    found = False
    for token in tokens:  # every one compared, in constant time
        found |= hmac.compare_digest(given[0], token.encode()) | hmac.compare_digest(given[1], token.encode())
    return found


class Exchange:
    """One request relayed: the relay, h11's view of the connection, and the deadlines."""

    def __init__(self, control: Control, box: Box, port: int) -> None:
        self.control, self.box, self.port = control, box, port
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + min(EXCHANGE_TIMEOUT, max(1.0, box.end - time.time()))
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.woken = asyncio.Event()
        self.relay: Relay | None = None

    def _wake(self) -> None:  # on the supervisor's reader thread
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            self.loop.call_soon_threadsafe(self.woken.set)

    async def _io(self, func: Callable[..., Any], *args: Any) -> Any:
        """Blocking supervisor work on the owner's I/O threads, its errors in E2B's proxy's shapes."""
        try:
            return await asyncio.wrap_future(self.control.folders.lanes(self.box.owner).io.submit(func, *args))
        except (NotFoundError, RelayEndedError) as exc:
            raise PortError(502, f"{CLOSED}: {exc}", self.box, self.port) from None
        except LimitError as exc:
            raise PortError(429, str(exc), self.box, self.port, after=1) from None
        except (SupervisorError, ConnectError, NbexecError) as exc:
            raise PortError(502, f"the sandbox's relay failed: {exc}", self.box, self.port) from None
        except TimeoutError as exc:
            raise PortError(504, str(exc), self.box, self.port) from None

    async def open(self) -> None:
        supervisor = await self._io(envd.supervisor, self.box)
        self.relay = await self._io(supervisor.ports.open, self.port, self._wake)
        end = self.loop.time() + CONNECT_TIMEOUT
        while not self.relay.up:
            self.woken.clear()
            try:
                self.relay.poll()  # only an end can wait there before the connection is up
            except SupervisorError as exc:
                raise PortError(502, f"{CLOSED}: {exc}", self.box, self.port) from None
            if not self.relay.up and not await self._wait(end):
                raise PortError(504, f"port {self.port} did not accept the connection within {CONNECT_TIMEOUT:g} s",
                                self.box, self.port)

    async def _wait(self, end: float) -> bool:
        """Wait until woken, or until ``end`` (or the exchange's deadline); whether woken."""
        left = min(end, self.deadline) - self.loop.time()
        if left <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.woken.wait(), left)
        return self.woken.is_set()

    async def send(self, request: Request) -> None:
        """The request's head, then its body as it comes (within the server's max_body)."""
        assert self.relay is not None
        target = _target(request)
        headers = forwarded(request, self.control.settings.tokens, self.port)
        try:
            await self._write(self.http.send(h11.Request(method=request.method, target=target, headers=headers)))
            total, limit = 0, self.control.settings.max_body
            if _has_body(request):
                async for chunk in request.stream():
                    total += len(chunk)
                    if total > limit:
                        raise E2bError(413, f"request body over {limit} bytes")
                    if chunk:
                        await self._write(self.http.send(h11.Data(data=chunk)))
            await self._write(self.http.send(h11.EndOfMessage()))
        except h11.LocalProtocolError as exc:
            raise PortError(400, f"the request cannot be relayed: {exc}", self.box, self.port) from None

    async def _write(self, data: bytes | None) -> None:
        if data:
            assert self.relay is not None
            await self._io(self.relay.send, data, READ_TIMEOUT)

    async def _take(self, end: float) -> bytes:
        """The server's next bytes (b"" at its end) by ``end``; RelayCutError past it or when the relay ended."""
        assert self.relay is not None
        while True:
            self.woken.clear()
            try:
                found = self.relay.poll()
            except SupervisorError as exc:
                raise RelayCutError(f"the connection to port {self.port} ended: {exc}") from None
            if found is not None:
                if self.relay.owes():
                    await self._io(self.relay.grant)
                return found
            if not await self._wait(end):
                raise RelayCutError(f"port {self.port} sent nothing in time")

    async def head(self) -> h11.Response:
        """The head of the server's final answer (1xx answers skipped), within MAX_HEAD and HEAD_TIMEOUT."""
        end, informational = self.loop.time() + HEAD_TIMEOUT, 0
        try:
            while True:
                event = self.http.next_event()
                if event is h11.NEED_DATA:
                    self.http.receive_data(await self._take(min(end, self.loop.time() + READ_TIMEOUT)))
                elif isinstance(event, h11.InformationalResponse):
                    informational += 1
                    if informational > MAX_INFORMATIONAL:
                        raise RelayCutError(f"more than {MAX_INFORMATIONAL} informational answers")
                elif isinstance(event, h11.Response):
                    return event
                else:
                    raise RelayCutError(f"the server closed the connection before answering ({event})")
        except h11.RemoteProtocolError as exc:
            raise PortError(502, f"the server on port {self.port} sent no valid HTTP answer: {exc}",
                            self.box, self.port) from None
        except RelayCutError as exc:
            raise PortError(504 if "in time" in str(exc) else 502, str(exc), self.box, self.port) from None

    async def body(self, give_back: Callable[[], None]) -> AsyncIterator[bytes]:
        """The answer's body as it comes, within MAX_RESPONSE bytes and the deadlines; the relay and its place are
        given back however the stream ends."""
        sent, pieces, parsed = 0, 0, bytearray()
        try:
            while True:
                event = self.http.next_event()
                if isinstance(event, h11.Data):
                    sent, pieces = sent + len(event.data), pieces + 1
                    if sent > MAX_RESPONSE:
                        raise RelayCutError(f"the answer of port {self.port} is over {MAX_RESPONSE} bytes")
                    if pieces > MAX_CHUNKS:
                        raise RelayCutError(f"the answer of port {self.port} came in over {MAX_CHUNKS} chunks")
                    parsed += event.data
                    continue
                if parsed:  # what one read brought goes on as one piece, not one per chunk
                    yield bytes(parsed)
                    parsed.clear()
                if event is h11.NEED_DATA:
                    self.http.receive_data(await self._take(self.loop.time() + READ_TIMEOUT))
                else:  # its end, or h11 paused (nothing more will come): never a loop that spins
                    return
        except h11.RemoteProtocolError as exc:
            raise RelayCutError(f"the answer of port {self.port} broke the protocol: {exc}") from None
        finally:
            self.close()
            give_back()

    def close(self) -> None:
        """Close the connection in the sandbox, without waiting (a cancelled stream may not wait)."""
        relay, self.relay = self.relay, None
        if relay is not None:
            with contextlib.suppress(RuntimeError):
                self.control.folders.lanes(self.box.owner).io.submit(relay.close)


def _target(request: Request) -> bytes:
    """The request's path below the data plane's prefix, as the client encoded it, and its query."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    path = raw.split(b"/e2b/sandbox", 1)[1] if raw.startswith(b"/e2b/sandbox") else raw
    query = request.scope.get("query_string") or b""
    return (path or b"/") + (b"?" + query if query else b"")


def _has_body(request: Request) -> bool:
    return "content-length" in request.headers or "transfer-encoding" in request.headers
