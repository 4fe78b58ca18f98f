"""The ZeroMQ wire protocol (ZMTP 3.0, NULL mechanism, RFC 23) on the host's end of a kernel connection: the
greeting, the READY handshake, the socket-type rules, and framing with a budget on every incoming message.

It replaces libzmq on the host, which could not bound a message: MAXMSGSIZE caps each *frame*, and libzmq hands
a multipart message to the reader only once its last frame is in, so one message of many large frames (sent
zero-copy, free for the sandbox) grew the host without limit. Here frames are read one at a time from a
non-blocking unix or TCP socket; past a message's byte limit their bytes are no longer kept, only counted, and past
its frame limit the message is malformed. Nothing is queued: the kernel's own socket buffers hold what the host
has not read yet.

The host always connects and the kernel binds (ipykernel: ROUTER for shell and control, XPUB for iopub). The
host announces ZMTP 3.0, so a libzmq peer speaks 3.0 to it: subscriptions are message frames, no heartbeats.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from nbexec.errors import ProtocolError, SandboxError
from nbexec.files.folders import socket_address

# signature (0xff, 8 bytes of padding, 0x7f), version 3.0, mechanism, as-server 0, 31 bytes of filler
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes((3, 0)) + b"NULL".ljust(20, b"\0") + bytes(32)
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_COMMAND = 64 * 1024  # READY and later commands (PING from 3.1 peers, ignored); libzmq's READY is < 100 bytes
PEERS = {"DEALER": ("ROUTER",), "SUB": ("PUB", "XPUB")}  # the peer socket types each of ours may talk to
_CHUNK = 256 * 1024  # bytes asked of the socket at a time (the socket buffer rarely holds more)
_POLL_SLICE = 0.5  # seconds a receive waits between checks that its connection is still open
_SUBSCRIBE_ALL = b"\x00\x01\x01"  # a one-byte message frame: \x01 (subscribe) + the empty topic


@dataclass(frozen=True)
class Incoming:
    """One multipart message: the frames kept (None where the byte limit was reached) and every frame's size."""

    frames: tuple[bytes | bytearray | None, ...]
    sizes: tuple[int, ...]


class Connection:
    """One ZMTP connection to a socket the kernel bound. Use from one thread.

    ``max_message`` bounds the bytes kept of each incoming message (later frames are read and dropped as they
    stream in); ``max_frames`` bounds its frames (more is a ProtocolError). After an error the connection stays
    broken; ``closed`` tells that the kernel ended it (EOF) rather than sent something malformed.
    """

    def __init__(self, sock: socket.socket, socket_type: str, *, max_message: int, max_frames: int) -> None:
        self.socket_type, self.max_message, self.max_frames = socket_type, max_message, max_frames
        self.closed = False
        self._sock = sock
        sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buffer, self._pos = b"", 0  # received bytes not consumed yet (at most one chunk)
        self._ready = False
        self._broken = ""
        self._shut = False  # closed by close(), maybe from another thread
        self._frames: list[bytes | bytearray | None] = []  # the message being read
        self._sizes: list[int] = []
        self._kept = 0
        self._dropping = False  # a frame of this message was past the limit: so are the rest
        self._left = -1  # bytes still to come of the current frame; -1 between frames
        self._frame: bytearray | None = None  # where they go (None: dropped)
        self._filled = 0
        self._flags = 0

    @classmethod
    def open(cls, address: Path | str, socket_type: str, *, max_message: int, max_frames: int,
             timeout: float) -> Connection:
        """Connect to the kernel's socket and complete the handshake within ``timeout`` seconds. ``address`` is a
        unix socket's path, or "tcp://host:port" for a kernel whose sockets are not on this host's filesystem
        (a pod, another machine): the same ZMTP either way."""
        deadline = time.monotonic() + timeout
        sock = _tcp(address, deadline) if isinstance(address, str) else _unix(address, deadline)
        try:
            connection = cls(sock, socket_type, max_message=max_message, max_frames=max_frames)
            connection._handshake(deadline)
        except BaseException:
            sock.close()
            raise
        return connection

    def close(self) -> None:
        """Close the connection, and end a receive waiting on it in another thread: the shutdown wakes its poll,
        and the flag stops one about to poll (its fd's number may by then be another socket's)."""
        self._shut = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    # -- handshake ----------------------------------------------------------------------------------

    def _handshake(self, deadline: float) -> None:
        self._send(GREETING, deadline)
        while len(self._buffer) - self._pos < len(GREETING):
            if not self._fill(deadline - time.monotonic()) and time.monotonic() >= deadline:
                raise self._fail("no ZMTP greeting from the kernel in time")
        greeting = self._buffer[self._pos:self._pos + len(GREETING)]
        self._pos += len(GREETING)
        if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
            raise self._fail("the kernel's socket does not speak ZMTP 3")
        if greeting[12:32] != GREETING[12:32]:
            raise self._fail("the kernel's socket asks for a security mechanism other than NULL")
        self._send(command(b"READY", {"Socket-Type": self.socket_type.encode()}), deadline)
        while True:
            self._advance()  # stops at READY (a message frame before it is refused), leaving what follows
            if self._ready:
                break
            if not self._fill(deadline - time.monotonic()) and time.monotonic() >= deadline:
                raise self._fail("no READY command from the kernel in time")
        if self.socket_type == "SUB":
            self._send(_SUBSCRIBE_ALL, deadline)

    def _command(self, body: bytearray) -> None:
        name = bytes(body[1:1 + body[0]]) if body else b""
        if self._ready:
            return  # PING, or anything a later ZMTP adds: nothing the host needs to answer
        if name == b"ERROR":
            raise self._fail(f"the kernel refused the handshake: {bytes(body[7:]).decode('ascii', 'replace')}")
        if name != b"READY":
            raise self._fail(f"the kernel sent a {name[:20]!r} command instead of READY")
        peer = properties(body, 1 + len(name)).get("socket-type", b"").decode("ascii", "replace")
        if peer not in PEERS[self.socket_type]:
            raise self._fail(f"the kernel's socket is a {peer[:20]!r}, which a {self.socket_type} cannot talk to")
        self._ready = True

    # -- sending ------------------------------------------------------------------------------------

    def send(self, frames: Sequence[bytes], timeout: float) -> None:
        """Send one multipart message; ProtocolError if the kernel does not take it within ``timeout``."""
        parts: list[bytes] = []
        for index, frame in enumerate(frames):
            more = MORE if index < len(frames) - 1 else 0
            size = len(frame)
            parts.append(bytes((more, size)) if size < 256 else bytes((more | LONG,)) + size.to_bytes(8, "big"))
            parts.append(frame)
        self._send(b"".join(parts), time.monotonic() + timeout)

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        writable: select.poll | None = None
        while view:
            try:
                view = view[self._sock.send(view):]
            except BlockingIOError:
                pass
            except OSError as exc:
                self.closed = True
                raise self._fail(f"the kernel closed its {self.socket_type} connection ({exc})") from exc
            if view:
                if writable is None:
                    writable = select.poll()
                    writable.register(self._sock, select.POLLOUT)
                left = deadline - time.monotonic()
                if left <= 0 or not writable.poll(math.ceil(left * 1000)):
                    raise self._fail("the kernel stopped reading its socket")

    # -- receiving ----------------------------------------------------------------------------------

    def receive(self, timeout: float) -> Incoming | None:
        """The next message, or None when none is complete after ``timeout`` seconds (a partly read message
        is kept for the next call)."""
        if self._broken:
            raise ProtocolError(self._broken)
        end = time.monotonic() + timeout
        read = False
        while True:
            message = self._advance()
            if message is not None:
                return message
            left = end - time.monotonic()
            if read and left <= 0:  # data may keep coming (a frame of 2**63 bytes): the caller's time counts
                return None
            if not self._fill(left):
                return None
            read = True

    def _fill(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for bytes, a slice at a time (a close from another thread ends the
        wait); False when none came."""
        end = time.monotonic() + timeout
        while True:
            if self._shut:
                self.closed = True
                raise self._fail(f"the {self.socket_type} connection was closed")
            left = end - time.monotonic()
            if self._poll.poll(max(0, math.ceil(min(left, _POLL_SLICE) * 1000))):
                break
            if left <= _POLL_SLICE:
                return False
        try:
            if self._frame is not None and self._pos == len(self._buffer) and self._left >= _CHUNK:
                # A large frame that is kept: straight into its buffer, one copy less.
                got = self._sock.recv_into(memoryview(self._frame)[self._filled:self._filled + self._left])
                self._filled, self._left = self._filled + got, self._left - got
            else:
                data = self._sock.recv(_CHUNK)
                got = len(data)
                self._buffer, self._pos = self._buffer[self._pos:] + data, 0
        except BlockingIOError:
            return True
        except OSError as exc:
            self.closed = True
            raise self._fail(f"the kernel closed its {self.socket_type} connection ({exc})") from exc
        if not got:
            self.closed = True
            raise self._fail(f"the kernel closed its {self.socket_type} connection")
        return True

    def _advance(self) -> Incoming | None:
        """Consume the buffered bytes; the message they complete, if any."""
        ready = self._ready
        while True:
            if self._left < 0:
                if ready and (message := self._whole_frames()) is not None:
                    return message
                if not self._start_frame():
                    return None
            if self._left > 0:
                take = min(len(self._buffer) - self._pos, self._left)
                if self._frame is not None and take:
                    self._frame[self._filled:self._filled + take] = memoryview(self._buffer)[self._pos:self._pos + take]
                self._pos, self._filled, self._left = self._pos + take, self._filled + take, self._left - take
                if self._pos == len(self._buffer):
                    self._buffer, self._pos = b"", 0
                if self._left:
                    return None
            message = self._end_frame()
            if message is not None or self._ready != ready:
                return message

    def _whole_frames(self) -> Incoming | None:
        """Read the message frames wholly in the buffer in one loop, each one slice: most frames are small, and
        a call per frame cost more than the rest of a message's handling. It stops at anything else (a command,
        reserved bits, a frame not all here, one past a limit), which `_start_frame` then takes or refuses."""
        buffer, pos, end = self._buffer, self._pos, len(self._buffer)
        frames, sizes, limit = self._frames, self._sizes, self.max_message
        while end - pos >= 2 and not self._dropping and len(sizes) < self.max_frames:
            flags = buffer[pos]
            if flags & LONG:
                if end - pos < 9:
                    break
                size, start = int.from_bytes(buffer[pos + 1:pos + 9], "big"), pos + 9
            else:
                size, start = buffer[pos + 1], pos + 2
            if flags & ~(MORE | LONG) or start + size > end or self._kept + size > limit:
                break
            pos = start + size
            sizes.append(size)
            frames.append(buffer[start:pos])
            self._kept += size
            if not flags & MORE:
                self._consumed(pos)
                message = Incoming(tuple(frames), tuple(sizes))
                self._frames, self._sizes, self._kept = [], [], 0
                return message
        self._consumed(pos)
        return None

    def _consumed(self, pos: int) -> None:
        self._buffer, self._pos = (b"", 0) if pos == len(self._buffer) else (self._buffer, pos)

    def _start_frame(self) -> bool:
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos < 2 or (buffer[pos] & LONG and len(buffer) - pos < 9):
            return False
        flags = buffer[pos]
        if flags & ~(MORE | LONG | COMMAND):
            raise self._fail(f"the kernel sent a frame with reserved flag bits ({flags:#x})")
        size = int.from_bytes(buffer[pos + 1:pos + 9], "big") if flags & LONG else buffer[pos + 1]
        self._pos, self._flags, self._left, self._filled = pos + (9 if flags & LONG else 2), flags, size, 0
        if flags & COMMAND:
            if flags & MORE or size > MAX_COMMAND:
                raise self._fail(f"the kernel sent a malformed command frame ({size:,} bytes)")
            self._frame = bytearray(size)
            return True
        if not self._ready:
            raise self._fail("the kernel sent a message before its READY command")
        if len(self._sizes) >= self.max_frames:
            raise self._fail(f"the kernel sent a message of more than {self.max_frames} frames")
        self._sizes.append(size)
        self._dropping = self._dropping or self._kept + size > self.max_message
        self._frame = None if self._dropping else bytearray(size)  # past the limit: read, counted, not kept
        self._kept += 0 if self._dropping else size
        return True

    def _end_frame(self) -> Incoming | None:
        frame, flags = self._frame, self._flags
        self._left, self._frame = -1, None
        if flags & COMMAND:
            self._command(frame or bytearray())
            return None
        self._frames.append(frame)
        if flags & MORE:
            return None
        message = Incoming(tuple(self._frames), tuple(self._sizes))
        self._frames, self._sizes, self._kept, self._dropping = [], [], 0, False
        return message

    def _fail(self, reason: str) -> ProtocolError:
        self._broken = self._broken or reason
        return ProtocolError(reason)


def command(name: bytes, props: dict[str, bytes]) -> bytes:
    """A command frame: name and properties (1-byte name length, name, 4-byte value length, value)."""
    body = bytes((len(name),)) + name + b"".join(bytes((len(key),)) + key.encode("ascii")
                                                 + len(value).to_bytes(4, "big") + value
                                                 for key, value in props.items())
    head = bytes((COMMAND, len(body))) if len(body) < 256 else bytes((COMMAND | LONG,)) + len(body).to_bytes(8, "big")
    return head + body


def properties(body: bytes | bytearray, start: int) -> dict[str, bytes]:
    """The properties of a command body from ``start``; names lower-cased (ZMTP names are case-insensitive)."""
    found: dict[str, bytes] = {}
    while start < len(body):
        end = start + 1 + body[start]
        name = bytes(body[start + 1:end]).decode("ascii", "replace").lower()
        if end + 4 > len(body):
            raise ProtocolError("a command property is cut short")
        size = int.from_bytes(body[end:end + 4], "big")
        start = end + 4 + size
        if start > len(body):
            raise ProtocolError("a command property is cut short")
        found[name] = bytes(body[end + 4:start])
    return found


def _unix(path: Path, deadline: float) -> socket.socket:
    """A connected unix socket; retried until ``deadline`` (the file appears at bind(), a moment before listen())."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with socket_address(path) as address:  # TMPDIR can be long; a socket address holds 107 bytes
            while True:
                try:
                    sock.connect(address)
                    return sock
                except (ConnectionRefusedError, FileNotFoundError) as exc:
                    if time.monotonic() > deadline:
                        raise SandboxError(f"the kernel does not accept connections on {path.name}") from exc
                    time.sleep(0.005)
    except BaseException:
        sock.close()
        raise


def _tcp(address: str, deadline: float) -> socket.socket:
    """A connected TCP socket to "tcp://host:port"; refusals retried until ``deadline`` (a kernel still
    starting has not bound yet). Small frames go out at once (no Nagle delay on a request)."""
    parts = urlsplit(address)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if parts.scheme != "tcp" or not host or not port or parts.path not in ("", "/"):
        raise SandboxError(f"a kernel address must be tcp://host:port or a unix socket's path, not {address[:100]!r}")
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
            break
        except (TimeoutError, ConnectionRefusedError) as exc:
            if time.monotonic() > deadline:
                raise SandboxError(f"the kernel does not accept connections on {host}:{port}") from exc
            time.sleep(0.005)
        except OSError as exc:  # no route, unknown name: retrying will not help
            raise SandboxError(f"the kernel at {host}:{port} cannot be reached: {exc.strerror or exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
