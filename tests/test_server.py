"""`nbexec serve` on a loopback port with real Docker: every endpoint, auth, isolation, limits, streaming."""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import nbexec
from nbexec.result import json_schema
from nbexec.sandbox.docker import daemon
from nbexec.service.server import create_app, token_id
from nbexec.service.settings import ServerSettings

from .azurite import free_port
from .conftest import CONTAINER_ID, IMAGE, container_id, wait_until

TOKEN_A = "token-a-" + "a" * 24
TOKEN_B = "token-b-" + "b" * 24


@dataclass
class Running:
    url: str
    server: uvicorn.Server
    gate: Any  # the app's gate: executions in flight per token

    def client(self, token: str | None = TOKEN_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture(autouse=True)
def _leaks_before_teardown(cleanup_ledger: None) -> None:
    """Each test is judged for leaks when it ends, before the module's service closes anything."""


def exists(container: str) -> bool:
    return bool(daemon.connect().containers.list(all=True, sparse=True, filters={"id": container}))


@contextlib.contextmanager
def running(settings: ServerSettings) -> Iterator[Running]:
    """``create_app(settings)`` under uvicorn in this process, on a free loopback port."""
    port = free_port()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the server did not start")
        yield Running(f"http://127.0.0.1:{port}", server, app.state.gate)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def service(docker_ready: None) -> Iterator[Running]:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=30, interrupt_grace=2)
    settings = ServerSettings(config=config, tokens=(TOKEN_A, TOKEN_B), max_sessions_per_token=2,
                              max_running_per_token=1, max_body=1024 * 1024)
    with running(settings) as service:
        yield service


def test_health_ready_metrics(service: Running) -> None:
    with service.client(None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = wait_until(lambda: (r := client.get("/readyz")).status_code == 200 and r, 60, "never ready")
        assert ready.json()["ready"] is True and ready.json()["image"] == "ok"
        assert "nbexec_live_sessions" in client.get("/metrics").text


def test_metrics_count_executions_in_the_prometheus_format(service: Running) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with service.client() as client:
        assert client.post("/v1/execute", json={"code": "1/0"}).json()["ok"] is False
        response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    assert samples[("nbexec_executions_total", (("kind", "oneshot"),))] >= 1
    assert samples[("nbexec_failures_total", (("kind", "exception"),))] >= 1
    assert samples[("nbexec_execution_seconds_count", ())] >= 1
    assert ("nbexec_live_sessions", ()) in samples and ("nbexec_pool_ready", ()) in samples


# Each shape of a bad credential: missing, empty, wrong, truncated, extended, the other scheme, two of them.
BAD_AUTH = {"missing": None, "empty": "Bearer ", "scheme-only": "Bearer", "wrong": "Bearer wrong-token-xxxxxxxxxxxx",
            "truncated": f"Bearer {TOKEN_A[:-1]}", "extended": f"Bearer {TOKEN_A}x", "prefix": f"Bearer {TOKEN_A[:8]}",
            "basic": f"Basic {TOKEN_A}", "no-scheme": TOKEN_A, "two": f"Bearer wrong, Bearer {TOKEN_A}",
            "non-ascii": f"Bearer {TOKEN_A[:-1]}\u00e9"}


def test_auth_is_required(service: Running) -> None:
    """A call refused: no session is made and the code does not run, whatever the shape of a bad credential."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts(client: httpx.Client) -> dict[str, float]:
        text = client.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("nbexec_live_sessions", "nbexec_execution_seconds_count")}

    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    with service.client() as owner:
        before = counts(owner)
        for shape, value in BAD_AUTH.items():
            headers = {"Content-Type": "application/json"} | ({} if value is None else {"Authorization": value})
            for path in ("/v1/execute", "/v1/sessions"):
                # http.client sends the header as written (httpx refuses some of these shapes before sending)
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    connection.request("POST", path, body=b'{"code": "1"}',
                                       headers={k: v.encode() for k, v in headers.items()})
                    response = connection.getresponse()
                    text = response.read().decode(errors="replace")
                finally:
                    connection.close()
                assert response.status == 401, (shape, path, response.status)
                assert "wrong-token" not in text and TOKEN_A not in text
        assert counts(owner) == before  # no session was made, no code ran on a refused call


def test_execute_one_shot_with_files(service: Running) -> None:
    with service.client() as client:
        payload = {"code": "print(open('/mnt/data/in.txt').read().upper())\nopen('/mnt/data/out.txt','w').write('o')",
                   "files": {"in.txt": base64.b64encode(b"hello").decode()}}
        data = client.post("/v1/execute", json=payload).json()
        assert data["ok"] and data["stdout"] == "HELLO\n"
        assert sorted(f["name"] for f in data["files"]) == ["in.txt", "out.txt"]
        failed = client.post("/v1/execute", json={"code": "1/0"}).json()
        assert failed["ok"] is False and failed["error"]["ename"] == "ZeroDivisionError"
        assert client.post("/v1/execute", json={"code": ""}).status_code == 422
        assert client.post("/v1/execute", json={"code": "1", "files": {"x": "%%%"}}).status_code == 422
        assert client.post("/v1/execute", json={"code": "1", "files": {"../x": "eA=="}}).status_code == 400


def test_sessions_files_and_isolation(service: Running) -> None:
    with service.client() as a, service.client(TOKEN_B) as b:
        created = a.post("/v1/sessions")
        assert created.status_code == 201
        sid = created.json()["id"]
        assert a.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).json()["ok"]
        assert a.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x + 1)"}).json()["stdout"] == "42\n"
        blob = bytes(range(256)) * 50
        assert a.put(f"/v1/sessions/{sid}/files/dir/blob.bin", content=blob).status_code == 201
        assert a.get(f"/v1/sessions/{sid}/files/dir/blob.bin").content == blob
        assert [f["name"] for f in a.get(f"/v1/sessions/{sid}/files").json()["files"]] == ["dir/blob.bin"]
        assert a.get(f"/v1/sessions/{sid}").json()["status"] == "ready"
        for response in (b.get(f"/v1/sessions/{sid}"), b.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}),
                         b.get(f"/v1/sessions/{sid}/files/dir/blob.bin"), b.get(f"/v1/sessions/{sid}/files"),
                         b.put(f"/v1/sessions/{sid}/files/planted.txt", content=b"from b"),
                         b.put(f"/v1/sessions/{sid}/files/dir/blob.bin", content=b"overwritten by b"),
                         b.delete(f"/v1/sessions/{sid}")):
            assert response.status_code == 404, (response.request.method, response.request.url)
        assert [f["name"] for f in a.get(f"/v1/sessions/{sid}/files").json()["files"]] == ["dir/blob.bin"]
        assert a.get(f"/v1/sessions/{sid}/files/dir/blob.bin").content == blob  # B wrote nothing
        assert a.get(f"/v1/sessions/{sid}/files/missing.txt").status_code == 404
        assert a.delete(f"/v1/sessions/{sid}").status_code == 204
        assert a.get(f"/v1/sessions/{sid}").status_code == 404


def test_delete_frees_the_container_at_once(service: Running) -> None:
    with service.client() as client:
        sid = client.post("/v1/sessions").json()["id"]
        ran = client.post(f"/v1/sessions/{sid}/execute", json={"code": CONTAINER_ID}).json()
        assert ran["ok"], ran
        container = container_id(ran["stdout"])
        assert exists(container)
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
        assert not exists(container), "DELETE answered before the session's container was removed"


def test_limits_answer_429_and_413(service: Running) -> None:
    with service.client() as client:
        ids = [client.post("/v1/sessions").json()["id"] for _ in range(2)]
        refused = client.post("/v1/sessions")
        assert refused.status_code == 429 and refused.headers["Retry-After"]
        results: list[int] = []
        slow = threading.Thread(target=lambda: results.append(client.post(
            "/v1/execute", json={"code": "import time; time.sleep(3)"}).status_code))
        slow.start()
        wait_until(lambda: service.gate.running.get(token_id(TOKEN_A.encode()), 0) >= 1, 30,
                   "the slow execution never started")
        with service.client() as other:
            busy = other.post("/v1/execute", json={"code": "1"})
        slow.join()
        assert busy.status_code == 429 and results == [200]
        assert client.put(f"/v1/sessions/{ids[0]}/files/big.bin", content=b"x" * (2 * 1024 * 1024)).status_code == 413
        for sid in ids:
            client.delete(f"/v1/sessions/{sid}")


def test_streaming_delivers_output_before_the_cell_ends(service: Running) -> None:
    code = "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')"
    with service.client() as client:
        started = time.monotonic()
        seen: list[tuple[str, float]] = []
        with client.stream("POST", "/v1/execute?stream=true", json={"code": code}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("event: "):
                    seen.append((line[7:], time.monotonic() - started))
        kinds = [k for k, _ in seen]
        assert kinds[0] == "output" and kinds[-1] == "result"
        assert seen[0][1] < seen[-1][1] - 1.5  # the first output arrived while the cell still slept


def test_openapi_documents_the_routes(service: Running) -> None:
    with service.client(None) as client:
        paths = client.get("/openapi.json").json()["paths"]
    for route in ("/v1/execute", "/v1/sessions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/execute",
                  "/v1/sessions/{session_id}/files", "/v1/sessions/{session_id}/files/{name}", "/healthz"):
        assert route in paths, route
    with service.client(None) as client:
        document = client.get("/openapi.json").json()
    scheme = document["components"]["securitySchemes"]["HTTPBearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    execute = document["paths"]["/v1/execute"]["post"]
    assert execute["security"] == [{"HTTPBearer": []}]
    assert "security" not in document["paths"]["/healthz"]["get"]
    ok = execute["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == json_schema(public=True)  # the result's one definition
    assert "text/event-stream" in ok
    result = ok["application/json"]["schema"]
    assert {"ok", "stdout", "error", "files", "images"} <= set(result["required"])
    assert "output_dir" not in result["properties"] and "path" not in result["properties"]["files"]["items"][
        "properties"]  # no host path in what the service sends
    session = document["paths"]["/v1/sessions"]["post"]["responses"]["201"]["content"]["application/json"]
    assert session["schema"] == {"$ref": "#/components/schemas/SessionModel"}


def test_fuzzing_finds_no_server_error(service: Running) -> None:
    """Requests generated from the server's own OpenAPI document (schemathesis + hypothesis) never get a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    auth = {"Authorization": f"Bearer {TOKEN_A}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10

    def run_case(case) -> None:  # type: ignore[no-untyped-def]
        case.headers = {**(case.headers or {}), **auth}
        response = case.call(base_url=service.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        if case.path == "/v1/sessions" and case.method.upper() == "POST" and response.status_code == 201:
            httpx.delete(f"{service.url}/v1/sessions/{response.json()['id']}", headers=auth, timeout=60)

    budget = settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    for operation in operations:
        budget(given(case=operation.as_strategy())(lambda case: run_case(case)))()


def test_typescript_client_runs_with_node(service: Running, tmp_path: Path) -> None:
    root = Path(__file__).parent.parent
    tsc = root / ".tools" / "node_modules" / ".bin" / "tsc"
    node = shutil.which("node")
    assert node and tsc.exists(), "needs Node.js and TypeScript in .tools/ (run scripts/setup.sh --test)"
    compiled = subprocess.run([str(tsc), str(root / "examples" / "typescript" / "client.ts"), "--target", "es2022",
                               "--module", "nodenext", "--types", "node", "--typeRoots",
                               str(root / ".tools" / "node_modules" / "@types"), "--outDir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stdout  # the example type-checks
    done = subprocess.run([node, str(tmp_path / "client.js")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NBEXEC_URL": service.url, "NBEXEC_TOKEN": TOKEN_B})
    assert done.returncode == 0, done.stderr
    assert "one-shot: ok=true stdout=5050" in done.stdout
    assert "session: ok=true stdout=43 files=input.csv,sums.csv" in done.stdout
    assert "download: ,0 | a,4 | b,6" in done.stdout
    assert "error: ZeroDivisionError: division by zero" in done.stdout


def test_a_quiet_stream_gets_keep_alive_comments(docker_ready: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=2)
    settings = ServerSettings(config=config, tokens=(TOKEN_A,), keepalive=0.2)
    code = "import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')"
    with running(settings) as service, service.client() as client, \
            client.stream("POST", "/v1/execute?stream=true", json={"code": code}) as response:
        lines = [line for line in response.iter_lines() if line]
    first, last = lines.index("event: output"), lines.index("event: result")
    assert ": keep-alive" in lines[first:last], lines  # comments while the cell slept between its two prints
    assert lines[-1].startswith("data: {") and '"stdout": "a\\nb\\n"' in lines[-1]


class BrokenStore:
    """An artifact store that fails in a way nbexec does not expect (not a StorageError)."""

    kind = "broken"
    prefix = "nbexec"

    def upload(self, blob_name: str, content: bytes, content_type: str) -> str:
        raise RuntimeError("the store fell over")

    def local_url(self, path: Path) -> str | None:
        return None


def test_a_stream_whose_run_fails_oddly_ends_with_an_error_event(docker_ready: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=30, interrupt_grace=2)
    settings = ServerSettings(config=config, tokens=(TOKEN_A,), store=BrokenStore())  # type: ignore[arg-type]
    code = "print('made', flush=True)\nopen('/mnt/data/x.txt', 'w').write('x')"
    with running(settings) as service, service.client() as client:
        with client.stream("POST", "/v1/execute?stream=true", json={"code": code}, timeout=60) as response:
            lines = list(response.iter_lines())  # ends only if the server ends the stream
        kinds = [line[7:] for line in lines if line.startswith("event: ")]
        assert kinds[0] == "output" and kinds[-1] == "error", kinds
        assert '"status": 500' in lines[-2] and not any("fell over" in line for line in lines)
        plain = client.post("/v1/execute", json={"code": code})
        assert plain.status_code == 500 and "fell over" not in plain.text
        assert client.post("/v1/execute", json={"code": "print(1)"}).json()["stdout"] == "1\n"  # slots were freed
