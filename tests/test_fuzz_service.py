"""Property-based tests of the parsers at the service's doors: the router's file paths (`sandbox.remote.paths`),
the signed client header and router ids (`service.identity`), the SSE re-framer (`service.sse`) and the egress
proxy's request head and body framing (`egress.request`). Two readers the doors rely on sit here too: wheel
METADATA (`packages.resolver`) and the kernel's last-error report (`sandbox.lasterror`).

Properties: never an exception but the documented one; never a path outside the judged one (checked from outside:
the URL an HTTP client sends and a server decodes); a signature holds for its own call once and for nothing else;
chunking anywhere gives the same events and the same body; CPU time linear in the input (tests/fuzzing.py)."""

from __future__ import annotations

import base64
import json
import posixpath
import re
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from nbexec.egress import request
from nbexec.errors import FileTransferError, PackageError
from nbexec.packages import resolver
from nbexec.sandbox import lasterror
from nbexec.sandbox.remote import paths
from nbexec.service import identity, sse

from .fuzzing import assert_linear

# -- router file paths -------------------------------------------------------------------------------------------

PREFIX = "/v1/sessions/s1/files/"
name_parts = st.sampled_from(["a", "b.csv", "", ".", "..", "%2e", "%2E%2e", "%2f", "%5C", "%00", "%25", "%252e",
                              "%25252e", "%2525252e", "\\", "\0", "é", "?", "#", " ", "%", "%zz", "..."])
file_names = st.lists(st.lists(name_parts, max_size=3).map("".join), min_size=1, max_size=4).map("/".join) \
    | st.text(max_size=16)


def _plain(segment: str) -> bool:
    """The documented rule: a segment nobody can normalise away is not empty, '.' or '..' and has no NUL,
    backslash or slash, as it is and percent-decoded, and settles within four decodings."""
    for _ in range(4):
        if segment in ("", ".", "..") or any(c in segment for c in "\0\\/"):
            return False
        if unquote(segment) == segment:
            return True
        segment = unquote(segment)
    return False


@given(name=file_names)
def test_a_file_name_travels_as_itself_or_is_refused(name: str) -> None:
    try:
        route = paths.encode(name)
    except FileTransferError as exc:
        assert "segment" in str(exc)
        assert not all(_plain(s) for s in name.split("/"))  # refused only when a segment could move
        return
    assert all(_plain(s) for s in name.split("/")), name
    assert re.fullmatch(r"[A-Za-z0-9_.~%/-]+", route), route  # nothing left for anyone to normalise
    assert [unquote(s) for s in route.split("/")] == name.split("/")  # the name, whole
    sent = httpx.URL("http://node" + PREFIX + route).raw_path.decode()
    assert sent == PREFIX + route  # the client library rewrote nothing
    path = unquote(sent)  # what an ASGI server routes on (decoded once)
    assert path[len(PREFIX):] == name and posixpath.normpath(path).startswith(PREFIX)
    for _ in range(4):  # however often something on the way decodes it again, it stays in the session's files
        path = unquote(path)
        assert posixpath.normpath(path).startswith(PREFIX.rstrip("/")), path


def test_paths_are_judged_in_linear_time() -> None:
    assert_linear(lambda n: "/".join(["a%2541"] * n), paths.encode, 200)
    assert_linear(lambda n: "%25" * n + "2e", lambda name: _refused(name), 200)


def _refused(name: str) -> bool:
    try:
        paths.encode(name)
    except FileTransferError:
        return True
    return False


# -- the signed client header and router ids ---------------------------------------------------------------------

TOKEN, OTHER = b"node-token-" + b"n" * 24, b"other-token-" + b"o" * 24
clients = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
nodes = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])
targets = st.from_regex(r"\A/v1/sessions/[a-z0-9%.]{0,12}(/files/[a-z0-9%.]{0,8})?(\?stream=(true|false))?\Z")


@given(method=methods, target=targets, client=clients, node=nodes)
def test_a_signature_holds_for_its_own_call_once(method: str, target: str, client: str, node: str) -> None:
    header = identity.sign(TOKEN, method, target, client, node).encode()
    verifier = identity.Verifier()
    assert verifier.verify(TOKEN, method, target, header) == identity.For(client, node, identity.id_key(TOKEN))
    with pytest.raises(identity.SignatureError, match="replayed"):
        verifier.verify(TOKEN, method, target, header)
    fresh = identity.Verifier()
    for other in ((OTHER, method, target), (TOKEN, method + "X", target), (TOKEN, method, target + "x"),
                  (TOKEN, method.lower(), target)):
        with pytest.raises(identity.SignatureError, match="signature"):
            fresh.verify(other[0], other[1], other[2], header)


@given(method=methods, target=targets, client=clients, node=nodes, at=st.integers(0), byte=st.integers(0, 255),
       how=st.sampled_from(["replace", "truncate", "extend", "drop"]))
def test_a_changed_header_never_verifies(method: str, target: str, client: str, node: str, at: int, byte: int,
                                         how: str) -> None:
    header = identity.sign(TOKEN, method, target, client, node).encode()
    index = at % len(header)
    changed = {"replace": header[:index] + bytes([byte]) + header[index + 1:], "truncate": header[:index],
               "extend": header + bytes([byte]), "drop": header[:index] + header[index + 1:]}[how]
    assume(changed != header)
    with pytest.raises(identity.SignatureError):
        identity.Verifier().verify(TOKEN, method, target, changed)


@given(header=st.binary(max_size=600) | st.lists(st.binary(max_size=70), max_size=7).map(b";".join))
def test_any_header_is_refused_with_the_documented_error(header: bytes) -> None:
    with pytest.raises(identity.SignatureError):
        identity.Verifier().verify(TOKEN, "GET", "/v1/sessions/a", header)


@given(skew=st.integers(-200, 200))
def test_the_window_holds_exactly(skew: int) -> None:
    header = identity.sign(TOKEN, "GET", "/v1/sessions/a", "alice", "n1").encode()
    stamp = int(header.split(b";")[2])
    verifier = identity.Verifier(window=60)
    if abs(skew) <= 60:
        assert verifier.verify(TOKEN, "GET", "/v1/sessions/a", header, now=stamp + skew).client == "alice"
    else:
        with pytest.raises(identity.SignatureError, match="stale or from the future"):
            verifier.verify(TOKEN, "GET", "/v1/sessions/a", header, now=stamp + skew)


def test_verification_is_linear_in_the_target() -> None:
    def verify(target: object) -> None:
        assert isinstance(target, str)
        header = identity.sign(TOKEN, "GET", target, "alice", "n1").encode()
        identity.Verifier().verify(TOKEN, "GET", target, header)

    assert_linear(lambda n: "/v1/sessions/" + "a" * n, verify, 20_000)


# -- SSE re-framing ----------------------------------------------------------------------------------------------

_NAME = re.compile(rb"[A-Za-z0-9_-]{1,32}")


def reference(stream: bytes, max_event: int) -> tuple[list[tuple[bytes, bytes]], bool, bool]:
    """The events a WHATWG event-stream parser reads from ``stream`` (type, data), whether nbexec's framer must
    refuse it (an event's bytes past ``max_event``, or a malformed event name) and whether an event is left
    undispatched at its end. A leading byte-order mark is not stripped (nodes send none)."""
    lines = re.split(rb"\r\n|\r|\n", stream)
    complete, last = lines[:-1], lines[-1]
    events: list[tuple[bytes, bytes]] = []
    name, data, size, seen = b"", b"", 0, False
    refused = False
    for index, line in enumerate([*complete, last]):
        whole = index < len(complete)
        if whole and line == b"":
            if data:
                events.append((name or b"message", data[:-1]))
            name, data, size, seen = b"", b"", 0, False
            continue
        size += len(line)
        seen = seen or bool(line)
        refused = refused or size > max_event
        field, colon, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if not colon:
            field, value = line, b""
        if field == b"event":
            refused = refused or len(value) > 32 or (whole and not _NAME.fullmatch(value))
            name = value
        elif field == b"data" and whole:
            data += value + b"\n"
    return events, refused, seen


pieces = st.sampled_from([b"data: ", b"data:", b"data", b"event: ", b"event:", b"result", b"error", b"output",
                          b"a b", b"id: 1", b"retry: 9", b": ping", b":", b"x" * 40, b"{\"k\": 1}", b" ", b"\xff",
                          b"\r", b"\n", b"\r\n", b"\n\n", b"\r\r", b"\xef\xbb\xbf"])
streams = st.lists(pieces, max_size=24).map(b"".join) | st.binary(max_size=120)


def _relay(chunks: list[bytes], max_event: int) -> tuple[bytes | None, bool]:
    framer = sse.Framer(max_event)
    out = b""
    try:
        for chunk in chunks:
            out += b"".join(sse.encode(piece) for piece in framer.feed(chunk))
    except sse.EventError:
        return None, False
    return out, framer.pending


@given(stream=streams, cuts=st.lists(st.integers(0, 200), max_size=8), empty=st.booleans(),
       max_event=st.sampled_from([8, 40, 1000]))
@example(stream=b"data: x\r\ndata: y\n\n", cuts=[8], empty=True, max_event=1000)  # an empty read inside a CRLF
@example(stream=b"x" * 40 + b"\rdata: \r\r", cuts=[], empty=False, max_event=1000)  # after an overlong field name
def test_chunking_anywhere_gives_the_same_events(stream: bytes, cuts: list[int], empty: bool, max_event: int) -> None:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    if empty:  # a transport may hand over an empty read anywhere
        chunks = [piece for chunk in chunks for piece in (chunk, b"")]
    events, refused, pending = reference(stream, max_event)
    whole, whole_pending = _relay([stream], max_event)
    split, split_pending = _relay(chunks, max_event)
    assert (whole is None, split is None) == (refused, refused), (whole, split)
    if whole is None or split is None:
        return
    assert split == whole  # the same bytes, however the node's stream was cut
    assert b"\r" not in whole
    assert reference(whole, 10**9)[0] == events  # the client reads the events the node sent, and only those
    assert whole_pending == split_pending == pending


def test_reframing_is_linear() -> None:
    def drip(stream: object) -> None:
        assert isinstance(stream, bytes)
        framer = sse.Framer(10**9)
        for at in range(0, len(stream), 3):
            framer.feed(stream[at:at + 3])

    assert_linear(lambda n: b"data: " + b"x" * n + b"\n\n", drip, 3000)  # one long line, dripped
    assert_linear(lambda n: b"data: x\r\n" * n + b"\r\n", drip, 300)  # many lines, CRLFs split
    assert_linear(lambda n: b": " + b"c" * n, drip, 3000)  # an endless comment


# -- the proxy's request body framing ----------------------------------------------------------------------------

def _chunked(chunks: list[bytes], extensions: list[bytes], trailers: list[bytes]) -> tuple[bytes, bytes]:
    """A chunked body as a sandbox may send it (extensions, trailers) and as the upstream must get it."""
    sent = b"".join(b"%x" % len(c) + extensions[i % len(extensions)] + b"\r\n" + c + b"\r\n"
                    for i, c in enumerate(chunks)) + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"
    canonical = b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + b"0\r\n\r\n"
    return sent, canonical


def _feed(body: request.Body, data: bytes, cuts: list[int]) -> bytes:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return b"".join(body.feed(data[a:b]) for a, b in zip([0, *points], [*points, len(data)], strict=True))


@given(chunks=st.lists(st.binary(min_size=1, max_size=20), max_size=6),
       extensions=st.lists(st.sampled_from([b"", b";a=b", b" ;x", b";\t\"q\""]), min_size=1, max_size=3),
       trailers=st.lists(st.sampled_from([b"X-T: 1", b"Host: evil.example", b"A:"]), max_size=3),
       after=st.binary(max_size=40), cuts=st.lists(st.integers(0, 400), max_size=10))
def test_a_chunked_body_split_anywhere_arrives_re_framed_and_alone(chunks: list[bytes], extensions: list[bytes],
                                                                   trailers: list[bytes], after: bytes,
                                                                   cuts: list[int]) -> None:
    sent, canonical = _chunked(chunks, extensions, trailers)
    body = request.Chunked()
    assert _feed(body, sent + after, cuts) == canonical  # nothing after the body, no extension, no trailer
    assert body.done and body.problem is None
    assert body.feed(b"GET /second HTTP/1.1\r\n\r\n") == b""


@given(data=st.lists(st.sampled_from([b"5", b"0", b"a", b"G", b"ffffffffffffffff1", b";x", b"\r\n", b"\n", b"\r",
                                      b"hello", b"X: 1", b" ", b"\x00", b"-1"]), max_size=16).map(b"".join),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_chunked_bytes_are_framed_the_same_however_they_arrive(data: bytes, cuts: list[int]) -> None:
    whole, split = request.Chunked(), request.Chunked()
    at_once = whole.feed(data)
    in_pieces = _feed(split, data, cuts)
    assert (whole.problem is None) == (split.problem is None) and whole.done == split.done
    if whole.problem is None:
        assert at_once == in_pieces
        # what goes upstream is unambiguous: canonical chunks (lower-case hex sizes, no extension, no trailer)
        rest = in_pieces
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            assert re.fullmatch(rb"[1-9a-f][0-9a-f]*|0", size_line), size_line
            if size_line == b"0":
                assert rest == b"\r\n" and whole.done
                break
            size = int(size_line, 16)
            assert rest[size:size + 2] in (b"\r\n", b""), rest[:size + 2]  # whole, or cut after the data
            rest = rest[size + 2:]


@given(size=st.integers(0, 50), data=st.binary(max_size=80), cuts=st.lists(st.integers(0, 100), max_size=6))
def test_a_length_body_passes_exactly_its_length(size: int, data: bytes, cuts: list[int]) -> None:
    body = request.Length(size)
    assert _feed(body, data, cuts) == data[:size]
    assert body.done == (len(data) >= size) and body.problem is None


@given(head=st.binary(max_size=300))
def test_any_head_is_judged_without_an_exception(head: bytes) -> None:
    judged = request.parse(head)
    assert (isinstance(judged, str) and judged) or isinstance(judged, request.Request)


def test_body_framing_is_linear() -> None:
    def drip(data: object) -> None:
        assert isinstance(data, bytes)
        body = request.Chunked()
        for at in range(len(data)):
            body.feed(data[at:at + 1])

    assert_linear(lambda n: b"1\r\nx\r\n" * n + b"0\r\n\r\n", drip, 200)  # many chunks, a byte at a time
    assert_linear(lambda n: b"0" * min(n, 4000) + b"1\r\n", drip, 200)  # a size line growing to its cap


# -- wheel METADATA ----------------------------------------------------------------------------------------------

wheel_names = st.sampled_from(["a-1-py3-none-any.whl", "a_b-2.0-py3-none-any.whl", "A.B-1.0rc1-1-py3-none-any.whl",
                               "a-1.whl", "a-x-py3-none-any.whl", "", "a-1-py3-none-any.zip"])
metadata_lines = st.sampled_from(["Name: a", "Name: A", "Name: a-b", "Name: A.B", "Name: evil", "Name:", "Version: 1",
                                  "Version: 1.0", "Version: 2.0", "Version: 1.0rc1", "Version: x", "Requires-Dist: b",
                                  "Requires-Dist: c; extra == 'x'", "Provides-Extra: x", " continued", "no colon",
                                  "Name: a\x00", "Version: 1 ", ""])


@given(filename=wheel_names, lines=st.lists(metadata_lines, max_size=10))
def test_metadata_is_judged_against_its_file_name_or_refused(filename: str, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    try:
        fetched = resolver.read_metadata(filename, text)
    except PackageError as exc:
        assert str(exc)
        return
    name, version, _, _ = parse_wheel_filename(filename)
    said = next(line.split(":", 1)[1] for line in text.splitlines() if line.startswith("Name:"))
    assert fetched.name == name == canonicalize_name(said.strip())  # what the file says it is, and the metadata too
    assert Version(fetched.version) == version
    assert list(fetched.requires) == [line.split(":", 1)[1].strip() for line in lines
                                      if line.startswith("Requires-Dist:")]


def test_metadata_is_read_in_linear_time() -> None:
    assert_linear(lambda n: "Name: a\nVersion: 1\n" + "Requires-Dist: b\n" * n,
                  lambda text: resolver.read_metadata("a-1-py3-none-any.whl", text), 60)  # type: ignore[arg-type]


# -- the kernel's last-error report ------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=8)


def _reply(text: Any, status: Any = "ok") -> dict[str, Any]:
    return {"user_expressions": {lasterror.KEY: {"status": status, "data": {"text/plain": text}}}}


def _encoded(report: Any) -> str:
    return "'" + base64.b64encode(json.dumps(report).encode()).decode() + "'"


@given(reply=st.dictionaries(st.sampled_from(["user_expressions", "status", "x"]), json_values, max_size=3)
       | json_values.map(lambda v: {"user_expressions": {lasterror.KEY: v}})
       | json_values.map(lambda v: _reply(_encoded(v))))
def test_any_reply_gives_a_report_or_none(reply: dict[str, Any]) -> None:
    found = lasterror.read(reply)
    assert found is None or isinstance(found, lasterror.LastError)
    described = lasterror.from_reply(reply)
    assert described is None or isinstance(described, lasterror.LastError)


texts = st.text(max_size=30)


@given(ename=texts, evalue=texts, lines=st.lists(texts, max_size=4))
def test_a_report_reads_back_as_the_kernel_wrote_it(ename: str, evalue: str, lines: list[str]) -> None:
    report = {"raised": True, "ename": ename, "evalue": evalue, "traceback": lines}
    found = lasterror.read(_reply(_encoded(report)))
    assert found == lasterror.LastError(True, ename, evalue, tuple(line.rstrip("\n") for line in lines))
    assert lasterror.read(_reply(_encoded({"raised": False}))) == lasterror.LastError(False)
    for broken in (_reply(_encoded(report), status="error"), _reply(_encoded(report)[1:-1]),
                   _reply(_encoded(report)[:-2] + "!'"), _reply(_encoded({**report, "raised": 1})),
                   _reply(_encoded({**report, "traceback": [*lines, 3]})), _reply("''"), _reply(None)):
        assert lasterror.read(broken) is None


def test_an_abort_reply_is_an_interrupt() -> None:
    assert lasterror.from_reply({"status": "abort"}) == lasterror.LastError(
        True, "KeyboardInterrupt", "The cell was interrupted (the kernel answered 'abort').")


@given(status=json_values)
def test_a_reply_that_is_not_an_error_says_how_the_kernel_answered(status: Any) -> None:
    assume(status not in ("error", "abort"))  # abort: an interrupt (bash_kernel, IRkernel), see above
    found = lasterror.from_reply({"status": status})
    assert found == lasterror.LastError(True, "KernelError",
                                        f"The kernel answered the cell with status {str(status)[:100]!r}.")


def test_reading_a_report_is_linear() -> None:
    assert_linear(lambda n: _reply(_encoded({"raised": True, "ename": "E", "evalue": "v" * n, "traceback": ["t"] * n})),
                  lasterror.read, 2000)  # type: ignore[arg-type]
