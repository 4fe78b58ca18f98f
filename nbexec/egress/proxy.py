"""The host side of ``network="allowlist"``: an HTTP proxy on a Unix socket that only a sandbox reaches.

It speaks the two forms clients use with HTTP_PROXY/HTTPS_PROXY (`nbexec.egress.request`): ``CONNECT host:port``
(a tunnel, for https) and one absolute-URI request per connection (plain http: the head rebuilt, the declared body
re-framed, nothing after it passed on, the connection closed after the answer). The head is capped (16 KiB, 10 s
as a whole) before it is parsed; every destination is judged by `egress.Allowlist`; bytes and connections are
counted per execution and capped; every connection is logged (`take`). What the proxy holds is bounded
(`nbexec.egress.budget`): descriptors per sandbox and per process, refused at once (503) when spent, and a tunnel
that idles or trickles is closed at its deadline. An accept that fails (the process out of descriptors) is tried
again after a pause: the proxy serves until `close`. `change` swaps the rules of a running sandbox: it is logged
as a connection entry of method ``RULES`` (what changed, and when), and every connection the new rules no longer
allow is closed at once (a tunnel too: its bytes are never judged again, so it cannot outlive its rule).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from nbexec.config import IDLE_TIMEOUT, MAX_OPEN, MIN_RATE
from nbexec.result import Connection

from . import Allowlist
from .budget import HOST, PER_CONNECTION, Budget, Pace
from .request import Body, Request, parse
from .sockets import bind, hung_up, read_head, refuse, shut
from .sockets import close as close_all

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
MAX_NAME = 255  # characters of a requested host kept in the log (a valid name has at most 253)
HEAD_TIMEOUT = 10.0  # for the whole head, however slowly it drips in
CONNECT_TIMEOUT = 10.0
PAUSE_FIRST, PAUSE_MOST = 0.05, 1.0  # seconds between accepts that failed, doubling
MAX_CHANGES_LOGGED = 64  # allowlist changes logged one by one per execution; the rest only counted
MAX_CHANGE_TEXT = 2000  # characters of one change's log entry
LOG_EXTRA = 16  # refusals past the connection cap still logged, then only counted
QUIET = 0.05  # seconds without a byte after which `take` takes a connection's state as it is
SETTLE = 0.5  # seconds `take` waits at most for the connections that just moved bytes to finish
_CAP = "the execution's connection cap (max_connections) was reached"


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # up + down per execution (0: no cap)
    max_connections: int  # opened per execution, refused ones included
    max_open: int = MAX_OPEN  # held at once; each costs PER_CONNECTION host descriptors and a thread
    idle_timeout: float = IDLE_TIMEOUT  # nothing moved this long: closed; also the window of min_rate
    min_rate: int = MIN_RATE  # bytes per second (both ways) each idle_timeout window must average


@dataclass(eq=False)  # kept in a set by identity
class _Entry:
    method: str
    host: str
    port: int
    allowed: bool = False
    reason: str | None = None
    address: str | None = None
    up: int = 0
    down: int = 0
    open: bool = True
    revoked: bool = False  # the rules changed under it: never connected, or closed
    last: float = field(default_factory=time.monotonic)  # when it opened or last moved a byte
    sockets: list[socket.socket] = field(default_factory=list)

    def snapshot(self) -> Connection:
        return Connection(host=self.host, port=self.port, method=self.method, allowed=self.allowed,
                          reason=self.reason, address=self.address, bytes_up=self.up, bytes_down=self.down,
                          open=self.open)


class Proxy:
    """One sandbox's proxy. `start` binds and serves; `take` hands the log over; `close` ends everything."""

    def __init__(self, listener: socket.socket, allowlist: Allowlist, limits: Limits, host: Budget = HOST) -> None:
        self.listener = listener
        self.allowlist = allowlist
        self.limits = limits
        self._own = Budget(limits.max_open * PER_CONNECTION)
        self._host = host
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clients: set[socket.socket] = set()  # every connection being served, whatever its phase
        self._log: list[_Entry] = []
        self._live: set[_Entry] = set()
        self._opened = 0
        self._bytes = 0
        self._unlogged = 0
        self._changes = 0  # allowlist changes since the last take
        self._closed = False

    @classmethod
    def start(cls, path: Path, allowlist: Allowlist, limits: Limits, host: Budget = HOST) -> Proxy:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind(listener, path)
        os.chmod(path, 0o666)  # the sandbox's uid connects (its folder is read-only to it)
        listener.listen(64)
        proxy = cls(listener, allowlist, limits, host)
        threading.Thread(target=proxy._accept, name="nbexec-egress", daemon=True).start()
        return proxy

    def close(self) -> None:
        """Stop accepting and end every connection (their threads close the sockets and give the budget back)."""
        with self._lock:
            self._closed = True
            sockets = [*self._clients, *(sock for entry in self._live for sock in entry.sockets)]
        self._stop.set()
        shut(self.listener)
        self.listener.close()
        shut(*sockets)

    def take(self) -> tuple[tuple[Connection, ...], list[str]]:
        """The connections since the last take (open ones again next time) and notes; the caps start over."""
        self._settle()
        with self._lock:
            entries, unlogged, used, changes = self._log, self._unlogged, self._bytes, self._changes
            self._log = [entry for entry in entries if entry.open]
            self._opened, self._bytes, self._unlogged, self._changes = len(self._log), 0, 0, 0
            shown = tuple(entry.snapshot() for entry in entries)
        notes = []
        if changes > MAX_CHANGES_LOGGED:
            notes.append(f"the allowlist changed {changes} times; the first {MAX_CHANGES_LOGGED} are logged")
        if unlogged:
            notes.append(f"{unlogged} more connections past the cap of {self.limits.max_connections} were refused "
                         "and not logged one by one")
        if self.limits.max_bytes and used > self.limits.max_bytes:
            notes.append(f"network traffic reached the {self.limits.max_bytes:,}-byte cap (max_egress); the "
                         "connection that passed it was closed")
        return shown, notes

    def _settle(self) -> None:
        """The log says what the code did: connections that just moved bytes get until they are quiet (SETTLE at
        most) to finish, as a close made just before the cell ended still travels through the forwarder and the
        relay; one the sandbox hung up on is then logged closed, whatever the far end does (keep-alive)."""
        deadline = time.monotonic() + SETTLE
        while (now := time.monotonic()) < deadline:
            with self._lock:
                if not any(now - entry.last < QUIET for entry in self._live):
                    break
            time.sleep(0.01)
        with self._lock:
            for entry in [entry for entry in self._live if hung_up(entry.sockets[0])]:
                entry.open = False

    def change(self, allowlist: Allowlist, what: str) -> int:
        """Judge by ``allowlist`` from now on, log the change (``what``), and close the connections it no longer
        allows; how many were closed."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self._lock:
            self.allowlist = allowlist
            revoked = [entry for entry in self._live
                       if not entry.revoked and entry.host and not allowlist.allows(entry.host, entry.port)]
            for entry in revoked:
                entry.revoked = True
                entry.reason = f"closed: the allowlist changed at {stamp} and no longer allows {entry.host}"
            sockets = [sock for entry in revoked for sock in entry.sockets]
            self._changes += 1
            if self._changes <= MAX_CHANGES_LOGGED:
                self._log.append(_Entry("RULES", "", 0, allowed=True, open=False,
                                        reason=f"the allowlist changed at {stamp}: {what}"[:MAX_CHANGE_TEXT]))
        shut(*sockets)
        return len(revoked)

    # -- accepting: never ends before close, never blocks on a client ----------------------------------------

    def _accept(self) -> None:
        pause = PAUSE_FIRST
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS...: the connection waits in the listen queue
                if self._stop.is_set():
                    return
                if pause == PAUSE_FIRST:
                    log.warning("the egress proxy could not accept a connection (%s); it tries again",
                                exc.strerror or exc)
                self._stop.wait(pause)
                pause = min(pause * 2, PAUSE_MOST)
                continue
            pause = PAUSE_FIRST
            try:
                self._hand_over(client)
            except Exception:  # a bug, not the sandbox's doing: this connection ends, the proxy goes on
                log.exception("the egress proxy failed on a new connection")
                close_all(client)

    def _hand_over(self, client: socket.socket) -> None:
        """Serve ``client`` on a thread of its own if the budgets cover it, else refuse it at once."""
        reason = self._reserve()
        if reason is None:
            with self._lock:
                self._clients.add(client)
            try:
                threading.Thread(target=self._serve, args=(client,), name="nbexec-egress-conn", daemon=True).start()
                return
            except RuntimeError:  # the host has no thread to give
                with self._lock:
                    self._clients.discard(client)
                self._release()
                reason = "the host could not start a thread for the connection; try again shortly"
        self._turn_away(client, reason)

    def _reserve(self) -> str | None:
        if not self._own.take(PER_CONNECTION):
            return (f"the sandbox already holds {self.limits.max_open} connections through the proxy "
                    "(max_open_connections); close one first")
        if not self._host.take(PER_CONNECTION):
            self._own.give(PER_CONNECTION)
            return "the host's egress connections are all in use (its descriptor budget); try again shortly"
        return None

    def _release(self) -> None:
        self._host.give(PER_CONNECTION)
        self._own.give(PER_CONNECTION)

    def _turn_away(self, client: socket.socket, reason: str) -> None:
        """Refuse a connection without blocking the accept loop: log it, answer 503, close."""
        self._enter(_Entry("", "", 0, reason=reason, open=False))
        client.setblocking(False)
        with contextlib.suppress(OSError):
            client.recv(MAX_HEAD)  # what already came is read, so the close is an end rather than a reset
        refuse(client, reason, status=b"503 Service Unavailable")
        close_all(client)

    # -- serving one connection ------------------------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        entry: _Entry | None = None
        try:
            head, rest = read_head(client, MAX_HEAD, HEAD_TIMEOUT)
            request = parse(head)
            entry = self._admit(request, client)
            if entry is None or isinstance(request, str):
                return
            body = request.body()  # plain http: the head, then the declared body only; a tunnel: TLS only
            rest = (request.forward or b"") + body.feed(rest)
            if body.problem:  # found before anything was sent: refused, not cut
                self._refused(entry, client, body.problem)
                return
            upstream = self._open(entry, client)
            if upstream is None:
                return
            if request.forward is None:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if rest and not self._charge(entry, len(rest), up=True):
                return
            upstream.sendall(rest)
            _Relay(self, entry, client, upstream, body).run()
        except OSError:
            pass
        except Exception:  # a bug, not the sandbox's doing: the connection ends, the proxy goes on
            log.exception("the egress proxy failed on a connection")
        finally:
            if entry is not None:
                self._finish(entry)
            close_all(client, *([upstream] if upstream else []))
            with self._lock:
                self._clients.discard(client)
            self._release()

    def _enter(self, entry: _Entry) -> str:
        """Count and log a new connection: "logged", "over" (logged, past max_connections), "counted" (past the
        cap and its extra entries: only counted) or "closed"."""
        with self._lock:
            if self._closed:
                return "closed"
            self._opened += 1
            over = self._opened > self.limits.max_connections
            if over and len(self._log) >= self.limits.max_connections + LOG_EXTRA:
                self._unlogged += 1
                return "counted"
            self._log.append(entry)
            if entry.open:
                self._live.add(entry)
        return "over" if over else "logged"

    def _admit(self, request: Request | str, client: socket.socket) -> _Entry | None:
        """Log the attempt and judge it: the entry when it may go on, else None (the client was answered)."""
        method, host, port = ("", "", 0) if isinstance(request, str) else (request.method, request.host,
                                                                            request.port)
        entry = _Entry(method, host[:MAX_NAME], port, sockets=[client])  # cap before keep: it is logged
        state = self._enter(entry)
        if state in ("closed", "counted"):
            entry.open = False
            if state == "counted":
                refuse(client, _CAP)
            return None
        if state == "over":
            return self._refused(entry, client, _CAP)
        if isinstance(request, str):
            return self._refused(entry, client, request)  # the parse error
        addresses, reason = self.allowlist.judge(host, port)
        if reason is not None:
            return self._refused(entry, client, reason)
        entry.allowed, entry.address = True, addresses[0]
        return entry

    def _refused(self, entry: _Entry, client: socket.socket, reason: str) -> _Entry | None:
        entry.reason, entry.allowed = reason, False
        self._finish(entry)
        refuse(client, reason)
        return None

    def _open(self, entry: _Entry, client: socket.socket) -> socket.socket | None:
        assert entry.address is not None
        try:
            upstream = socket.create_connection((entry.address, entry.port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            entry.reason = f"could not connect to {entry.address}:{entry.port}: {exc.strerror or exc}"
            self._finish(entry)
            refuse(client, entry.reason, status=b"502 Bad Gateway")
            return None
        with self._lock:
            entry.sockets.append(upstream)
            closed = self._closed or entry.revoked  # the rules changed while it connected
        if closed:
            upstream.close()
            return None
        return upstream

    def _charge(self, entry: _Entry, count: int, *, up: bool) -> bool:
        with self._lock:
            self._bytes += count
            if up:
                entry.up += count
            else:
                entry.down += count
            entry.last = time.monotonic()
            within = not self.limits.max_bytes or self._bytes <= self.limits.max_bytes
        if not within:
            entry.reason = "closed: the execution's byte cap (max_egress) was reached"
        return within

    def _finish(self, entry: _Entry) -> None:
        with self._lock:
            entry.open = False
            self._live.discard(entry)


class _Relay:
    """One connection's copying both ways until both sides are done, a cap is reached or its pace is missed;
    from the client, only what ``body`` passes (a plain-http request's declared body, a tunnel's TLS)."""

    def __init__(self, proxy: Proxy, entry: _Entry, client: socket.socket, upstream: socket.socket,
                 body: Body | None) -> None:
        self.proxy, self.entry, self.client, self.body = proxy, entry, client, body
        self.peers = {client: upstream, upstream: client}
        limits = proxy.limits
        self.pace = Pace(limits.idle_timeout, int(limits.min_rate * limits.idle_timeout), time.monotonic())
        self.selector = selectors.PollSelector()  # poll: no descriptor of its own (epoll would cost one)
        for sock in self.peers:
            sock.settimeout(limits.idle_timeout)  # a peer that does not read stalls a send this long at most
        self.selector.register(upstream, selectors.EVENT_READ)
        if body is None or not body.done:
            self.selector.register(client, selectors.EVENT_READ)

    def run(self) -> None:
        with self.selector:
            while self.selector.get_map() and not self.pace.check(time.monotonic()):
                for key, _ in self.selector.select(self.pace.wait(time.monotonic())):
                    if not self._move(key.fileobj):  # type: ignore[arg-type]
                        return
        self.entry.reason = self.entry.reason or self.pace.reason

    def _move(self, source: socket.socket) -> bool:
        """Pass on what ``source`` has; False when the connection is to end."""
        data = source.recv(65536)
        if not data:
            self.selector.unregister(source)
            with contextlib.suppress(OSError):
                self.peers[source].shutdown(socket.SHUT_WR)
            return True
        up = source is self.client
        if up and self.body is not None:
            data = self.body.feed(data)
            if self.body.problem:
                self.entry.reason = f"closed: {self.body.problem}"
                return False
            if self.body.done:  # the declared body has passed: nothing after it is read, let alone sent
                self.selector.unregister(self.client)
        if not data:
            return True
        if not self.proxy._charge(self.entry, len(data), up=up):
            return False
        self.peers[source].sendall(data)
        self.pace.moved(len(data), time.monotonic())
        return True

