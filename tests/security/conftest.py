"""Fixtures of the hostile suites (test_hostile.py, test_languages_hostile.py): a listener on the host side of
Docker's bridge that records what a sandbox sends it, and a canary file on the host the code must not touch."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nbexec.sandbox.docker import daemon


@dataclass
class Listener:
    """A TCP and a UDP socket on the host side of Docker's default bridge (an address of this machine, reached
    from a sandbox only when it has a network). It records what it receives; TCP peers get an HTTP 200."""

    host: str
    tcp: socket.socket
    udp: socket.socket
    received: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def got(self, token: str) -> bytes:
        with self.lock:
            return b"".join(r for r in self.received if token.encode() in r)

    def serve_tcp(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(3)
                try:
                    data = conn.recv(4096)
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
                except OSError:
                    continue
            with self.lock:
                self.received.append(data)

    def serve_udp(self) -> None:
        while True:
            try:
                data, _ = self.udp.recvfrom(4096)
            except OSError:
                return
            with self.lock:
                self.received.append(data)


@pytest.fixture(scope="module")
def listener(docker_ready: None) -> Iterator[Listener]:
    network = daemon.connect().networks.get("bridge")
    gateway = network.attrs["IPAM"]["Config"][0].get("Gateway") or "172.17.0.1"
    tcp, udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tcp.bind((gateway, 0))
        udp.bind((gateway, 0))
    except OSError as exc:
        pytest.fail(f"the network controls bind a listener on Docker's bridge gateway {gateway}, which must be an "
                    f"address of this machine (a local engine): {exc}", pytrace=False)
    tcp.listen(16)
    found = Listener(gateway, tcp, udp)
    for serve in (found.serve_tcp, found.serve_udp):
        threading.Thread(target=serve, daemon=True).start()
    yield found
    tcp.close()
    udp.close()


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "host"
    folder.mkdir()
    path = folder / "canary.txt"
    path.write_text("host secret")
    monkeypatch.setenv("NBEXEC_CANARY_SECRET", "s3cret-canary")
    return path
