"""The host's side of a connection to a port inside the sandbox (``supervisor.ports``), relayed by the supervisor
(`agentports`): the sandbox keeps no network interface but loopback, and the bytes cross in frames.

What the supervisor sends is hostile input: data past the window the host granted, or a ``took`` past what the
host sent, breaks the protocol and closes the supervisor. A relay holds at most PORT_WINDOW bytes it was sent and
not yet taken, and at most MAX_PIECES frames in all (a server that answers a byte at a time costs the host a
bounded number of frames, not one per byte for as long as it likes). Waits are the caller's: `Relay.poll` never
blocks, `Relay.wait` has a deadline, and ``wake`` (called on the supervisor's reader thread) lets an event loop
wait without a thread of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from . import wire
from .events import SupervisorError, SupervisorLostError, Violation, number, text

MAX_PIECES = 16384  # frames of data one connection may bring (64 KiB each when the server writes freely)


class RelayEndedError(SupervisorError):
    """The connection ended before it was up, or broke: ``str()`` says why."""


class Link(Protocol):
    """What the relays use of a `Supervisor`."""

    def request(self, head: dict[str, Any], data: bytes = b"", *,
                on_reply: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any], bytes]: ...

    def notify(self, head: dict[str, Any], data: bytes = b"") -> None: ...

    def broken(self, reason: str) -> SupervisorLostError: ...


class Relay:
    """One connection to 127.0.0.1:<port> inside the sandbox. ``up`` once connected; `poll` takes what came."""

    def __init__(self, link: Link, wake: Callable[[], None] | None, forget: Callable[[Relay], bool]) -> None:
        self.conn = 0
        self.up = False
        self._link, self._wake, self._forget = link, wake or (lambda: None), forget
        self._cond = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._held = 0  # bytes received and not yet taken
        self._granted = wire.PORT_WINDOW  # bytes the supervisor may still send
        self._taken = 0  # bytes taken and not yet granted again
        self._in_flight = 0  # bytes sent and not yet written to the socket in the sandbox
        self._eof = False
        self._error: SupervisorError | None = None
        self.pieces = 0

    # -- the supervisor's reader thread ----------------------------------------------------------------------------

    def feed(self, head: dict[str, Any], data: bytes) -> None:
        with self._cond:
            if "end" in head:
                reason = text(head["end"])
                if reason == "eof" and self.up:
                    self._eof = True
                elif self._error is None:
                    self._error = RelayEndedError(reason)
            elif head.get("up") is True:
                self.up = True
            elif "took" in head:
                took = number(head["took"])
                if not 0 <= took <= self._in_flight:
                    raise Violation("a port connection wrote more than it was sent")
                self._in_flight -= took
            else:
                self._data(data)
            self._cond.notify_all()
        self._wake()

    def _data(self, data: bytes) -> None:
        if not self.up or len(data) > self._granted:
            raise Violation("port data past the window it was granted")
        self._granted -= len(data)
        self.pieces += 1
        if self.pieces > MAX_PIECES and self._error is None:
            self._error = RelayEndedError(f"the server sent its answer in more than {MAX_PIECES} pieces")
        if self._error is None:
            self._chunks.append(data)
            self._held += len(data)

    def fail(self, error: SupervisorError) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
        self._wake()

    # -- the caller ------------------------------------------------------------------------------------------------

    def poll(self) -> bytes | None:
        """The next bytes the server sent, b"" at its end, None when nothing is waiting; the error that ended the
        connection, if one did, once everything before it is taken."""
        with self._cond:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._held -= len(chunk)
                self._taken += len(chunk)
                return chunk
            if self._error is not None:
                raise self._error
            return b"" if self._eof else None

    def wait(self, timeout: float, *, up: bool = False) -> bool:
        """Wait up to ``timeout`` s for something to `poll` (with ``up``: or for the connection to be up)."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._chunks) or self._error is not None or self._eof
                                       or (up and self.up), timeout)

    def owes(self) -> bool:
        """Whether `grant` would give the supervisor more room (half a window taken since the last grant)."""
        with self._cond:
            return self._taken >= wire.PORT_WINDOW // 2 and self._error is None

    def grant(self) -> None:
        """Let the supervisor send as many bytes again as were taken (blocking, briefly)."""
        with self._cond:
            given, self._taken = self._taken, 0
            self._granted += given
        if given:
            self._link.notify({"op": "port_more", "conn": self.conn, "bytes": given})

    def send(self, data: bytes, timeout: float) -> None:
        """Send ``data`` to the server, waiting up to ``timeout`` s for room (blocking); TimeoutError past it."""
        view = memoryview(data)
        while view:
            with self._cond:
                room = lambda: self._error is not None or self._in_flight < wire.PORT_WINDOW  # noqa: E731
                if not self._cond.wait_for(room, timeout):
                    raise TimeoutError("the server in the sandbox did not take the request in time")
                if self._error is not None:
                    raise self._error
                part = view[:min(wire.OUTPUT_CHUNK, wire.PORT_WINDOW - self._in_flight)]
                self._in_flight += len(part)
            self._link.notify({"op": "port_send", "conn": self.conn}, bytes(part))
            view = view[len(part):]

    def close(self) -> None:
        """End the connection (the sandbox's socket is closed); nothing more arrives."""
        self.fail(RelayEndedError("the relay was closed"))
        if self._forget(self):
            self._link.notify({"op": "port_close", "conn": self.conn})


class Ports:
    """``supervisor.ports``: the relays open, by their connection's number (thread-safe)."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._relays: dict[int, Relay] = {}

    def open(self, port: int, wake: Callable[[], None] | None = None) -> Relay:
        """A relay to 127.0.0.1:``port`` in the sandbox (blocking while the supervisor answers); it is ``up`` once
        connected, or ends with `RelayEndedError`. NotFoundError when nothing listens, LimitError past
        MAX_PORT_CONNS."""
        relay = Relay(self._link, wake, self._forget)

        def register(head: dict[str, Any]) -> None:  # on the reader thread, before any event of the connection
            relay.conn = number(head.get("conn"))
            with self._lock:
                self._relays[relay.conn] = relay

        self._link.request({"op": "port_open", "port": port}, on_reply=register)
        return relay

    def _forget(self, relay: Relay) -> bool:
        with self._lock:
            return self._relays.pop(relay.conn, None) is relay

    def feed(self, head: dict[str, Any], data: bytes) -> None:
        """An event of one connection (on the reader thread); one of a connection closed meanwhile is dropped."""
        conn = number(head.get("conn"))
        with self._lock:
            relay = self._relays.pop(conn, None) if "end" in head else self._relays.get(conn)
        if relay is not None:
            relay.feed(head, data)

    def fail(self, error: SupervisorError) -> None:
        """End every relay with ``error`` (the supervisor is lost)."""
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.fail(error)
