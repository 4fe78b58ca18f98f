"""The host's one kernel client: ZMQ sockets of its own, and one receive path on which every message from the
sandbox is sized, signature-checked and filtered before anything in it is parsed.

It replaces jupyter_client's BlockingKernelClient on the execution path: those channels share the process-wide
zmq.Context, set no MAXMSGSIZE or receive high-water mark (so libzmq queues whatever the kernel sends, in host
memory), and parse every message in full. jupyter_client's Session is kept only to build and sign requests.

The kernel holds the connection key, so a signature proves nothing about the code's good will: it only rules out
frames that did not go through the key holder. Everything a message says is checked like any other hostile input.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import re
import socket as socket_module
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.session import Session

from .errors import ProtocolError

MAX_HEADER = 64 * 1024  # a header or parent_header frame; kernels send a few hundred bytes
MAX_CONTROL = 1024 * 1024  # content of the messages nbexec reads whatever the budget (status, replies)
MAX_DEPTH = 64  # nesting of parsed content: deeper is refused (later encoders would recurse past the stack)
RECEIVE_HWM = 2  # messages libzmq may queue per socket before it stops reading (host memory: about that many
# times MAXMSGSIZE, plus the one message being decoded)
_REPLAY_WINDOW = 65536  # signatures remembered to reject a message sent twice
_DELIMITER = b"<IDS|MSG>"
_SURROGATE = re.compile("[\ud800-\udfff]")
_LOST = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


@dataclass(frozen=True)
class Message:
    """A verified message whose content is still raw bytes: ``size`` is what keeping it costs."""

    channel: str
    msg_type: str
    msg_id: str
    parent_id: str
    size: int  # bytes of the metadata, content and buffer frames
    raw_content: bytes | memoryview = field(repr=False)  # a view of the received frame: not copied

    def content(self, limit: int | None = None) -> dict[str, Any]:
        """The parsed content; ProtocolError when it is larger than ``limit`` or not a JSON object."""
        if limit is not None and len(self.raw_content) > limit:
            raise ProtocolError(f"a {self.msg_type} message of {len(self.raw_content):,} bytes is over its "
                                f"{limit:,}-byte limit")
        content = parse(self.raw_content, self.msg_type)
        if not isinstance(content, dict):
            raise ProtocolError(f"the content of a {self.msg_type} message is not a JSON object")
        return content


def parse(raw: bytes | memoryview, what: str) -> Any:
    """Strict UTF-8 JSON, nesting capped; lone surrogates (from \\ud800-style escapes) become U+FFFD."""
    try:
        text = str(raw, "utf-8")
        value = json.loads(text)
    except RecursionError as exc:
        raise ProtocolError(f"a {what} message is nested too deeply") from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"a {what} message is not valid UTF-8 JSON: {str(exc)[:200]}") from exc
    surrogates = "\\ud" in text or "\\uD" in text
    if not surrogates and text.count("{") + text.count("[") <= MAX_DEPTH:  # cannot be too deep: skip the walk
        return value
    return _clean(value, surrogates, what)


def _clean(value: Any, surrogates: bool, what: str) -> Any:
    """Walk the parsed value without recursion: refuse deep nesting, replace lone surrogates."""
    fix = _fix_text if surrogates else (lambda s: s)
    root: list[Any] = [value]
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"a {what} message is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            if surrogates:
                items = [(fix(k), v) for k, v in node.items()]
                node.clear()
                node.update(items)
            pairs: Any = node.items()
        else:
            pairs = enumerate(node)
        for key, child in list(pairs):
            if isinstance(child, str):
                node[key] = fix(child)
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return root[0]


def _fix_text(text: str) -> str:
    # In a Python str every surrogate is a lone one (escaped pairs were joined by the decoder).
    return _SURROGATE.sub("\ufffd", text)


class KernelClient:
    """Shell, iopub and control sockets to one kernel, on a ZMQ context nbexec owns. Use from one thread."""

    def __init__(self, session: Session, max_message: int) -> None:
        self.session = session
        self.max_message = max_message
        self._key = session.key or b""
        self._context: zmq.Context[Any] | None = None
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[str, zmq.Socket[Any]] = {}
        self._pollers: dict[str, zmq.Poller] = {}
        self._addresses: dict[str, tuple[int, str]] = {}
        self._seen: set[bytes] = set()
        self.lost = ""  # the channel libzmq dropped: a frame over MAXMSGSIZE was refused, or the kernel went away
        self._order: collections.deque[bytes] = collections.deque()

    @classmethod
    def connect(cls, base: Path, connection: dict[str, Any], *, max_message: int) -> KernelClient:
        """Connect to the kernel whose ipc sockets are ``<base>-<port>`` (the connection file's numbering)."""
        session = Session(key=str(connection["key"]).encode("ascii"), signature_scheme="hmac-sha256",
                          username="nbexec")
        client = cls(session, max_message)
        client._context = zmq.Context()
        try:
            for channel, kind in (("shell", zmq.DEALER), ("iopub", zmq.SUB), ("control", zmq.DEALER)):
                client._open(channel, kind, f"ipc://{base}-{connection[channel + '_port']}")
        except BaseException:
            client.close()
            raise
        return client

    def _open(self, channel: str, kind: int, address: str) -> None:
        assert self._context is not None
        self._addresses[channel] = (kind, address)
        socket = self._context.socket(kind)
        self._sockets[channel] = socket
        # Before connect: libzmq copies these into each connection it makes.
        socket.setsockopt(zmq.LINGER, 0)
        # Control replies are never read: a small frame limit keeps what libzmq may queue there small too.
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL if channel == "control" else self.max_message)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        if kind == zmq.SUB:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        if channel != "control":
            monitor = socket.get_monitor_socket(_LOST)
            self._monitors[channel] = monitor
            poller.register(monitor, zmq.POLLIN)
        self._pollers[channel] = poller
        socket.connect(address)

    def listening(self, channel: str) -> bool:
        """Whether the kernel still accepts connections on ``channel``'s socket: after a dropped connection,
        True means libzmq refused a frame, False that the kernel went away."""
        path = self._addresses[channel][1].removeprefix("ipc://")
        with socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                return False
        return True

    def reopen(self, channel: str) -> None:
        """Replace a connection libzmq gave up on (it does not reconnect after a refused frame)."""
        for socket in (self._monitors.pop(channel, None), self._sockets.pop(channel, None)):
            if socket is not None:
                socket.close(linger=0)
        self._open(channel, *self._addresses[channel])

    def close(self) -> None:
        for socket in [*self._monitors.values(), *self._sockets.values()]:
            socket.close(linger=0)
        self._monitors, self._sockets, self._pollers = {}, {}, {}
        if self._context is not None:
            self._context.term()
            self._context = None

    stop_channels = close  # the name Sandbox.destroy calls (it was a BlockingKernelClient)

    # -- requests ---------------------------------------------------------------------------------

    def request(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        """Send a signed request; return its msg_id."""
        msg = self.session.msg(msg_type, content)
        self.session.send(self._sockets[channel], msg)
        return str(msg["header"]["msg_id"])

    def execute(self, code: str, *, silent: bool = False, store_history: bool = True,
                stop_on_error: bool = True) -> str:
        return self.request("shell", "execute_request", {
            "code": code, "silent": silent, "store_history": store_history, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": stop_on_error})

    def kernel_info(self) -> str:
        return self.request("shell", "kernel_info_request", {})

    def interrupt(self) -> None:
        self.request("control", "interrupt_request", {})

    # -- the one receive path ---------------------------------------------------------------------

    def recv(self, channel: str, timeout: float, *, parent: str | None = None) -> Message | None:
        """The next verified message on ``channel`` ("iopub" or "shell"), or None after ``timeout`` seconds.

        With ``parent``, messages answering other requests are dropped unparsed. Raises ProtocolError when the
        kernel breaks the protocol, or when libzmq dropped the connection (then ``lost`` is set: a frame over
        MAXMSGSIZE, or the kernel went away; the caller tells which by asking whether the sandbox still runs).
        """
        socket = self._sockets[channel]
        end = time.monotonic() + timeout
        while True:
            left = max(0.0, end - time.monotonic())
            events = dict(self._pollers[channel].poll(int(left * 1000)))
            if len(events) > 1 or (events and socket not in events):
                self._check_monitor(channel)
            if socket in events:
                message = self._verify(channel, socket.recv_multipart(copy=False))
                if message is not None and (parent is None or message.parent_id == parent):
                    return message
            if time.monotonic() >= end:
                return None

    def _check_monitor(self, channel: str) -> None:
        monitor = self._monitors[channel]
        if monitor.poll(0):
            monitor.recv_multipart()
            self.lost = channel  # see reopen
            raise ProtocolError(f"the {channel} connection to the kernel was dropped (a message over the "
                                f"{self.max_message:,}-byte frame limit, or the kernel went away)")

    def _verify(self, channel: str, frames: list[Any]) -> Message | None:
        """Check sizes and the signature, then parse the headers only; None for a message to ignore."""
        buffers = [frame.buffer for frame in frames]
        try:
            start = next(i for i, b in enumerate(buffers) if len(b) == len(_DELIMITER) and b == _DELIMITER) + 1
        except StopIteration:
            raise ProtocolError(f"a message on {channel} has no <IDS|MSG> delimiter") from None
        parts = buffers[start:]
        if len(parts) < 5:
            raise ProtocolError(f"a message on {channel} has {len(parts)} frames after its delimiter (need 5)")
        signature, header, parent_header, metadata, content = parts[:5]
        if len(header) > MAX_HEADER or len(parent_header) > MAX_HEADER or len(signature) > 128:
            raise ProtocolError(f"a message on {channel} has a header over {MAX_HEADER:,} bytes")
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts[1:5]:
            digest.update(part)
        given = bytes(signature)
        if not hmac.compare_digest(given, digest.hexdigest().encode("ascii")):
            raise ProtocolError(f"a message on {channel} is unsigned or its signature is wrong")
        self._remember(given)
        parent = _object(parse(bytes(parent_header), "parent header"), "parent header")
        head = _object(parse(bytes(header), "header"), "header")
        msg_type, msg_id, parent_id = head.get("msg_type"), head.get("msg_id"), parent.get("msg_id", "")
        if not isinstance(msg_type, str) or not isinstance(msg_id, str) or not isinstance(parent_id, str):
            raise ProtocolError(f"a message on {channel} has a header without string msg_type and msg_id")
        size = len(metadata) + len(content) + sum(len(extra) for extra in parts[5:])
        return Message(channel, msg_type, msg_id, parent_id, size, content)

    def _remember(self, signature: bytes) -> None:
        if signature in self._seen:
            raise ProtocolError("the kernel sent the same signed message twice (a replay)")
        self._seen.add(signature)
        self._order.append(signature)
        if len(self._order) > _REPLAY_WINDOW:
            self._seen.discard(self._order.popleft())


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"a message's {what} is not a JSON object")
    return value
