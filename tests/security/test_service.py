"""Hostile HTTP clients against a real `nbexec serve` process on a loopback port.

Each attack is judged from outside: the server process's memory (/proc/<pid>/status), the status codes and
bodies it answers, the containers labelled with its pid, and its folders on the host.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from nbexec.errors import FileTransferError
from nbexec.files import artifacts
from nbexec.sandbox.docker import daemon

from ..azurite import free_port
from ..conftest import CONTAINER_ID, IMAGE, children_of, container_id

ROOT = Path(__file__).resolve().parents[2]
TOKEN_A = "token-a-" + "a" * 24
TOKEN_B = "token-b-" + "b" * 24
MiB = 1024 * 1024


@dataclass
class Served:
    """A running `nbexec serve` subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    children: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, token: str | None = TOKEN_A, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def memory_kib(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the server process in KiB."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])

    def containers(self, *, pool: bool = True) -> list[str]:
        """Names of the containers this server made (``pool=False``: all but its warm pool)."""
        found = daemon.connect().containers.list(all=True, sparse=True, filters={"label": daemon.LABEL_OWNER})
        return [c.attrs["Names"][0].lstrip("/") for c in found
                if c.attrs["Labels"].get(daemon.LABEL_OWNER, "").endswith(f":{self.proc.pid}")
                and (pool or c.attrs["Labels"].get(daemon.LABEL_ROLE) != "pool")]

    def folders(self) -> list[str]:
        return glob.glob(f"{tempfile.gettempdir()}/nbexec*/nbexec-{self.proc.pid}-*")

    def live_children(self) -> list[int]:
        alive = []
        for pid in self.children | _children(self.proc.pid):
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                continue
        return alive


def _children(pid: int) -> set[int]:
    return set(children_of(pid))


def start_serve(tmp: Path, *args: str, no_auth: bool = False, env: dict[str, str] | None = None) -> Served:
    tokens = tmp / "tokens"
    tokens.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    tokens.chmod(0o600)
    port = free_port()
    auth = ["--no-auth"] if no_auth else ["--token-file", str(tokens)]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "1",
               "NBEXEC_WARM_IMPORTS": "", "NBEXEC_TIMEOUT": "90", "NBEXEC_INTERRUPT_GRACE": "3", **(env or {})}
    environ.pop("NBEXEC_API_TOKENS", None)
    log = tmp / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from nbexec.cli.main import main; main()", "serve", "--host",
                                 "127.0.0.1", "--port", str(port), *auth, *args],
                                env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(proc, port, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"nbexec serve exited with {proc.returncode}:\n{log.read_text()}", pytrace=False)
        try:
            if httpx.get(f"{served.url}/healthz", headers={"Host": f"127.0.0.1:{port}"}, timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            time.sleep(0.2)
    stop(served)
    pytest.fail(f"nbexec serve did not answer /healthz:\n{log.read_text()}", pytrace=False)


def stop(served: Served, sig: int = signal.SIGTERM, wait: float = 90) -> int:
    served.children |= _children(served.proc.pid)
    served.proc.send_signal(sig)
    try:
        return served.proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait(timeout=30)
        raise


def assert_nothing_left(served: Served) -> None:
    """After the process ended: no container, no working folder and no child process of it remains."""
    deadline = time.monotonic() + 10
    while (served.containers() or served.folders() or served.live_children()) and time.monotonic() < deadline:
        time.sleep(0.2)
    containers, folders, children = served.containers(), served.folders(), served.live_children()
    for name in containers:  # clean up what leaked, then fail
        daemon.connect().containers.get(name).remove(force=True)
    assert (containers, folders, children) == ([], [], []), served.log.read_text()[-3000:]


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def served(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A real `nbexec serve` with two tokens, small limits and a short result TTL."""
    tmp = tmp_path_factory.mktemp("serve")
    server = start_serve(tmp, "--max-body", "1m", "--max-running-per-token", "2", "--max-sessions-per-token", "4",
                         "--result-ttl", "4", env={"NBEXEC_TIMEOUT": "30"})
    try:
        yield server
        # Leftovers are judged before anything is stopped: only the warm pool may remain.
        pool_only = wait_for(lambda: not server.containers(pool=False), 20)
        left = server.containers(pool=False)
    finally:
        stop(server)
    assert_nothing_left(server)
    assert pool_only, f"the tests left sandboxes in the running server: {left}"


def send_chunked(port: int, path: str, total: int, headers: dict[str, str]) -> tuple[int, int]:
    """POST ``total`` bytes as a chunked body over a raw socket; return (HTTP status, bytes sent)."""
    chunk = b"x" * MiB
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Transfer-Encoding: chunked",
                "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            while sent < total:
                sock.sendall(frame)
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: that is allowed
        sock.settimeout(60)
        reply = b""
        try:
            while b"\r\n" not in reply:
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
        except OSError:
            pass
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0
    return status, sent


@pytest.mark.parametrize(("token", "path", "status"), [
    (None, "/v1/execute", 401),
    (None, "/v1/sessions/x/files/a.bin", 401),
    (TOKEN_A, "/v1/execute", 413),
], ids=["unauthenticated-execute", "unauthenticated-upload", "authenticated-over-limit"])
def test_a_300_mib_chunked_body_costs_the_server_under_20_mib(served: Served, token: str | None, path: str,
                                                              status: int) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    before, _ = served.memory_kib()
    answered, sent = send_chunked(served.port, path, 300 * MiB, headers)
    _, peak = served.memory_kib()
    growth = (peak - before) / 1024
    print(f"\n{path} token={'yes' if token else 'no'}: sent {sent / MiB:.0f} MiB, "
          f"server RSS {before / 1024:.1f} MiB -> peak {peak / 1024:.1f} MiB (+{growth:.1f} MiB)")
    assert answered == status
    assert growth < 20, f"the server grew by {growth:.1f} MiB"


@pytest.mark.parametrize("value", [
    "Bearer " + "é" * 32, "Bearer " + TOKEN_A + "é", "Bearer \x01\x02" + "a" * 30, "bearer", "Bearer",
    "Basic " + TOKEN_A, TOKEN_A, "Bearer  " + TOKEN_A + "x", "Bearer " + "\udcff" * 20,
], ids=["non-ascii", "token-plus-non-ascii", "control", "scheme-only", "no-token", "basic", "no-scheme",
        "near-miss", "raw-high-bytes"])
def test_odd_authorization_headers_get_401(served: Served, value: str) -> None:
    raw = value.encode("utf-8", "surrogateescape")
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/sessions", skip_host=True)
        conn.putheader("Host", f"127.0.0.1:{served.port}")
        conn.putheader("Authorization", raw)
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 401, response.read()
    finally:
        conn.close()


def test_the_client_timeout_never_raises_the_operators_limit(served: Served) -> None:
    started = time.monotonic()
    with served.client() as client:
        result = client.post("/v1/execute", json={"code": "import time; time.sleep(90)", "timeout": 3600}).json()
    assert result["error"]["kind"] == "timeout", result
    assert time.monotonic() - started < 60  # the operator's 30 s limit (plus the grace), not the client's hour


def test_one_token_cannot_stall_another(served: Served) -> None:
    """A saturates its execution slots with sleeping cells and piles uploads and listings onto its busy session;
    B's cheap requests still finish while A's runs are running."""
    with served.client() as a:
        sid = a.post("/v1/sessions").json()["id"]
        a.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})
        runs = [threading.Thread(target=lambda: a.post(f"/v1/sessions/{sid}/execute",
                                                       json={"code": "import time; time.sleep(12)"})),
                threading.Thread(target=lambda: a.post("/v1/execute", json={"code": "import time; time.sleep(12)"}))]
        uploads = [threading.Thread(target=lambda i=i: a.put(f"/v1/sessions/{sid}/files/f{i}", content=b"x"))
                   for i in range(40)]  # more than asyncio's default thread pool holds
        # ... and downloads and listings, which a framework runs on its shared worker threads (40 in anyio's
        # default limiter): each waits for A's busy session.
        uploads += [threading.Thread(target=lambda: a.get(f"/v1/sessions/{sid}/files")) for _ in range(45)]
        for thread in runs:
            thread.start()
        time.sleep(0.5)
        for thread in uploads:
            thread.start()
        time.sleep(0.5)
        with served.client(TOKEN_B) as b:
            other = b.post("/v1/sessions")
            assert other.status_code == 201
            listing = b.get(f"/v1/sessions/{other.json()['id']}/files")
            assert listing.status_code == 200
            quick = b.post(f"/v1/sessions/{other.json()['id']}/execute", json={"code": "print('b')"}).json()
            b_done_while_a_runs = runs[0].is_alive()
            assert quick["stdout"] == "b\n"
            b.delete(f"/v1/sessions/{other.json()['id']}")
        for thread in runs + uploads:
            thread.join()
        a.delete(f"/v1/sessions/{sid}")
    assert b_done_while_a_runs, "B's requests waited for A's runs to end"


def _leaks_host_paths(text: str) -> list[str]:
    return [marker for marker in ("file://", "/tmp/", "output_dir", "notebook_path", '"path"') if marker in text]


def test_results_carry_no_host_paths_and_files_are_served_to_their_owner(served: Served) -> None:
    code = ("open('/mnt/data/out.txt', 'w').write('made')\n"
            "from IPython.display import Image, display\n"
            "import base64\n"
            "display(Image(base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=')))\n"
            "print('see sandbox:/mnt/data/out.txt')")
    with served.client() as a, served.client(TOKEN_B) as b:
        response = a.post("/v1/execute", json={"code": code, "files": {"in.txt": "aW4="}})
        assert response.status_code == 200 and response.json()["ok"], response.text
        assert _leaks_host_paths(response.text) == []
        result = response.json()
        kept = glob.glob(f"{tempfile.gettempdir()}/nbexec*/nbexec-{served.proc.pid}-*/*{result['execution_id']}*")
        assert kept, "the one-shot result's folder should exist during its TTL"
        urls = {f["name"]: f["url"] for f in result["files"]}
        assert urls["out.txt"].startswith("/v1/executions/") and urls["out.txt"] in result["stdout"]
        assert a.get(urls["out.txt"]).content == b"made" and a.get(urls["in.txt"]).content == b"in"
        image = result["images"][0]["url"]
        assert a.get(image).content.startswith(b"\x89PNG")
        assert b.get(urls["out.txt"]).status_code == 404 and b.get(image).status_code == 404
        assert a.get(urls["out.txt"].rsplit("/", 1)[0] + "/../../x").status_code in (400, 404)

        sid = a.post("/v1/sessions").json()["id"]
        ran = a.post(f"/v1/sessions/{sid}/execute", json={"code": code})
        assert _leaks_host_paths(ran.text) == [] and _leaks_host_paths(a.get(f"/v1/sessions/{sid}/files").text) == []
        session_urls = {f["name"]: f["url"] for f in ran.json()["files"]}
        assert a.get(session_urls["out.txt"]).content == b"made"
        assert a.get(ran.json()["images"][0]["url"]).content.startswith(b"\x89PNG")
        assert b.get(session_urls["out.txt"]).status_code == 404
        folder = glob.glob(f"{tempfile.gettempdir()}/nbexec*/nbexec-{served.proc.pid}-*/*{sid}*")
        assert folder, "the session's folder should exist while it is live"
        assert a.delete(f"/v1/sessions/{sid}").status_code == 204
        assert wait_for(lambda: all(not os.path.exists(p) for p in folder), 10), "the session's folder stayed"

        assert wait_for(lambda: a.get(urls["out.txt"]).status_code == 404, 20), "served past its TTL"
        assert wait_for(lambda: all(not os.path.exists(p) for p in kept), 10), "the result's folder stayed"


def _stream_until_first_output(client: httpx.Client, path: str, code: str) -> str:
    """Start a streamed run, read its first output event (returned), then leave."""
    with client.stream("POST", path, json={"code": code}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                return line  # leaving the block closes the connection: the client is gone
    pytest.fail("no output event arrived")


def test_a_client_leaving_a_session_stream_interrupts_the_run(served: Served) -> None:
    with served.client() as a:
        sid = a.post("/v1/sessions").json()["id"]
        _stream_until_first_output(a, f"/v1/sessions/{sid}/execute?stream=true",
                                   "import time\nprint('go', flush=True)\ntime.sleep(60)")
        left = time.monotonic()
        assert wait_for(lambda: a.get(f"/v1/sessions/{sid}").json()["status"] == "ready", 10), \
            "the session stayed busy after its client left"
        after = a.post(f"/v1/sessions/{sid}/execute", json={"code": "print('again')"}).json()
        assert after["stdout"] == "again\n" and time.monotonic() - left < 15  # not the 30 s time limit
        a.delete(f"/v1/sessions/{sid}")


def test_a_client_leaving_a_one_shot_stream_stops_its_sandbox(served: Served) -> None:
    with served.client() as a:
        first = _stream_until_first_output(a, "/v1/execute?stream=true",
                                           CONTAINER_ID + "\nimport sys, time\nsys.stdout.flush()\ntime.sleep(60)")
    container = container_id(first)  # the one-shot's own container, whatever its pool label says
    gone = lambda: not daemon.connect().containers.list(all=True, sparse=True, filters={"id": container})  # noqa: E731
    assert wait_for(gone, 10), "the one-shot sandbox outlived its client"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopping_the_server_leaves_nothing(docker_ready: None, tmp_path: Path, sig: int) -> None:
    server = start_serve(tmp_path, "--result-ttl", "600")
    try:
        with server.client() as a:
            sessions = [a.post("/v1/sessions").json()["id"] for _ in range(2)]
            for sid in sessions:
                assert a.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"}).json()["ok"]
            assert a.post("/v1/execute", json={"code": "open('/mnt/data/k', 'w').write('k')"}).json()["ok"]
            running = threading.Thread(target=lambda: _swallow(lambda: a.post(
                f"/v1/sessions/{sessions[0]}/execute", json={"code": "import time; time.sleep(60)"})))
            running.start()
            assert wait_for(lambda: a.get(f"/v1/sessions/{sessions[0]}").json()["status"] == "busy", 10)
            assert server.containers() and server.folders()
            started = time.monotonic()
            stop(server, sig)
            took = time.monotonic() - started
            running.join(timeout=30)
    finally:
        if server.proc.poll() is None:
            stop(server, signal.SIGKILL)
    assert_nothing_left(server)
    assert took < 40, f"stopping took {took:.0f} s"


def _swallow(call: Callable[[], object]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        call()


def test_no_auth_answers_only_loopback_host_names(docker_ready: None, tmp_path: Path) -> None:
    server = start_serve(tmp_path, no_auth=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example",
                         f"localhost:{server.port + 1}", "10.0.0.1", ""):
                response = client.post("/v1/sessions", headers={"Host": host})
                assert response.status_code in (400, 403), (host, response.status_code)
            for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "localhost", f"[::1]:{server.port}"):
                created = client.post("/v1/sessions", headers={"Host": host})
                assert created.status_code == 201, (host, created.text)
                client.delete(f"/v1/sessions/{created.json()['id']}", headers={"Host": host})
    finally:
        stop(server)
    assert_nothing_left(server)


# -- open_stream: what the file routes read with ---------------------------------------------------------------

def test_open_stream_reads_regular_files_only_and_within_the_cap(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ok.bin").write_bytes(b"a" * 3000)
    (tmp_path / "secret").write_text("host secret")
    os.symlink(tmp_path / "secret", tmp_path / "link")
    os.symlink(tmp_path / "sub", tmp_path / "dirlink")
    os.mkfifo(tmp_path / "fifo")
    size, chunks = artifacts.open_stream(tmp_path, "sub/ok.bin", max_bytes=3000, chunk=1024)
    assert size == 3000 and [len(c) for c in chunks] == [1024, 1024, 952]
    for name in ("link", "dirlink/ok.bin", "fifo", "sub", "../secret", "missing"):
        with pytest.raises(FileTransferError):
            artifacts.open_stream(tmp_path, name)
    with pytest.raises(FileTransferError):
        artifacts.open_stream(tmp_path, "sub/ok.bin", max_bytes=2999)


def test_open_stream_stops_at_the_size_seen_at_open(tmp_path: Path) -> None:
    target = tmp_path / "growing"
    target.write_bytes(b"a" * 100)
    size, chunks = artifacts.open_stream(tmp_path, "growing", chunk=10)
    with target.open("ab") as handle:
        handle.write(b"b" * 10_000)  # the code keeps writing after the download started
    assert size == 100 and b"".join(chunks) == b"a" * 100
    assert stat.S_ISREG(os.stat(target).st_mode)
