"""Servers inside an E2B sandbox, reached through the sandbox URL (#40, ports): E2B's own SDK (`e2b` from PyPI,
unmodified) makes the sandbox and starts the server in the background; httpx fetches through nbexec's relay with
the headers E2B's data plane routes by (E2b-Sandbox-Id, E2b-Sandbox-Port, the sandbox's traffic token). The
sandbox has no network interface but loopback throughout: the relay runs through its process supervisor."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

import nbexec
from nbexec.service.settings import ServerSettings

from . import e2bsdk
from .conftest import IMAGE, wait_until
from .test_server import TOKEN_A, Running, running

SERVER = """import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self, body, status=200, **headers):
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
    def do_GET(self):
        if self.path.startswith("/moved"):
            return self.answer(b"", 302, Location="http://169.254.169.254/latest/meta-data/")
        seen = "|".join(f"{k.lower()}={v}" for k, v in self.headers.items())
        self.answer(f"{self.command} {self.path} {seen}".encode(), Set_Cookie="a=1")
    def do_POST(self):
        size = int(self.headers.get("Content-Length", 0))
        self.answer(self.rfile.read(size)[::-1], 201)
    do_PUT = do_PATCH = do_DELETE = do_POST
    do_HEAD = do_GET
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door(e2b_ports=True) as service:
        yield service


@pytest.fixture
def sdk(door: Running, monkeypatch: pytest.MonkeyPatch) -> Running:
    """E2B's three variables, and nothing else of E2B's."""
    e2bsdk.point(monkeypatch, door.url, TOKEN_A)
    return door


@pytest.fixture
def serving(sdk: Running) -> Iterator[Sandbox]:
    """A sandbox whose code serves HTTP on 127.0.0.1:8000, started in the background with E2B's SDK."""
    sandbox = Sandbox.create(timeout=120)
    try:
        sandbox.files.write("/home/user/server.py", SERVER)
        sandbox.commands.run("python3 /home/user/server.py 8000", background=True, timeout=0)
        wait_until(lambda: "up" in sandbox.commands.run(
            "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000)); print('up')\" || true").stdout,
            30, "the server in the sandbox did not start")
        yield sandbox
    finally:
        sandbox.kill()


def relay(door: Running, sandbox: Sandbox, port: int = 8000, **headers: str) -> httpx.Client:
    """A client of the sandbox's port through the door, with the sandbox's own traffic token."""
    routing = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(port),
               "E2B-Traffic-Access-Token": sandbox.traffic_access_token or "", **headers}
    return httpx.Client(base_url=f"{door.url}/e2b/sandbox", headers=routing, timeout=60, follow_redirects=False)


def test_a_server_in_the_sandbox_answers_through_the_relay(door: Running, serving: Sandbox) -> None:
    host = serving.get_host(8000)  # what the SDK gives for a port: <port>-<id>.<domain>, a name E2B's DNS serves
    assert host.startswith(f"8000-{serving.sandbox_id}.")
    with relay(door, serving) as client:
        got = client.get("/some/path%20x", params={"q": "a b"}, headers={"X-Mine": "kept"})
        assert got.status_code == 200, got.text
        method, target, seen = got.text.split(" ", 2)
        assert (method, target) == ("GET", "/some/path%20x?q=a+b")
        assert "x-mine=kept" in seen and "connection=close" in seen
        for own in ("e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port", "x-access-token"):
            assert own not in seen  # nbexec's routing headers and the sandbox's token stay on the host
        assert got.headers["set-cookie"] == "a=1"
        posted = client.post("/echo", content=b"hello relay" * 1000)
        assert posted.status_code == 201 and posted.content == (b"hello relay" * 1000)[::-1]
        streamed = client.put("/echo", content=iter([b"abc"] * 3000))  # chunked, no Content-Length
        assert streamed.status_code in (201, 411), streamed.text  # the server reads Content-Length only
        head = client.head("/")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0


def test_a_redirect_is_passed_back_never_followed(door: Running, serving: Sandbox) -> None:
    with relay(door, serving) as client:
        got = client.get("/moved")
    assert got.status_code == 302 and got.headers["location"].startswith("http://169.254.169.254/")


def test_a_closed_port_answers_as_e2b_does(door: Running, serving: Sandbox) -> None:
    with relay(door, serving, port=8001) as client:
        got = client.get("/")
    assert got.status_code == 502, got.text
    assert got.json()["sandboxId"] == serving.sandbox_id and got.json()["port"] == "8001"
    assert got.json()["message"].startswith("The sandbox is running but port is not open")


def test_the_relay_is_off_unless_the_operator_turns_it_on(docker_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NBEXEC_E2B_PORTS", raising=False)
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30)
    settings = ServerSettings(config=config, tokens=(TOKEN_A,))
    assert settings.e2b_ports is False
    with running(settings) as door:
        for name in [n for n in os.environ if n.startswith("E2B_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("E2B_API_URL", f"{door.url}/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{door.url}/e2b/sandbox")
        monkeypatch.setenv("E2B_API_KEY", TOKEN_A)
        sandbox = Sandbox.create(timeout=60)
        try:
            sandbox.files.write("/home/user/server.py", SERVER)
            sandbox.commands.run("python3 /home/user/server.py 8000", background=True, timeout=0)
            probe = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)\""
            wait_until(lambda: sandbox.commands.run(probe + " 2>/dev/null || true").stdout.strip() == "200", 30,
                       "the server in the sandbox did not start")  # it runs: only the relay is off
            with relay(door, sandbox) as client:
                got = client.get("/")
        finally:
            sandbox.kill()
    assert got.status_code == 502 and "NBEXEC_E2B_PORTS=1" in got.json()["message"], got.text
