"""Exact edges of the hostile-input code that the property tests leave loose: each case pins a boundary, a message or
a window that a one-character change of the code would move (found by the machine-made mutants of
scripts/mutants.py). The kernel wire (zmtp framing on the send and receive side, the replay window, the parent
filter, dispatch), message content limits, `.env` reading and the names a node gives for its files."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import struct
import subprocess
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbexec import egress, names
from nbexec.cli import envfile
from nbexec.errors import ConfigError, FileTransferError, ProtocolError
from nbexec.files import folders
from nbexec.notebook import outputs
from nbexec.sandbox import kernel as kernel_protocol
from nbexec.sandbox import messages, zmtp
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.messages import MAX_DEPTH, Message, parse
from nbexec.sandbox.remote import files as node_files

from .test_fuzz_wire import KEY, header, signed, verify
from .test_kernel import PEER, STREAM, FakeKernel, frame

# -- zmtp ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[zmtp.Connection, socket.socket]]:
    """A connection past its handshake (as the kernel's READY left it) and the kernel's end of the socket."""
    ours, theirs = socket.socketpair()
    connection = zmtp.Connection(ours, "SUB", max_message=1000, max_frames=8)
    connection._ready = True  # the handshake is tested end to end in test_kernel and test_fuzz_wire
    yield connection, theirs
    connection.close()
    theirs.close()


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the connection ended early"
        data += chunk
    return data


def test_send_uses_the_short_form_below_256_bytes_and_the_long_form_from_256(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    connection.send([b"a" * 255, b"b" * 256, b""], 5)
    expected = (b"\x01\xff" + b"a" * 255 + b"\x03" + (256).to_bytes(8, "big") + b"b" * 256 + b"\x00\x00")
    assert read_exactly(theirs, len(expected)) == expected


def test_send_waits_for_a_slow_reader_until_its_timeout(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    data = b"x" * (4 << 20)  # more than the socket buffers hold: send must wait for the reader
    got = bytearray()

    def slow() -> None:
        threading.Event().wait(0.3)
        while len(got) < len(data) + 9:
            got.extend(theirs.recv(1 << 20))

    reader = threading.Thread(target=slow, daemon=True)
    reader.start()
    connection.send([data], 30)
    reader.join(30)
    assert bytes(got[9:]) == data


def test_a_message_already_in_the_socket_is_received_without_waiting(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    theirs.sendall(frame(b"now"))
    assert [bytes(f) for f in connection.receive(0).frames] == [b"now"]  # type: ignore[union-attr]


def test_a_message_larger_than_one_read_is_received_whole_within_the_timeout(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    """600 kB take several reads (256 KiB each): a timeout under a second still lets them all in, as long as the
    bytes keep coming (no sleep here: a writer thread sends them as fast as they are read)."""
    connection, theirs = pair
    data = frame(b"x" * 600_000) + frame(b"next")
    writer = threading.Thread(target=theirs.sendall, args=(data,), daemon=True)
    writer.start()
    message = connection.receive(0.9)
    writer.join(30)
    assert message is not None and message.sizes == (600_000,)


def test_a_frame_that_never_ends_gives_back_control_while_it_streams(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    total, sent = 16 << 30, [0]  # far more than 0.2 s moves; a reader that waits for the end takes seconds
    stop = threading.Event()

    def stream() -> None:
        theirs.settimeout(2)  # once the reader stops, a blocked send gives up
        with contextlib.suppress(OSError):
            theirs.sendall(b"\x02" + (2**62).to_bytes(8, "big"))
            while sent[0] < total and not stop.is_set():
                sent[0] += theirs.send(b"x" * 65536)

    writer = threading.Thread(target=stream, daemon=True)
    writer.start()
    assert connection.receive(0.2) is None
    stop.set()
    writer.join(30)
    assert sent[0] < total, "receive returned only once the sender had finished"


def test_past_its_timeout_receive_reads_once_and_gives_back_control(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    """3 MiB of an endless frame wait in the socket: a receive whose time is up reads once (256 KiB) and returns,
    leaving the rest for the next call, rather than reading for as long as bytes keep coming."""
    connection, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    theirs.sendall(b"\x02" + (2**62).to_bytes(8, "big") + b"x" * (3 << 20))
    assert connection.receive(0) is None
    waiting = struct.unpack("i", fcntl.ioctl(connection._sock, termios.FIONREAD, b"\0" * 4))[0]
    assert waiting == (3 << 20) + 9 - zmtp._CHUNK, waiting


def test_a_broken_connection_stays_broken_with_its_reason(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    theirs.sendall(bytes((0x80, 1)) + b"x" + frame(b"fine"))
    for _ in range(2):  # the same reason again: nothing after a malformed frame is read
        with pytest.raises(ProtocolError, match=r"reserved flag bits \(0x80\)"):
            connection.receive(1)


def test_after_a_send_that_timed_out_nothing_more_is_received(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    with pytest.raises(ProtocolError, match="stopped reading"):
        connection.send([b"x" * (8 << 20)], 0.2)  # the kernel never reads
    theirs.sendall(frame(b"later"))
    with pytest.raises(ProtocolError, match="stopped reading"):  # the connection stays broken
        connection.receive(1)


@pytest.mark.parametrize(("body", "name"), [(b"", "b''"), (b"\x04PING", "b'PING'")])
def test_a_command_before_ready_is_named(tmp_path: Path, body: bytes, name: str) -> None:
    from .test_fuzz_wire import converse_greeting

    _, error = converse_greeting(PEER + frame(body, flags=zmtp.COMMAND))
    assert isinstance(error, ProtocolError) and f"sent a {name} command instead of READY" in str(error)


def test_a_long_command_uses_the_long_form() -> None:
    body = b"\x05READY\x01v" + (300).to_bytes(4, "big") + b"x" * 300
    assert zmtp.command(b"READY", {"v": b"x" * 300}) == b"\x06" + len(body).to_bytes(8, "big") + body
    short = b"\x05READY\x01v" + (5).to_bytes(4, "big") + b"x" * 5
    assert zmtp.command(b"READY", {"v": b"x" * 5}) == b"\x04" + bytes((len(short),)) + short


@pytest.mark.parametrize(("value", "long"), [(243, False), (244, True)])  # bodies of 255 and 256 bytes
def test_a_command_body_of_256_bytes_takes_the_long_form(value: int, long: bool) -> None:
    body = b"\x05READY\x01v" + value.to_bytes(4, "big") + b"x" * value
    head = b"\x06" + len(body).to_bytes(8, "big") if long else b"\x04" + bytes((len(body),))
    assert zmtp.command(b"READY", {"v": b"x" * value}) == head + body


@pytest.mark.parametrize(("body", "start"), [(b"\x01a\x00\x00", 0), (b"\x01a\x00\x00\x00\x05ab", 0),
                                             (b"\x05READY\x01a", 6)], ids=["size-cut", "value-cut", "size-missing"])
def test_a_property_cut_short_is_refused_with_the_reason(body: bytes, start: int) -> None:
    with pytest.raises(ProtocolError, match=r"^a command property is cut short$"):
        zmtp.properties(body, start)


@pytest.fixture
def roomy() -> Iterator[tuple[zmtp.Connection, socket.socket]]:
    """A ready connection that keeps messages of 4 MiB, and a kernel end whose socket buffer holds them whole."""
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    if theirs.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 4 << 20:
        pytest.fail("this test needs a 4 MiB socket buffer: raise net.core.wmem_max", pytrace=False)
    connection = zmtp.Connection(ours, "SUB", max_message=4 << 20, max_frames=8)
    connection._ready = True
    yield connection, theirs
    connection.close()
    theirs.close()


def test_a_large_kept_frame_read_straight_into_its_buffer_arrives_whole(
        roomy: tuple[zmtp.Connection, socket.socket]) -> None:
    """The frame's first 256 KiB come through the read buffer, the rest straight into the frame (one copy less),
    ending exactly at the frame's end: every byte lands at its offset, and the next message starts after it."""
    connection, theirs = roomy
    data = bytes(range(256)) * 2400
    theirs.sendall(frame(data) + frame(b"next"))
    first, second = connection.receive(5), connection.receive(5)
    assert first is not None and first.sizes == (len(data),) and bytes(first.frames[0] or b"") == data
    assert second is not None and [bytes(f or b"") for f in second.frames] == [b"next"]


def test_a_frame_split_across_receive_calls_arrives_whole(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    data = bytes(range(200)) * 3
    whole = frame(data) + frame(b"next")
    theirs.sendall(whole[:300])
    assert connection.receive(0) is None and connection.receive(0) is None  # half a frame: kept for later
    theirs.sendall(whole[300:])
    first, second = connection.receive(1), connection.receive(1)
    assert first is not None and bytes(first.frames[0] or b"") == data
    assert second is not None and [bytes(f or b"") for f in second.frames] == [b"next"]


def test_a_long_frame_header_split_across_reads_waits_for_its_size(
        pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    long = frame(b"y" * 300)
    theirs.sendall(frame(b"a") + long[:5])  # one read: a whole message, then part of the next frame's size
    first = connection.receive(1)
    assert first is not None and [bytes(f or b"") for f in first.frames] == [b"a"]
    theirs.sendall(long[5:])
    second = connection.receive(1)
    assert second is not None and second.sizes == (300,) and bytes(second.frames[0] or b"") == b"y" * 300


def test_a_message_that_comes_later_is_waited_for(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    later = threading.Timer(0.3, theirs.sendall, args=(frame(b"later"),))
    later.start()
    try:
        found = connection.receive(30)  # returns as soon as it comes; 30 s is only the bound
    finally:
        later.join(30)
    assert found is not None and [bytes(f or b"") for f in found.frames] == [b"later"]


def test_a_reset_connection_is_closed_with_the_reason(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    connection.send([b"unread"], 1)
    theirs.close()  # with our message unread in it: the next read fails with ECONNRESET
    with pytest.raises(ProtocolError, match=r"^the kernel closed its SUB connection \(\[Errno 104\] Connection reset"):
        connection.receive(1)
    assert connection.closed is True


def test_a_command_of_exactly_the_command_limit_is_taken(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    body = b"\x04PING" + b"x" * (zmtp.MAX_COMMAND - 5)
    theirs.sendall(frame(body, flags=zmtp.COMMAND, long=True) + frame(b"after"))
    found = connection.receive(5)
    assert found is not None and [bytes(f or b"") for f in found.frames] == [b"after"]
    theirs.sendall(frame(body + b"x", flags=zmtp.COMMAND, long=True))
    with pytest.raises(ProtocolError, match=r"^the kernel sent a malformed command frame \(65,537 bytes\)$"):
        connection.receive(5)


def test_a_message_before_ready_is_refused_by_name() -> None:
    ours, theirs = socket.socketpair()
    connection = zmtp.Connection(ours, "SUB", max_message=1000, max_frames=8)
    try:
        theirs.sendall(frame(b"early"))
        with pytest.raises(ProtocolError, match=r"^the kernel sent a message before its READY command$"):
            connection.receive(1)
    finally:
        connection.close()
        theirs.close()


def test_a_message_of_exactly_max_frames_is_taken(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    theirs.sendall(b"".join(frame(b"f", more=True) for _ in range(7)) + frame(b"f"))
    found = connection.receive(1)
    assert found is not None and len(found.frames) == 8
    theirs.sendall(b"".join(frame(b"f", more=True) for _ in range(8)) + frame(b"f"))
    with pytest.raises(ProtocolError, match=r"^the kernel sent a message of more than 8 frames$"):
        connection.receive(1)


@pytest.mark.parametrize("cut", [False, True], ids=["together", "each-frame-cut"])
def test_the_byte_limit_counts_every_kept_frame_of_a_message(cut: bool,
                                                            pair: tuple[zmtp.Connection, socket.socket]) -> None:
    """Frames wholly in the buffer are read in one loop; a frame cut short is read a piece at a time: both count."""
    connection, theirs = pair
    parts = [frame(b"a" * 400, more=True), frame(b"b" * 400, more=True), frame(b"c" * 300)]
    if cut:
        for part in parts:
            theirs.sendall(part[:100])
            assert connection.receive(0.2) is None
            theirs.sendall(part[100:])
        found = connection.receive(1)
    else:
        theirs.sendall(b"".join(parts))
        found = connection.receive(1)
    assert found is not None and found.sizes == (400, 400, 300)
    assert [bytes(f) if f is not None else None for f in found.frames] == [b"a" * 400, b"b" * 400, None]


def test_two_messages_of_exactly_the_limit_are_both_kept(pair: tuple[zmtp.Connection, socket.socket]) -> None:
    connection, theirs = pair
    theirs.sendall(frame(b"a" * 1000) + frame(b"b" * 1000))
    assert [bytes(connection.receive(1).frames[0] or b"") for _ in range(2)] == [b"a" * 1000, b"b" * 1000]  # type: ignore[union-attr]


def test_the_handshake_sends_greeting_ready_and_subscription() -> None:
    import tempfile

    got = bytearray()
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        path = Path(folder) / "s"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.listen(1)

        def serve() -> None:
            with server, server.accept()[0] as conn:
                conn.settimeout(10)
                conn.sendall(PEER + zmtp.command(b"READY", {"Socket-Type": b"XPUB"}))
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(65536):
                        got.extend(chunk)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        zmtp.Connection.open(path, "SUB", max_message=1000, max_frames=8, timeout=10).close()
        thread.join(10)
    assert bytes(got) == zmtp.GREETING + zmtp.command(b"READY", {"Socket-Type": b"SUB"}) + b"\x00\x01\x01"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("script", "words"), [(b"", "no ZMTP greeting from the kernel in time"),
                                               (PEER, "no READY command from the kernel in time")])
def test_a_silent_kernel_is_given_up_on_at_the_deadline(script: bytes, words: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        path = Path(folder) / "s"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.listen(1)
        with server:
            def serve() -> None:
                conn = server.accept()[0]
                conn.sendall(script)
                stop.wait(30)
                conn.close()

            stop = threading.Event()
            threading.Thread(target=serve, daemon=True).start()
            try:
                with pytest.raises(ProtocolError, match=f"^{words}$"):
                    zmtp.Connection.open(path, "SUB", max_message=1000, max_frames=8, timeout=0.5)
            finally:
                stop.set()


@pytest.mark.parametrize(("script", "words"), [
    (b"GET / HTTP/1.1\r\n" + bytes(48), "the kernel's socket does not speak ZMTP 3"),
    (PEER[:12] + b"CURVE".ljust(20, b"\0") + PEER[32:],
     "the kernel's socket asks for a security mechanism other than NULL"),
    (PEER + frame(b"\x05ERROR\x05d\xffnied", flags=zmtp.COMMAND), "the kernel refused the handshake: d\ufffdnied"),
    (PEER + frame(b"\x1e" + b"X" * 30, flags=zmtp.COMMAND),
     f"the kernel sent a {b'X' * 20!r} command instead of READY"),
    (PEER + frame(b"\x05READY", flags=zmtp.COMMAND), "the kernel's socket is a '', which a DEALER cannot talk to"),
    (PEER + zmtp.command(b"READY", {"Socket-Type": b"Y" * 30}),
     f"the kernel's socket is a {'Y' * 20!r}, which a DEALER cannot talk to"),
])
def test_each_handshake_failure_says_exactly_what(script: bytes, words: str) -> None:
    from .test_fuzz_wire import converse_greeting

    _, error = converse_greeting(script)
    assert isinstance(error, ProtocolError) and str(error) == words


# -- the kernel message --------------------------------------------------------------------------------------------

def test_the_replay_window_remembers_the_last_signatures_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_protocol, "_REPLAY_WINDOW", 4)
    client = kernel_protocol.KernelClient(KEY, 1 << 20)
    sent = [signed(header(f"m{i}")) for i in range(5)]
    for frames in sent:
        verify(list(frames), client)
    with pytest.raises(ProtocolError, match=r"^the kernel sent the same signed message twice \(a replay\)$"):
        verify(list(sent[1]), client)  # still within the last four
    assert verify(list(sent[0]), client) is not None  # out of the window: memory stays bounded


def test_recv_keeps_to_the_parent_asked_for(tmp_path: Path) -> None:
    fake = FakeKernel(tmp_path)
    try:
        fake.iopub.send_multipart(fake.frames("stream", b'{"text": "other"}', parent="p2"))
        fake.iopub.send_multipart(fake.frames("stream", STREAM))
        message = fake.client.recv("iopub", 5.0, parent="p1")
        assert message is not None and message.parent_id == "p1" and bytes(message.raw_content) == STREAM
        fake.iopub.send_multipart(fake.frames("stream", STREAM, key=None))
        with pytest.raises(ProtocolError, match="a message on iopub is unsigned"):
            fake.client.recv("iopub", 5.0)
    finally:
        fake.close()


def message(kind: str, content: object) -> Message:
    raw = json.dumps(content).encode()
    return Message("iopub", kind, "m", "p", len(raw), raw)


def _asks(*payload: object, **content: object) -> Message:
    return message("execute_reply", {"status": "ok", "payload": list(payload), **content})


@pytest.mark.parametrize(("reply", "asked"), [
    (_asks(), None),
    (_asks({"source": "ask_exit", "keepkernel": False}), ""),  # exit(): SystemExit shows nothing
    (_asks({"source": "ask_exit"}), ""),
    (_asks({"source": "ask_exit", "keepkernel": None}), ""),
    (_asks({"source": "ask_exit", "keepkernel": True}), "True"),
    (_asks({"source": "ask_exit", "keepkernel": 0}), "0"),  # 0 is not False: shown as the code passed it
    (_asks({"source": "ask_exit", "keepkernel": "k" * 300}), "k" * 200),
    (_asks(*({"source": "ask_exit", "keepkernel": word} for word in ("first", "middle", "last"))), "last"),
    (_asks({"source": "page", "data": {"text/plain": "ask_exit"}}), None),  # the words alone ask for nothing
    (_asks({"source": "ASK_EXIT", "keepkernel": 1}), None),
    (_asks("ask_exit", {"source": "ask_exit", "keepkernel": 2}), "2"),  # a payload that is not an object: skipped
    (message("execute_reply", {"status": "ok", "payload": None, "note": "ask_exit"}), None),
    (message("execute_reply", {"status": "ok", "payload": {"source": "ask_exit"}}), None),
    (message("execute_reply", ["ask_exit"]), None),  # content that is not an object: a reply nbexec cannot read
    (Message("shell", "execute_reply", "m", "p", 9, b'"ask_exit', True), None),
])
def test_exit_is_read_from_the_reply_s_ask_exit_payload_only(reply: Message, asked: str | None) -> None:
    assert messages.exit_asked(reply, 4096) == asked


def test_exit_is_not_read_from_a_reply_past_its_limit() -> None:
    reply = _asks({"source": "ask_exit", "keepkernel": "x" * 100})
    assert messages.exit_asked(reply, len(reply.raw_content)) == "x" * 100
    assert messages.exit_asked(reply, len(reply.raw_content) - 1) is None


@pytest.mark.parametrize(("state", "idle"), [("idle", True), ("busy", False), ("IDLE", False), (None, False)])
def test_dispatch_ends_the_cell_at_idle_only(state: str | None, idle: bool) -> None:
    run = Execution()
    assert kernel_protocol.dispatch(message("status", {"execution_state": state}), run, lambda m: None) is idle
    assert ("iopub.status.idle" in run.timing) is idle


@pytest.mark.parametrize(("count", "kept"), [(7, 7), ("7", None), (None, None)])
def test_dispatch_keeps_an_integer_execution_count_only(count: object, kept: int | None) -> None:
    run = Execution()
    assert kernel_protocol.dispatch(message("execute_input", {"execution_count": count}), run, lambda m: None) is False
    assert run.execution_count == kept and "iopub.execute_input" in run.timing


def test_an_execute_input_past_the_control_limit_is_refused() -> None:
    big = message("execute_input", {"code": "x" * kernel_protocol.MAX_CONTROL, "execution_count": 1})
    with pytest.raises(ProtocolError, match="over its"):
        kernel_protocol.dispatch(big, Execution(), lambda m: None)


def test_error_messages_are_counted_read_or_dropped_by_their_size() -> None:
    run = Execution()
    whole = message("error", {"ename": "E", "evalue": "v", "traceback": []})
    dropped = Message("iopub", "error", "m", "p", 5000, b"", False)  # past the frame limit: read past, not kept
    for msg in (whole, dropped, dropped, whole):
        assert kernel_protocol.dispatch(msg, run, lambda m: None) is False
    assert (run.status, run.errors_read, run.errors_dropped) == ("error", 2, 10000)


def test_a_frame_before_the_delimiter_is_not_taken_for_it() -> None:
    frames: list[bytes | None] = list(signed(header("m")))
    frames[0] = b"123456789"  # an identity frame as long as the delimiter
    found = verify(frames)
    assert found is not None and found.msg_id == "m"
    without = [frames[0], *frames[2:]]  # no delimiter, and five frames where they would follow it
    with pytest.raises(ProtocolError, match=r"^a message on iopub has no <IDS\|MSG> delimiter in its first 5 frames$"):
        verify(without)
    with pytest.raises(ProtocolError, match=r"^a message on iopub has 4 frames after its delimiter \(need 5\)$"):
        verify(frames[:-1])


@pytest.mark.parametrize("part", ["header", "parent"])
def test_headers_of_exactly_the_limit_are_parsed(part: str) -> None:
    head, parent = json.dumps(header("m")).encode(), b'{"msg_id": "p"}'
    if part == "header":
        head += b" " * (kernel_protocol.MAX_HEADER - len(head))
    else:
        parent += b" " * (kernel_protocol.MAX_HEADER - len(parent))
    found = verify(signed(head, parent=parent))
    assert found is not None and (found.msg_id, found.parent_id) == ("m", "p")
    with pytest.raises(ProtocolError, match="header over"):
        verify(signed(head + b" ", parent=parent) if part == "header" else signed(head, parent=parent + b" "))


def test_a_signature_of_128_bytes_is_checked_and_one_of_129_refused_unread() -> None:
    frames: list[bytes | None] = list(signed(header("m")))
    frames[2] = b"0" * 128
    with pytest.raises(ProtocolError, match="signature is wrong"):
        verify(frames)
    frames[2] = b"0" * 129
    with pytest.raises(ProtocolError, match="header over"):
        verify(frames)


@pytest.mark.parametrize(("head", "parent", "words"), [
    (b"[]", b"{}", r"^a message's header is not a JSON object$"),
    (b"{", b"{}", r"^a header message is not valid UTF-8 JSON: "),
    (b"{}", b"{", r"^a parent header message is not valid UTF-8 JSON: "),
    (b'{"msg_type": "stream", "msg_id": 5}', b"{}",
     r"^a message on iopub has a header without string msg_type and msg_id$"),
    (b'{"msg_type": 5, "msg_id": "m"}', b"{}", "without string msg_type"),
    (b'{"msg_type": "stream", "msg_id": "m"}', b'{"msg_id": 5}', "without string msg_type"),
])
def test_each_header_problem_is_named(head: bytes, parent: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        verify(signed(head, parent=parent))


def test_a_parent_without_an_id_is_no_parent() -> None:
    found = verify(signed(header("m"), parent=b"{}"))
    assert found is not None and (found.channel, found.msg_id, found.parent_id) == ("iopub", "m", "")


def test_header_problems_are_named() -> None:
    with pytest.raises(ProtocolError, match=r"^a message's parent header is not a JSON object$"):
        verify(signed(header("x"), parent=b"[]"))


# -- message content -----------------------------------------------------------------------------------------------

def test_content_up_to_its_limit_is_parsed_and_past_it_refused_with_the_sizes() -> None:
    raw = b'{"a": 1}'
    fits = Message("iopub", "stream", "m", "p", 1234, raw)
    assert fits.content(len(raw)) == {"a": 1}
    with pytest.raises(ProtocolError, match=r"^a stream message of 1,234 bytes is over its 7-byte limit$"):
        fits.content(len(raw) - 1)
    dropped = Message("iopub", "display_data", "m", "p", 5000, b"", complete=False)
    with pytest.raises(ProtocolError, match=r"^a display_data message of 5,000 bytes is over its 0-byte limit$"):
        dropped.content()
    with pytest.raises(ProtocolError, match=r"^a stream message is not valid UTF-8 JSON"):
        Message("iopub", "stream", "m", "p", 1, b"{").content()


def test_parse_errors_name_the_message_and_the_fault() -> None:
    with pytest.raises(ProtocolError, match=r"^a header message is nested too deeply$"):
        parse(b"[" * 100_000 + b"]" * 100_000, "header")
    with pytest.raises(ProtocolError, match=r"^a header message is not valid UTF-8 JSON: Expecting value: line 1"):
        parse(b"{\"a\": }", "header")


@pytest.mark.parametrize("raw", [b'{"t": "a\\uD800b"}', b'{"t": "a\\ud800b"}', b'{"\\uDC00": "b"}'])
def test_lone_surrogates_are_replaced_in_either_case_of_escape(raw: bytes) -> None:
    value = parse(raw, "x")
    assert "\ufffd" in json.dumps(value, ensure_ascii=False) and not any(
        0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(value, ensure_ascii=False))


def test_a_wide_value_walked_for_depth_keeps_its_text() -> None:
    raw = ("[" + ",".join(['["a", {"k": "b"}]'] * 70) + "]").encode()  # over MAX_DEPTH brackets: walked
    assert parse(raw, "x") == [["a", {"k": "b"}]] * 70


@pytest.mark.parametrize("levels", [MAX_DEPTH, MAX_DEPTH + 1])
def test_the_depth_cap_is_exact(levels: int) -> None:
    # Two lists at the deepest level: more brackets than MAX_DEPTH, so the value is walked, not let through
    raw = ("[" * (levels - 1) + "[0],[0]" + "]" * (levels - 1)).encode()
    if levels > MAX_DEPTH:
        with pytest.raises(ProtocolError, match=f"^a x message is nested more than {MAX_DEPTH} levels deep$"):
            parse(raw, "x")
    else:
        assert parse(raw, "x") is not None


# -- .env ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def environment() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_current_folder_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("NBEXEC_EDGE_HERE=1\n")
    monkeypatch.chdir(tmp_path)
    with environment():
        assert envfile.load() == ["NBEXEC_EDGE_HERE"] and os.environ["NBEXEC_EDGE_HERE"] == "1"


def test_a_env_of_exactly_the_cap_is_read_whole(tmp_path: Path) -> None:
    line = "NBEXEC_EDGE_LAST=end\n"
    (tmp_path / ".env").write_text("#" * (envfile.MAX_BYTES - len(line) - 1) + "\n" + line)
    assert (tmp_path / ".env").stat().st_size == envfile.MAX_BYTES
    with environment():
        assert envfile.load(tmp_path) == ["NBEXEC_EDGE_LAST"] and os.environ["NBEXEC_EDGE_LAST"] == "end"


def test_a_env_larger_than_it_said_is_refused(tmp_path: Path) -> None:
    """A .env whose size said 0 at fstat and whose reading gives MiBs (it grew): refused, not parsed. /proc/kallsyms
    is such a file; a .env may not be a link to it, so it is bind-mounted there (root only) for the test."""
    kallsyms = Path("/proc/kallsyms")  # a regular file of root's whose size says 0 and whose reading is MiBs
    assert kallsyms.stat().st_size == 0 and len(kallsyms.read_bytes()) > envfile.MAX_BYTES
    if os.getuid() != 0:
        pytest.fail("this test bind-mounts /proc/kallsyms over a .env: run it as root (as CI does)", pytrace=False)
    (tmp_path / ".env").touch()
    subprocess.run(["mount", "--bind", str(kallsyms), str(tmp_path / ".env")], check=True)
    try:
        with pytest.raises(ConfigError, match=rf"is over the {envfile.MAX_BYTES} bytes a \.env may have"):
            envfile.load(tmp_path)
    finally:
        subprocess.run(["umount", str(tmp_path / ".env")], check=True)


def test_read_at_most_reads_exactly_the_limit(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert envfile._read_at_most(fd, 200_000) == data[:200_000]  # several reads, joined as they came
    finally:
        os.close(fd)


def test_a_env_that_cannot_be_read_or_is_not_ours_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the socket below is bound by a relative name: a nested TMPDIR outgrows sun_path
    (tmp_path / ".env").symlink_to(tmp_path / ".env")  # a loop is a link like any other
    with pytest.raises(ConfigError, match=r"^/.*/\.env is a link; nbexec loads only a \.env that is a file of its own"):
        envfile.load(tmp_path)
    (tmp_path / ".env").unlink()
    with socket.socket(socket.AF_UNIX) as listening:  # a socket: open() fails (ENXIO) whoever asks, root too
        listening.bind(".env")
        with pytest.raises(ConfigError, match=r"^cannot read .*\.env: No such device or address$"):
            envfile.load(tmp_path)
    (tmp_path / ".env").unlink()
    (tmp_path / ".env").write_text("A=1\n")
    os.chmod(tmp_path / ".env", 0o646)
    with pytest.raises(ConfigError, match=r"is writable by everyone; nbexec reads only a \.env that is yours and "
                                          r"writable by you alone"):
        envfile.load(tmp_path)
    if os.getuid() == 0:  # only root can give a file to another user: uid 1 is neither root nor us
        os.chmod(tmp_path / ".env", 0o644)
        os.chown(tmp_path / ".env", 1, 1)
        with pytest.raises(ConfigError, match="is owned by uid 1"):
            envfile.load(tmp_path)



def test_each_refusal_of_a_env_says_what_to_do_in_full(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path)
    assert str(refused.value) == (f"{env} is a link; nbexec loads only a .env that is a file of its own (copy the "
                                  "settings into it, or run nbexec from another folder)")
    env.unlink()
    env.write_text("A=1\n")
    os.chmod(env, 0o602)
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path)
    assert str(refused.value) == (f"{env} is writable by everyone; nbexec reads only a .env that is yours and "
                                  "writable by you alone (fix it with chown/chmod g-w,o-w, or remove it)")
    os.chmod(env, 0o600)
    os.link(env, tmp_path / "second-name")
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path)
    assert str(refused.value) == (f"{env} has 2 names (a hard link): nbexec loads only a .env that is a file of its "
                                  "own, not a link to another (copy it, or run nbexec from another folder)")
    (tmp_path / "second-name").unlink()
    os.chmod(tmp_path, 0o757)
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path)
    assert str(refused.value) == (f"{env} lies in a folder writable by everyone; nbexec loads a .env only from a "
                                  f"folder that is yours and writable by you alone (chmod g-w,o-w {tmp_path}), or "
                                  "run nbexec from another folder")
    os.chmod(tmp_path, 0o755)
    (tmp_path / folders.MARK).write_text("")
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path)
    assert str(refused.value) == (f"{env} lies in an nbexec output folder ({tmp_path.resolve()}): files there may "
                                  "come from a sandbox, so nbexec never loads them. Keep your settings elsewhere, "
                                  "or run nbexec from another folder")


def test_a_env_folder_that_is_not_a_folder_is_refused_as_one(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("A=1\n")  # opened as a folder: ENOTDIR, before any .env is looked for
    with pytest.raises(ConfigError) as refused:
        envfile.load(tmp_path / "plain")
    assert str(refused.value) == f"cannot open the folder {tmp_path / 'plain'}: Not a directory"


def _stat(mode: int, gid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 1, 1, 1, os.getuid(), gid, 4, 0, 0, 0))


def test_a_group_may_write_a_env_only_when_it_is_the_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import grp
    import pwd

    user = pwd.getpwuid(os.getuid()).pw_name
    groups = {os.getgid(): grp.struct_group((user, "x", os.getgid(), [])),
              4242: grp.struct_group((user, "x", 4242, [])),  # named after the user, but not the user's group
              4343: grp.struct_group(("staff", "x", 4343, []))}
    monkeypatch.setattr(grp, "getgrgid", groups.__getitem__)
    assert envfile._control_problem(_stat(0o600, 4343)) == ""  # not writable by its group: whose group is moot
    assert envfile._control_problem(_stat(0o660, os.getgid())) == ""
    assert envfile._control_problem(_stat(0o660, 4242)) == "writable by group 4242"
    assert envfile._control_problem(_stat(0o660, 4343)) == "writable by group 4343"
    for members, private in (([user], True), (["other"], False), ([user, "other"], False)):
        groups[os.getgid()] = grp.struct_group((user, "x", os.getgid(), members))
        assert envfile._private_group(os.getgid()) is private, members
    groups[os.getgid()] = grp.struct_group(("staff", "x", os.getgid(), []))
    assert not envfile._private_group(os.getgid())  # the user's group, named otherwise: shared

# -- names a node gives --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "refused"), [("a/" + "n" * 255, False), ("a/" + "n" * 256, True),
                                               ("a\0b", True), ("é" * 127, False), ("é" * 128, True)])
def test_a_node_name_segment_is_at_most_255_bytes_and_has_no_nul(tmp_path: Path, name: str, refused: bool) -> None:
    with folders.OutputFolder.open(folders.make_output_dir(tmp_path / "out", may_exist=True)) as out:
        if refused:
            with pytest.raises(FileTransferError, match=r"is not a plain relative name$"):
                node_files.save(out, name, iter([b"x"]), 0)
        else:
            assert Path(node_files.save(out, name, iter([b"x"]), 0).path).read_bytes() == b"x"


# -- allowlist rules ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("host", "matched"), [("a.example.org", True), ("a.b.example.org", True),
                                               ("example.org", False), (".example.org", False),
                                               ("evilexample.org", False), ("xexample.org", False),
                                               ("a.example.org.evil", False)])
def test_a_wildcard_rule_matches_names_under_its_domain_only(host: str, matched: bool) -> None:
    assert egress.Rule("*.example.org", (443,)).matches(host, 443) is matched
    assert egress.Rule("*.example.org", (443,)).matches(host, 80) is False


def test_judgement_reasons_are_exact() -> None:
    def unknown(name: str, port: int) -> list[str]:
        raise socket.gaierror(-2, "Name or service not known")

    rules = egress.Allowlist([egress.parse_rule("x.example")], unknown)
    assert rules.judge("x.example", 443) == ([], "x.example does not resolve on the host (Name or service not known)")
    bad = "_" * 150 + "!"
    assert rules.judge(bad, 443) == ([], f"{bad[:100]!r} is not a host name or an address")


# -- error trimming ---------------------------------------------------------------------------------------------------

def test_an_error_name_is_kept_up_to_1024_bytes() -> None:
    assert outputs.trim_error("E" * 1024, "v", [], 1 << 20)[0] == "E" * 1024
    assert outputs.trim_error("E" * 1025, "v", [], 1 << 20)[0] != "E" * 1025


def test_the_last_frame_that_fits_exactly_is_kept() -> None:
    lines = ["head"] + [f"{i:09d}x" for i in range(100)]  # 11 bytes each with the newline
    # 491 = 200 for the marker + 5 for the first line + exactly 26 lines of 11
    assert outputs.trim_traceback(lines, 491)[2:] == lines[-26:]
    assert outputs.trim_traceback(lines, 490)[2:] == lines[-25:]


@pytest.mark.parametrize(("entry", "words"), [
    ("[::1]x", "write an IPv6 address as [addr] or [addr]:port"), ("a.example:http", "the port must be a number or *"),
    ("a.example:0", "the port is out of range"), ("a.example:65536", "the port is out of range"),
    ("*.1.2.3.4", "is not a host name, *.domain, or an IP address"), ("-a.example", "is not a host name")])
def test_a_bad_allowlist_entry_says_what_is_wrong(entry: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        egress.parse_rule(entry)
    assert f"allowed_hosts entry {entry!r}" in str(refused.value) and words in str(refused.value)


@pytest.mark.parametrize(("entry", "host", "ports"), [("a.example:1", "a.example", (1,)),
                                                      ("a.example:65535", "a.example", (65535,)),
                                                      ("[::1]:8080", "::1", (8080,))])
def test_the_ports_at_the_edges_are_allowed(entry: str, host: str, ports: tuple[int, ...]) -> None:
    assert egress.parse_rule(entry) == egress.Rule(host, ports)


@pytest.mark.parametrize(("host", "normal"), [
    ("-a.b.c", None), ("a.-b.c", None), ("*.com", None), ("*.a.com", "*.a.com"), ("A.Example.", "a.example"),
    ("a." * 126 + "b", "a." * 126 + "b"), ("a." * 126 + "bc", None)])  # 253 characters at most
def test_names_are_normalised_or_refused(host: str, normal: str | None) -> None:
    assert names.normal_host(host) == normal


def test_an_unparseable_answer_is_refused_with_the_reason() -> None:
    rules = egress.Allowlist([egress.parse_rule("x.example")], lambda name, port: ["not-an-address"])
    reason = ("x.example resolves to not-an-address, an unparseable address; such addresses are reached only when "
              "allowed_hosts lists the address itself")
    assert rules.judge("x.example", 443) == ([], reason)
