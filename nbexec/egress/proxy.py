"""The host side of ``network="allowlist"``: an HTTP proxy on a Unix socket that only a sandbox reaches.

It speaks the two forms clients use with HTTP_PROXY/HTTPS_PROXY: ``CONNECT host:port`` (a tunnel, for https)
and an absolute URI (``GET http://host/path``, for plain http, forwarded with the URI's own Host header and
``Connection: close``, so one connection carries one request to one judged host). The request head is capped
(16 KiB) before it is parsed; every destination is judged by `egress.Allowlist`; bytes and connections are
counted per execution and capped; every connection is logged (`take`). One thread per connection, at most
`MAX_OPEN` at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from nbexec.result import Connection

from . import Allowlist

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
MAX_OPEN = 32  # connections served at once; more wait in the listen queue
MAX_NAME = 255  # characters of a requested host kept in the log (a valid name has at most 253)
HEAD_TIMEOUT = 10.0  # for the whole head, however slowly it drips in
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0
LOG_EXTRA = 16  # refusals past the connection cap still logged, then only counted
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"host",
        b"te", b"trailer", b"upgrade"}
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # up + down per execution (0: no cap)
    max_connections: int


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
    sockets: list[socket.socket] = field(default_factory=list)

    def snapshot(self) -> Connection:
        return Connection(host=self.host, port=self.port, method=self.method, allowed=self.allowed,
                          reason=self.reason, address=self.address, bytes_up=self.up, bytes_down=self.down,
                          open=self.open)


class Proxy:
    """One sandbox's proxy. `start` binds and serves; `take` hands the log over; `close` ends everything."""

    def __init__(self, listener: socket.socket, allowlist: Allowlist, limits: Limits) -> None:
        self.listener = listener
        self.allowlist = allowlist
        self.limits = limits
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_OPEN)
        self._log: list[_Entry] = []
        self._live: set[_Entry] = set()
        self._opened = 0
        self._bytes = 0
        self._unlogged = 0
        self._closed = False

    @classmethod
    def start(cls, path: Path, allowlist: Allowlist, limits: Limits) -> Proxy:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o666)  # the sandbox's uid connects (its folder is read-only to it)
        listener.listen(64)
        proxy = cls(listener, allowlist, limits)
        threading.Thread(target=proxy._accept, name="nbexec-egress", daemon=True).start()
        return proxy

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for entry in live:
            _close(*entry.sockets)

    def take(self) -> tuple[tuple[Connection, ...], list[str]]:
        """The connections since the last take (open ones again next time) and notes; the caps start over."""
        with self._lock:
            entries, unlogged, used = self._log, self._unlogged, self._bytes
            self._log = [entry for entry in entries if entry.open]
            self._opened, self._bytes, self._unlogged = len(self._log), 0, 0
            shown = tuple(entry.snapshot() for entry in entries)
        notes = []
        if unlogged:
            notes.append(f"{unlogged} more connections past the cap of {self.limits.max_connections} were refused "
                         "and not logged one by one")
        if self.limits.max_bytes and used > self.limits.max_bytes:
            notes.append(f"network traffic reached the {self.limits.max_bytes:,}-byte cap (max_egress); the "
                         "connection that passed it was closed")
        return shown, notes

    def _accept(self) -> None:
        while True:
            self._slots.acquire()
            try:
                client, _ = self.listener.accept()
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._serve, args=(client,), name="nbexec-egress-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        entry: _Entry | None = None
        try:
            head, rest = _read_head(client)
            method, host, port, forward = _parse(head)
            entry = self._admit(method, host, port, client)
            if entry is None:
                return
            upstream = self._open(entry, client)
            if upstream is None:
                return
            if forward is None:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                rest = forward + rest
            if rest and not self._charge(entry, len(rest), up=True):
                return
            upstream.sendall(rest)
            self._relay(entry, client, upstream)
        except OSError:
            pass
        except Exception:  # a bug, not the sandbox's doing: the connection ends, the proxy goes on
            log.exception("the egress proxy failed on a connection")
        finally:
            if entry is not None:
                self._finish(entry)
            _close(client, *([upstream] if upstream else []))
            self._slots.release()

    def _admit(self, method: str, host: str, port: int, client: socket.socket) -> _Entry | None:
        """Log the attempt and judge it: the entry when it may go on, else None (the client was answered)."""
        entry = _Entry(method, host[:MAX_NAME], port, sockets=[client])  # cap before keep: it is logged
        with self._lock:
            if self._closed:
                return None
            self._opened += 1
            over = self._opened > self.limits.max_connections
            if over and len(self._log) >= self.limits.max_connections + LOG_EXTRA:
                self._unlogged += 1
                entry.open = False
                _refuse(client, "the execution's connection cap (max_connections) was reached")
                return None
            self._log.append(entry)
            self._live.add(entry)
        if over:
            return self._refused(entry, client, "the execution's connection cap (max_connections) was reached")
        if method == "":
            return self._refused(entry, client, host)  # the parse error, in the host field
        addresses, reason = self.allowlist.judge(host, port)
        if reason is not None:
            return self._refused(entry, client, reason)
        entry.allowed, entry.address = True, addresses[0]
        return entry

    def _refused(self, entry: _Entry, client: socket.socket, reason: str) -> _Entry | None:
        entry.reason = reason
        if not entry.method:
            entry.host = ""
        self._finish(entry)
        _refuse(client, reason)
        return None

    def _open(self, entry: _Entry, client: socket.socket) -> socket.socket | None:
        assert entry.address is not None
        try:
            upstream = socket.create_connection((entry.address, entry.port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            entry.reason = f"could not connect to {entry.address}:{entry.port}: {exc.strerror or exc}"
            self._finish(entry)
            _refuse(client, entry.reason, status=b"502 Bad Gateway")
            return None
        entry.sockets.append(upstream)
        with self._lock:
            closed = self._closed
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
            within = not self.limits.max_bytes or self._bytes <= self.limits.max_bytes
        if not within:
            entry.reason = "closed: the execution's byte cap (max_egress) was reached"
        return within

    def _relay(self, entry: _Entry, client: socket.socket, upstream: socket.socket) -> None:
        """Copy both ways until both sides are done, the caps are reached or nothing moves for IDLE_TIMEOUT."""
        peers = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            for sock in peers:
                sock.settimeout(IDLE_TIMEOUT)
                selector.register(sock, selectors.EVENT_READ)
            while selector.get_map():
                events = selector.select(IDLE_TIMEOUT)
                if not events:
                    entry.reason = entry.reason or f"closed after {IDLE_TIMEOUT:g} s without traffic"
                    break
                for key, _ in events:
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        selector.unregister(source)
                        with contextlib.suppress(OSError):
                            peers[source].shutdown(socket.SHUT_WR)
                        continue
                    if not self._charge(entry, len(data), up=source is client):
                        self._finish(entry)
                        return
                    peers[source].sendall(data)
        self._finish(entry)

    def _finish(self, entry: _Entry) -> None:
        with self._lock:
            entry.open = False
            self._live.discard(entry)


def _read_head(client: socket.socket) -> tuple[bytes, bytes]:
    """The request head (up to MAX_HEAD bytes) and whatever came after it."""
    data = b""
    deadline = time.monotonic() + HEAD_TIMEOUT
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            return b"", b""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request head did not arrive in time")
        client.settimeout(left)
        chunk = client.recv(4096)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _parse(head: bytes) -> tuple[str, str, int, bytes | None]:
    """(method, host, port, the head to send upstream or None for CONNECT); method "" and the problem as host
    when it is no proxy request nbexec serves."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if not head or len(parts) != 3 or not _TOKEN.match(parts[0]) or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        return "", "not an HTTP/1.x proxy request", 0, None
    if any(b"\r" in line or b"\n" in line for line in lines):  # a bare CR or LF would start a line upstream
        return "", "a bare CR or LF in the request head", 0, None
    method, target = parts[0].decode(), parts[1].decode("ascii", "replace")
    if method == "CONNECT":
        host, _, digits = target.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or not digits.isdigit() or not 0 < int(digits) < 65536:
            return "", "CONNECT needs host:port", 0, None
        return method, host, int(digits), None
    url = urlsplit(target)
    try:
        port = url.port or 80
    except ValueError:
        port = 0
    if url.scheme != "http" or not url.hostname or not 0 < port < 65536 or url.username or url.password:
        return "", "only CONNECT and http:// URLs without credentials go through this proxy", 0, None
    names = [line.split(b":", 1)[0] for line in lines[1:]]
    if not all(b":" in line and _TOKEN.match(name) for line, name in zip(lines[1:], names, strict=True)):
        return "", "a header line that is not name: value", 0, None
    headers = [line for line, name in zip(lines[1:], names, strict=True) if name.lower() not in _HOP]
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    authority = url.netloc.rsplit("@", 1)[-1].encode()
    forward = b"\r\n".join([f"{method} {path} {parts[2].decode()}".encode(), b"Host: " + authority, *headers,
                            b"Connection: close"]) + b"\r\n\r\n"
    return method, url.hostname, port, forward


def _refuse(client: socket.socket, reason: str, *, status: bytes = b"403 Forbidden") -> None:
    text = re.sub(r"[^\x20-\x7e]", "?", reason)[:300]
    body = f"nbexec egress: {text}\n".encode()
    with contextlib.suppress(OSError):
        client.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                       + b"X-Nbexec-Refused: " + text.encode() + b"\r\nContent-Length: "
                       + str(len(body)).encode() + b"\r\n\r\n" + body)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
