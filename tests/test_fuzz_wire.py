"""Property-based tests of the kernel wire, where the sandbox's bytes first meet the host: ZMTP greetings, commands
and frames (`sandbox.zmtp`), a kernel message's signature, replay window and headers (`KernelClient._verify`), and
the JSON parser of message parts (`sandbox.messages`).

Properties: any bytes end in a value or a ProtocolError (never another exception); what is kept stays within the
byte and frame limits and is what was sent; a message is accepted only when its four signed parts carry the key's
HMAC, once; CPU time grows linearly with the input (tests/fuzzing.py)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import socket
import struct
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from nbexec.errors import ProtocolError
from nbexec.sandbox import kernel, zmtp
from nbexec.sandbox.kernel import MAX_HEADER, KernelClient
from nbexec.sandbox.messages import MAX_DEPTH, Message, parse

from .fuzzing import assert_linear
from .test_kernel import PEER, frame, ready

KEY = b"fuzz-key-" + b"k" * 23
LIMIT = 600  # bytes kept of one message in the framing tests
FRAMES = 8  # frames of one message in the framing tests

# -- ZMTP ------------------------------------------------------------------------------------------------------

Frame = tuple[bytes, bool, bool]  # body, more, long form
frames_strategy = st.lists(st.tuples(st.binary(max_size=300), st.booleans(), st.booleans()), max_size=14)


def peer(path: Path, script: bytes) -> threading.Thread:
    """A unix socket at ``path`` that answers one connection with ``script`` after the client's greeting, then
    ends its side (EOF after the last byte, never a reset) and reads until the client closes."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        with server, server.accept()[0] as conn:
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                conn.recv(64)
                conn.sendall(script)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def converse(script: bytes, *, max_frames: int = FRAMES) -> tuple[list[zmtp.Incoming], BaseException | None]:
    """Open a connection to a peer that sends ``script`` after its greeting, then ends; every message received
    and the exception that ended the conversation (the peer's EOF is a ProtocolError)."""
    received: list[zmtp.Incoming] = []
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # a short path: a unix socket address is 107 bytes
        path = Path(folder) / "s"
        server = peer(path, PEER + script)
        try:
            connection = zmtp.Connection.open(path, "SUB", max_message=LIMIT, max_frames=max_frames, timeout=5)
        except Exception as exc:  # judged by the caller: only ProtocolError is documented
            server.join(10)
            return received, exc
        try:
            while (message := connection.receive(5)) is not None:
                received.append(message)
        except Exception as exc:
            return received, exc
        finally:
            connection.close()
            server.join(10)
    return received, None


def expected_messages(frames: list[Frame]) -> list[list[bytes | None]]:
    """What a correct reader keeps of well-formed frames: per message, frames past the byte limit dropped."""
    messages: list[list[bytes | None]] = []
    current: list[bytes | None] = []
    kept, dropping = 0, False
    for body, more, _ in frames:
        dropping = dropping or kept + len(body) > LIMIT
        current.append(None if dropping else body)
        kept += 0 if dropping else len(body)
        if not more:
            messages.append(current)
            current, kept, dropping = [], 0, False
    return messages


def encode(frames: list[Frame]) -> bytes:
    return b"".join(frame(body, more=more, long=long) for body, more, long in frames)


@given(frames=frames_strategy)
@example(frames=[(b"a" * 500, True, False), (b"b" * 200, True, True), (b"c", False, False)])  # dropping holds
def test_well_formed_frames_arrive_as_sent_within_the_limits(frames: list[Frame]) -> None:
    received, error = converse(ready(b"XPUB") + encode(frames))
    assert isinstance(error, ProtocolError)  # the peer hung up: the documented error, after every whole message
    want = expected_messages(frames)
    if any(len(message) > FRAMES for message in want):
        cut = next(i for i, message in enumerate(want) if len(message) > FRAMES)
        want = want[:cut]
        assert f"more than {FRAMES} frames" in str(error)
    assert [[None if f is None else bytes(f) for f in m.frames] for m in received] == want
    sizes = iter(len(body) for body, _, _ in frames)
    for message in received:
        assert message.sizes == tuple(next(sizes) for _ in message.sizes)  # every frame counted, kept or not
        assert sum(len(f) for f in message.frames if f is not None) <= LIMIT
        assert len(message.frames) == len(message.sizes) <= FRAMES


def dripped(stream: bytes, pieces: list[int], *, max_message: int = LIMIT
            ) -> tuple[list[zmtp.Incoming], BaseException | None]:
    """Hand ``stream`` (the peer's greeting onwards) to a SUB connection in pieces of the given sizes (cycled; one
    byte at a time when none): each piece is sent only once the reader has taken every byte before it, so each of
    its reads ends exactly where a piece does. The messages received and the error that ended the reading."""
    ours, theirs = socket.socketpair()
    sizes = pieces or [1]

    def drip() -> None:
        with contextlib.suppress(OSError, ValueError):  # the reader closed its end (ValueError: fileno -1)
            at, turn = 0, 0
            while at < len(stream):
                while struct.unpack("i", fcntl.ioctl(ours, termios.FIONREAD, b"\0" * 4))[0]:
                    time.sleep(0.0002)
                size = sizes[turn % len(sizes)]
                theirs.sendall(stream[at:at + size])
                at, turn = at + size, turn + 1
            theirs.shutdown(socket.SHUT_WR)

    received: list[zmtp.Incoming] = []
    writer = threading.Thread(target=drip, daemon=True)
    writer.start()
    connection = zmtp.Connection(ours, "SUB", max_message=max_message, max_frames=10**6)
    try:
        connection._handshake(time.monotonic() + 5)
        while (message := connection.receive(5)) is not None:
            received.append(message)
    except Exception as exc:  # judged by the caller: the peer's EOF is the documented ProtocolError
        return received, exc
    finally:
        connection.close()
        writer.join(10)
        theirs.close()
    return received, None


@given(frames=frames_strategy, pieces=st.lists(st.integers(min_value=1, max_value=40), max_size=30))
@example(frames=[(b"", True, False), (b"a" * 300, True, True), (b"", False, True)], pieces=[])  # byte by byte
@example(frames=[(b"x", False, True), (b"", False, False)], pieces=[1, 8, 2, 9])  # cut inside each frame head
def test_a_stream_reads_the_same_however_the_kernel_splits_it(frames: list[Frame], pieces: list[int]) -> None:
    """The kernel chooses where its bytes break between the host's reads: its greeting, READY, short and long
    frame heads and bodies, cut anywhere, give the messages the whole stream gives, and nothing more."""
    received, error = dripped(PEER + ready(b"XPUB") + encode(frames), pieces)
    assert isinstance(error, ProtocolError) and "closed its SUB connection" in str(error), repr(error)
    assert [[None if f is None else bytes(f) for f in m.frames] for m in received] == expected_messages(frames)
    assert [m.sizes for m in received] == [tuple(len(body) for body, _, _ in group)
                                           for group in _grouped(frames)]


@pytest.mark.parametrize("pieces", [[], [4096], [100_000], [300_000], [9, 262_144, 1, 70_000]],
                         ids=["whole", "4k", "100k", "300k", "uneven"])
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "dropped"])
def test_a_large_frame_arrives_whole_however_it_is_split(pieces: list[int], kept: bool) -> None:
    """A frame of several socket reads (kept: read straight into its own buffer; dropped: only counted) arrives
    byte for byte or as its size alone, and the message after it is read whole."""
    body = bytes(range(256)) * 2731 + b"end"  # 699,139 bytes, no two neighbouring reads alike
    stream = PEER + ready(b"XPUB") + frame(body, more=True) + frame(b"tail") + frame(b"next")
    received, error = dripped(stream, pieces or [len(stream)],
                              max_message=(1 << 20) if kept else LIMIT)
    assert isinstance(error, ProtocolError) and "closed its SUB connection" in str(error), repr(error)
    assert [None if f is None else bytes(f) for f in received[0].frames] == ([body, b"tail"] if kept else [None, None])
    assert [m.sizes for m in received] == [(len(body), 4), (4,)]
    assert [bytes(f) for f in received[1].frames if f is not None] == [b"next"]


def _grouped(frames: list[Frame]) -> list[list[Frame]]:
    """The frames of each whole message (a trailing message with MORE set on its last frame is not one)."""
    groups: list[list[Frame]] = []
    current: list[Frame] = []
    for one in frames:
        current.append(one)
        if not one[1]:
            groups.append(current)
            current = []
    return groups


@given(frames=frames_strategy, at=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255),
       cut=st.integers(min_value=0))
def test_corrupt_frames_end_in_a_protocol_error_and_nothing_past_the_limits(
        frames: list[Frame], at: int, value: int, cut: int) -> None:
    stream = bytearray(ready(b"PUB") + encode(frames))
    stream[at % len(stream)] = value  # any one byte wrong, the READY command's included
    received, error = converse(bytes(stream[:len(stream) - cut % 8]))  # and possibly cut short
    assert error is None or isinstance(error, ProtocolError), repr(error)
    for message in received:
        assert sum(len(f) for f in message.frames if f is not None) <= LIMIT
        assert len(message.frames) == len(message.sizes) <= FRAMES
        for kept, size in zip(message.frames, message.sizes, strict=True):
            assert kept is None or len(kept) == size


@given(greeting=st.one_of(st.binary(min_size=64, max_size=64),
                          st.tuples(st.integers(0, 63), st.integers(0, 255)).map(
                              lambda change: PEER[:change[0]] + bytes((change[1],)) + PEER[change[0] + 1:])))
def test_a_greeting_is_accepted_only_when_it_is_zmtp_3_null(greeting: bytes) -> None:
    _, error = converse_greeting(greeting + ready(b"ROUTER"))
    valid = greeting[0] == 0xFF and greeting[9] == 0x7F and greeting[10] >= 3 and greeting[12:32] == PEER[12:32]
    if valid:
        assert error is None or isinstance(error, ProtocolError)  # the rest (as-server, filler) is not judged
    else:
        assert isinstance(error, ProtocolError), repr(error)


def converse_greeting(script: bytes) -> tuple[None, BaseException | None]:
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        path = Path(folder) / "s"
        server = peer(path, script)
        try:
            zmtp.Connection.open(path, "DEALER", max_message=LIMIT, max_frames=FRAMES, timeout=5).close()
        except Exception as exc:
            return None, exc
        finally:
            server.join(10)
    return None, None


@given(body=st.binary(max_size=200), start=st.integers(min_value=0, max_value=20))
def test_command_properties_parse_or_are_refused(body: bytes, start: int) -> None:
    try:
        found = zmtp.properties(body, start)
    except ProtocolError:
        return
    assert all(name == name.lower() for name in found)
    assert sum(len(value) for value in found.values()) <= len(body)


@given(props=st.dictionaries(st.text("abcdefgh-", min_size=1, max_size=20), st.binary(max_size=60), max_size=6))
def test_command_properties_round_trip(props: dict[str, bytes]) -> None:
    encoded = zmtp.command(b"READY", props)
    body = encoded[2:] if not encoded[0] & zmtp.LONG else encoded[9:]
    assert zmtp.properties(body, 1 + len(b"READY")) == props


def test_framing_is_linear_in_the_number_of_frames() -> None:
    def script(count: int) -> bytes:
        return ready(b"XPUB") + frame(b"x", more=True) * 3 * count + frame(b"y") * count

    assert_linear(script, lambda data: converse(data, max_frames=10**9), 2000)  # type: ignore[arg-type]


def test_command_properties_are_linear() -> None:
    assert_linear(lambda n: zmtp.command(b"READY", {f"p{i}": b"v" * 3 for i in range(n)})[9:],
                  lambda body: zmtp.properties(body, 6), 2000)  # type: ignore[arg-type]


# -- the kernel message: signature, replays, headers -----------------------------------------------------------

def signed(header: dict[str, Any] | bytes, content: bytes = b"{}", *, parent: bytes = b'{"msg_id": "p"}',
           metadata: bytes = b"{}", key: bytes = KEY) -> list[bytes]:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in (head, parent, metadata, content):
        digest.update(part)
    return [b"topic", b"<IDS|MSG>", digest.hexdigest().encode(), head, parent, metadata, content]


def verify(frames: list[bytes | None], client: KernelClient | None = None) -> Message | None:
    incoming = zmtp.Incoming(tuple(None if f is None else bytearray(f) for f in frames),
                             tuple(0 if f is None else len(f) for f in frames))
    return (client or KernelClient(KEY, 1 << 20))._verify("iopub", incoming)


def header(msg_id: str) -> dict[str, str]:
    return {"msg_id": msg_id, "msg_type": "stream", "session": "s", "username": "k"}


SHAPES = ["wrong-byte", "empty", "missing", "truncated", "other-key", "part-changed", "uppercase"]


@given(shape=st.sampled_from(SHAPES), at=st.integers(min_value=0), value=st.integers(1, 255),
       content=st.binary(max_size=64), msg_id=st.text(max_size=12))
def test_a_message_without_its_own_signature_is_refused(shape: str, at: int, value: int, content: bytes,
                                                       msg_id: str) -> None:
    frames: list[bytes | None] = list(signed(header(msg_id), content))
    signature = frames[2]
    assert signature is not None
    if shape == "wrong-byte":
        index = at % len(signature)
        frames[2] = signature[:index] + bytes((signature[index] ^ value,)) + signature[index + 1:]
    elif shape == "empty":
        frames[2] = b""
    elif shape == "missing":
        del frames[2]
    elif shape == "truncated":
        frames[2] = signature[:at % len(signature)]
    elif shape == "other-key":
        frames = list(signed(header(msg_id), content, key=KEY + b"x"))
    elif shape == "part-changed":
        part = 3 + at % 4
        original = frames[part] or b""
        frames[part] = original + bytes((value,)) if at % 2 else original[:-1]
    else:
        assume(signature.upper() != signature)
        frames[2] = signature.upper()
    with pytest.raises(ProtocolError):
        verify(frames)


@given(msg_id=st.text(max_size=12), content=st.binary(max_size=64))
def test_a_signed_message_is_accepted_once(msg_id: str, content: bytes) -> None:
    client = KernelClient(KEY, 1 << 20)
    frames: list[bytes | None] = list(signed(header(msg_id), content))
    message = verify(frames, client)
    assert message is not None and message.complete and message.msg_id == msg_id
    assert bytes(message.raw_content) == content
    with pytest.raises(ProtocolError, match="twice"):
        verify(frames, client)  # replayed


def is_signed(parts: list[bytes | None]) -> bool:
    if len(parts) < 5 or None in parts:
        return False
    digest = hmac.new(KEY, digestmod=hashlib.sha256)
    for part in parts[1:]:
        digest.update(part or b"")
    return parts[0] == digest.hexdigest().encode()


STRAY = [b"<IDS|MSG>", b"f" * 64, b"\x00k\x8bEg"]  # what ipykernel 7.4 once echoed before a reply (CI, stop 30)


@given(idents=st.lists(st.one_of(st.just(b"<IDS|MSG>"), st.binary(max_size=70)), max_size=3),
       msg_id=st.text(max_size=12))
def test_a_signed_message_after_stray_routing_frames_is_read(idents: list[bytes], msg_id: str) -> None:
    frames: list[bytes | None] = [*STRAY[:1], *idents, *signed(header(msg_id))[1:]]
    message = verify(frames)
    assert message is not None and message.complete and message.msg_id == msg_id


def test_the_reply_ci_saw_after_a_resume_is_read_and_its_tampered_twin_refused() -> None:
    frames: list[bytes | None] = [*STRAY, *signed(header("m"), b'{"status": "ok"}')[1:]]
    message = verify(frames)
    assert message is not None and message.msg_id == "m" and bytes(message.raw_content) == b'{"status": "ok"}'
    frames[-1] = b'{"status": "ko"}'
    with pytest.raises(ProtocolError, match="signature is wrong"):
        verify(frames)


@pytest.mark.parametrize("size", [129, 4096])
def test_a_long_routing_frame_after_a_stray_delimiter_is_never_taken_for_a_signature(size: int) -> None:
    """The candidate whose signature frame is too long is passed over unhashed, and the real message read."""
    frames: list[bytes | None] = [b"<IDS|MSG>", b"r" * size, *signed(header("m"))[1:]]
    message = verify(frames)
    assert message is not None and message.msg_id == "m"


@pytest.mark.parametrize("idents", [5, 6, 40])
def test_a_delimiter_after_more_than_four_routing_frames_is_refused(idents: int) -> None:
    frames: list[bytes | None] = [*[b"<IDS|MSG>"] * idents, *signed(header("m"))[1:]]
    with pytest.raises(ProtocolError, match=r"delimiter in its first 5 frames|signature is wrong"):
        verify(frames)


def test_stray_delimiters_cost_a_bounded_number_of_signature_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judged by the bytes hashed: each of the five candidates' four parts once."""
    hashed = [0]
    original = hmac.new

    class Counting:
        def __init__(self, key: bytes, digestmod: Any) -> None:
            self._digest = original(key, digestmod=digestmod)

        def update(self, part: bytes) -> None:
            hashed[0] += len(part)
            self._digest.update(part)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

        def digest(self) -> bytes:
            return self._digest.digest()

    def one_call(key: bytes, data: bytes, digest: str) -> bytes:  # a small message's HMAC, in one call
        hashed[0] += len(data)
        return original_digest(key, data, digest)

    original_digest = hmac.digest
    monkeypatch.setattr(kernel.hmac, "digest", one_call)
    big = b"x" * 100_000
    behind = [b"<IDS|MSG>", b"r", b"<IDS|MSG>", b"r", *signed(header("m"), big)[1:]]  # signed before counting
    monkeypatch.setattr(kernel.hmac, "new", Counting)
    with pytest.raises(ProtocolError):
        verify([b"<IDS|MSG>"] * 5 + [big] * 50)
    assert hashed[0] <= 5 * 4 * len(big)
    hashed[0] = 0  # a signed message behind two stray delimiters: its own four parts are hashed once
    message = verify(behind)
    assert message is not None and message.msg_id == "m"
    assert len(big) <= hashed[0] < 2 * len(big)


@given(prefix=st.lists(st.one_of(st.just(b"<IDS|MSG>"), st.binary(max_size=70), st.just(b"f" * 64)), max_size=6),
       msg_id=st.text(max_size=8), part=st.integers(0, 3), tamper=st.booleans())
def test_a_message_behind_routing_frames_is_read_only_whole_and_signed(prefix: list[bytes], msg_id: str, part: int,
                                                                     tamper: bool) -> None:
    """A signed message behind any routing frames (delimiters among them): read, with its own id, when its delimiter
    is within the first five frames and nothing signed was changed; refused otherwise."""
    message_frames = signed(header(msg_id), b'{"n": 1}')[1:]
    if tamper:
        message_frames[2 + part] = message_frames[2 + part] + b" "
    frames: list[bytes | None] = [*prefix, *message_frames]
    if tamper or len(prefix) > 4:
        with pytest.raises(ProtocolError):
            verify(frames)
        return
    message = verify(frames)
    assert message is not None and message.msg_id == msg_id and bytes(message.raw_content) == b'{"n": 1}'


@given(frames=st.lists(st.one_of(st.binary(max_size=80), st.just(b"<IDS|MSG>"), st.none()), max_size=10))
def test_any_frames_are_a_message_only_when_signed(frames: list[bytes | None]) -> None:
    try:
        message = verify(frames)
    except ProtocolError:
        return
    assert message is not None
    starts = [i + 1 for i, frame in enumerate(frames[:5]) if frame == b"<IDS|MSG>"]
    assert starts, "a message was read past the routing frames a client accepts"
    if message.complete:  # judged: the key's HMAC over exactly the four signed parts after one delimiter
        assert any(is_signed(frames[start:start + 5]) for start in starts)
    else:  # content dropped unread: it is never handed on
        with pytest.raises(ProtocolError):
            message.content(None)


@given(parent=st.binary(max_size=80), head=st.binary(max_size=80))
def test_headers_are_objects_with_string_ids_or_refused(parent: bytes, head: bytes) -> None:
    try:
        message = verify(signed(head, parent=parent))
    except ProtocolError:
        return
    assert message is not None
    assert isinstance(message.msg_type, str) and isinstance(message.msg_id, str)
    assert isinstance(message.parent_id, str)


def test_an_oversized_header_is_refused_before_it_is_parsed() -> None:
    deep = b"[" * (MAX_HEADER + 1)  # would be a RecursionError, were it parsed
    with pytest.raises(ProtocolError, match="header over"):
        verify(signed(deep))
    with pytest.raises(ProtocolError, match="header over"):
        verify(signed(header("x"), parent=deep))
    with pytest.raises(ProtocolError, match="header over"):
        verify([b"<IDS|MSG>", b"0" * 129, *signed(header("x"))[3:]])


def test_verification_is_linear_in_the_content() -> None:
    assert_linear(lambda n: signed(header("x"), b'{"t": "' + b"a" * n + b'"}'),
                  lambda frames: verify(frames), 200_000)  # type: ignore[arg-type]


# -- the JSON parser -------------------------------------------------------------------------------------------

json_text = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=4), max_leaves=20)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def no_surrogates(value: Any) -> bool:
    text = json.dumps(value, ensure_ascii=False)
    text.encode("utf-8")  # a lone surrogate would raise here, in every later encoder too
    return True


@given(raw=st.one_of(st.binary(max_size=200), json_text.map(lambda v: json.dumps(v).encode()),
                     st.text(max_size=60).map(lambda t: json.dumps(t).encode().replace(b"\\u", b"\\ud8"))))
def test_parse_gives_a_clean_shallow_value_or_a_protocol_error(raw: bytes) -> None:
    try:
        value = parse(raw, "fuzz")
    except ProtocolError:
        return
    assert depth(value) <= MAX_DEPTH
    assert no_surrogates(value)


@given(levels=st.integers(min_value=0, max_value=MAX_DEPTH + 40), kind=st.sampled_from("[{"))
def test_nesting_past_the_cap_is_refused(levels: int, kind: str) -> None:
    opening, closing = ("[", "]") if kind == "[" else ('{"k":', "}")
    raw = (opening * levels + "0" + closing * levels).encode()
    if levels > MAX_DEPTH:
        with pytest.raises(ProtocolError):
            parse(raw, "fuzz")
    else:
        assert depth(parse(raw, "fuzz")) == levels


@given(raw=st.binary(max_size=100), limit=st.integers(min_value=0, max_value=120))
def test_content_is_parsed_only_within_its_limit(raw: bytes, limit: int) -> None:
    message = Message("iopub", "stream", "m", "p", len(raw), raw)
    try:
        content = message.content(limit)
    except ProtocolError:
        return
    assert len(raw) <= limit and isinstance(content, dict)


@pytest.mark.parametrize("shape", ["surrogates", "keys-with-surrogates", "wide-and-shallow", "deep-then-wide"])
def test_parse_is_linear(shape: str) -> None:
    def make(n: int) -> bytes:
        if shape == "surrogates":
            return b'{"t": "' + b"\\ud800" * n + b'"}'
        if shape == "keys-with-surrogates":
            return b"{" + b",".join(b'"\\udc%02x%d": 1' % (i % 256, i) for i in range(n)) + b"}"
        if shape == "wide-and-shallow":
            return b"[" + b",".join([b"[[1]]"] * n) + b"]"
        return b"[" * 60 + b",".join([b"[]"] * n) + b"]" * 60

    assert_linear(make, lambda raw: parse(raw, "fuzz"), 5000)  # type: ignore[arg-type]
