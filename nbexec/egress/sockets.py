"""What the egress proxy does to a client's socket whatever the request: refuse it with a reason, end it."""

from __future__ import annotations

import contextlib
import re
import socket


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
