"""`nbexec mcp` attacked as a hostile client would: a real server process on a loopback port, the real `mcp` client
over streamable HTTP, raw HTTP for the bearer check, and SIGTERM/SIGINT with live sessions.

Each server runs with its own TMPDIR, so every working and output folder it makes is under the test's tmp_path,
and its containers carry its pid in the `nbexec.owner` label: leaks are judged on exactly what it made.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from nbexec.sandbox.docker import daemon

from ..conftest import IMAGE, children_of


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class McpProcess:
    process: subprocess.Popen[bytes]
    tmp: Path
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def label(self) -> str:
        return f"{daemon.LABEL_OWNER}={socket.gethostname()}:{self.process.pid}"

    def containers(self) -> list[str]:
        return [c.id for c in daemon.connect().containers.list(all=True, sparse=True, filters={"label": self.label})]

    def folders(self) -> list[Path]:
        """Working folders and session output folders the server made (the two roots themselves excepted)."""
        roots = [root for root in self.tmp.iterdir() if root.name.startswith("nbexec") and root.is_dir()]
        return [entry for root in roots for entry in root.iterdir()]

    def children(self) -> list[int]:
        return list(children_of(self.process.pid))


def _environment(tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0", "TMPDIR": str(tmp)}
    env.pop("NBEXEC_API_TOKENS", None)
    return {**env, **(extra or {})}


def _start_http(tmp: Path, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1") -> McpProcess:
    port = _free_port()
    command = [sys.executable, "-m", "nbexec.cli", "mcp", "--transport", "streamable-http", "--host", host,
               "--port", str(port), "--timeout", "30", *args]
    with (tmp / "server.log").open("wb") as log:  # the child keeps its own descriptor
        server = McpProcess(subprocess.Popen(command, env=_environment(tmp, env), stdout=log, stderr=log), tmp, port)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.1)
    server.process.kill()
    raise AssertionError(f"nbexec mcp did not listen: {(tmp / 'server.log').read_text()[-2000:]}")


def _stop_and_clean(server: McpProcess) -> list[str]:
    """Stop the server as an operator would, then remove what is left: returns what had leaked."""
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=30)
    for stream in (server.process.stdin, server.process.stdout):
        if stream is not None:
            stream.close()
    leaked = server.containers()
    for name in leaked:
        daemon.connect().containers.get(name).remove(force=True)
    return leaked


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return _short(tmp_path)


def _short(tmp_path: Path) -> Path:
    """A private folder with a short path under ``tmp_path``: TMPDIR is part of every folder the server makes."""
    path = tmp_path / "t"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def http_server(docker_ready: None, tmp: Path) -> Iterator[McpProcess]:
    server = _start_http(tmp)
    yield server
    assert _stop_and_clean(server) == [], "the MCP server left containers"


@asynccontextmanager
async def _client(url: str, token: str | None = None) -> AsyncIterator[Any]:
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60, read=300)) as http, \
            streamable_http_client(url, http_client=http) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        yield client


def _text(result: Any) -> str:
    return "\n".join(getattr(c, "text", "") for c in result.content)


def conversation(tmp_path: Path, env: dict[str, str],
                 talk: Callable[[McpProcess, Any], Awaitable[dict[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    """Start `nbexec mcp` over HTTP with ``env`` (in a short private folder under ``tmp_path``), hold one client's
    conversation (``talk(server, client)`` returns what it saw) and stop the server as an operator would: what the
    conversation saw and the containers the server left."""
    server = _start_http(_short(tmp_path), env=env)

    async def held() -> dict[str, Any]:
        async with _client(server.url) as client:
            return await talk(server, client)

    try:
        seen = anyio.run(held)
    finally:
        leaked = _stop_and_clean(server)
    return seen, leaked


# -- state and files are per client ----------------------------------------------------------------------------

def test_two_http_clients_never_share_variables_or_files(http_server: McpProcess) -> None:
    async def attack() -> dict[str, Any]:
        from mcp.shared.exceptions import MCPError

        out: dict[str, Any] = {}
        async with _client(http_server.url) as alice, _client(http_server.url) as bob:
            first = await alice.call_tool("execute_python", {"code": "x = 1\nopen('a.txt', 'w').write('alice-secret')"})
            assert not first.is_error, _text(first)
            out["alice_x"] = _text(await alice.call_tool("execute_python", {"code": "print(x)"}))
            alice_uris = [str(r.uri) for r in (await alice.list_resources()).resources]
            out["alice_uris"] = alice_uris
            out["alice_read"] = (await alice.read_resource(alice_uris[0])).contents[0] if alice_uris else None
            out["bob_x"] = _text(await bob.call_tool("execute_python", {"code": "print(x)"}))
            out["bob_ls"] = _text(await bob.call_tool("execute_python", {
                "code": "import os; print(sorted(os.listdir('.')))"}))
            out["bob_uris"] = [str(r.uri) for r in (await bob.list_resources()).resources]
            out["bob_templates"] = [t.uri_template for t in (await bob.list_resource_templates()).resource_templates]
            guesses = alice_uris + [f"nbexec://{segment}/a.txt" for segment in ("stdio", "files", "alice")]
            out["bob_reads"] = []
            for uri in guesses:
                try:
                    content = await bob.read_resource(uri)
                    out["bob_reads"].append((uri, repr(content.contents)))
                except MCPError:
                    pass
        return out

    out = anyio.run(attack)
    assert out["alice_x"].splitlines()[0] == "1"
    assert len(out["alice_uris"]) == 1 and out["alice_read"].blob == "YWxpY2Utc2VjcmV0"  # b"alice-secret"
    assert "NameError" in out["bob_x"], "client B saw client A's variable"
    assert "a.txt" not in out["bob_ls"], "client B's /mnt/data holds client A's file"
    assert out["bob_uris"] == [], "client B lists client A's resources"
    assert out["bob_reads"] == [], "client B read client A's file through a resource URI"
    assert str(http_server.tmp) not in out["alice_x"], "host paths were sent to an HTTP client"


def test_the_sdks_default_client_keeps_its_state(http_server: McpProcess) -> None:
    """`mcp.client.Client` probes the single-exchange era first, whose requests carry no session: the server
    turns it to the handshake, so a session exists to keep state in (and to scope it by)."""
    from mcp.client import Client

    async def use() -> tuple[str, str]:
        async with Client(http_server.url) as client:
            await client.call_tool("execute_python", {"code": "x = 5"})
            return client.protocol_version, _text(await client.call_tool("execute_python", {"code": "print(x)"}))

    version, text = anyio.run(use)
    assert text == "5" and version != "2026-07-28"


def test_resources_are_capped(http_server: McpProcess) -> None:
    async def attack() -> tuple[str, str]:
        from mcp.shared.exceptions import MCPError

        async with _client(http_server.url) as client:
            await client.call_tool("execute_python", {
                "code": "f = open('big.bin', 'wb'); f.truncate(64 * 1024 * 1024); f.close()"})
            uri = next(str(r.uri) for r in (await client.list_resources()).resources if str(r.uri).endswith("big.bin"))
            try:
                await client.read_resource(uri)
            except MCPError as exc:
                return uri, str(exc)
            return uri, "read whole"

    _uri, message = anyio.run(attack)
    assert "larger than" in message, message


def test_ended_client_session_frees_its_container_folder_and_resources(http_server: McpProcess) -> None:
    async def use_and_leave() -> None:
        async with _client(http_server.url) as client:
            await client.call_tool("execute_python", {"code": "open('gone.txt', 'w').write('x')"})
            assert http_server.containers() and http_server.folders()
        # leaving the block sends DELETE: the MCP session ends here

    anyio.run(use_and_leave)
    deadline = time.monotonic() + 60
    while (http_server.containers() or http_server.folders()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert http_server.containers() == [], "the ended client's container is still there"
    assert http_server.folders() == [], "the ended client's folders are still there"
    assert http_server.process.poll() is None


# -- bearer tokens -----------------------------------------------------------------------------------------------

def test_non_loopback_host_without_tokens_refuses_to_start(docker_ready: None, tmp: Path) -> None:
    command = [sys.executable, "-m", "nbexec.cli", "mcp", "--transport", "streamable-http", "--host", "0.0.0.0",
               "--port", str(_free_port())]
    try:
        done = subprocess.run(command, env=_environment(tmp), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("nbexec mcp served a non-loopback address without tokens")
    assert done.returncode == 2, done.stderr
    assert "token" in done.stderr.lower()


def test_tokens_are_checked_before_the_mcp_app(docker_ready: None, tmp: Path) -> None:
    (tmp / "tokens").write_text("first-token-0123456789\nsecond-token-0123456789\n")
    server = _start_http(tmp, "--token-file", str(tmp / "tokens"))
    try:
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        statuses = {}
        for name, auth in [("none", None), ("wrong", b"Bearer wrong-token-0123456789"),
                           ("prefix", b"Bearer first-token"), ("non-ascii", "Bearer fïrst-token-0123456789".encode()),
                           ("basic", b"Basic Zmlyc3QtdG9rZW4tMDEyMzQ1Njc4OQ==")]:
            extra = {"Authorization": auth} if auth else {}
            reply = httpx.post(server.url, json=initialize, headers={**headers, **extra}, timeout=30)
            statuses[name] = reply.status_code
        assert statuses == dict.fromkeys(statuses, 401)

        async def allowed() -> str:
            async with _client(server.url, "second-token-0123456789") as client:
                return _text(await client.call_tool("execute_python", {"code": "print(6 * 7)"}))

        text = anyio.run(allowed)
        assert text == "42"
    finally:
        assert _stop_and_clean(server) == []


def test_a_session_id_is_bound_to_the_token_that_opened_it(docker_ready: None, tmp: Path) -> None:
    (tmp / "tokens").write_text("alice-token-0123456789\nmallory-token-0123456789\n")
    server = _start_http(tmp, "--token-file", str(tmp / "tokens"))
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    try:
        alice, mallory = "Bearer alice-token-0123456789", "Bearer mallory-token-0123456789"
        opened = httpx.post(server.url, headers={**headers, "Authorization": alice}, timeout=30, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "a", "version": "1"}}})
        session_id = opened.headers["mcp-session-id"]
        stolen = httpx.post(server.url, timeout=30, json={"jsonrpc": "2.0", "id": 2, "method": "resources/list"},
                            headers={**headers, "Authorization": mallory, "mcp-session-id": session_id,
                                     "mcp-protocol-version": "2025-06-18"})
        assert stolen.status_code == 404
    finally:
        assert _stop_and_clean(server) == []


# -- signals ------------------------------------------------------------------------------------------------------

def _rpc(process: subprocess.Popen[bytes], message: dict[str, Any]) -> dict[str, Any] | None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(message).encode() + b"\n")
    process.stdin.flush()
    if "id" not in message:
        return None
    while True:
        line = process.stdout.readline()
        assert line, "the stdio server closed its output"
        reply = json.loads(line)
        if reply.get("id") == message["id"]:
            return dict(reply)


def _start_stdio_with_session(tmp: Path) -> McpProcess:
    command = [sys.executable, "-m", "nbexec.cli", "mcp", "--timeout", "30"]
    with (tmp / "server.log").open("wb") as log:
        server = McpProcess(subprocess.Popen(command, env=_environment(tmp), stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log), tmp)
    _rpc(server.process, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    _rpc(server.process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
    reply = _rpc(server.process, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "execute_python", "arguments": {"code": "x = 1\nopen('kept.txt', 'w').write('x')"}}})
    assert reply is not None and "result" in reply, reply
    return server


@pytest.mark.parametrize("transport", ["stdio", "streamable-http"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_live_sessions_leaves_nothing(docker_ready: None, tmp: Path, transport: str,
                                                  signum: int) -> None:
    if transport == "stdio":
        server = _start_stdio_with_session(tmp)
        busy = None
    else:
        server = _start_http(tmp)
        busy = _http_busy_client(server)
    try:
        deadline = time.monotonic() + 60
        while not server.containers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.containers() and server.folders(), "no live session to leave behind"
        children = server.children()
        server.process.send_signal(signum)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"nbexec mcp ({transport}) did not stop within 60 s of {signum!r}")
        # judged before anything of the test closes a session
        assert server.containers() == [], f"containers left after {signum!r}"
        assert server.folders() == [], f"folders left after {signum!r}: {server.folders()}"
        assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == []
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
            assert busy.stdout is not None
            busy.stdout.close()
        leaked = _stop_and_clean(server)
    assert leaked == []


_BUSY_CLIENT = """
import anyio, httpx2, sys
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

async def main():
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(60, read=300)) as http, \\
            streamable_http_client(sys.argv[1], http_client=http) as (read, write), ClientSession(read, write) as c:
        await c.initialize()
        await c.call_tool("execute_python", {"code": "x = 1"})
        print("ready", flush=True)
        await c.call_tool("execute_python", {"code": "import time; time.sleep(300)"})

anyio.run(main)
"""


def _http_busy_client(server: McpProcess) -> subprocess.Popen[bytes]:
    """A client in another process with one idle-then-busy session (a cell running when the signal comes)."""
    client = subprocess.Popen([sys.executable, "-c", _BUSY_CLIENT, server.url], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    assert client.stdout is not None
    assert client.stdout.readline() == b"ready\n", "the busy client did not get going"
    return client


def test_snapshot_and_restore_tools(http_server: McpProcess) -> None:
    """A conversation keeps its session as a snapshot and another restores it (files and variables); a changed
    id is refused as a tool error, the session left as it was."""
    async def use() -> dict[str, str]:
        out: dict[str, str] = {}
        async with _client(http_server.url) as alice, _client(http_server.url) as bob:
            await alice.call_tool("execute_python", {"code": "x = 41\nopen('n.txt', 'w').write('kept')"})
            made = await alice.call_tool("snapshot_session", {})
            assert not made.is_error, _text(made)
            snapshot = _text(made).strip()
            changed = snapshot[:-1] + ("0" if snapshot[-1] != "0" else "1")
            bad = await bob.call_tool("restore_session", {"snapshot_id": changed})
            out["bad"] = f"{bad.is_error} {_text(bad)}"
            good = await bob.call_tool("restore_session", {"snapshot_id": snapshot})
            assert not good.is_error, _text(good)
            out["bob"] = _text(await bob.call_tool("execute_python", {"code": "print(x + 1, open('n.txt').read())"}))
        return out

    out = anyio.run(use)
    assert out["bad"].startswith("True Tool error") and "snapshot" in out["bad"]
    assert out["bob"].splitlines()[0] == "42 kept"
