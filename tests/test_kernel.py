"""The kernel client's receive path and the cell's output budget, fed scripted messages (nbclient's TestRunCell is
the model). The fake kernel is real ZMQ (pyzmq, playing ipykernel's part) on ipc:// sockets in a temporary folder,
and a raw unix-socket peer scripts the ZMTP bytes libzmq would never send: Docker adds nothing here."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.session import Session
from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.engine.budget import MAX_ERROR, Budget, CellState
from nbexec.engine.widgets import WidgetState
from nbexec.errors import NbexecError, ProtocolError
from nbexec.files.folders import socket_address
from nbexec.notebook import outputs
from nbexec.sandbox import kernel as kernel_protocol
from nbexec.sandbox import zmtp
from nbexec.sandbox.kernel import MAX_FRAMES, Execution, KernelClient
from nbexec.sandbox.messages import MAX_DEPTH, Message, parse

KEY = "0123456789abcdef" * 4
FRAME_LIMIT = 1024 * 1024


class FakeKernel:
    """Bound PUB and ROUTER sockets that send whatever frames a test scripts."""

    def __init__(self, folder: Path) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.session = Session(key=KEY.encode(), signature_scheme="hmac-sha256")
        base = folder / "kernel"
        # Bound through a descriptor of the folder, as the client connects: a long TMPDIR stays within the
        # unix socket address limit.
        self._folder = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        short = f"/proc/self/fd/{self._folder}/kernel"
        self.iopub = self.context.socket(zmq.PUB)
        self.iopub.setsockopt(zmq.SNDHWM, 0)  # a scripted flood is sent whole, however slow the reader (under load)
        self.iopub.bind(f"ipc://{short}-2")
        self.shell = self.context.socket(zmq.ROUTER)
        self.shell.bind(f"ipc://{short}-1")
        self.control = self.context.socket(zmq.ROUTER)
        self.control.bind(f"ipc://{short}-4")
        self.client = KernelClient.connect(base, {"key": KEY, "shell_port": 1, "iopub_port": 2, "control_port": 4},
                                           max_message=FRAME_LIMIT)
        deadline = time.monotonic() + 10
        while self.client.recv("iopub", 0.05) is None:  # PUB/SUB: wait until the subscription is seen
            assert time.monotonic() < deadline, "the fake kernel's iopub never reached the client"
            self.iopub.send_multipart(self.frames("status", b'{"execution_state": "idle"}', parent="warm-up"))

    def frames(self, kind: str, content: bytes, *, parent: str = "p1", key: str | None = KEY,
               header: bytes | None = None) -> list[bytes]:
        head = header if header is not None else json.dumps(
            {"msg_id": uuid.uuid4().hex, "msg_type": kind, "session": "s", "username": "k", "version": "5.4"}).encode()
        parts = [head, json.dumps({"msg_id": parent}).encode(), b"{}", content]
        signature = b"0" * 64
        if key is not None:
            digest = hmac.new(key.encode(), digestmod=hashlib.sha256)
            for part in parts:
                digest.update(part)
            signature = digest.hexdigest().encode()
        return [b"kernel." + kind.encode(), b"<IDS|MSG>", signature, *parts]

    def close(self) -> None:
        self.client.close()
        self.context.destroy(linger=0)
        os.close(self._folder)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    fake = FakeKernel(tmp_path)
    yield fake
    fake.close()


STREAM = b'{"name": "stdout", "text": "hi\\n"}'
Script = Callable[[FakeKernel], list[list[bytes]]]


def _replay(k: FakeKernel) -> list[list[bytes]]:
    frames = k.frames("stream", STREAM)
    return [frames, frames]


RECEIVE_CASES: list[tuple[str, Script, list[str]]] = [
    ("signed", lambda k: [k.frames("stream", STREAM)], ["stream"]),
    ("unsigned", lambda k: [k.frames("stream", STREAM, key=None)], ["protocol"]),
    ("signed-with-another-key", lambda k: [k.frames("stream", STREAM, key="another")], ["protocol"]),
    ("replayed", _replay, ["stream", "protocol"]),
    ("other-parent-dropped", lambda k: [k.frames("stream", b"not parsed", parent="p2"),
                                        k.frames("stream", STREAM)], ["stream"]),
    ("no-delimiter", lambda k: [[b"topic", b"x", b"y"]], ["protocol"]),
    ("too-few-frames", lambda k: [k.frames("stream", STREAM)[:5]], ["protocol"]),
    ("oversized-header", lambda k: [k.frames("stream", STREAM, header=b" " * (65 * 1024))], ["protocol"]),
    ("header-not-an-object", lambda k: [k.frames("stream", STREAM, header=b"[1]")], ["protocol"]),
    ("header-not-utf8", lambda k: [k.frames("stream", STREAM, header=b'{"msg_type": "\xff"}')], ["protocol"]),
    ("msg-type-not-a-string", lambda k: [k.frames("stream", STREAM, header=b'{"msg_type": 1, "msg_id": "a"}')],
     ["protocol"]),
    # Past the byte limit a message is read and dropped as it streams in: its size is known, its content is not.
    ("content-over-the-limit", lambda k: [k.frames("stream", b" " * (FRAME_LIMIT + 1)), k.frames("stream", STREAM)],
     ["stream:dropped", "stream"]),
    # Buffers are not signed: dropped past the limit, the message is still whole (and charged for them).
    ("buffers-over-the-limit", lambda k: [k.frames("stream", STREAM) + [b"b" * FRAME_LIMIT] * 3], ["stream"]),
    ("headers-past-the-limit", lambda k: [[b"t" * FRAME_LIMIT, *k.frames("stream", STREAM)]], ["protocol"]),
    ("too-many-frames", lambda k: [k.frames("stream", STREAM) + [b"b"] * MAX_FRAMES], ["protocol"]),
    ("long-frames", lambda k: [k.frames("stream", b'{"name": "stdout", "text": "' + b"x" * 70000 + b'"}')],
     ["stream"]),
]


@pytest.mark.parametrize(("script", "expected"), [c[1:] for c in RECEIVE_CASES], ids=[c[0] for c in RECEIVE_CASES])
def test_receive(kernel: FakeKernel, script: Script, expected: list[str]) -> None:
    for frames in script(kernel):
        kernel.iopub.send_multipart(frames)
    seen: list[str] = []
    for _ in expected:
        try:
            message = kernel.client.recv("iopub", 2.0, parent="p1")
        except ProtocolError:
            seen.append("protocol")
            break
        seen.append("nothing" if message is None else message.msg_type + ("" if message.complete else ":dropped"))
    assert seen == expected


def test_a_message_over_the_limit_is_never_held(kernel: FakeKernel) -> None:
    """One message of 40 MiB in 1 MiB frames (libzmq would hold it all): the client keeps about one frame."""
    extra = [b"b" * FRAME_LIMIT] * 40
    tracemalloc.start()
    try:
        kernel.iopub.send_multipart(kernel.frames("stream", STREAM) + extra, copy=False)
        message = kernel.client.recv("iopub", 10.0, parent="p1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message is not None and message.complete and message.size >= 40 * FRAME_LIMIT
    assert peak < 3 * FRAME_LIMIT, peak


def test_a_closed_connection_is_noticed_at_once(kernel: FakeKernel) -> None:
    kernel.iopub.close(linger=0)  # the kernel went away: end of file on the socket
    started = time.monotonic()
    with pytest.raises(ProtocolError, match="closed"):
        kernel.client.recv("iopub", 10.0)
    assert kernel.client.lost == "iopub" and time.monotonic() - started < 5
    with pytest.raises(ProtocolError):  # and it stays closed
        kernel.client.recv("iopub", 0)


# -- ZMTP framing, from a raw peer ---------------------------------------------------------------------------

def ready(socket_type: bytes) -> bytes:
    return zmtp.command(b"READY", {"Socket-Type": socket_type, "Identity": b""})


def frame(body: bytes, *, more: bool = False, long: bool = False, flags: int = 0) -> bytes:
    flags |= zmtp.MORE if more else 0
    if long or len(body) > 255:
        return bytes((flags | zmtp.LONG,)) + len(body).to_bytes(8, "big") + body
    return bytes((flags, len(body))) + body


PEER = zmtp.GREETING[:11] + b"\x01" + zmtp.GREETING[12:]  # libzmq 4.3 announces ZMTP 3.1
PING = frame(b"\x04PING\x00\x00" + b"ctx", flags=zmtp.COMMAND)
LIMIT = 1000
HANG_UP = b"<the peer closes the connection here>"
# (id, what the peer sends after the greeting, expected: frames of each message received, or an error's words)
RAW_CASES: list[tuple[str, bytes, list[Any]]] = [
    ("short-and-long-frames", ready(b"XPUB") + frame(b"a", more=True) + frame(b"b", long=True, more=True)
     + frame(b"c" * 300), [[b"a", b"b", b"c" * 300]]),
    ("commands-between-messages-ignored", ready(b"PUB") + PING + frame(b"a") + PING + frame(b"b"),
     [[b"a"], [b"b"]]),
    ("over-the-limit-read-past", ready(b"XPUB") + frame(b"a", more=True) + frame(b"x" * LIMIT, more=True)
     + frame(b"c") + frame(b"next"), [[b"a", None, None], [b"next"]]),
    ("too-many-frames", ready(b"XPUB") + frame(b"a", more=True) * 100, ["more than 64 frames"]),
    ("reserved-flags", ready(b"XPUB") + frame(b"a", flags=0x80), ["reserved flag"]),
    ("eof-mid-frame", ready(b"XPUB") + frame(b"a" * 100)[:50] + HANG_UP, ["closed"]),
    ("huge-frame-times-out", ready(b"XPUB") + b"\x02" + (2**62).to_bytes(8, "big") + b"x" * 100000, [None]),
    ("wrong-socket-type", ready(b"DEALER"), ["cannot talk to"]),
    ("no-ready", frame(b"a"), ["before its READY"]),
    ("oversized-command", frame(b"\x05READY" + b"x" * 70000, flags=zmtp.COMMAND), ["malformed command"]),
    ("error-command", frame(b"\x05ERROR\x06denied", flags=zmtp.COMMAND), ["refused the handshake: denied"]),
    ("cut-property", frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x09SUB", flags=zmtp.COMMAND), ["cut short"]),
]
BAD_GREETINGS = [
    ("not-zmtp", b"GET / HTTP/1.1\r\n" + bytes(48), "does not speak ZMTP 3"),
    ("zmtp-2", PEER[:10] + b"\x01" + PEER[11:], "does not speak ZMTP 3"),
    ("curve", PEER[:12] + b"CURVE".ljust(20, b"\0") + PEER[32:], "other than NULL"),
    ("eof-in-greeting", PEER[:10] + HANG_UP, "closed"),
]


def raw_peer(path: Path, script: bytes) -> threading.Thread:
    """A listening unix socket that answers one connection with ``script``; it closes the connection at
    ``HANG_UP``, or else once the client has."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket_address(path) as address:  # a long TMPDIR stays within the socket address limit
        server.bind(address)
    server.listen(1)

    def serve() -> None:
        with server, server.accept()[0] as peer:
            peer.settimeout(10)
            try:
                peer.recv(64)
                peer.sendall(script.removesuffix(HANG_UP))
                while not script.endswith(HANG_UP) and peer.recv(65536):
                    pass
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("script", "expected"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_zmtp(tmp_path: Path, script: bytes, expected: list[Any]) -> None:
    raw_peer(tmp_path / "s", PEER + script)
    seen: list[Any] = []
    connection = None
    try:
        connection = zmtp.Connection.open(tmp_path / "s", "SUB", max_message=LIMIT, max_frames=MAX_FRAMES,
                                          timeout=5)
        for _ in expected:
            message = connection.receive(0.5)
            seen.append(None if message is None else [None if f is None else bytes(f) for f in message.frames])
    except ProtocolError as exc:
        seen.append(next((words for words in expected if isinstance(words, str) and words in str(exc)), str(exc)))
    finally:
        if connection is not None:
            connection.close()
    assert seen == expected


@pytest.mark.parametrize(("greeting", "words"), [c[1:] for c in BAD_GREETINGS], ids=[c[0] for c in BAD_GREETINGS])
def test_bad_greeting(tmp_path: Path, greeting: bytes, words: str) -> None:
    raw_peer(tmp_path / "s", greeting)
    with pytest.raises(ProtocolError, match=words):
        zmtp.Connection.open(tmp_path / "s", "DEALER", max_message=LIMIT, max_frames=MAX_FRAMES, timeout=5)


def test_sizes_are_counted_past_the_limit(tmp_path: Path) -> None:
    raw_peer(tmp_path / "s", PEER + ready(b"ROUTER") + frame(b"a", more=True) + frame(b"x" * 5000))
    connection = zmtp.Connection.open(tmp_path / "s", "DEALER", max_message=LIMIT, max_frames=MAX_FRAMES,
                                      timeout=5)
    message = connection.receive(5)
    connection.close()
    assert message is not None and message.sizes == (1, 5000) and message.frames == (b"a", None)


def test_requests_are_signed(kernel: FakeKernel) -> None:
    msg_id = kernel.client.execute("print(1)")
    _, msg = kernel.session.feed_identities(kernel.shell.recv_multipart())
    parsed = kernel.session.deserialize(msg)  # checks the signature with the shared key
    assert parsed["header"]["msg_id"] == msg_id and parsed["content"]["code"] == "print(1)"


# -- parsing -------------------------------------------------------------------------------------------------

PARSE_CASES: list[tuple[str, bytes, Any]] = [
    ("object", b'{"a": [1, "x"]}', {"a": [1, "x"]}),
    ("lone-surrogate", b'{"t": "a\\ud800b", "\\udc00": 1}', {"t": "a\ufffdb", "\ufffd": 1}),
    ("escaped-pair-kept", b'{"t": "\\ud83d\\ude00"}', {"t": "\U0001f600"}),
    ("invalid-utf8", b'{"t": "\xff"}', ProtocolError),
    ("encoded-surrogate", b'{"t": "\xed\xa0\x80"}', ProtocolError),
    ("utf16", '{"t": 1}'.encode("utf-16"), ProtocolError),
    ("not-json", b"{", ProtocolError),
    ("too-deep-for-python", b"[" * 100000 + b"]" * 100000, ProtocolError),
    ("too-deep-for-nbexec", b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2), ProtocolError),
    ("huge-int", b"1" * 5000, ProtocolError),
]


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in PARSE_CASES], ids=[c[0] for c in PARSE_CASES])
def test_parse(raw: bytes, expected: Any) -> None:
    if expected is ProtocolError:
        with pytest.raises(ProtocolError) as caught:
            parse(raw, "test")
        assert isinstance(caught.value, NbexecError)
    else:
        assert parse(raw, "test") == expected


# -- the cell's budget, per kind -----------------------------------------------------------------------------

def msg(kind: str, content: Any) -> Message:
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    return Message("iopub", kind, uuid.uuid4().hex, "p1", len(raw) + 2, raw)


def run(messages: list[Message], budget: Budget) -> tuple[NotebookNode, Execution]:
    cell = NotebookNode(cell_type="code", source="", outputs=[], metadata={})
    state = CellState(cell, 0, budget, None)
    outcome = Execution()
    for message in messages:
        kernel_protocol.dispatch(message, outcome, state.add)
    state.finish()  # as run_cell does: merged stream pieces are joined once
    budget.finish(1000, 10)
    return cell, outcome


def small(**changes: int) -> Budget:
    return Budget(**{"text": 1000, "display": 1000, "outputs": 10, **changes})


def display(size: int = 10, *, metadata: int = 0, display_id: str | None = None, transient: Any = "unset") -> Message:
    content: dict[str, Any] = {"data": {"image/png": "p" * size}, "metadata": {"m": "x" * metadata}}
    if display_id is not None:
        content["transient"] = {"display_id": display_id}
    elif transient != "unset":
        content["transient"] = transient
    return msg("display_data", content)


def update(size: int, display_id: Any) -> Message:
    return msg("update_display_data", {"data": {"image/png": "u" * size}, "metadata": {}, "transient": display_id})


def stream(text: str, name: str = "stdout") -> Message:
    return msg("stream", {"name": name, "text": text})


def error(traceback_lines: int = 3, line: int = 10) -> Message:
    return msg("error", {"ename": "E", "evalue": "v", "traceback": ["x" * line] * traceback_lines + ["last"]})


def over_the_limit(kind: str, size: int) -> Message:
    return Message("iopub", kind, uuid.uuid4().hex, "p1", size, b"", complete=False)


def texts(cell: NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


Judge = Callable[[NotebookNode, Budget, Execution], bool]
BUDGET_CASES: list[tuple[str, list[Message], Judge]] = [
    ("streams-merge", [stream("a"), stream("b")],
     lambda c, b, o: len(c.outputs) == 1 and c.outputs[0].text == "ab" and b.dropped == 0),
    ("stream-past-the-budget-keeps-a-prefix", [stream("x" * 1500)],
     lambda c, b, o: c.outputs[0].text == "x" * 1000 and b.dropped_text == 500 and "truncated" in c.outputs[1].text),
    ("stream-after-the-budget-is-not-parsed", [stream("x" * 1000), msg("stream", b"not json at all")],
     lambda c, b, o: b.dropped_text > 0),
    ("display-metadata-is-charged", [display(10, metadata=2000)],
     lambda c, b, o: b.dropped_display > 2000 and all(x.output_type == "stream" for x in c.outputs)),
    ("displays-after-the-budget-are-not-parsed", [display(900), msg("display_data", b"[" * 2000)],
     lambda c, b, o: b.dropped_display > 0 and b.dropped_outputs == 1),
    ("update-is-charged-its-new-size", [display(10, display_id="d"), update(2000, {"display_id": "d"})],
     lambda c, b, o: c.outputs[0].data["image/png"] == "p" * 10 and b.dropped_display > 2000),
    ("update-that-fits-applies", [display(10, display_id="d"), update(1, {"display_id": "d"})],
     lambda c, b, o: c.outputs[0].data["image/png"] == "u"),
    ("clear-output-flood-is-charged", [stream("a"), *[msg("clear_output", {"wait": True})] * 200, stream("b")],
     lambda c, b, o: b.dropped_text > 0 and "b" in texts(c)),
    ("first-error-kept-and-trimmed", [error(300, 10000)],
     lambda c, b, o: o.status == "error" and c.outputs[0].traceback[-1] == "last"
     and "traceback lines" in "".join(c.outputs[0].traceback)
     and len("".join(c.outputs[0].traceback)) <= MAX_ERROR),
    ("later-errors-over-the-budget-dropped", [error(), error(100, 100)],
     lambda c, b, o: sum(x.output_type == "error" for x in c.outputs) == 1 and b.dropped_text > 0),
    ("output-count-cap", [display(1)] * 15,
     lambda c, b, o: sum(x.output_type == "display_data" for x in c.outputs) == 10 and b.dropped_outputs == 5
     and "5 outputs dropped" in c.outputs[-1].text),
    ("transient-null", [display(5, transient=None), update(1, None)],
     lambda c, b, o: c.outputs[0].data["image/png"] == "p" * 5),
    ("unknown-type-ignored", [msg("nbexec_unknown", b"not even json"), msg("comm_msg", b"[")],
     lambda c, b, o: c.outputs == [] and o.status == "ok"),
    ("over-the-frame-limit-counted-unread", [over_the_limit("display_data", 5000), stream("a")],
     lambda c, b, o: b.dropped_frames == 1 and b.dropped_display == 5000 and "a" in texts(c)
     and "larger than the whole output allowance" in texts(c)),
    ("execution-count-of-the-wrong-type", [msg("execute_input", {"execution_count": "7"})],
     lambda c, b, o: o.execution_count is None),
]


@pytest.mark.parametrize(("messages", "check"), [c[1:] for c in BUDGET_CASES], ids=[c[0] for c in BUDGET_CASES])
def test_budget(messages: list[Message], check: Judge) -> None:
    budget = small()
    cell, outcome = run(messages, budget)
    assert check(cell, budget, outcome), (cell.outputs, budget)


MALFORMED: list[tuple[str, Message]] = [
    ("content-is-a-list", msg("stream", b"[1, 2]")),
    ("stream-text-not-a-string", msg("stream", {"name": "stdout", "text": 5})),
    ("display-data-not-an-object", msg("display_data", {"data": [1], "metadata": {}})),
    ("error-traceback-not-strings", msg("error", {"ename": "E", "evalue": "v", "traceback": [1]})),
    ("status-content-too-large", msg("status", {"execution_state": "x" * (2 * 1024 * 1024)})),
    ("deeply-nested-metadata", msg("display_data", b'{"data": {}, "metadata": ' + b"[" * 100 + b"]" * 100 + b"}")),
]


@pytest.mark.parametrize("message", [c[1] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_is_a_protocol_error(message: Message) -> None:
    with pytest.raises(ProtocolError):
        run([message], small(display=10 * 1024 * 1024, text=10 * 1024 * 1024))


def test_error_trim_keeps_head_and_last_frames() -> None:
    lines = ["Traceback header"] + [f"frame {i} " + "z" * 1000 for i in range(5000)] + ["ValueError: last"]
    kept = outputs.trim_traceback(lines, 100_000)
    assert kept[0] == "Traceback header" and kept[-1] == "ValueError: last"
    assert "traceback lines" in kept[1] and sum(len(x) for x in kept) <= 100_000


def test_a_cut_stream_keeps_its_name_and_the_marker_is_on_stderr() -> None:
    """Text past the allowance: what is kept stays on stdout; nbexec's marker of what was cut is on stderr."""
    cell, _ = run([stream("a" * 3000)], small(text=1000))
    names = [(output.name, bool(output.text)) for output in cell.outputs]
    assert names[0] == ("stdout", True) and ("stderr", True) in names[1:], names


def test_a_lone_surrogate_in_cut_text_is_replaced_not_a_crash() -> None:
    """JSON may carry a lone surrogate (\\ud800): the parser makes it U+FFFD, so text past the allowance is cut
    like any other (the cut's own surrogate handling is never reached: tests/mutants-equivalent.yaml)."""
    raw = b'{"name": "stdout", "text": "' + b"ab\\ud800" * 400 + b'"}'
    cell, outcome = run([msg("stream", raw)], small(text=1000))
    kept = cell.outputs[0].text
    assert kept.startswith("ab\ufffdab") and "\ud800" not in kept and 300 <= len(kept) <= 1000, len(kept)
    assert json.dumps(kept, ensure_ascii=False).encode() and outcome.status != "error"


def test_each_stream_piece_reaches_the_listener_with_its_name() -> None:
    """What a caller watching the run sees (on_output): every piece, with the stream it was written to."""
    seen: list[tuple[int, str, str, str]] = []
    cell = NotebookNode(cell_type="code", source="", outputs=[], metadata={})
    state = CellState(cell, 3, small(), lambda index, output: seen.append(
        (index, output.output_type, output.name, output.text)))
    for message in (stream("a"), stream("b", "stderr"), stream("c")):
        kernel_protocol.dispatch(message, Execution(), state.add)
    assert seen == [(3, "stream", "stdout", "a"), (3, "stream", "stderr", "b"), (3, "stream", "stdout", "c")]


def test_errors_after_the_first_take_outputs_until_none_are_left() -> None:
    """The first error is always kept; each later one takes one of the allowance's outputs, and past the last it
    is dropped and counted."""
    budget = small(outputs=2)
    cell, outcome = run([msg("error", {"ename": f"E{n}", "evalue": "v", "traceback": []}) for n in (1, 2, 3)],
                        budget)
    assert [o.ename for o in cell.outputs if o.output_type == "error"] == ["E1", "E2"]
    assert budget.outputs == 0 and budget.dropped_outputs == 1 and outcome.status == "error"


def test_a_stream_past_the_output_count_is_dropped_and_its_bytes_counted() -> None:
    budget = small(outputs=1)
    cell, _ = run([display(), stream("abc")], budget)
    assert not any("abc" in str(o.get("text", "")) for o in cell.outputs)
    assert budget.dropped_outputs == 1 and budget.dropped_text == 3  # what it takes in JSON, without quotes


def test_an_error_nobody_could_describe_says_what_to_do() -> None:
    cell = NotebookNode(cell_type="code", source="", outputs=[], metadata={})
    node = CellState(cell, 0, small(), None).failure(Execution(status="error", errors_dropped=70_000))
    assert node.ename == "UnknownError" and node.evalue == (
        "The code raised an exception, but its error message (70,000 bytes) was larger than the whole output "
        "allowance and the kernel did not say what it was. Raise smaller errors, or raise max_output / max_display.")


def test_another_librarys_comm_costs_its_size_and_nothing_more() -> None:
    state = WidgetState().limit(SandboxConfig())
    raw = json.dumps({"comm_id": "c1", "target_name": "other.library", "data": {"state": {"a": 1}}}).encode()
    assert state.add(Message("iopub", "comm_open", "m1", "p1", len(raw), raw), 10_000) == len(raw)
    assert state.models == {}


def test_an_error_without_its_fields_is_kept_with_empty_ones() -> None:
    cell, outcome = run([msg("error", {"ename": "E"})], small())
    (node,) = [o for o in cell.outputs if o.output_type == "error"]
    assert (node.ename, node.evalue, node.traceback) == ("E", "", []) and outcome.status == "error"


def _comm(kind: str, data: dict[str, Any], buffers: tuple[bytes, ...] = ()) -> Message:
    raw = json.dumps({"comm_id": "w1", "target_name": "jupyter.widget", "data": data}).encode()
    return Message("iopub", kind, uuid.uuid4().hex, "p1", len(raw) + sum(map(len, buffers)), raw, buffers=buffers)


SLIDER = {"_model_name": "IntSliderModel", "_model_module": "@jupyter-widgets/controls",
          "_model_module_version": "2.0.0", "value": 3}


def test_a_widget_model_is_saved_with_the_module_it_names() -> None:
    state = WidgetState().limit(SandboxConfig())
    state.add(_comm("comm_open", {"state": SLIDER, "buffer_paths": []}), 1 << 20)
    state.add(_comm("comm_msg", {"method": "update", "buffer_paths": [["b"]]}, (b"\x00\x01",)), 1 << 20)
    nb = NotebookNode(metadata={}, cells=[])
    state.save(nb)
    (entry,) = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    assert (entry["model_name"], entry["model_module"], entry["model_module_version"]) == (
        "IntSliderModel", "@jupyter-widgets/controls", "2.0.0")
    assert entry["buffers"] == [{"data": "AAE=", "encoding": "base64", "path": ["b"]}]  # an update without state


def test_a_buffer_path_with_a_long_key_drops_the_widget_state() -> None:
    state = WidgetState().limit(SandboxConfig())
    state.add(_comm("comm_open", {"state": SLIDER, "buffer_paths": []}), 1 << 20)
    state.add(_comm("comm_msg", {"method": "update", "state": {}, "buffer_paths": [["k" * 257]]}, (b"x",)), 1 << 20)
    assert state.dropped and "buffer path" in state.dropped and state.models == {}
