"""The kernel client's receive path and the cell's output budget, fed scripted messages (nbclient's TestRunCell is
the model). The fake kernel is real ZMQ on ipc:// sockets in a temporary folder: Docker adds nothing here."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.session import Session
from nbformat import NotebookNode

from nbexec import outputs, runner
from nbexec.errors import NbexecError, ProtocolError
from nbexec.kernel import MAX_DEPTH, KernelClient, Message, parse
from nbexec.runner import Budget, CellOutcome

KEY = "0123456789abcdef" * 4
FRAME_LIMIT = 1024 * 1024


class FakeKernel:
    """Bound PUB and ROUTER sockets that send whatever frames a test scripts."""

    def __init__(self, folder: Path) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.session = Session(key=KEY.encode(), signature_scheme="hmac-sha256")
        base = folder / "kernel"
        self.iopub = self.context.socket(zmq.PUB)
        self.iopub.bind(f"ipc://{base}-2")
        self.shell = self.context.socket(zmq.ROUTER)
        self.shell.bind(f"ipc://{base}-1")
        self.control = self.context.socket(zmq.ROUTER)
        self.control.bind(f"ipc://{base}-4")
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
    ("frame-over-maxmsgsize", lambda k: [k.frames("stream", b" " * (FRAME_LIMIT + 1))], ["protocol"]),
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
        seen.append(message.msg_type if message is not None else "nothing")
    assert seen == expected


def test_a_dropped_connection_is_noticed_at_once(kernel: FakeKernel) -> None:
    kernel.iopub.send_multipart(kernel.frames("stream", b" " * (FRAME_LIMIT + 1)))
    started = time.monotonic()
    with pytest.raises(ProtocolError, match="dropped"):
        kernel.client.recv("iopub", 10.0)
    assert kernel.client.lost == "iopub" and time.monotonic() - started < 5
    kernel.client.reopen("iopub")  # libzmq gave up on that connection; a new one works
    deadline = time.monotonic() + 10
    while kernel.client.recv("iopub", 0.05, parent="p1") is None:
        assert time.monotonic() < deadline, "the reopened connection never received anything"
        kernel.iopub.send_multipart(kernel.frames("stream", STREAM))


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


def run(messages: list[Message], budget: Budget) -> tuple[NotebookNode, CellOutcome]:
    cell = NotebookNode(cell_type="code", source="", outputs=[], metadata={})
    state = runner._CellState(cell, 0, budget, None)
    outcome = CellOutcome(status="ok")
    for message in messages:
        runner._handle(message, state, outcome)
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


def texts(cell: NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


Judge = Callable[[NotebookNode, Budget, CellOutcome], bool]
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
     and len("".join(c.outputs[0].traceback)) <= runner.MAX_ERROR),
    ("later-errors-over-the-budget-dropped", [error(), error(100, 100)],
     lambda c, b, o: sum(x.output_type == "error" for x in c.outputs) == 1 and b.dropped_text > 0),
    ("output-count-cap", [display(1)] * 15,
     lambda c, b, o: sum(x.output_type == "display_data" for x in c.outputs) == 10 and b.dropped_outputs == 5
     and "5 outputs dropped" in c.outputs[-1].text),
    ("transient-null", [display(5, transient=None), update(1, None)],
     lambda c, b, o: c.outputs[0].data["image/png"] == "p" * 5),
    ("unknown-type-ignored", [msg("nbexec_unknown", b"not even json"), msg("comm_msg", b"[")],
     lambda c, b, o: c.outputs == [] and o.status == "ok"),
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
