"""The router is a tenant boundary, and a hostile node cannot hurt it.

Real `nbexec serve` processes on loopback (a node with small per-client caps, a router in front of it), a fake
hostile node (`tests/fakenode.py`) and two clients with different tokens. Every attack is judged by its effect:
the bytes a client receives, the files of another client's session, what reached the hostile node, the router
process's peak memory (/proc/<pid>/status), a request that is refused, a run that stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

import nbexec
from nbexec.service.fleet import Fleet, members

from ..azurite import free_port
from ..cluster import (
    CLIENT_TOKEN,
    NODE_TOKEN,
    OTHER_TOKEN,
    Server,
    client,
    fake_behind_router,
    node,
    nodes_up,
    peak_kib,
    router,
    router_at,
    stop,
    wait_ready,
)
from ..conftest import wait_until
from ..fakenode import Behaviour, FakeNode, MiB, for_header, public_id, raw_id

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(600)"
PNG = ("from IPython.display import Image, display\nimport base64\ndisplay(Image(base64.b64decode("
       "'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=')))\n")
CAPS = {"NBEXEC_MAX_OUTPUT": "1m", "NBEXEC_MAX_DISPLAY": "2m", "NBEXEC_MAX_DATA": "4m"}  # the hostile routers'
EVENT_CAP = 2 * (1 + 2) * MiB + MiB  # what these caps let one event from a node be: 2 x (output + display) + 1 MiB
GROWTH_LIMIT = 32 * MiB  # the router's peak memory may grow this much at most under any hostile answer


@pytest.fixture(scope="module")
def pair(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """One real node (per client: 2 sessions, 1 run; runs may last 600 s) and a router in front of it."""
    tmp = tmp_path_factory.mktemp("router")
    tmp.chmod(0o755)
    member = node(0, tmp, running=1, sessions=2, timeout=600, tag="r").start()
    front = router([member]).start()
    try:
        wait_ready([member])
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw its node up", interval=0.2)
        yield member, front
    finally:
        stop(front, member)
        wait_until(lambda: not member.containers(), 60, f"{member.name} left containers behind")


def _raw_request(server: Server, method: str, target: str, token: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``target`` exactly as written (no client library normalises or re-encodes it)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        connection.putheader("Authorization", f"Bearer {token}")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


# -- file names never leave the caller's session ----------------------------------------------------------------

SECRET = b"A's secret, never for B"
TRAVERSALS = {
    "dot-segments": "../../{a}/files/secret.txt",
    "encoded-dots": "%2e%2e/%2e%2e/{a}/files/secret.txt",
    "encoded-slashes": "..%2F..%2F{a}%2Ffiles%2Fsecret.txt",
    "all-encoded": "%2E%2E%2F%2E%2E%2F{a}%2Ffiles%2Fsecret.txt",
    "double-encoded": "%252e%252e/%252e%252e/{a}/files/secret.txt",
    "backslashes": "..%5C..%5C{a}%5Cfiles%5Csecret.txt",
    "dot": "./secret.txt",
    "empty-segment": "sub//secret.txt",
    "trailing-slash": "secret.txt/",
    "nul": "secret.txt%00",
}


@pytest.mark.parametrize("kind", ["files", "images"])
@pytest.mark.parametrize("shape", list(TRAVERSALS), ids=list(TRAVERSALS))
def test_a_file_name_never_leaves_the_callers_session(pair: tuple[Server, Server], shape: str, kind: str) -> None:
    _, front = pair
    with client(front) as a, client(front, OTHER_TOKEN) as b:
        mine = a.post("/v1/sessions").json()["id"]
        theirs = b.post("/v1/sessions").json()["id"]
        try:
            assert a.put(f"/v1/sessions/{mine}/files/secret.txt", content=SECRET).status_code == 201
            name = TRAVERSALS[shape].format(a=raw_id(mine))
            status, got = _raw_request(front, "GET", f"/v1/sessions/{theirs}/{kind}/{name}", OTHER_TOKEN)
            assert SECRET not in got, f"B read A's file with {name!r}"
            put_status, _ = _raw_request(front, "PUT", f"/v1/sessions/{theirs}/files/{name}", OTHER_TOKEN,
                                         b"written by B")
            assert a.get(f"/v1/sessions/{mine}/files/secret.txt").content == SECRET, f"B wrote A's file: {name!r}"
            assert [f["name"] for f in a.get(f"/v1/sessions/{mine}/files").json()["files"]] == ["secret.txt"]
            assert (status, put_status) == (400, 400), (got[:300], name)  # refused, with a reason
            assert b"segment" in got
        finally:
            a.delete(f"/v1/sessions/{mine}")
            b.delete(f"/v1/sessions/{theirs}")


ODD_NAMES = ["q?x.txt", "h#x.txt", "p%41.txt", "s p.txt", "\u00e9t\u00e9.txt", "sub/d.txt", "..a.txt", "a..b"]


def test_odd_but_honest_names_travel_unchanged(pair: tuple[Server, Server], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the router and through the library's client: the name a client gives is the name stored."""
    member, front = pair
    with client(front) as a:
        sid = a.post("/v1/sessions").json()["id"]
        try:
            for name in ODD_NAMES:
                assert a.put(f"/v1/sessions/{sid}/files/{quote(name)}", content=name.encode()).status_code == 201
            assert sorted(f["name"] for f in a.get(f"/v1/sessions/{sid}/files").json()["files"]) == sorted(ODD_NAMES)
            assert all(a.get(f"/v1/sessions/{sid}/files/{quote(n)}").content == n.encode() for n in ODD_NAMES)
        finally:
            a.delete(f"/v1/sessions/{sid}")
    monkeypatch.setenv("NBEXEC_NODES", member.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    with nbexec.Session(output_dir=tmp_path / "library") as session:
        for name in ODD_NAMES:
            session.upload(name.encode(), name)
        assert sorted(f.name for f in session.files()) == sorted(ODD_NAMES)
        assert all(session.download(n) == n.encode() for n in ODD_NAMES)


def _download_or_refusal(session: Any, name: str) -> bytes | str:
    try:
        return bytes(session.download(name))
    except nbexec.FileTransferError:
        return "refused"


LIBRARY_NAMES = ["../../{raw}/files/secret.txt", "a/../../../{raw}/files/secret.txt", "./secret.txt", "a//b",
                 "..\\..\\{raw}\\files\\secret.txt", "x\0y", "%2e%2e/%2e%2e/{raw}/files/secret.txt", "dir/"]


def test_the_library_client_keeps_names_inside_its_session(pair: tuple[Server, Server], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    member, _ = pair
    monkeypatch.setenv("NBEXEC_NODES", member.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    with nbexec.Session(output_dir=tmp_path / "one") as one, nbexec.Session(output_dir=tmp_path / "two") as two:
        one.upload(SECRET, "secret.txt")
        raw = str(one.files()[0].url).split("/")[3]  # /v1/sessions/<raw>/files/secret.txt
        for pattern in LIBRARY_NAMES:
            name = pattern.format(raw=raw)
            assert _download_or_refusal(two, name) == "refused", name
            with contextlib.suppress(nbexec.FileTransferError):
                two.upload(b"written by two", name)
            assert one.download("secret.txt") == SECRET, f"the other session wrote it through {name!r}"
        assert [f.name for f in one.files()] == ["secret.txt"]


# -- the node keeps each client's things apart -----------------------------------------------------------------

def _signed(http: httpx.Client, method: str, path: str, who: str, **options: Any) -> httpx.Response:
    return http.request(method, path, headers=for_header(method, path, who, "r0", NODE_TOKEN), **options)


@pytest.fixture
def alices_session(pair: tuple[Server, Server]) -> Iterator[tuple[httpx.Client, str]]:
    """A session the node made for client "alice" (as a router would ask), with secret.txt in it."""
    member, _ = pair
    with client(member, NODE_TOKEN) as http:
        made = _signed(http, "POST", "/v1/sessions", "alice")
        assert made.status_code == 201, made.text
        raw = raw_id(made.json()["id"])
        put = _signed(http, "PUT", f"/v1/sessions/{raw}/files/secret.txt", "alice", content=SECRET)
        assert put.status_code == 201, put.text
        try:
            yield http, raw
        finally:
            _signed(http, "DELETE", f"/v1/sessions/{raw}", "alice")


def test_the_node_renders_ids_for_the_client_and_name_it_was_signed_for(pair: tuple[Server, Server],
                                                                     alices_session: tuple[httpx.Client, str]) -> None:
    http, raw = alices_session
    instance = http.get("/v1/capacity").json()["instance"]
    described = _signed(http, "GET", f"/v1/sessions/{raw}", "alice").json()
    assert described["id"] == public_id(NODE_TOKEN, "alice", "r0", instance, raw)


@pytest.mark.parametrize("who", ["bob", None], ids=["another-client", "unsigned"])
def test_the_node_refuses_one_clients_session_to_another(alices_session: tuple[httpx.Client, str],
                                                         who: str | None) -> None:
    """Even a router tricked into asking for A's session on B's behalf gets nothing of it."""
    http, raw = alices_session
    calls: list[tuple[str, str, dict[str, Any]]] = [
             ("GET", f"/v1/sessions/{raw}", {}), ("GET", f"/v1/sessions/{raw}/files", {}),
             ("GET", f"/v1/sessions/{raw}/files/secret.txt", {}),
             ("PUT", f"/v1/sessions/{raw}/files/secret.txt", {"content": b"written by another"}),
             ("POST", f"/v1/sessions/{raw}/execute", {"json": {"code": "print(open('secret.txt').read())"}}),
             ("DELETE", f"/v1/sessions/{raw}", {})]
    for method, path, options in calls:
        answer = _signed(http, method, path, who, **options) if who else http.request(method, path, **options)
        assert answer.status_code == 404 and SECRET not in answer.content, (method, path, answer.text[:200])
    assert _signed(http, "GET", f"/v1/sessions/{raw}/files/secret.txt", "alice").content == SECRET


def _bad_headers(path: str) -> dict[str, dict[str, str]]:
    good = for_header("GET", path, "alice", "r0", NODE_TOKEN)["X-Nbexec-For"]
    fields = good.split(";")
    now = time.time()
    return {
        "expired": for_header("GET", path, "alice", "r0", NODE_TOKEN, when=now - 3600),
        "from-the-future": for_header("GET", path, "alice", "r0", NODE_TOKEN, when=now + 3600),
        "wrong-signature": {"X-Nbexec-For": good[:-1] + ("0" if good[-1] != "0" else "1")},
        "truncated": {"X-Nbexec-For": ";".join(fields[:4])},
        "empty": {"X-Nbexec-For": ""},
        "extra-field": {"X-Nbexec-For": good + ";x"},
        "oversized": for_header("GET", path, "a" * 8000, "r0", NODE_TOKEN),
        "another-path": for_header("GET", path.replace("/files/secret.txt", "/files/other.txt"), "alice", "r0",
                                   NODE_TOKEN),
        "another-method": for_header("PUT", path, "alice", "r0", NODE_TOKEN),
        "another-key": for_header("GET", path, "alice", "r0", CLIENT_TOKEN),
        "bad-client-name": for_header("GET", path, "al ice", "r0", NODE_TOKEN),
        "bad-node-name": for_header("GET", path, "alice", "r0;x", NODE_TOKEN),
    }


BAD_HEADERS = [*_bad_headers("/x/files/secret.txt"), "replayed"]


@pytest.mark.parametrize("shape", BAD_HEADERS)
def test_the_node_refuses_a_bad_client_signature(alices_session: tuple[httpx.Client, str], shape: str) -> None:
    http, raw = alices_session
    path = f"/v1/sessions/{raw}/files/secret.txt"
    if shape == "replayed":
        headers = for_header("GET", path, "alice", "r0", NODE_TOKEN)
        assert http.get(path, headers=headers).content == SECRET
    else:
        headers = _bad_headers(path)[shape]
    answer = http.get(path, headers=headers)
    assert answer.status_code == 401 and SECRET not in answer.content, (shape, answer.status_code, answer.text[:200])


# -- per-client caps -------------------------------------------------------------------------------------------

def _stream_first_output(server: Server, path: str, code: str, token: str = CLIENT_TOKEN) -> contextlib.ExitStack:
    """Start a streamed run and read until its first output; return the open stream (close it to leave)."""
    stack = contextlib.ExitStack()
    http = stack.enter_context(client(server, token, timeout=30))
    response = stack.enter_context(http.stream("POST", f"{path}?stream=true", json={"code": code}))
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    stack.callback(lines.close)  # referenced until the stack closes: a dropped iterator would close the stream
    for line in lines:
        if line.startswith("data: ") and "started" in line:
            return stack
    stack.close()
    raise AssertionError("the run never printed")


def test_one_clients_sessions_and_runs_never_use_up_anothers(pair: tuple[Server, Server]) -> None:
    _, front = pair
    with client(front) as a, client(front, OTHER_TOKEN) as b:
        made = [a.post("/v1/sessions") for _ in range(2)]
        theirs: list[str] = []
        try:
            assert [r.status_code for r in made] == [201, 201]
            assert a.post("/v1/sessions").status_code == 429  # A's own cap holds
            answer = b.post("/v1/sessions")
            assert answer.status_code == 201, f"B was refused a session because of A's: {answer.text}"
            theirs.append(answer.json()["id"])
            with _stream_first_output(front, "/v1/execute", SLEEPER):
                assert a.post("/v1/execute", json={"code": "1"}).status_code == 429  # A's one run slot is taken
                ran = b.post(f"/v1/sessions/{theirs[0]}/execute", json={"code": "print('B runs')"})
                assert ran.status_code == 200 and ran.json()["stdout"] == "B runs\n", ran.text
            wait_until(lambda: a.post("/v1/execute", json={"code": "1"}).status_code == 200, 90,
                       "A's run went on after A left")
        finally:
            for sid in [r.json()["id"] for r in made if r.status_code == 201]:
                a.delete(f"/v1/sessions/{sid}")
            for sid in theirs:
                b.delete(f"/v1/sessions/{sid}")


def test_one_client_holds_at_most_its_calls_through_the_router() -> None:
    """The router's own cap (calls in flight per client token) is each client's, never shared."""
    fake = FakeNode(token=NODE_TOKEN, behaviour=Behaviour(run="hold")).start()
    front = router_at([fake.url], args=("--max-calls-per-token", "2")).start()
    try:
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw the fake node", interval=0.2)
        with client(front) as a, client(front, OTHER_TOKEN) as b:
            sid, theirs = a.post("/v1/sessions").json()["id"], b.post("/v1/sessions").json()["id"]
            held = [_stream_held(front, CLIENT_TOKEN) for _ in range(2)]
            try:
                assert a.get(f"/v1/sessions/{sid}").status_code == 429  # A's two calls are in flight
                with _stream_held(front, OTHER_TOKEN):
                    assert b.get(f"/v1/sessions/{theirs}").status_code == 200  # B's own count
            finally:
                for stream in held:
                    stream.close()
            wait_until(lambda: a.get(f"/v1/sessions/{sid}").status_code == 200, 30,
                       "A's calls were not counted off when A left them")
    finally:
        stop(front)
        fake.close()


def _stream_held(front: Server, token: str) -> contextlib.ExitStack:
    """A streamed run the fake node holds open (its first output read)."""
    stack = contextlib.ExitStack()
    http = stack.enter_context(client(front, token, timeout=30))
    response = stack.enter_context(http.stream("POST", "/v1/execute?stream=true", json={"code": "1"}))
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    stack.callback(lines.close)  # referenced until the stack closes: a dropped iterator would close the stream
    next(line for line in lines if line.startswith("data: "))
    return stack


# -- a client that hangs up interrupts its run --------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["one-shot", "session", "one-shot-streamed"])
@pytest.mark.parametrize("where", ["node", "router"])
def test_a_client_that_hangs_up_interrupts_its_run(pair: tuple[Server, Server], where: str, kind: str) -> None:
    """The caller leaves mid-run; with one run slot per client, its next run is accepted only once that run ended
    (the node's time limit is 600 s: the wait below is far shorter)."""
    member, front = pair
    server, token = (member, NODE_TOKEN) if where == "node" else (front, CLIENT_TOKEN)
    with client(server, token, timeout=120) as http:
        path = "/v1/execute"
        sid = http.post("/v1/sessions").json()["id"] if kind == "session" else None
        if sid:
            path = f"/v1/sessions/{sid}/execute"
        try:
            if kind == "one-shot-streamed":
                _stream_first_output(server, path, SLEEPER, token).close()
            else:
                with client(server, token, timeout=6) as leaving, pytest.raises(httpx.ReadTimeout):
                    leaving.post(path, json={"code": SLEEPER})  # gives up after 6 s without an answer
            answer = wait_until(lambda: _accepted(http, path), 90, "the run went on after its client hung up")
            assert answer is not None and answer.json()["stdout"] == "again\n"
        finally:
            if sid:
                http.delete(f"/v1/sessions/{sid}")


def _accepted(http: httpx.Client, path: str) -> httpx.Response | None:
    answer = http.post(path, json={"code": "print('again')"})
    return answer if answer.status_code == 200 else None


# -- /readyz ---------------------------------------------------------------------------------------------------

def test_readyz_says_ready_without_topology(pair: tuple[Server, Server]) -> None:
    member, front = pair
    ready = httpx.get(f"{front.url}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json() == {"ready": True}, ready.text
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lonely = router_at([nowhere]).start()
    try:
        wait_until(lambda: _answers(lonely), 60, "the router never answered")
        down = httpx.get(f"{lonely.url}/readyz", timeout=5)
        assert down.status_code == 503 and down.json() == {"ready": False}, down.text
    finally:
        stop(lonely)
    assert httpx.get(f"{front.url}/v1/nodes", timeout=5).status_code == 401
    with client(front, CLIENT_TOKEN) as tenant, client(front, NODE_TOKEN) as operator:
        assert tenant.get("/v1/nodes").status_code == 401  # a client is not the operator
        detail = operator.get("/v1/nodes").json()["nodes"]
    assert [(n["url"], n["up"]) for n in detail] == [(member.url, True)]


def _answers(server: Server) -> bool:
    try:
        return httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- nodes are who the configuration says -------------------------------------------------------------------------

def test_a_node_cannot_take_another_nodes_sessions_by_its_name(pair: tuple[Server, Server]) -> None:
    member, _ = pair
    with client(member, NODE_TOKEN) as direct:
        real = direct.get("/v1/capacity").json()
    liar = FakeNode(token=NODE_TOKEN, name=real["node"], instance=real["instance"], sessions=10**6,
                    pool_free=-5).start()  # claims the real node's name and instance, and looks busy
    front = router_at([liar.url, member.url]).start()
    try:
        wait_until(lambda: nodes_up(front) == 2, 60, "the router never saw both nodes", interval=0.2)
        with client(front) as http:
            sid = http.post("/v1/sessions").json()["id"]
            try:
                liar.name = sid.rsplit(".", 3)[0]  # now it claims the router's own name for the real node too
                probes = len([s for s in liar.seen if s.path == "/v1/capacity"])
                wait_until(lambda: len([s for s in liar.seen if s.path == "/v1/capacity"]) >= probes + 2, 30,
                           "the router never probed the liar again")
                ran = http.post(f"/v1/sessions/{sid}/execute", json={"code": "print('code of A: ' + 'x1y2z3')"})
                assert liar.received(b"x1y2z3") == [], "the liar received the client's code"
                assert liar.received(raw_id(sid).encode()) == [], "the liar received calls for the session"
                assert ran.status_code == 200 and ran.json()["stdout"] == "code of A: x1y2z3\n", ran.text
            finally:
                http.delete(f"/v1/sessions/{sid}")
    finally:
        stop(front)
        liar.close()


# -- a hostile node cannot grow the router's memory ---------------------------------------------------------------

@pytest.fixture
def hostile() -> Iterator[tuple[FakeNode, Server]]:
    """A fake node (honest until a test says otherwise) and a router in front of it, with small caps."""
    with fake_behind_router(CAPS) as pair:
        yield pair


def _take(response: httpx.Response, limit: int = 64 * MiB) -> int:
    """Read a response's body (at most ``limit`` bytes) and return how many bytes arrived before it ended."""
    got = 0
    with contextlib.suppress(httpx.HTTPError):
        for chunk in response.iter_raw():
            got += len(chunk)
            if got >= limit:
                break
    return got


def _warm_up(http: httpx.Client) -> str:
    """Honest calls of every kind, so the router's baseline has everything imported; return a session id."""
    assert http.post("/v1/execute", json={"code": "1"}).json()["stdout"] == "honest\n"
    with http.stream("POST", "/v1/execute?stream=true", json={"code": "1"}) as streamed:
        assert b"event: result" in streamed.read()
    sid = str(http.post("/v1/sessions").json()["id"])
    assert http.get(f"/v1/sessions/{sid}").status_code == 200
    assert http.get(f"/v1/sessions/{sid}/files/x.bin").content == b"honest bytes"
    return sid


HOSTILE = {  # shape: (behaviour, what the client calls)
    "endless-event-line": (Behaviour(run="endless-line"), "execute"),
    "endless-event-line-streamed": (Behaviour(run="endless-line"), "execute-streamed"),
    "tiny-objects-result": (Behaviour(run="tiny-objects"), "execute"),
    "endless-error-body": (Behaviour(run="endless-error"), "execute"),
    "endless-json-body": (Behaviour(session="endless-json"), "session"),
    "endless-download": (Behaviour(download="endless"), "download"),
    "endless-capacity": (Behaviour(capacity="endless-json"), "capacity"),
}


@pytest.mark.parametrize("shape", list(HOSTILE))
def test_a_hostile_node_cannot_grow_the_routers_memory(hostile: tuple[FakeNode, Server], shape: str) -> None:
    fake, front = hostile
    behaviour, call = HOSTILE[shape]
    with client(front, timeout=120) as http:
        sid = _warm_up(http)
        before = peak_kib(front)
        fake.behaviour = behaviour
        received = _hostile_call(http, fake, call, sid)
    grown = (peak_kib(front) - before) * 1024
    print(f"\n{shape}: the router's peak RSS grew {grown / MiB:.1f} MiB; the client received {received / MiB:.1f} MiB")
    assert grown < GROWTH_LIMIT, f"{shape}: the router's peak memory grew by {grown / MiB:.0f} MiB"
    limit = {"download": 4 * MiB, "session": 4 * MiB}.get(call, EVENT_CAP)
    assert received <= limit + MiB, f"{shape}: {received / MiB:.0f} MiB reached the client past the cap"


def _hostile_call(http: httpx.Client, fake: FakeNode, call: str, sid: str) -> int:
    if call == "capacity":
        wait_until(lambda: len(fake.sent.get("capacity", [])) >= 2, 60, "the router never probed again")
        return 0
    if call == "session":
        request = http.build_request("GET", f"/v1/sessions/{sid}")
    elif call == "download":
        request = http.build_request("GET", f"/v1/sessions/{sid}/files/x.bin")
    else:
        streamed = "?stream=true" if call == "execute-streamed" else ""
        request = http.build_request("POST", f"/v1/execute{streamed}", json={"code": "1"})
    try:
        response = http.send(request, stream=True)
    except httpx.HTTPError:
        return 0
    try:
        return _take(response)
    finally:
        response.close()


# -- the router forwards every node route ------------------------------------------------------------------------

def _node_routes() -> list[tuple[str, str]]:
    """(method, path template) of every route of a node's app, from its own route table."""
    from nbexec.service.server import create_app
    from nbexec.service.settings import ServerSettings

    app = create_app(ServerSettings(config=nbexec.SandboxConfig(), tokens=("t" * 16,)))
    found = []
    for route in app.routes:
        methods: set[str] = getattr(route, "methods", None) or {"GET"}
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", ""))
        # E2B's API (/e2b) goes through the router by its own two routes: tests/security/test_router_e2b.py.
        found += [(m, path) for m in sorted(methods) if m != "HEAD" and not path.startswith("/e2b/")]
    return found


def test_every_node_route_is_reachable_through_the_router(pair: tuple[Server, Server]) -> None:
    _, front = pair
    routes = _node_routes()
    assert ("POST", "/v1/sessions/{session_id}/execute") in routes and len(routes) > 15
    assert ("POST", "/v1/sandboxes/{sandbox_id}/run") in routes  # the seam's routes, for library clients
    with client(front) as http, client(front, OTHER_TOKEN) as other:  # other: a client with room for new ones
        sid = http.post("/v1/sessions").json()["id"]
        box = http.post("/v1/sandboxes", json={"purpose": "session"}).json()["id"]
        try:
            assert http.put(f"/v1/sessions/{sid}/files/f.txt", content=b"f").status_code == 201
            assert http.put(f"/v1/sandboxes/{box}/files/f.txt", content=b"f").status_code == 201
            session_image = http.post(f"/v1/sessions/{sid}/execute", json={"code": PNG}).json()["images"][0]["name"]
            once = http.post("/v1/execute", json={"code": PNG + "open('/mnt/data/f.txt', 'w').write('f')"}).json()
            snapshot = http.post(f"/v1/sessions/{sid}/snapshot").json()["snapshot"]
            batch = http.post("/v1/batches", json=[{"code": "1"}]).json()["id"]
            names = {"session_id": sid, "execution_id": once["execution_id"], "sandbox_id": box, "filename": "f.whl",
                     "snapshot_id": snapshot, "batch_id": batch}
            unreachable = []
            for method, template in sorted(routes, key=lambda r: (r[0] == "DELETE", r)):
                image = session_image if "{session_id}" in template else once["images"][0]["name"]
                path = template.format(**names, name=image if "/images/" in template else "f.txt")
                making = method == "POST" and path in ("/v1/sessions", "/v1/sandboxes", "/v1/batches")
                answer = (other if making else http).request(method, path, **_options(method, path))
                forwarded = path.startswith(("/v1/sessions", "/v1/executions/", "/v1/sandboxes", "/v1/batches/")) \
                    or path == "/v1/execute"
                # The node's own policy answers a change of a session's allowlist (this node has network off),
                # and an interrupt of an idle session is 409.
                policy = path.endswith("/egress") and answer.status_code == 400 and "allowlist" in answer.text
                idle = template.endswith("/interrupt") and answer.status_code == 409
                capped = template.endswith("/fork") and answer.status_code == 429  # the node's session cap answered
                # A sandbox that is not asleep cannot be woken; once /sleep made it sleep, the node says so (409).
                asleep = answer.status_code == 409 and ("asleep" in answer.text or template.endswith("/wake"))
                refused = answer.status_code >= 400 and not (policy or idle or capped or asleep)
                if refused or (forwarded and "x-nbexec-node" not in answer.headers):
                    unreachable.append((method, template, answer.status_code, answer.text[:120]))
                if making and answer.status_code in (201, 202):
                    other.delete(f"{path}/{answer.json()['id']}")
            assert unreachable == []
        finally:
            http.delete(f"/v1/sessions/{sid}")
            http.delete(f"/v1/sandboxes/{box}")


def _options(method: str, path: str) -> dict[str, Any]:
    """What one route needs to succeed: a cell's code, a sandbox's purpose, a file's or a wheel's bytes."""
    if path.endswith("execute"):
        return {"json": {"code": "1"}}
    if path.endswith("/egress"):
        return {"json": {"deny": ["api.example.com"]}}
    if path.endswith("/run"):
        return {"json": {"code": "1", "timeout": 30}}
    if path.endswith("/judge"):  # a program judged by name: a batch's judge item (the sandbox may be frozen by now)
        return {"json": {"program": "print(1)", "tests": [{"expected": "1"}], "limits": {"time": 1, "program": 2}}}
    if path.endswith("/hidden"):  # nbexec's own requests, by name (the route takes no code)
        return {"json": {"operation": "packages.setup", "timeout": 30}}
    if path == "/v1/sandboxes":
        return {"json": {"purpose": "session"}}
    if path == "/v1/batches":
        return {"json": [{"code": "1"}]}
    if "/wheels/" in path:
        return {"content": b"f", "params": {"sha256": hashlib.sha256(b"f").hexdigest()}}
    return {"content": b"f"} if method == "PUT" else {}


def test_a_route_the_router_never_heard_of_is_forwarded_with_its_checks(hostile: tuple[FakeNode, Server]) -> None:
    fake, front = hostile
    with client(front) as a, client(front, OTHER_TOKEN) as b:
        sid = a.post("/v1/sessions").json()["id"]
        answer = a.post(f"/v1/sessions/{sid}/brand-new-route")
        assert answer.status_code == 200 and answer.json() == {"route": "brand-new", "method": "POST"}, answer.text
        seen = [s for s in fake.seen if "/brand-new-route" in s.path]
        assert [s.path.split("?")[0] for s in seen] == [f"/v1/sessions/{raw_id(sid)}/brand-new-route"]
        assert "x-nbexec-for" in seen[0].headers  # signed for the client
        before = len(fake.seen)
        assert b.post(f"/v1/sessions/{sid}/brand-new-route").status_code == 404  # not B's: never sent on
        assert b.post(f"/v1/sessions/{sid}/x/%2e%2e/brand-new-route").status_code in (400, 404)
        assert len(fake.seen) == before


# -- a router stops whatever its nodes do -------------------------------------------------------------------------

def test_a_router_exits_on_sigterm_whatever_its_nodes_do() -> None:
    """SIGTERM stops a router within seconds while one of its nodes is lost (every connection refused) and another
    holds a client's run open and then sends its capacity without end: no node keeps the router's process alive
    (a router in front of a lost node once outlived its SIGTERM by twenty minutes)."""
    fake = FakeNode(token=NODE_TOKEN, behaviour=Behaviour(run="hold")).start()
    lost = f"lost=http://127.0.0.1:{free_port()}"  # nothing listens there
    front = router_at([f"fake={fake.url}", lost], env=CAPS).start()
    try:
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw the fake node", interval=0.2)
        with _stream_held(front, CLIENT_TOKEN):
            fake.behaviour.capacity = "endless-json"
            probes = len([s for s in fake.seen if s.path == "/v1/capacity"])
            wait_until(lambda: len([s for s in fake.seen if s.path == "/v1/capacity"]) > probes, 30,
                       "the router never probed the endless node")
            front.kill(signal.SIGTERM, within=20)  # fails (and kills it) if the router lives on
    finally:
        stop(front)
        fake.close()


def test_the_routers_health_checks_end_even_when_a_cancellation_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's shutdown cancels a node's health check at the moment a probe of a lost node has just failed:
    on Python 3.11, ``asyncio.wait_for`` returns that probe's outcome and the cancellation is lost. The check must
    end anyway (one that lives on keeps the router's process from exiting after SIGTERM). Real probes over real
    sockets to a port where nothing listens; only the moment of the shutdown is chosen."""
    fleet = Fleet(members((f"lost=http://127.0.0.1:{free_port()}",)), NODE_TOKEN)
    read, closing = Fleet._read_capacity, []

    async def read_then_close(self: Fleet, name: str) -> bytes:
        try:
            return await read(self, name)
        finally:  # the shutdown's cancel lands before wait_for's caller has resumed
            if self._tasks and not closing:
                closing.append(asyncio.create_task(self.close()))

    async def main() -> tuple[bool, list[bool]]:
        await fleet.start()  # its first probe runs before any check: no shutdown yet
        while not closing:
            await asyncio.sleep(0.01)
        done, _ = await asyncio.wait(closing, timeout=15)
        return bool(done), [task.done() for task in fleet._tasks]

    monkeypatch.setattr(Fleet, "_read_capacity", read_then_close)
    closed, checks = asyncio.run(main())
    assert closed and all(checks), f"the shutdown did not end the health checks: closed={closed}, checks={checks}"
