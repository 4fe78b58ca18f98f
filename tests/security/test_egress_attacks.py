"""Hostile clients of the allowlist proxy (`nbexec.egress.proxy`), judged from the host: what the allowed server
received, what the log keeps, and the proxy's own threads. The sandbox reaches the proxy's Unix socket directly,
so each attack here talks to it raw, as code in the sandbox can."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbexec import egress
from nbexec.egress import proxy, request
from nbexec.egress.proxy import Limits, Proxy

from ..conftest import wait_until
from ..test_egress import Server, _ask

HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc"  # how a TLS ClientHello starts: what a tunnel must carry first


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    found = Server()
    yield found
    found.close()


@pytest.fixture
def short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A socket path relative to tmp_path (a Unix socket's address is at most 107 bytes, and TMPDIR may be deep)."""
    monkeypatch.chdir(tmp_path)
    return Path("proxy.sock")


@pytest.fixture
def gate(short: Path, server: Server) -> Iterator[tuple[Proxy, Path]]:
    path = short
    started = Proxy.start(path, egress.Allowlist.of([f"127.0.0.1:{server.port}"]),
                          Limits(max_bytes=100_000, max_connections=64))
    yield started, path
    started.close()


@pytest.mark.parametrize(("address", "problem"), [("fec0::1", "site-local"), ("::127.0.0.1", "reserved"),
                                                  ("2002:a9fe:a9fe::", "link-local")])
def test_odd_addresses_are_not_public(address: str, problem: str) -> None:
    assert problem in (egress.address_problem(ipaddress.ip_address(address)) or "")


@pytest.mark.parametrize("host", ["127.1", "0x7f.1", "2130706433", "::ffff:127.0.0.1", "::ffff:7f00:1",
                                  "0177.0.0.1", "127.000.000.001"])
def test_other_spellings_of_a_listed_address_are_not_it(host: str) -> None:
    # Only the listed address opens a loopback port: another spelling is a name (resolved and judged) or refused.
    addresses, reason = egress.Allowlist.of(["127.0.0.1:8080"]).judge(host, 8080)
    assert addresses == [] and reason is not None


@pytest.mark.parametrize("head", [
    "GET http://127.0.0.1:{port}/smuggled HTTP/1.1\nHost:\tevil.example\r\n\r\n",  # LF in the version
    "GET http://127.0.0.1:{port}/smuggled HTTP/1.1\r\nX-A: 1\nHost: evil.example\r\n\r\n",  # LF in a header
    "GET http://127.0.0.1:{port}/smuggled HTTP/1.1\r\nX-A: 1\rHost: evil.example\r\n\r\n",  # a bare CR
], ids=["version", "header", "carriage-return"])
def test_a_bare_line_break_cannot_smuggle_a_host_header(gate: tuple[Proxy, Path], server: Server, head: str) -> None:
    _, path = gate
    answer = _ask(path, head.format(port=server.port).encode())
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert not [seen for seen in server.seen if seen[0] == "/smuggled"], "the request reached the server"


def test_the_log_keeps_a_capped_host_name(gate: tuple[Proxy, Path]) -> None:
    started, path = gate
    _ask(path, b"CONNECT " + b"a" * 15_000 + b":443 HTTP/1.1\r\n\r\n")
    (shown,), _ = started.take()
    assert not shown.allowed and len(shown.host) <= proxy.MAX_NAME


def test_a_dripping_head_is_cut_off_as_a_whole(gate: tuple[Proxy, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = gate
    monkeypatch.setattr(proxy, "HEAD_TIMEOUT", 0.5)
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))
        client.settimeout(0.2)  # each byte comes well within the timeout; the head as a whole does not
        for _ in range(100):  # 20 s of dripping at most: the head is never finished
            try:
                client.sendall(b"G")
                if client.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        else:
            pytest.fail("the proxy kept a connection whose head never ended")


def test_a_flood_of_connections_holds_a_bounded_number_of_host_threads(gate: tuple[Proxy, Path]) -> None:
    started, path = gate

    def serving() -> int:
        return sum(1 for thread in threading.enumerate() if thread.name == "nbexec-egress-conn")

    # Judged against none: the threads of an earlier test's proxy may still be ending, and counting them as a
    # baseline that then shrinks would hide as many of this proxy's.
    wait_until(lambda: serving() == 0, 20, "an earlier proxy's connection threads did not end")
    before = 0
    clients = []
    most = started.limits.max_open
    try:
        for _ in range(most + 40):  # within the listen queue: every connect succeeds at once
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(path))
            client.settimeout(10)
            clients.append(client)
        wait_until(lambda: serving() - before >= most, 10, "the proxy did not take connections")
        turned = [client.recv(4096) for client in clients[most:]]  # past the budget: refused, not left waiting
        assert all(answer.startswith(b"HTTP/1.1 503") for answer in turned), turned[:2]
        assert serving() - before == most
    finally:
        for client in clients:
            client.close()
    wait_until(lambda: serving() == before, 20, "the proxy's threads did not end with their clients")


@pytest.fixture
def sink() -> Iterator[tuple[socket.socket, list[int]]]:
    """A loopback TCP server that counts and drops what it gets (an allowed upload destination)."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[int] = []

    def read(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                received.append(len(data))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=read, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener, received
    listener.close()


def test_the_byte_cap_counts_what_the_sandbox_sends(short: Path, sink: tuple[socket.socket, list[int]]) -> None:
    port, received = sink[0].getsockname()[1], sink[1]
    path = short
    started = Proxy.start(path, egress.Allowlist.of([f"127.0.0.1:{port}"]), Limits(max_bytes=100_000,
                                                                                    max_connections=4))
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(str(path))
            client.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            client.sendall(HELLO)  # a tunnel carries TLS only
            with contextlib.suppress(OSError):
                for _ in range(100):  # 1.6 MB offered against a 100 kB cap
                    client.sendall(b"x" * 16_384)
            with contextlib.suppress(OSError):
                assert client.recv(65536) == b"", "the tunnel stayed open past the byte cap"
        (shown,), notes = started.take()
    finally:
        started.close()
    assert sum(received) <= 100_000 and "byte cap" in (shown.reason or ""), (sum(received), shown)
    assert any("max_egress" in note for note in notes)


# -- one request per plain-http connection, its body framed ----------------------------------------------------

class Recorder:
    """An allowed loopback TCP server that keeps every byte each connection brings until the proxy closes it. It
    answers the first head of a connection and stops sending, as a lenient server that would go on reading
    pipelined requests (whatever their Host) would."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[bytearray] = []
        self.done = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=self._serve, args=(self.listener.accept()[0],), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        got = bytearray()
        self.connections.append(got)
        conn.settimeout(30)
        with conn, contextlib.suppress(OSError):
            while b"\r\n\r\n" not in got and (data := conn.recv(65536)):
                got += data
            if b"\r\n\r\n" in got:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                conn.shutdown(socket.SHUT_WR)
            while data := conn.recv(65536):
                got += data
        self.done += 1

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def recorders(short: Path) -> Iterator[tuple[Recorder, Recorder, Proxy, Path]]:
    first, other = Recorder(), Recorder()
    started = Proxy.start(short, egress.Allowlist.of([f"127.0.0.1:{first.port}", f"127.0.0.1:{other.port}"]),
                          Limits(max_bytes=1_000_000, max_connections=64))
    yield first, other, started, short
    started.close()
    first.close()
    other.close()


FIRSTS = {  # the first request, and the body its upstream must get (re-framed by the proxy, canonical)
    "get": ("GET http://127.0.0.1:{port}/first HTTP/1.1\r\nHost: evil.example\r\n\r\n", b""),
    "length": ("POST http://127.0.0.1:{port}/first HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", b"hello"),
    "chunked": ("POST http://127.0.0.1:{port}/first HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                "5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
}
SECONDS = {  # what a second, pipelined request tries
    "another-host": "GET http://127.0.0.1:{other}/second HTTP/1.1\r\nHost: 127.0.0.1:{other}\r\n\r\n",
    "any-host": "GET /second HTTP/1.1\r\nHost: metadata.google.internal\r\n\r\n",
    "hop-by-hop": ("GET /second HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, Keep-Alive\r\n"
                   "Upgrade: websocket\r\nProxy-Authorization: Basic eDp5\r\nKeep-Alive: 300\r\n\r\n"),
    "bare-lf": "GET /second HTTP/1.1\nHost: evil.example\n\n",
}


@pytest.mark.parametrize("second", SECONDS, ids=list(SECONDS))
@pytest.mark.parametrize("first", FIRSTS, ids=list(FIRSTS))
def test_a_pipelined_second_request_never_reaches_any_upstream(
        recorders: tuple[Recorder, Recorder, Proxy, Path], first: str, second: str) -> None:
    near, far, _, path = recorders
    request, body = FIRSTS[first]
    answer = _ask(path, (request + SECONDS[second]).format(port=near.port, other=far.port).encode())
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"ok"), answer[:200]
    wait_until(lambda: near.done == 1, 10, "the upstream connection was not closed")
    got = bytes(near.connections[0])
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /first HTTP/1.1\r\n" if body else b"GET /first HTTP/1.1\r\n"), got[:200]
    assert rest == body, f"the upstream got {rest[:300]!r} after the head"
    assert far.connections == [], "the other host was reached"


def test_headers_named_by_connection_are_not_forwarded(recorders: tuple[Recorder, Recorder, Proxy, Path]) -> None:
    near, _, _, path = recorders
    _ask(path, f"GET http://127.0.0.1:{near.port}/first HTTP/1.1\r\nConnection: keep-alive, X-Secret\r\n"
               "X-Secret: for the proxy only\r\nX-Kept: 1\r\nUpgrade: h2c\r\nTE: trailers\r\n\r\n".encode())
    wait_until(lambda: near.done == 1, 10, "the upstream connection was not closed")
    head = bytes(near.connections[0]).lower()
    assert b"x-kept: 1" in head and b"x-secret" not in head and b"upgrade" not in head and b"te:" not in head, head


@pytest.mark.parametrize("request_text", [
    "POST {url} HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 30\r\n\r\n0\r\n\r\nGET /2 HTTP/1.1\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "POST {url} HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "POST {url} HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\nhello",
    "POST {url} HTTP/1.1\r\nContent-Length: -1\r\n\r\nhello",
    "POST {url} HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello",
    "POST {url} HTTP/1.1\r\nContent-Length: \r\n\r\nhello",
    "POST {url} HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\nhello",
    "POST {url} HTTP/1.1\r\nX-Null: a\x00b\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\ng\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000005\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n",
    "POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: a\nHost: evil\r\n\r\n",
], ids=["length-and-chunked", "chunked-and-length", "other-coding", "two-codings", "xchunked", "chunked-http10",
        "two-lengths", "length-list", "negative-length", "signed-length", "empty-length", "huge-length",
        "nul-in-header", "size-bare-lf", "size-not-hex", "size-negative", "size-space", "size-0x",
        "size-17-digits", "no-crlf-after-data", "extension-bare-cr", "trailer-bare-lf"])
def test_an_ambiguous_or_malformed_body_is_refused_before_anything_is_sent(
        recorders: tuple[Recorder, Recorder, Proxy, Path], request_text: str) -> None:
    near, _, started, path = recorders
    answer = _ask(path, request_text.format(url=f"http://127.0.0.1:{near.port}/first").encode())
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    (shown,), _ = started.take()
    assert not shown.allowed or shown.bytes_up == 0, shown
    assert near.connections == [], f"the upstream got {bytes(near.connections[0])[:300]!r}"


def test_a_malformed_chunk_later_in_the_body_stops_the_request_there(
        recorders: tuple[Recorder, Recorder, Proxy, Path]) -> None:
    near, _, _, path = recorders
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(10)
        client.connect(str(path))
        client.sendall(f"POST http://127.0.0.1:{near.port}/first HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                       "5\r\nhello\r\n".encode())
        wait_until(lambda: near.connections and near.connections[0].endswith(b"hello\r\n"), 10,
                   "the first chunk did not arrive")
        with contextlib.suppress(OSError):
            client.sendall(b"zz\r\nGET /second HTTP/1.1\r\nHost: evil.example\r\n\r\n")
            while client.recv(65536):
                pass
    wait_until(lambda: near.done == 1, 10, "the upstream connection was not closed")
    assert bytes(near.connections[0]).partition(b"\r\n\r\n")[2] == b"5\r\nhello\r\n"


@pytest.mark.parametrize("split", [1, 2, 3, 7, 64])
def test_a_body_split_anywhere_arrives_whole_and_alone(
        recorders: tuple[Recorder, Recorder, Proxy, Path], split: int) -> None:
    near, _, _, path = recorders
    body = b"4\r\nwiki\r\n5;x=y\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nA: b\r\n\r\n"
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(10)
        client.connect(str(path))
        head = f"PUT http://127.0.0.1:{near.port}/first HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        client.sendall(head + body[:split])
        wait_until(lambda: near.connections, 10, "the head did not arrive")
        for at in range(split, len(body), split):
            client.sendall(body[at:at + split])
        with contextlib.suppress(OSError):  # the proxy may have closed already: the body was whole
            client.sendall(b"GET /second HTTP/1.1\r\n\r\n")
            while client.recv(65536):
                pass
    wait_until(lambda: near.done == 1, 10, "the upstream connection was not closed")
    rest = bytes(near.connections[0]).partition(b"\r\n\r\n")[2]
    assert rest == b"4\r\nwiki\r\n5\r\npedia\r\ne\r\n in\r\n\r\nchunks.\r\n0\r\n\r\n"


# -- the framing, as a pure parser of hostile bytes (hypothesis) -------------------------------------------------

def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [data[start:end] for start, end in itertools.pairwise(points)]


@settings(max_examples=300, deadline=None, database=None)
@given(parts=st.lists(st.binary(min_size=1, max_size=40), max_size=8), after=st.binary(max_size=60),
       cuts=st.lists(st.integers(0, 1000), max_size=12),
       style=st.sampled_from(["plain", "upper", "zeros", "extension", "trailer"]))
def test_a_chunked_body_in_any_split_passes_whole_canonical_and_alone(
        parts: list[bytes], after: bytes, cuts: list[int], style: str) -> None:
    def size(count: int) -> bytes:
        return {"upper": b"%X", "zeros": b"000%x", "extension": b"%x ;a=b;c"}.get(style, b"%x") % count

    sent = (b"".join(size(len(part)) + b"\r\n" + part + b"\r\n" for part in parts) + b"0\r\n"
            + (b"X-Trailer: 1\r\nY: 2\r\n" if style == "trailer" else b"") + b"\r\n" + after)
    framer = request.Chunked()
    out = b"".join(framer.feed(piece) for piece in _pieces(sent, cuts))
    assert framer.done and framer.problem is None
    assert out == b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


@settings(max_examples=500, deadline=None, database=None)
@given(data=st.one_of(st.binary(max_size=600), st.lists(st.sampled_from(
           [b"5", b"0", b"\r\n", b"\n", b"\r", b"hello", b";x=y", b"X: 1", b"ffffffffffffffff", b" "]),
           max_size=40).map(b"".join)),
       cuts=st.lists(st.integers(0, 1000), max_size=12))
def test_any_bytes_as_a_chunked_body_never_raise_never_grow_and_split_alike(data: bytes, cuts: list[int]) -> None:
    split, whole = request.Chunked(), request.Chunked()
    out = b"".join(split.feed(piece) for piece in _pieces(data, cuts))
    once = whole.feed(data)
    assert len(out) <= len(data), "the upstream got more than the sandbox sent"
    assert (split.done, split.problem) == (whole.done, whole.problem)
    if whole.problem is None:
        assert out == once


_NAMES = [b"Host", b"Connection", b"Content-Length", b"Transfer-Encoding", b"Upgrade", b"Proxy-Authorization",
          b"Keep-Alive", b"TE", b"Trailer", b"X-A", b"x-b", b"Content-length", b"Transfer-encoding", b"X A", b""]
_VALUES = [b"chunked", b" chunked ", b"Chunked", b"gzip, chunked", b"5", b"0", b"05", b"5, 5", b"-1", b"close",
           b"keep-alive, X-A", b"x-b", b"evil.example", b"a\x00b", b"a\x7fb", b"a\tb", b"\xff\xfe", b""]


@settings(max_examples=500, deadline=None, database=None)
@given(method=st.sampled_from([b"GET", b"POST", b"CONNECT", b"G T", b""]),
       target=st.sampled_from([b"http://127.0.0.1:8080/p?q", b"http://a@b/", b"/origin", b"https://x/", b"x:443"]),
       version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1"]),
       fields=st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(_VALUES)), max_size=6))
def test_a_forwarded_head_is_unambiguous(method: bytes, target: bytes, version: bytes,
                                         fields: list[tuple[bytes, bytes]]) -> None:
    head = b"\r\n".join([method + b" " + target + b" " + version, *(name + b":" + value for name, value in fields)])
    found = request.parse(head)
    if isinstance(found, str) or found.forward is None:
        return
    lines = found.forward[:-4].split(b"\r\n")
    names = [line.partition(b":")[0].lower() for line in lines[1:]]
    assert not any(b"\r" in line or b"\n" in line for line in lines)
    assert names.count(b"host") == 1 and names[-1] == b"connection" and names.count(b"connection") == 1
    assert names.count(b"content-length") + names.count(b"transfer-encoding") <= 1
    assert not {b"upgrade", b"proxy-authorization", b"keep-alive", b"te", b"trailer"} & set(names)
    declared = [name.lower() for name, _ in fields]
    assert not (b"content-length" in declared and b"transfer-encoding" in declared)
    named = {token.strip().lower() for name, value in fields if name.lower() == b"connection"
             for token in value.split(b",")}  # hop-by-hop too: never forwarded
    assert not named & (set(names[1:-1]) - {b"content-length", b"transfer-encoding"}), (named, names)


@pytest.fixture
def port_80() -> Iterator[list[tuple[str, str]]]:
    """A plain-http server on 127.0.0.1:80 (the tests run as root), recording (path, Host) of each request."""
    import http.server

    seen: list[tuple[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            seen.append((self.path, self.headers.get("Host", "")))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # the base class's names
            pass

    found = http.server.ThreadingHTTPServer(("127.0.0.1", 80), Handler)
    threading.Thread(target=found.serve_forever, daemon=True).start()
    yield seen
    found.shutdown()
    found.server_close()


def test_connect_to_the_plain_http_port_is_no_raw_tunnel(short: Path, port_80: list[tuple[str, str]]) -> None:
    """Attack (#36): the rule that lets plain http reach 127.0.0.1:80 made CONNECT to it a raw tunnel, and a request
    in that tunnel went on with any Host (plain requests get the URL's own). CONNECT to port 80 is refused."""
    started = Proxy.start(short, egress.Allowlist.of(["127.0.0.1:80"]), Limits(max_bytes=100_000, max_connections=8))
    try:
        answer = _ask(short, b"CONNECT 127.0.0.1:80 HTTP/1.1\r\n\r\n"  # the tunnel's request sent with it
                             b"GET /tunnelled HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n")
        plain = _ask(short, b"GET http://127.0.0.1/plain HTTP/1.1\r\nHost: other.example\r\n\r\n")
        shown, _ = started.take()
    finally:
        started.close()
    assert answer.startswith(b"HTTP/1.1 403") and b"port 80" in answer, answer[:300]
    assert plain.startswith(b"HTTP/1.0 204"), plain[:300]  # plain http to the port still goes, judged
    assert port_80 == [("/plain", "127.0.0.1")], port_80
    assert [(c.allowed, "CONNECT to port 80" in (c.reason or "")) for c in shown] == [(False, True), (True, False)]


TUNNELLED = b"GET /tunnelled HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("when", ["with-the-head", "after-the-answer", "one-byte-at-a-time"])
def test_a_tunnel_to_another_plain_http_port_carries_no_request(gate: tuple[Proxy, Path], server: Server,
                                                                when: str) -> None:
    """Attack (#36, attacker's read): a rule opening a plain-http port other than 80 (here the loopback server's)
    made CONNECT to it a raw tunnel, and a request in it went on with any Host. A tunnel carries TLS only: its
    first bytes must be a ClientHello, else it is refused (403 before any upstream connection, or closed)."""
    started, path = gate
    head = f"CONNECT 127.0.0.1:{server.port} HTTP/1.1\r\n\r\n".encode()
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(10)
        client.connect(str(path))
        client.sendall(head + TUNNELLED if when == "with-the-head" else head)
        answer = client.recv(65536)
        with contextlib.suppress(OSError):  # a reset while sending is the tunnel closed too
            for part in ([] if when == "with-the-head" else [TUNNELLED] if when == "after-the-answer"
                         else [bytes([byte]) for byte in TUNNELLED[:8]]):
                client.sendall(part)
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                answer += chunk
    shown, _ = started.take()
    assert not [seen for seen in server.seen if seen[0] == "/tunnelled"], "the tunnelled request reached the server"
    assert b"hello from" not in answer, answer[:300]
    assert answer.startswith(b"HTTP/1.1 403" if when == "with-the-head" else b"HTTP/1.1 200"), answer[:300]
    assert "TLS" in (shown[-1].reason or ""), shown[-1]
    plain = _ask(path, f"GET http://127.0.0.1:{server.port}/plain HTTP/1.1\r\nHost: other.example\r\n\r\n".encode())
    assert plain.endswith(b"hello from the allowed server"), plain[:300]  # plain http still goes, judged
    assert ("/plain", f"127.0.0.1:{server.port}") in server.seen


@given(data=st.one_of(st.binary(max_size=40), st.binary(max_size=40).map(lambda tail: HELLO + tail)),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6))
def test_a_tunnels_start_passes_whole_or_nothing(data: bytes, cuts: list[int]) -> None:
    """However the client's bytes are split, a tunnel passes them all, in order, when they open with a TLS
    ClientHello record, and none of them otherwise (what is held before the ninth byte is never sent)."""
    gate, sent = request.TlsStart(), b""
    edges = [0, *sorted(cut for cut in cuts if cut < len(data)), len(data)]
    for start, end in itertools.pairwise(edges):
        sent += gate.feed(data[start:end])
    record = int.from_bytes(data[3:5], "big")
    hello = len(data) >= 9 and data[0] == 0x16 and data[1] == 3 and data[2] <= 4 and data[5] == 1 \
        and 0 < record <= 16384 + 2048 and 38 <= int.from_bytes(data[6:9], "big") <= record - 4
    if hello:
        assert sent == data and gate.problem is None
    else:
        assert sent == b""
        assert gate.problem is not None or len(data) < 9


# -- a tunnel is raw again after its first six bytes --------------------------------------------------------------

class LineServer:
    """A loopback server of a line protocol (Redis's inline commands, SMTP, memcached): an unknown line gets an
    error and the connection goes on. It records every line."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError), conn.makefile("rb") as lines:
            for line in lines:
                self.lines.append(line.rstrip(b"\r\n"))
                conn.sendall(b"+OK\r\n" if line.startswith(b"SET ") else b"-ERR unknown command\r\n")


def test_a_tunnel_to_a_line_protocol_port_carries_no_command(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A tunnel must start like a TLS ClientHello, but only its first six bytes are judged: a record length of
    0x0d0a ("\\r\\n", within the longest record) ends a line, and everything after passes raw. A rule opening a
    port that speaks a line protocol (host:6379, host:25) takes any command through CONNECT. Before: the server
    ran the tunnelled command."""
    monkeypatch.chdir(tmp_path)
    server, path = LineServer(), Path("proxy.sock")
    started = Proxy.start(path, egress.Allowlist.of([f"127.0.0.1:{server.port}"]),
                          Limits(max_bytes=100_000, max_connections=8))
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(str(path))
            client.sendall(f"CONNECT 127.0.0.1:{server.port} HTTP/1.1\r\n\r\n".encode())
            answer = client.recv(4096)
            with contextlib.suppress(OSError):
                client.sendall(b"\x16\x03\x01\r\n\x01\r\nSET owned 1\r\n")
                time.sleep(1)
                answer += client.recv(4096)
    finally:
        started.close()
        server.sock.close()
    assert b"SET owned 1" not in server.lines, f"the tunnelled command reached the server: {answer!r}"
