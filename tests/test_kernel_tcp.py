"""The kernel wire over TCP: a real ipykernel on this host, listening on 127.0.0.1, driven by nbexec's own kernel
client (ZMTP, signing, the execute loop) exactly as a unix-socket kernel is. No Docker: fast tier. A backend
whose kernel is not on this host's filesystem (a pod, another machine) connects this way."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbexec.errors import SandboxError
from nbexec.sandbox import zmtp
from nbexec.sandbox.kernel import KernelClient
from nbexec.sandbox.messages import Message


def _free_ports(count: int) -> list[int]:
    holders = [socket.socket() for _ in range(count)]
    try:
        for holder in holders:
            holder.bind(("127.0.0.1", 0))
        return [holder.getsockname()[1] for holder in holders]
    finally:
        for holder in holders:
            holder.close()


@pytest.fixture
def tcp_kernel(tmp_path: Path) -> Iterator[tuple[dict[str, Any], subprocess.Popen[bytes]]]:
    shell, iopub, stdin, control, hb = _free_ports(5)
    connection = {"transport": "tcp", "ip": "127.0.0.1", "key": secrets.token_hex(32),
                  "signature_scheme": "hmac-sha256", "kernel_name": "python3", "shell_port": shell,
                  "iopub_port": iopub, "stdin_port": stdin, "control_port": control, "hb_port": hb}
    (tmp_path / "kernel.json").write_text(json.dumps(connection))
    process = subprocess.Popen([sys.executable, "-m", "ipykernel_launcher", "-f", str(tmp_path / "kernel.json")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        yield connection, process
    finally:
        process.kill()
        process.wait(10)


def _ready(connection: dict[str, Any], process: subprocess.Popen[bytes]) -> KernelClient:
    client = KernelClient.connect(None, connection, max_message=1024 * 1024, timeout=30)
    deadline = time.monotonic() + 30

    def check() -> None:
        assert process.poll() is None, "the kernel exited while starting"
        assert time.monotonic() < deadline, "the kernel did not answer kernel_info within 30 s"

    info = client.wait_ready(check)
    client.wait_subscribed(check)
    assert info.get("name") == "python"
    return client


def test_a_cell_runs_on_a_kernel_over_tcp(tcp_kernel: tuple[dict[str, Any], subprocess.Popen[bytes]]) -> None:
    client = _ready(*tcp_kernel)
    try:
        seen: list[Message] = []
        run = client.run("x = 6 * 7\nprint('over tcp', x)", deadline=time.monotonic() + 30, grace=5,
                         on_output=seen.append, alive=lambda: True, kill=lambda: None)
        assert run.status == "ok" and run.reply == "ok"
        streams = [m.content() for m in seen if m.msg_type == "stream"]
        assert "".join(s["text"] for s in streams) == "over tcp 42\n"
        failed = client.run("1 / 0", deadline=time.monotonic() + 30, grace=5, on_output=seen.append,
                            alive=lambda: True, kill=lambda: None)
        assert failed.status == "error"
        reply = client.run_silent("pass", 30, expressions={"x": "x"})
        assert reply is not None and reply["user_expressions"]["x"]["data"]["text/plain"] == "42"
    finally:
        client.close()


def test_an_interrupt_over_tcp_ends_a_cell_at_its_deadline(
        tcp_kernel: tuple[dict[str, Any], subprocess.Popen[bytes]]) -> None:
    client = _ready(*tcp_kernel)
    try:
        started = time.monotonic()
        run = client.run("import time\ntime.sleep(60)", deadline=started + 1, grace=10, on_output=lambda m: None,
                         alive=lambda: True, kill=lambda: pytest.fail("the interrupt did not end the cell"))
        assert (run.status, run.stop) == ("timeout", "interrupted")
        assert time.monotonic() - started < 10
    finally:
        client.close()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "tcp://:5000", "udp://127.0.0.1:5000",
                                     "tcp://127.0.0.1:5000/x", "tcp://127.0.0.1:notaport"])
def test_a_malformed_tcp_address_is_refused(address: str) -> None:
    with pytest.raises(SandboxError, match="tcp://host:port"):
        zmtp.Connection.open(address, "DEALER", max_message=1024, max_frames=4, timeout=1)


def test_a_tcp_port_nobody_listens_on_fails_by_the_deadline() -> None:
    port = _free_ports(1)[0]
    started = time.monotonic()
    with pytest.raises(SandboxError, match="does not accept connections"):
        zmtp.Connection.open(f"tcp://127.0.0.1:{port}", "DEALER", max_message=1024, max_frames=4, timeout=0.5)
    assert time.monotonic() - started < 5
