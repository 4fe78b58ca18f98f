"""Connections to ports inside the sandbox (stdlib only, Python 3.9+): part of the agent, for the host's port
relay (`ports`). The sandbox still has no network: the agent connects to 127.0.0.1 only, from inside, and the
bytes cross to the host in frames over the agent's own stdin and stdout.

Each direction is windowed: the agent reads from a connection only as many bytes as the host granted
(``port_more``), and the host sends at most PORT_WINDOW bytes the agent has not yet written to the socket (``took``
events say how many it wrote). A server that answers without end, or a host that stops reading, holds at most a
window per direction. Events: ``{"ev": "port", "conn": n}`` with ``up`` (connected), ``took`` (bytes written),
``end`` (a reason: the connection is gone) or raw data.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
from collections.abc import Callable
from typing import Any

from .agentfiles import Answer, Failure
from .wire import MAX_PORT_CONNS, OUTPUT_CHUNK, PORT_WINDOW

Send = Callable[..., None]


class Conn:
    """One connection: its socket, the bytes the host may still receive, the bytes waiting for the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.up = sock, False
        self.credit = PORT_WINDOW  # the host's first grant is implied
        self.pending = bytearray()


class Ports:
    """The port requests and the connections open (at most MAX_PORT_CONNS), their sockets in the agent's loop."""

    def __init__(self, selector: selectors.BaseSelector, send: Send) -> None:
        self.selector, self.send = selector, send
        self.conns: dict[int, Conn] = {}
        self.by_fd: dict[int, int] = {}
        self.next_id = 1

    def op_port_open(self, head: dict[str, Any], _: bytes) -> Answer:
        port = head["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise Failure("invalid_argument", "port must be a number from 1 to 65535")
        if len(self.conns) >= MAX_PORT_CONNS:
            raise Failure("resource_exhausted", f"{MAX_PORT_CONNS} port connections are open already")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        found = sock.connect_ex(("127.0.0.1", port))  # loopback only: no name is ever resolved
        if found not in (0, errno.EINPROGRESS):
            sock.close()
            raise Failure("not_found", f"nothing listens on port {port} ({errno.errorcode.get(found, found)})")
        number, self.next_id = self.next_id, self.next_id + 1
        self.conns[number] = Conn(sock)
        self.by_fd[sock.fileno()] = number
        self.selector.register(sock, selectors.EVENT_WRITE)  # writable: the connect has finished
        return {"conn": number}, b""

    def op_port_send(self, head: dict[str, Any], data: bytes) -> Answer:
        conn = self.conns.get(head["conn"])
        if conn is None:
            return {}, b""  # closed meanwhile: the host hears of it by the end event
        if len(conn.pending) + len(data) > PORT_WINDOW:
            self.end(head["conn"], "the host sent past its window")
            return {}, b""
        conn.pending += data
        self.interest(conn)
        return {}, b""

    def op_port_more(self, head: dict[str, Any], _: bytes) -> Answer:
        conn = self.conns.get(head["conn"])
        if conn is not None:
            conn.credit = min(PORT_WINDOW, conn.credit + max(0, int(head["bytes"])))
            self.interest(conn)
        return {}, b""

    def op_port_close(self, head: dict[str, Any], _: bytes) -> Answer:
        self.end(head["conn"], None)
        return {}, b""

    def interest(self, conn: Conn) -> None:
        events = 0 if conn.up else selectors.EVENT_WRITE
        if conn.up:
            events |= (selectors.EVENT_READ if conn.credit > 0 else 0) | (
                selectors.EVENT_WRITE if conn.pending else 0)
        with contextlib.suppress(KeyError):
            self.selector.unregister(conn.sock)
        if events:
            self.selector.register(conn.sock, events)

    def end(self, number: int, reason: str | None) -> None:
        """Close a connection; tell the host why unless it asked for the close (``reason`` None)."""
        conn = self.conns.pop(number, None)
        if conn is None:
            return
        self.by_fd.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError):
            self.selector.unregister(conn.sock)
        conn.sock.close()
        if reason is not None:
            self.send({"ev": "port", "conn": number, "end": reason})

    def ready(self, fd: int, events: int) -> None:
        number = self.by_fd[fd]
        conn = self.conns[number]
        try:
            if not conn.up:
                self.connected(number, conn)
                return
            if events & selectors.EVENT_WRITE and conn.pending:
                taken = conn.sock.send(conn.pending)
                del conn.pending[:taken]
                self.send({"ev": "port", "conn": number, "took": taken})
            if events & selectors.EVENT_READ and conn.credit > 0:
                chunk = conn.sock.recv(min(OUTPUT_CHUNK, conn.credit))
                if not chunk:
                    self.end(number, "eof")
                    return
                conn.credit -= len(chunk)
                self.send({"ev": "port", "conn": number}, chunk)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self.end(number, f"the connection failed: {exc.strerror or exc}")
            return
        self.interest(conn)

    def connected(self, number: int, conn: Conn) -> None:
        failed = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if failed:
            self.end(number, f"nothing listens on that port ({errno.errorcode.get(failed, failed)})")
            return
        try:
            conn.sock.getpeername()  # still connecting (writable for an earlier socket of the same fd): wait
        except OSError:
            return
        conn.up = True
        self.send({"ev": "port", "conn": number, "up": True})
        self.interest(conn)
