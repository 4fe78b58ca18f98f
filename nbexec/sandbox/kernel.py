"""The host's one kernel client: a ZMTP connection per channel (see `zmtp`), and one receive path on which every
message from the sandbox is sized, signature-checked and filtered before anything in it is parsed.

It replaces jupyter_client's BlockingKernelClient and libzmq on the execution path: those share the process-wide
zmq.Context, queue whatever the kernel sends in host memory (a message of many frames has no size limit in
libzmq), and parse every message in full. Requests are built and signed here as jupyter_client's Session does.

The kernel holds the connection key, so a signature proves nothing about the code's good will: it only rules out
frames that did not go through the key holder. Everything a message says is checked like any other hostile input.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ProtocolError
from . import zmtp

MAX_HEADER = 64 * 1024  # a header or parent_header frame; kernels send a few hundred bytes
MAX_CONTROL = 1024 * 1024  # content of the messages nbexec reads whatever the budget (status, replies)
MAX_DEPTH = 64  # nesting of parsed content: deeper is refused (later encoders would recurse past the stack)
MAX_FRAMES = 64  # frames of one message: topic, delimiter, 5 parts, and buffers (comm messages carry a few)
MAX_REPLY = MAX_CONTROL + 3 * MAX_HEADER  # bytes kept of a shell or control message (replies are read capped)
SEND_TIMEOUT = 30.0  # seconds a request may wait for the kernel to read it (it reads on its own I/O thread)
_REPLAY_WINDOW = 65536  # signatures remembered to reject a message sent twice
_DELIMITER = b"<IDS|MSG>"
_SURROGATE = re.compile("[\ud800-\udfff]")
_CHANNELS = (("shell", "DEALER"), ("iopub", "SUB"), ("control", "DEALER"))


@dataclass(frozen=True)
class Message:
    """A verified message whose content is still raw bytes: ``size`` is what keeping it costs."""

    channel: str
    msg_type: str
    msg_id: str
    parent_id: str
    size: int  # bytes of the metadata, content and buffer frames
    raw_content: bytes | bytearray = field(repr=False)  # the received frame: not copied
    complete: bool = True  # False: past the frame limit, its content was read and dropped, never kept or checked

    def content(self, limit: int | None = None) -> dict[str, Any]:
        """The parsed content; ProtocolError when it is larger than ``limit`` or not a JSON object."""
        if not self.complete or (limit is not None and len(self.raw_content) > limit):
            raise ProtocolError(f"a {self.msg_type} message of {self.size:,} bytes is over its "
                                f"{limit or 0:,}-byte limit")
        content = parse(self.raw_content, self.msg_type)
        if not isinstance(content, dict):
            raise ProtocolError(f"the content of a {self.msg_type} message is not a JSON object")
        return content


def parse(raw: bytes | bytearray | memoryview, what: str) -> Any:
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
    """Shell, iopub and control connections to one kernel. Use from one thread."""

    def __init__(self, key: bytes, max_message: int) -> None:
        self.max_message = max_message
        self._key = key
        self._session = uuid.uuid4().hex
        self._connections: dict[str, zmtp.Connection] = {}
        self._seen: set[bytes] = set()
        self._order: collections.deque[bytes] = collections.deque()
        self.lost = ""  # the channel whose connection the kernel closed (it went away, or crashed its messaging)

    @classmethod
    def connect(cls, base: Path, connection: dict[str, Any], *, max_message: int,
                timeout: float = 10.0) -> KernelClient:
        """Connect to the kernel whose ipc sockets are ``<base>-<port>`` (the connection file's numbering).

        ``max_message`` bounds what is kept of one iopub message; shell and control keep ``MAX_REPLY``."""
        client = cls(str(connection["key"]).encode("ascii"), max_message)
        try:
            for channel, kind in _CHANNELS:
                path = Path(f"{base}-{connection[channel + '_port']}")
                limit = max_message if channel == "iopub" else MAX_REPLY
                client._connections[channel] = zmtp.Connection.open(path, kind, max_message=limit,
                                                                    max_frames=MAX_FRAMES, timeout=timeout)
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections = {}

    stop_channels = close  # the name Sandbox.destroy calls (it was a BlockingKernelClient)

    # -- requests ---------------------------------------------------------------------------------

    def request(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        """Send a signed request; return its msg_id."""
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "nbexec", "session": self._session,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "5.4"}
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            digest.update(part)
        connection = self._channel(channel)
        try:
            connection.send([_DELIMITER, digest.hexdigest().encode("ascii"), *parts], SEND_TIMEOUT)
        except ProtocolError:
            # As with libzmq, a request the kernel cannot take is no error here: the receive path, which the
            # caller polls against its deadline and Docker's view of the sandbox, reports what became of it.
            self.lost = channel if connection.closed else self.lost
        return msg_id

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

        With ``parent``, messages answering other requests are dropped unparsed. A message past the channel's
        byte limit comes back incomplete (its size counted, its content dropped unread). Raises ProtocolError
        when the kernel breaks the protocol or closes the connection (then ``lost`` names the channel).
        """
        connection = self._channel(channel)
        end = time.monotonic() + timeout
        while True:
            try:
                incoming = connection.receive(max(0.0, end - time.monotonic()))
            except ProtocolError:
                if connection.closed:
                    self.lost = channel
                raise
            if incoming is None:
                return None
            message = self._verify(channel, incoming)
            if message is not None and (parent is None or message.parent_id == parent):
                return message
            if time.monotonic() >= end:
                return None

    def _channel(self, channel: str) -> zmtp.Connection:
        connection = self._connections.get(channel)
        if connection is None:
            raise ProtocolError(f"the {channel} connection to the kernel is closed")
        return connection

    def _verify(self, channel: str, incoming: zmtp.Incoming) -> Message | None:
        """Check sizes and the signature, then parse the headers only; None for a message to ignore."""
        frames, sizes = incoming.frames, incoming.sizes
        start = next((i + 1 for i, f in enumerate(frames) if sizes[i] == len(_DELIMITER) and f == _DELIMITER), 0)
        if not start:
            raise ProtocolError(f"a message on {channel} has no <IDS|MSG> delimiter")
        if len(frames) - start < 5:
            raise ProtocolError(f"a message on {channel} has {len(frames) - start} frames after its delimiter "
                                "(need 5)")
        signature, header, parent_header, metadata, content = frames[start:start + 5]
        if signature is None or header is None or parent_header is None or len(header) > MAX_HEADER \
                or len(parent_header) > MAX_HEADER or len(signature) > 128:
            raise ProtocolError(f"a message on {channel} has a header over {MAX_HEADER:,} bytes")
        size = sum(sizes[start + 3:])
        complete = metadata is not None and content is not None  # buffers are not signed: need not be kept
        if metadata is not None and content is not None:
            digest = hmac.new(self._key, digestmod=hashlib.sha256)
            for part in (header, parent_header, metadata, content):
                digest.update(part)
            given = bytes(signature)
            if not hmac.compare_digest(given, digest.hexdigest().encode("ascii")):
                raise ProtocolError(f"a message on {channel} is unsigned or its signature is wrong")
            self._remember(given)
        parent = _object(parse(parent_header, "parent header"), "parent header")
        head = _object(parse(header, "header"), "header")
        msg_type, msg_id, parent_id = head.get("msg_type"), head.get("msg_id"), parent.get("msg_id", "")
        if not isinstance(msg_type, str) or not isinstance(msg_id, str) or not isinstance(parent_id, str):
            raise ProtocolError(f"a message on {channel} has a header without string msg_type and msg_id")
        return Message(channel, msg_type, msg_id, parent_id, size, content or b"", complete)

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
