"""The seam over HTTP (the node's /v1/sandboxes routes and the library's RemoteHandle), attacked from both ends.

A node (a real `nbexec serve` on loopback) keeps each client's sandboxes to that client, counts them in its caps,
takes wheels only within its package budget and by their sha256, relays a run's messages whole only within its
output allowance, and interrupts a run whose client left. A library client facing a hostile node
(`tests/seamnode.py`) keeps its own limits where the bytes are kept: oversized, endless or lying frames, answers
about another sandbox, endless answers and hidden failures end in an honest error or a failed result, never in
host memory spent or a run reported as a success. Every test judges the effect (a file not overwritten, a
sandbox still running, bytes that never arrived, host memory, the result), never a status line alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import nbexec
from nbexec.sandbox.execution import Execution
from nbexec.sandbox.remote import frames
from nbexec.sandbox.remote import source as remote

from .. import cluster, seamnode
from ..conftest import IMAGE, wait_until
from ..fakenode import for_header, raw_id
from ..seamnode import MiB, Reply
from .test_host_files import cost

NODE_TOKEN, SECRET = cluster.NODE_TOKEN, b"alice's secret"
RELAY_CAP = 128 * 1024  # the node's max_output + max_display below


@pytest.fixture(scope="module")
def seam_node(docker_ready: None) -> Iterator[cluster.Server]:
    """One node with small caps: 64 KiB of output and of display, 1 MiB and 3 wheels per sandbox, 2 sessions or
    sandboxes per client."""
    with cluster.running_node("s", {"NBEXEC_MAX_OUTPUT": "64k", "NBEXEC_MAX_DISPLAY": "64k", "NBEXEC_POOL_SIZE": "0",
                                    "NBEXEC_MAX_PACKAGE_DOWNLOAD": "1m", "NBEXEC_MAX_PACKAGES": "3"},
                              running=2, sessions=2, timeout=600) as server:  # runs end only when stopped
        yield server
    tmp = Path(server.env["TMPDIR"]).parent
    assert not list(tmp.rglob(".wheel-*")), "a wheel's temporary file was left on the node"


def _signed(http: httpx.Client, method: str, path: str, who: str | None, *, params: dict[str, str] | None = None,
            **options: Any) -> httpx.Response:
    """A call as a router makes it for client ``who`` (None: the node token's own, unsigned); the query is part
    of what is signed."""
    target = path + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")
    headers = for_header(method, target, who, "r0", NODE_TOKEN) if who else {}
    return http.request(method, target, headers=headers, **options)


@pytest.fixture
def alices(seam_node: cluster.Server) -> Iterator[tuple[httpx.Client, str]]:
    """A sandbox the node made for client "alice" (as a router would ask), with secret.txt in it."""
    with cluster.client(seam_node, NODE_TOKEN, timeout=120) as http:
        made = _signed(http, "POST", "/v1/sandboxes", "alice", json={"purpose": "session"})
        assert made.status_code == 201, made.text
        raw = raw_id(made.json()["id"])
        assert _signed(http, "PUT", f"/v1/sandboxes/{raw}/files/secret.txt", "alice",
                       content=SECRET).status_code == 201
        try:
            yield http, raw
        finally:
            _signed(http, "DELETE", f"/v1/sandboxes/{raw}", "alice")


def _alice_runs(http: httpx.Client, raw: str, code: str) -> bytes:
    answer = _signed(http, "POST", f"/v1/sandboxes/{raw}/run", "alice", json={"code": code, "timeout": 60})
    assert answer.status_code == 200, answer.text
    return answer.content


def _sandbox_routes() -> list[tuple[str, str]]:
    from nbexec.service.server import create_app
    from nbexec.service.settings import ServerSettings

    app = create_app(ServerSettings(config=nbexec.SandboxConfig(), tokens=("t" * 16,)))
    found = []
    for route in app.routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", ""))
        if path.startswith("/v1/sandboxes"):
            found += [(m, path) for m in sorted(getattr(route, "methods", None) or {"GET"}) if m != "HEAD"]
    return found


SANDBOX_ROUTES = _sandbox_routes()


# -- who can reach a sandbox -------------------------------------------------------------------------------------

def test_every_sandbox_route_needs_a_node_token(seam_node: cluster.Server, alices: tuple[httpx.Client, str]) -> None:
    _, raw = alices
    assert len(SANDBOX_ROUTES) >= 13, SANDBOX_ROUTES
    for token in (None, cluster.CLIENT_TOKEN, "x" * 40):
        with cluster.client(seam_node, token) as stranger:
            for method, template in SANDBOX_ROUTES:
                path = template.format(sandbox_id=raw, name="secret.txt", filename="a.whl")
                answer = stranger.request(method, path, content=b"x" if method == "PUT" else None)
                assert answer.status_code == 401 and SECRET not in answer.content, (token, method, path)


@pytest.mark.parametrize("who", ["bob", None], ids=["another-client", "unsigned"])
def test_the_node_refuses_one_clients_sandbox_to_another(alices: tuple[httpx.Client, str], who: str | None) -> None:
    """Every route, with alice's sandbox id, for another client: 404, and nothing of alice's sandbox is touched."""
    http, raw = alices
    sha = hashlib.sha256(b"w").hexdigest()
    for method, template in SANDBOX_ROUTES:
        path = template.format(sandbox_id=raw, name="secret.txt", filename="evil-1.0-py3-none-any.whl")
        if path == "/v1/sandboxes":
            continue  # makes a sandbox of one's own
        options: dict[str, Any] = {
            "/run": {"json": {"code": "open('/mnt/data/secret.txt', 'w').write('owned')", "timeout": 30}},
            "/hidden": {"json": {"operation": "packages.setup", "timeout": 30}},
            "/egress": {"json": {"allow": [], "deny": ["a.example"]}},
        }.get(path[path.rfind("/"):], {})
        if method == "PUT":
            options = {"content": b"w", "params": {"sha256": sha}} if "/wheels/" in path else {"content": b"owned"}
        answer = _signed(http, method, path, who, **options)
        assert answer.status_code == 404 and SECRET not in answer.content, (method, path, answer.text[:200])
    state = _signed(http, "GET", f"/v1/sandboxes/{raw}/state", "alice").json()
    assert state["running"] is True  # not killed, not frozen, not deleted
    assert _signed(http, "GET", f"/v1/sandboxes/{raw}/files/secret.txt", "alice").content == SECRET
    assert b"evil" not in _alice_runs(http, raw, "import os; print(os.listdir('/mnt/wheels'))")


def test_sandboxes_count_in_the_clients_caps(alices: tuple[httpx.Client, str]) -> None:
    http, _ = alices
    session = _signed(http, "POST", "/v1/sessions", "alice")
    assert session.status_code == 201
    try:
        refused = _signed(http, "POST", "/v1/sandboxes", "alice", json={"purpose": "oneshot"})
        assert refused.status_code == 429, refused.text  # a session and a sandbox: alice's two
        others = _signed(http, "POST", "/v1/sandboxes", "bob", json={"purpose": "oneshot"})
        assert others.status_code == 201  # bob's caps are bob's
        _signed(http, "DELETE", f"/v1/sandboxes/{raw_id(others.json()['id'])}", "bob")
    finally:
        _signed(http, "DELETE", f"/v1/sessions/{raw_id(session.json()['id'])}", "alice")


# -- wheels: the node's package budget and the wheel's sha256 -----------------------------------------------------

WHEEL = "honest-1.0-py3-none-any.whl"
BAD_WHEELS = {  # (file name, body, sha256 sent): each refused, nothing reaches /mnt/wheels
    "over-the-budget": ("big-1.0-py3-none-any.whl", b"x" * (MiB + 1), None),
    "sha256-mismatch": ("lied-1.0-py3-none-any.whl", b"real", hashlib.sha256(b"claimed").hexdigest()),
    "sha256-malformed": ("short-1.0-py3-none-any.whl", b"x", "abc"),
    "not-a-wheel": ("notes.txt", b"x", None),
    "hidden-name": (".hidden.whl", b"x", None),
    "encoded-slash": ("a%2Fb.whl", b"x", None),
    "empty-name": (".whl", b"x", None),
}


@pytest.mark.parametrize("shape", list(BAD_WHEELS))
def test_wheels_are_refused_past_the_budget_or_their_sha256(alices: tuple[httpx.Client, str], shape: str) -> None:
    http, raw = alices
    name, body, sha = BAD_WHEELS[shape]
    answer = _signed(http, "PUT", f"/v1/sandboxes/{raw}/wheels/{name}", "alice", content=body,
                     params={"sha256": sha or hashlib.sha256(body).hexdigest()})
    assert answer.status_code in (400, 404, 413), answer.text
    assert _signed(http, "PUT", f"/v1/sandboxes/{raw}/wheels/{WHEEL}", "alice", content=b"ok",
                   params={"sha256": hashlib.sha256(b"ok").hexdigest()}).status_code == 201
    seen = _alice_runs(http, raw, "import os; print(sorted(os.listdir('/mnt/wheels')))")
    assert f"['{WHEEL}']".encode() in seen, seen


def test_the_wheels_of_a_sandbox_stay_within_the_budget_together(alices: tuple[httpx.Client, str]) -> None:
    """Each wheel under max_package_download, two of them past it: the second is refused."""
    http, raw = alices
    part = b"p" * (600 * 1024)
    codes = [_signed(http, "PUT", f"/v1/sandboxes/{raw}/wheels/part{i}-1.0-py3-none-any.whl", "alice",
                     content=part, params={"sha256": hashlib.sha256(part).hexdigest()}).status_code for i in range(2)]
    assert codes == [201, 413]
    assert b"part1-" not in _alice_runs(http, raw, "import os; print(sorted(os.listdir('/mnt/wheels')))")


def test_a_sandbox_takes_at_most_max_packages_wheels(alices: tuple[httpx.Client, str]) -> None:
    http, raw = alices
    codes = [_signed(http, "PUT", f"/v1/sandboxes/{raw}/wheels/w{i}-1.0-py3-none-any.whl", "alice", content=b"w",
                     params={"sha256": hashlib.sha256(b"w").hexdigest()}).status_code for i in range(5)]
    assert codes == [201, 201, 201, 413, 413]
    assert b"w3-" not in _alice_runs(http, raw, "import os; print(sorted(os.listdir('/mnt/wheels')))")


# -- what a node relays ------------------------------------------------------------------------------------------

# 20 MB in 400 messages: fewer than the kernel's own PUB socket queues (1,000), so none is dropped inside the
# sandbox when the host reads slowly (2,000 messages of 10 kB lost 5 MB there on a loaded machine, before any node).
FLOOD = "for _ in range(400):\n    print('x' * 50_000, flush=True)"


def test_the_node_relays_no_more_than_its_allowance(alices: tuple[httpx.Client, str]) -> None:
    """The node's own output allowance holds where the bytes first arrive: past it, messages travel as headers
    (still counted by the client), so 20 MB printed cost the wire well under 2 MB."""
    http, raw = alices
    relayed = _alice_runs(http, raw, FLOOD)
    print(f"\na run printing 20 MB relayed {len(relayed):,} bytes")
    assert len(relayed) < 2 * MiB, len(relayed)
    headers = [json.loads(line[2:]) for line in relayed.split(b"\n") if line.startswith(b"M {")]
    # Every byte counted, however the kernel batched the 20 MB into messages (fewer, larger ones under load).
    assert headers and sum(h["size"] for h in headers) > 19_000_000
    assert sum(h["length"] for h in headers) <= RELAY_CAP and not headers[-1]["complete"]


def test_a_client_that_leaves_interrupts_its_run(seam_node: cluster.Server, alices: tuple[httpx.Client, str]) -> None:
    http, raw = alices
    path = f"/v1/sandboxes/{raw}/run"
    with http.stream("POST", path, headers=for_header("POST", path, "alice", "r0", NODE_TOKEN),
                     json={"code": "import time\nprint('start' + 'ed', flush=True)\ntime.sleep(600)", "timeout": 600},
                     ) as run:
        # The iterator is kept: one dropped mid-answer closes the connection, and the node would see its client
        # leave before the count below is read. "started" is the run's output, not the echo of its code.
        chunks = run.iter_bytes()
        for chunk in chunks:
            if b"started" in chunk:
                break
        wait_until(lambda: http.get("/v1/capacity").json()["running"] == 1, 30, "the run never counted")
    wait_until(lambda: http.get("/v1/capacity").json()["running"] == 0, 60, "the run went on after its client left")
    assert b"after" in _alice_runs(http, raw, "print('after')")  # interrupted, not killed


# -- a hostile node, seen from the library -----------------------------------------------------------------------

@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch) -> Iterator[seamnode.SeamNode]:
    with seamnode.SeamNode() as node:
        node.sandbox_answer["interrupt_grace"] = 0
        monkeypatch.setenv("NBEXEC_NODES", node.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
        remote.forget_all()
        try:
            yield node
        finally:
            remote.forget_all()


def _config(**changes: Any) -> nbexec.SandboxConfig:
    values: dict[str, Any] = {"image": IMAGE, "source": "remote", "timeout": 2, "max_output": "1m",
                              "max_display": "1m", "max_files": 20, **changes}
    return nbexec.SandboxConfig(**values)


def _run_stream(*frames: bytes, endless: bytes | tuple[bytes, int] = b"") -> seamnode.Answer:
    """The node's answer to /run: ``frames``, then ``endless`` for ever (b"slow": a keep-alive every 50 ms), or a
    (chunk, count) pair: the chunk that many times (much sent, little held by this process)."""
    def answer(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> Reply:
        def chunks() -> Iterator[bytes]:
            yield from frames
            if isinstance(endless, tuple):
                for _ in range(endless[1]):
                    yield endless[0]
                return
            while endless == b"slow":
                time.sleep(0.05)
                yield seamnode.frame("K", {})
            while endless:
                yield endless
        return Reply(200, chunks(), {"Content-Type": "application/x-nbexec-frames"})
    return answer


def _m(length: int, size: int | None = None, kind: str = "stream", content: int | None = None) -> bytes:
    return seamnode.frame("M", {"type": kind, "channel": "iopub", "id": "m", "parent": "p",
                                "size": length if size is None else size, "complete": True,
                                "content": length if content is None else content, "buffers": [], "length": length})


LIES = "SMUGGLED-" * 100
DISPLAY = json.dumps({"data": {"text/html": "SMUGGLED-" * 40_000}, "metadata": {}}).encode()  # 360 KB, said 100
HOSTILE_RUNS = {
    "oversized-frame": (_m(2 << 30), b""),
    "endless-frame-past-the-limit": (_m(1 << 29), bytes(MiB)),
    "endless-header-line": (b"M " + b"x" * 10_000, (b"y" * 65536, 1024)),  # 64 MiB without a line's end
    "length-smaller-than-sent": (_m(10) + LIES.encode(), b""),
    "size-smaller-than-carried": (seamnode.frame("M", {"type": "display_data", "channel": "iopub", "id": "m",
                                                       "parent": "p", "size": 100, "complete": True,
                                                       "content": len(DISPLAY), "buffers": []}, DISPLAY)
                                  + seamnode.end(), b""),
    "another-sandbox-begins": (seamnode.frame("B", {"sandbox": "0ther"}) + seamnode.end(sandbox="0ther"), b""),
    "another-sandbox-ends": (seamnode.stream_message("hi\n") + seamnode.end(sandbox="0ther"), b""),
    "not-an-output": (seamnode.frame("M", {"type": "status", "channel": "iopub", "id": "m", "parent": "p",
                                           "size": 2, "complete": True, "content": 2, "buffers": []}, b"{}")
                      + seamnode.end(), b""),
    "malformed-end": (seamnode.end(status="fine"), b""),
    "malformed-late-unread": (seamnode.end(late_unread="no"), b""),
    "content-of-a-dropped-message": (seamnode.frame("M", {"type": "stream", "channel": "iopub", "id": "m",
                                                          "parent": "p", "size": 900, "complete": False,
                                                          "content": 900, "buffers": []}, LIES.encode()), b""),
    "endless-keep-alives": (b"", b"slow"),  # a keep-alive every 50 ms, for ever
}


@pytest.mark.parametrize("shape", list(HOSTILE_RUNS))
def test_a_hostile_run_stream_is_a_sandbox_that_misbehaved(hostile: seamnode.SeamNode, tmp_path: Path,
                                                           shape: str) -> None:
    first, endless = HOSTILE_RUNS[shape]
    begins = b"" if shape == "another-sandbox-begins" else seamnode.begin()
    hostile.answers["/run"] = _run_stream(begins + first, endless=endless)
    found: list[nbexec.ExecutionResult] = []
    with cost() as here:  # max_display 64k: a display message that says its size honestly is dropped
        runner = threading.Thread(target=lambda: found.append(nbexec.execute_notebook(
            "print('hi')", config=_config(max_display="64k"), output_dir=tmp_path / "out")))
        runner.start()
        wait_until(lambda: not runner.is_alive(), 120, "the run never ended: the node's stream was followed for ever")
    result = found[0]
    assert not result.ok and result.error is not None and result.error.kind == "protocol", result.error
    assert "hostile" in result.error.evalue and "SMUGGLED" not in result.to_json()
    assert ("POST", f"/v1/sandboxes/{seamnode.SANDBOX}/kill") in hostile.seen  # the engine stopped it
    assert here.peak < 16 * MiB, here


def test_a_stream_that_ends_without_its_end_is_a_lost_node(hostile: seamnode.SeamNode, tmp_path: Path) -> None:
    hostile.answers["/run"] = _run_stream(seamnode.begin() + seamnode.stream_message("partial\n"))
    with pytest.raises(nbexec.NodeLostError, match="hostile"):
        nbexec.execute_notebook("print('hi')", config=_config(), output_dir=tmp_path / "out")
    with nbexec.Session(_config(), output_dir=tmp_path / "session") as session, \
            pytest.raises(nbexec.SessionLostError, match="hostile"):
        session.run("print('hi')")


def test_how_a_run_ended_crosses_the_seam_whole() -> None:
    """Every field a node's end frame carries (the error counts it carries are not taken: the client counts the
    error messages it read itself)."""
    ended = Execution(status="error", execution_count=3, stop="", timing={"iopub.status.idle": "t"}, reply="error",
                      exit_value="7", late_unread=True)
    assert frames.load_execution(json.loads(json.dumps(frames.dump_execution(ended)))) == ended


@pytest.mark.parametrize("said", [True, False, None])
def test_a_nodes_word_that_output_was_left_unread_reaches_the_result(hostile: seamnode.SeamNode, tmp_path: Path,
                                                                    said: bool | None) -> None:
    """The node stopped reading a cell's late output (a timer still printing): the result's notes say so, and
    only then (a node that does not send the field, an older one, said nothing)."""
    fields = {} if said is None else {"late_unread": said}
    hostile.answers["/run"] = _run_stream(seamnode.begin() + seamnode.stream_message("hi\n") + seamnode.end(**fields))
    result = nbexec.execute_notebook("print('hi')", config=_config(), output_dir=tmp_path / "out")
    assert result.ok and result.stdout == "hi\n", result.error
    assert [n for n in result.notes if "still printing" in n] == (["cell 0 was still printing when its run ended "
        "(a timer or a background task?): what it printed later is not in this result"] if said else [])


ERROR = json.dumps({"ename": "KeyError", "evalue": "'k'", "traceback": ["KeyError: 'k'"]}).encode()
HIDDEN_FAILURES = {
    "error-then-ok": seamnode.frame("M", {"type": "error", "channel": "iopub", "id": "m", "parent": "p",
                                          "size": len(ERROR), "complete": True, "content": len(ERROR),
                                          "buffers": []}, ERROR) + seamnode.end(),
    "dropped-error-then-ok": seamnode.frame("M", {"type": "error", "channel": "iopub", "id": "m", "parent": "p",
                                                  "size": 5 * MiB, "complete": False, "content": 0,
                                                  "buffers": []}) + seamnode.end(),
    "error-status-alone": seamnode.end(status="error", reply="error"),
    "huge-last-error": seamnode.end(status="error", reply="", error={
        "raised": True, "ename": "E" * MiB, "evalue": "\x1b[2J" + "v" * MiB, "traceback": ["t" * MiB]}),
}


@pytest.mark.parametrize("shape", list(HIDDEN_FAILURES))
def test_a_node_cannot_hide_a_failure(hostile: seamnode.SeamNode, tmp_path: Path, shape: str) -> None:
    hostile.answers["/run"] = _run_stream(seamnode.begin() + HIDDEN_FAILURES[shape])
    result = nbexec.execute_notebook("print('hi')", config=_config(), output_dir=tmp_path / "out")
    assert not result.ok and result.error is not None and result.error.kind == "exception", result.error
    text = result.error.ename + result.error.evalue + "".join(result.error.traceback)
    assert len(text.encode()) <= 1024 * 1024 + 1024 and "\x1b" not in text


def _about_another(route: str) -> seamnode.Answer:
    def answer(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> Reply:
        honest = seamnode.honest(method, rest, query, body)
        assert honest is not None
        if route == "/files":
            data = {"sandbox": "0ther", "files": [{"name": "theirs.txt", "size": 4, "mime": "text/plain",
                                                   "sha256": "0" * 64, "url": None}], "skipped_files": [], "notes": []}
        else:
            data = {**json.loads(b"".join(honest.body)), "sandbox": "0ther"}
        return seamnode.json_reply(data)
    return answer


@pytest.mark.parametrize("route", ["/files", "/notes", "/connections", "/state"])
def test_an_answer_about_another_sandbox_is_refused(hostile: seamnode.SeamNode, tmp_path: Path, route: str) -> None:
    hostile.answers[route] = _about_another(route)
    hostile.answers["/run"] = _run_stream(seamnode.begin() + seamnode.end(status="gone"))  # asks for /state
    with contextlib.suppress(nbexec.NbexecError):
        result = nbexec.execute_notebook("print('hi')", config=_config(), output_dir=tmp_path / "out")
        assert not result.ok and result.error is not None and result.error.kind == "protocol", result
    assert not any(path.endswith("/theirs.txt") for _, path in hostile.seen)
    assert not (tmp_path / "out" / "data" / "theirs.txt").exists()


def _endless(kind: str) -> seamnode.Answer:
    def answer(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> Reply:
        def chunks() -> Iterator[bytes]:
            yield b'{"sandbox": "5eed", "notes": ["' if kind == "json" else b""
            for _ in range(512):
                yield b"a" * MiB
        return Reply(500 if kind == "error" else 200, chunks(), {"Content-Type": "application/json"})
    return answer


@pytest.mark.parametrize("route", ["/notes", "/connections", "/files", "/state"])
@pytest.mark.parametrize("kind", ["json", "error"])
def test_endless_answers_are_read_within_caps(hostile: seamnode.SeamNode, tmp_path: Path, route: str,
                                              kind: str) -> None:
    hostile.answers[route] = _endless(kind)
    hostile.answers["/run"] = _run_stream(seamnode.begin() + seamnode.end(status="gone"))  # asks for /state
    started = time.monotonic()
    with cost() as here, contextlib.suppress(nbexec.NbexecError):
        nbexec.execute_notebook("print('hi')", config=_config(), output_dir=tmp_path / "out")
    print(f"\n{route} answering 512 MiB ({kind}): peak {here.peak:,} bytes, {time.monotonic() - started:.1f} s")
    assert here.peak < 16 * MiB, here
