"""Hostile clients of the allowlist proxy (`nbexec.egress.proxy`), judged from the host: what the allowed server
received, what the log keeps, and the proxy's own threads. The sandbox reaches the proxy's Unix socket directly,
so each attack here talks to it raw, as code in the sandbox can."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbexec import egress
from nbexec.egress import proxy
from nbexec.egress.proxy import Limits, Proxy

from ..conftest import wait_until
from ..test_egress import Server, _ask


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
    _, path = gate

    def serving() -> int:
        return sum(1 for thread in threading.enumerate() if thread.name == "nbexec-egress-conn")

    before = serving()
    clients = []
    try:
        for _ in range(proxy.MAX_OPEN + 40):  # within the listen queue: every connect succeeds at once
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(path))
            clients.append(client)
        wait_until(lambda: serving() - before >= proxy.MAX_OPEN, 10, "the proxy did not take connections")
        assert serving() - before == proxy.MAX_OPEN
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
