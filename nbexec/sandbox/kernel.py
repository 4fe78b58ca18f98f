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
import contextlib
import datetime
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbexec.errors import ProtocolError

from . import lasterror, zmtp
from .execution import COMM_KINDS, OUTPUT_KINDS, Execution, dispatch
from .lasterror import LastError
from .messages import MAX_CONTROL, Message, exit_asked, parse_header, signature

log = logging.getLogger(__name__)
MAX_HEADER = 64 * 1024  # a header or parent_header frame; kernels send a few hundred bytes
# Header bytes a message carries free: both headers of an honest kernel's message take a few hundred. Past it
# they count in the message's size, so a message of huge headers and a byte of content pays for its headers.
HEADER_ALLOWANCE = 1024
MAX_FRAMES = 64  # frames of one message: topic, delimiter, 5 parts, and buffers (comm messages carry a few)
MAX_REPLY = MAX_CONTROL + 3 * MAX_HEADER  # bytes kept of a shell or control message (replies are read capped)
SEND_TIMEOUT = 30.0  # seconds a request may wait for the kernel to read it (it reads on its own I/O thread)
_REPLAY_WINDOW = 65536  # signatures remembered to reject a message sent twice
_DELIMITER = b"<IDS|MSG>"
_MAX_IDENTITIES = 4  # routing frames before the delimiter: a DEALER is sent none, a kernel may echo a few
_CHANNELS = (("shell", "DEALER"), ("iopub", "SUB"), ("control", "DEALER"))
_POLL = 0.25  # seconds between checks of the deadline while a cell is silent
_LIVENESS_EVERY = 1.0  # seconds between asking whether the sandbox still runs
_IDLE_AFTER_REPLY = 1.0  # seconds to wait for iopub's idle once the shell reply is in (a full PUB queue drops it)
_REPLY_AFTER_IDLE = 5.0  # seconds to wait for the shell reply once iopub is idle (the reply says how the cell ended)
MAX_SETTLE = 1.0  # seconds an idle cell's late outputs are read at most (kernels with a ``settle``)...
_WINDOW, _BACKLOG = 0.25, 25  # ...then only while a window brings this many: a queue draining, not a timer
_DRAIN_QUIET = 1.0  # seconds of silence that end a queue's drain (the kernel may be off the CPU for a while)
_ASK_WAIT = 10.0  # seconds the kernel has to say how its last cell ended, when its messages could not
TAIL = 1.0  # seconds read past a silent request's reply for its idle, at most (within the caller's own time)
TAIL_MESSAGES = 20_000  # messages read past a reply at most; others' are counted and dropped unparsed


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
        self.read = 0  # messages received, dropped ones too: what a loop's message budget counts
        self.asks_last_error = True  # lasterror's code is Python: only an IPython kernel is asked it
        self.settle = 0.0  # seconds of iopub silence read past idle (Deno publishes some outputs after it)

    @classmethod
    def connect(cls, base: Path | None, connection: dict[str, Any], *, max_message: int,
                timeout: float = 10.0) -> KernelClient:
        """Connect to the kernel whose ipc sockets are ``<base>-<port>`` (the connection file's numbering), or,
        when the connection says ``"transport": "tcp"``, whose ports listen at its ``ip`` (``base`` unused).

        ``max_message`` bounds what is kept of one iopub message; shell and control keep ``MAX_REPLY``."""
        client = cls(str(connection["key"]).encode("ascii"), max_message)
        try:
            for channel, kind in _CHANNELS:
                port = connection[channel + "_port"]
                address = f"tcp://{connection['ip']}:{port}" if connection.get("transport") == "tcp" else \
                    Path(f"{base}-{port}")
                limit = max_message if channel == "iopub" else MAX_REPLY
                client._connections[channel] = zmtp.Connection.open(address, kind, max_message=limit,
                                                                    max_frames=MAX_FRAMES, timeout=timeout)
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections = {}

    # -- requests ---------------------------------------------------------------------------------

    def request(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        """Send a signed request; return its msg_id."""
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "nbexec", "session": self._session,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "5.4"}
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        connection = self._channel(channel)
        try:
            connection.send([_DELIMITER, signature(self._key, parts), *parts], SEND_TIMEOUT)
        except ProtocolError:
            # As with libzmq, a request the kernel cannot take is no error here: the receive path, which the
            # caller polls against its deadline and Docker's view of the sandbox, reports what became of it.
            self.lost = channel if connection.closed else self.lost
        return msg_id

    def execute(self, code: str, *, silent: bool = False, store_history: bool = True,
                stop_on_error: bool = True, expressions: dict[str, str] | None = None) -> str:
        return self.request("shell", "execute_request", {
            "code": code, "silent": silent, "store_history": store_history, "user_expressions": expressions or {},
            "allow_stdin": False, "stop_on_error": stop_on_error})

    def kernel_info(self) -> str:
        return self.request("shell", "kernel_info_request", {})

    def interrupt(self) -> None:
        self.request("control", "interrupt_request", {})

    # -- conversations ----------------------------------------------------------------------------

    def wait_ready(self, check: Callable[[], None]) -> dict[str, Any]:
        """Ask for kernel_info until the kernel answers; return its language_info. ``check`` is called between
        tries and raises to give up (the sandbox stopped, the start-up deadline passed)."""
        asked: set[str] = set()
        while True:
            # Replies can lag behind requests while the kernel starts: accept a reply to any of ours.
            check()
            asked.add(self.kernel_info())
            reply, give_up = self.recv("shell", 0.5), time.monotonic() + 0.5
            while reply is not None and reply.parent_id not in asked and time.monotonic() < give_up:
                reply = self.recv("shell", 0.05)
            if reply is not None and reply.parent_id in asked:  # others' past 0.5 s: asked again
                info = reply.content(MAX_CONTROL).get("language_info", {})
                return info if isinstance(info, dict) else {}

    def wait_subscribed(self, check: Callable[[], None]) -> None:
        """iopub is a PUB/SUB pair: wait until the kernel sees our subscription (early output would be lost),
        then drop what the handshake left on both channels."""
        while self.recv("iopub", 0.2) is None:
            check()
            self.kernel_info()
        end, budget = time.monotonic() + TAIL, self.read + TAIL_MESSAGES
        while time.monotonic() < end and self.read < budget and (
                self.recv("iopub", 0.005) is not None or self.recv("shell", 0) is not None):
            pass

    def run_silent(self, code: str, timeout: float, *,
                   expressions: dict[str, str] | None = None) -> dict[str, Any] | None:
        """Run ``code`` silently, outside the history (``expressions``: user_expressions evaluated after it); the
        reply's content, or None after ``timeout`` seconds. What it published is read up to its idle (see
        `tail`), so the next cell starts clean."""
        deadline = time.monotonic() + timeout
        msg_id = self.execute(code, silent=True, store_history=False, stop_on_error=False, expressions=expressions)
        reply = self.recv("shell", timeout, parent=msg_id)
        if reply is None:
            return None
        content = reply.content(MAX_CONTROL)
        self.tail(msg_id, min(deadline, time.monotonic() + TAIL))
        return content

    def tail(self, msg_id: str, end: float) -> bool:
        """Read iopub past ``msg_id``'s reply up to its idle; True when it came. Messages of other requests are
        dropped unparsed. Past ``end`` or TAIL_MESSAGES messages it stops: what is left has another parent for
        the next reader, who drops it the same way."""
        start = self.read
        while (left := end - time.monotonic()) > 0 and (room := TAIL_MESSAGES - (self.read - start)) > 0:
            msg = self.recv("iopub", left, parent=msg_id, budget=room)
            if msg is not None and msg.msg_type == "status" \
                    and msg.content(MAX_CONTROL).get("execution_state") == "idle":
                return True
        log.info("a silent request's idle did not come in its bound; %d messages read past", self.read - start)
        return False

    def run(self, code: str, *, deadline: float, grace: float, on_output: Callable[[Message], None],
            alive: Callable[[], bool], kill: Callable[[], None],
            interrupt: Callable[[], None] | None = None) -> Execution:
        """Execute ``code`` and hand each of its output messages (unparsed) to ``on_output`` until the kernel is
        idle (and ``settle`` seconds quiet after). Past ``deadline`` (time.monotonic()) the cell is interrupted
        (``interrupt``, by default an interrupt_request), and ``kill`` is called when the kernel is not idle
        ``grace`` seconds later. ``alive`` is asked once a second; False ends the run as "gone".
        Kinds nbexec does not know (comm_close, ...) are ignored unparsed. Raises ProtocolError when the kernel
        breaks the protocol."""
        run = Execution()
        msg_id = self.execute(code, store_history=True, stop_on_error=True)
        next_check = time.monotonic() + _LIVENESS_EVERY
        replied: float | None = None
        while True:
            msg = self.recv("iopub", max(0.0, min(_POLL, deadline - time.monotonic())), parent=msg_id)
            if msg is not None:
                if dispatch(msg, run, on_output):
                    break
            elif replied is None:  # silence: a full PUB queue in the kernel drops messages, idle too
                replied = time.monotonic() if self._reply(msg_id, run, 0) else None
            elif time.monotonic() - replied >= _IDLE_AFTER_REPLY:
                break
            now = time.monotonic()
            if now >= deadline:
                return self._stop(msg_id, run, grace, on_output, (kill, interrupt or self.interrupt))
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY
                if not alive():
                    run.status = "gone"
                    return run
        if self.settle:
            self._settle(msg_id, run, on_output, deadline)
        if replied is None:
            with contextlib.suppress(ProtocolError):  # a bad reply tells nothing: the kernel is asked below
                self._reply(msg_id, run, max(_IDLE_AFTER_REPLY, min(_REPLY_AFTER_IDLE, deadline - time.monotonic())))
        self._conclude(run, deadline)
        return run

    def _conclude(self, run: Execution, deadline: float) -> None:
        """Settle the status from the reply, and ask the kernel what its messages could not say: whether the
        cell raised (its reply was unreadable) or what it raised (the error message was too large to keep)."""
        if run.reply == "error":
            run.status = "error"
        unknown = run.reply not in ("ok", "error") and run.status == "ok"
        if not self.asks_last_error or (not unknown and (run.status != "error" or run.errors_read
                                                           or run.error is not None)):
            return
        asked = self.last_error(max(1.0, min(_ASK_WAIT, deadline - time.monotonic())))
        if asked is not None and asked.raised:
            run.status, run.error = "error", asked

    def _reply(self, msg_id: str, run: Execution, timeout: float) -> bool:
        """Read the cell's shell reply (so the next cell's is not mistaken for it): its status, the error it
        describes, and the execution count when no execute_input gave it; False when none came."""
        reply = self.recv("shell", timeout, parent=msg_id)
        if reply is None:
            return False
        run.stamp("shell.execute_reply")
        run.exit_value = exit_asked(reply, MAX_CONTROL)
        try:  # past its limit, or malformed, a reply says nothing: the kernel is asked instead
            content = reply.content(MAX_CONTROL)
        except ProtocolError:
            return True
        if run.execution_count is None:  # no execute_input seen: the reply carries the count too
            count = content.get("execution_count")
            run.execution_count = count if isinstance(count, int) else None
        status = content.get("status")
        run.reply = "ok" if status == "ok" else "error" if isinstance(status, str) else ""
        if run.reply == "error":
            run.error = lasterror.from_reply(content)
        return True

    def last_error(self, timeout: float) -> LastError | None:
        """Ask the kernel how its last cell ended (see `lasterror`); None when it does not say within ``timeout``
        or says nothing readable. What the request publishes is drained. Raises ProtocolError as `recv` does."""
        msg_id = self.execute(lasterror.CODE, silent=True, store_history=False, stop_on_error=False,
                              expressions={lasterror.KEY: lasterror.EXPRESSION})
        reply = self.recv("shell", timeout, parent=msg_id)
        if reply is None:
            return None
        self.tail(msg_id, time.monotonic() + min(timeout, 2.0))
        try:
            return lasterror.read(reply.content(MAX_CONTROL))
        except ProtocolError:  # past its limit or malformed: the kernel said nothing readable
            return None

    def _stop(self, msg_id: str, run: Execution, grace: float, on_output: Callable[[Message], None],
              stops: tuple[Callable[[], None], Callable[[], None]]) -> Execution:
        """Interrupt a cell past its deadline; kill the sandbox if the kernel is not idle ``grace`` s later.
        ``stops``: (kill, interrupt)."""
        kill, interrupt = stops
        interrupt()
        run.status, give_up = "timeout", time.monotonic() + grace
        while time.monotonic() < give_up:
            msg = self.recv("iopub", min(_POLL, max(0.0, give_up - time.monotonic())), parent=msg_id)
            if msg is None:
                continue
            if msg.msg_type == "status" and msg.content(MAX_CONTROL).get("execution_state") == "idle":
                run.stamp("iopub.status.idle")
                with contextlib.suppress(ProtocolError):
                    self._reply(msg_id, run, 1.0)
                run.stop = "interrupted"
                return run
            if msg.msg_type in (OUTPUT_KINDS | COMM_KINDS) - {"error"}:  # the KeyboardInterrupt traceback is replaced
                on_output(msg)
        kill()
        run.stop = "killed"
        return run

    def _settle(self, msg_id: str, run: Execution, on_output: Callable[[Message], None], deadline: float) -> None:
        """Outputs published after idle (Deno's drain runs apart from its status) until silence; past MAX_SETTLE s only
        a queue draining, so a timer cannot hold the run open. Cut while output still came: ``late_unread``."""
        settled = min(deadline, (now := time.monotonic()) + MAX_SETTLE)
        window, count, lulls = now + _WINDOW, 0, -1  # messages read in this window; windows in a row with few
        while (now := time.monotonic()) < deadline:
            msg = None
            if now >= window:  # hundreds a window: a queue draining; a few: a timer, unless one waits (host away)
                lulls = 0 if count >= _BACKLOG else max(lulls, 0) + 1
                if now >= settled and lulls >= 2 and (msg := self.recv("iopub", 0, parent=msg_id)) is None:
                    break
                window, count = now + _WINDOW, 0
            quiet = _DRAIN_QUIET if lulls == 0 or count >= _BACKLOG else self.settle
            if msg is None and (msg := self.recv("iopub", min(quiet, deadline - now), parent=msg_id)) is None:
                return  # silence
            dispatch(msg, run, on_output)
            count += 1
        run.late_unread = True

    # -- the one receive path ---------------------------------------------------------------------

    def recv(self, channel: str, timeout: float, *, parent: str | None = None,
             budget: int | None = None) -> Message | None:
        """The next verified message on ``channel`` ("iopub" or "shell"), or None after ``timeout`` seconds (or
        ``budget`` messages dropped).

        With ``parent``, messages answering other requests are dropped unparsed. A message past the channel's
        byte limit comes back incomplete (its size counted, its content dropped unread). Raises ProtocolError
        when the kernel breaks the protocol or closes the connection (then ``lost`` names the channel).
        """
        connection = self._channel(channel)
        end, most = time.monotonic() + timeout, None if budget is None else self.read + budget
        while True:
            try:
                incoming = connection.receive(max(0.0, end - time.monotonic()))
            except ProtocolError:
                if connection.closed:
                    self.lost = channel
                raise
            if incoming is None:
                return None
            self.read += 1
            message = self._verify(channel, incoming, parent)
            if message is not None and (parent is None or message.parent_id == parent):
                return message
            if time.monotonic() >= end or (most is not None and self.read >= most):
                return None

    def _channel(self, channel: str) -> zmtp.Connection:
        connection = self._connections.get(channel)
        if connection is None:
            raise ProtocolError(f"the {channel} connection to the kernel is closed")
        return connection

    def _verify(self, channel: str, incoming: zmtp.Incoming, parent_id: str | None = None) -> Message | None:
        """Check sizes and the signature, then parse the headers only; None for a message to ignore (one whose
        parent header does not hold ``parent_id``'s bytes: it answers another request, so nothing is parsed)."""
        frames, sizes = incoming.frames, incoming.sizes
        starts = [i + 1 for i, f in enumerate(frames[:_MAX_IDENTITIES + 1])
                  if sizes[i] == len(_DELIMITER) and f == _DELIMITER]
        if not starts:
            raise ProtocolError(f"a message on {channel} has no <IDS|MSG> delimiter in its first "
                                f"{_MAX_IDENTITIES + 1} frames")
        start, signed = starts[0], None  # None: not checked yet
        if len(starts) > 1:
            # Routing frames may hold the delimiter's bytes (ipykernel 7 once echoed a stray <IDS|MSG> and
            # signature before a reply's own): the message starts at the delimiter whose signature holds.
            start, signed = next(((s, True) for s in starts if self._signed(frames, s)), (start, False))
        if len(frames) - start < 5:
            raise ProtocolError(f"a message on {channel} has {len(frames) - start} frames after its delimiter "
                                "(need 5)")
        signature, header, parent_header, metadata, content = frames[start:start + 5]
        if signature is None or header is None or parent_header is None or len(header) > MAX_HEADER \
                or len(parent_header) > MAX_HEADER or len(signature) > 128:
            raise ProtocolError(f"a message on {channel} has a header over {MAX_HEADER:,} bytes")
        if parent_id is not None and parent_id.encode() not in parent_header:
            return None
        size = sum(sizes[start + 3:]) + max(0, len(header) + len(parent_header) - HEADER_ALLOWANCE)
        complete = metadata is not None and content is not None  # buffers are not signed: need not be kept
        if complete:
            if not (self._signed(frames, start) if signed is None else signed):  # each candidate hashed once
                raise ProtocolError(f"a message on {channel} is unsigned or its signature is wrong")
            self._remember(bytes(signature))
        parent, head = parse_header(parent_header, "parent header"), parse_header(header, "header")
        msg_type, msg_id, parent_id = head.get("msg_type"), head.get("msg_id"), parent.get("msg_id", "")
        if not isinstance(msg_type, str) or not isinstance(msg_id, str) or not isinstance(parent_id, str):
            raise ProtocolError(f"a message on {channel} has a header without string msg_type and msg_id")
        return Message(channel, msg_type, msg_id, parent_id, size, content or b"", complete,
                       tuple(frames[start + 5:]))

    def _signed(self, frames: tuple[bytes | bytearray | None, ...], start: int) -> bool:
        """Whether the five frames from ``start`` are whole and a message signed with our key."""
        parts = frames[start:start + 5]
        if len(parts) < 5 or any(part is None for part in parts) or len(parts[0] or b"") > 128:
            return False
        return hmac.compare_digest(bytes(parts[0] or b""), signature(self._key, [part or b"" for part in parts[1:]]))

    def _remember(self, signature: bytes) -> None:
        if signature in self._seen:
            raise ProtocolError("the kernel sent the same signed message twice (a replay)")
        self._seen.add(signature)
        self._order.append(signature)
        if len(self._order) > _REPLAY_WINDOW:
            self._seen.discard(self._order.popleft())

