"""What the egress proxy does to sockets, whatever the request.

It binds its listener, reads a request's head, refuses a client with a reason, tells a client that hung up, and
ends a connection."""

from __future__ import annotations

import contextlib
import re
import select
import socket
import time
from pathlib import Path

from nbexec.files.folders import socket_address


def bind(listener: socket.socket, path: Path) -> None:
    """Bind ``listener`` at ``path``, however long its folder's name (a long TMPDIR stays usable)."""
    with socket_address(path) as address:
        listener.bind(address)


def read_head(client: socket.socket, limit: int, timeout: float) -> tuple[bytes, bytes]:
    """The request head (up to ``limit`` bytes, within ``timeout`` seconds in all) and whatever came after it.

    Two empty strings when the client ends or oversteps first."""
    data = b""
    deadline = time.monotonic() + timeout
    while b"\r\n\r\n" not in data:
        if len(data) > limit:
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


def hung_up(sock: socket.socket) -> bool:
    """The other end has closed the connection, both ways (POLLHUP; a half-close is not one)."""
    poller = select.poll()
    poller.register(sock, 0)  # no event asked for: a hang-up is reported whatever is asked
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def refuse(client: socket.socket, reason: str, *, status: bytes = b"403 Forbidden") -> None:
    text = re.sub(r"[^\x20-\x7e]", "?", reason)[:300]
    body = f"nbexec egress: {text}\n".encode()
    with contextlib.suppress(OSError):
        client.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                       + b"X-Nbexec-Refused: " + text.encode() + b"\r\nContent-Length: "
                       + str(len(body)).encode() + b"\r\n\r\n" + body)


def shut(*sockets: socket.socket) -> None:
    """End both directions (a thread blocked on the socket wakes up; the descriptor stays until closed)."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def close(*sockets: socket.socket) -> None:
    shut(*sockets)
    for sock in sockets:
        sock.close()
