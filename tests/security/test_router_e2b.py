"""E2B's API through a router (#40): E2B's own SDKs (`e2b`, `e2b-code-interpreter`, unmodified) pointed at a real
router in front of two real `nbexec serve` nodes, with only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; and
the router as a tenant boundary on that door, judged from outside: the status another token gets, the owner's
sandbox unaffected, how long a call on a lost node takes, the bytes a client gets and the router's peak memory
under a node that streams without end."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2b
import httpx
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

from nbexec.service import e2b_ids, identity

from .. import e2bsdk
from ..azurite import free_port
from ..cluster import (
    CLIENT_TOKEN,
    NODE_TOKEN,
    OTHER_TOKEN,
    Server,
    fake_behind_router,
    node,
    nodes_up,
    peak_kib,
    router_at,
    stop,
    wait_ready,
)
from ..conftest import wait_until
from ..fakenode import Behaviour, FakeNode, MiB

ENVD, INTERPRETER = "49983", "49999"
CAPS = {"NBEXEC_MAX_OUTPUT": "1m", "NBEXEC_MAX_DISPLAY": "2m", "NBEXEC_MAX_DATA": "4m"}  # the hostile router's
EVENT_CAP = 2 * (1 + 2) * MiB + MiB  # what these caps let one message from a node be
GROWTH_LIMIT = 32 * MiB  # the router's peak memory may grow this much at most under any hostile answer
KEY = identity.id_key(NODE_TOKEN.encode())


def _token_id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def cluster(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, ...]]:
    """Two real nodes and a router in front of them (and of a third, configured node that never answers)."""
    tmp = Path(tempfile.mkdtemp(prefix="re2b-", dir="/tmp"))
    tmp.chmod(0o755)
    members = [node(i, tmp, sessions=4, timeout=60, tag="e").start() for i in range(2)]
    urls = [f"{m.name}={m.url}" for m in members] + [f"ghost=http://127.0.0.1:{free_port()}"]
    front = router_at(urls).start()
    try:
        wait_ready(members)
        wait_until(lambda: nodes_up(front) == 2, 60, "the router never saw its nodes up", interval=0.2)
        yield front, *members
    finally:
        stop(front, *members)
        for member in members:
            wait_until(lambda m=member: not m.containers(), 60, f"{member.name} left containers behind")


def _point_sdk(monkeypatch: pytest.MonkeyPatch, front: Server, token: str = CLIENT_TOKEN) -> None:
    """The three variables, and nothing else of E2B's."""
    e2bsdk.point(monkeypatch, front.url, token)


@pytest.fixture
def sdk(cluster: tuple[Server, ...], monkeypatch: pytest.MonkeyPatch) -> Server:
    _point_sdk(monkeypatch, cluster[0])
    return cluster[0]


def _sessions_seen(front: Server) -> int:
    answer = httpx.get(f"{front.url}/v1/nodes", headers={"Authorization": f"Bearer {NODE_TOKEN}"}, timeout=5)
    return sum(n.get("sessions", 0) for n in answer.json()["nodes"])


def _on_both_nodes(front: Server, members: tuple[Server, ...]) -> list[Sandbox]:
    """Two sandboxes, one on each node: the second is made once the router has seen the first node's load."""
    made = [Sandbox.create(timeout=120, metadata={"suite": "router"})]
    wait_until(lambda: _sessions_seen(front) >= 1, 30, "the router never saw the first sandbox's node busier")
    made.append(Sandbox.create(timeout=120, metadata={"suite": "router"}))
    assert {s.sandbox_id.rsplit("-", 4)[0] for s in made} == {m.name for m in members}, "both on one node"
    return made


def test_the_sdk_works_through_the_router_on_both_nodes(cluster: tuple[Server, ...], sdk: Server) -> None:
    front, *members = cluster
    made = _on_both_nodes(front, tuple(members))
    try:
        for index, sandbox in enumerate(made):
            seen: list[str] = []
            run = sandbox.run_code(f"print('out')\n6 * {index + 7}", on_stdout=lambda m, got=seen: got.append(m.line))
            assert run.text == str(6 * (index + 7)) and seen == ["out\n"]
            assert sandbox.commands.run("echo hi; pwd").stdout == "hi\n/home/user\n"
            sandbox.files.write("note.txt", f"kept {index}")
            assert sandbox.files.read("note.txt") == f"kept {index}"
            assert "note.txt" in {e.name for e in sandbox.files.list("/home/user")}
            assert sandbox.is_running() and Sandbox.get_info(sandbox.sandbox_id).metadata == {"suite": "router"}
        listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "router"}), limit=1)
        pages = [listed.next_items() for _ in range(2)]
        assert [len(p) for p in pages] == [1, 1] and not listed.has_next
        assert {p[0].sandbox_id for p in pages} == {s.sandbox_id for s in made}
        assert not Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "other"})).next_items()
    finally:
        assert [s.kill() for s in made] == [True, True]
    assert not {s.sandbox_id for s in Sandbox.list().next_items()} & {s.sandbox_id for s in made}
    assert Sandbox.kill(made[0].sandbox_id) is False


def test_lifecycle_streams_and_interrupts_through_the_router(sdk: Server) -> None:
    """What carries ids or streams: pause and connect (its answer's id), fork (ids in a list), a background
    process killed by pid, gzip both ways, a client time limit that interrupts the cell on the node."""
    made = Sandbox.create(timeout=120)
    forks: list[Any] = []
    try:
        made.run_code("kept = 'value'")
        assert made.pause() is True and Sandbox.get_info(made.sandbox_id).state.value == "paused"
        again = Sandbox.connect(made.sandbox_id)
        assert again.sandbox_id == made.sandbox_id and again.run_code("kept").text == "'value'"
        forks = made.fork(count=1, timeout=60)
        assert forks[0].sandbox_id.rsplit("-", 4)[0] == made.sandbox_id.rsplit("-", 4)[0]  # its node
        assert forks[0].run_code("kept").text == "'value'"
        made.files.write("g.txt", b"z" * 5000, gzip=True)
        assert made.files.read("g.txt", gzip=True) == "z" * 5000
        sleeper = made.commands.run("sleep 600", background=True)
        assert made.commands.kill(sleeper.pid) is True
        with pytest.raises(e2b.CommandExitException):
            sleeper.wait()  # its stream, through the router, ends with the kill
        with pytest.raises(e2b.TimeoutException):
            made.run_code("import time\nwhile True: time.sleep(0.1)", timeout=2)
        assert wait_until(lambda: made.run_code("'free'", timeout=20), 20, "the cell ran on").text == "'free'"
    finally:
        for one in [made, *forks]:
            one.kill()


def test_the_async_sdk_through_the_router(sdk: Server) -> None:
    async def scenario() -> tuple[str | None, list[str], str]:
        made = await AsyncSandbox.create(timeout=60)
        seen: list[str] = []
        try:
            run = await made.run_code("print('a')\n2 ** 10", on_stdout=lambda m: seen.append(m.line))
            done = await made.commands.run("echo async")
            return run.text, seen, done.stdout
        finally:
            await made.kill()
    assert asyncio.run(scenario()) == ("1024", ["a\n"], "async\n")


# -- one token never reaches another's sandbox through the router ---------------------------------------------

@pytest.fixture
def victim(sdk: Server) -> Iterator[tuple[Sandbox, int, str]]:
    """Token A's sandbox with a background process (its pid) and a file, and its envd access token."""
    made = _create(sdk, CLIENT_TOKEN)
    sandbox = Sandbox.connect(made["sandboxID"])
    sandbox.files.write("secret.txt", "A's secret")
    sleeper = sandbox.commands.run("sleep 600", background=True)
    yield sandbox, sleeper.pid, made["envdAccessToken"]
    sandbox.kill()


def _create(front: Server, token: str) -> dict[str, Any]:
    with _control(front, token) as control:
        answer = control.post("/v2/sandboxes", json={"templateID": "code-interpreter-v1", "timeout": 120})
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made


def _control(front: Server, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"{front.url}/e2b", headers={"X-API-KEY": token}, timeout=60)


def _data(front: Server, sandbox_id: str, token: str, port: str = ENVD) -> httpx.Client:
    return httpx.Client(base_url=f"{front.url}/e2b/sandbox", timeout=60, headers={
        "E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": port, "X-Access-Token": token,
        "E2B-Traffic-Access-Token": token})


def _connect_envelope(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def _attacks(front: Server, theirs: str, token: str) -> dict[str, int]:
    """Every way token B (with its own sandbox's access token) reaches for A's sandbox: the status of each."""
    seen: dict[str, int] = {}
    with _control(front, OTHER_TOKEN) as control:
        seen["info"] = control.get(f"/sandboxes/{theirs}").status_code
        seen["connect"] = control.post(f"/v2/sandboxes/{theirs}/connect", json={"timeout": 60}).status_code
        seen["timeout"] = control.post(f"/sandboxes/{theirs}/timeout", json={"timeout": 1}).status_code
        seen["pause"] = control.post(f"/sandboxes/{theirs}/pause", json={}).status_code
        seen["snapshot"] = control.post(f"/sandboxes/{theirs}/snapshots", json={}).status_code
        seen["fork"] = control.post(f"/sandboxes/{theirs}/fork", json={"count": 1}).status_code
        seen["kill"] = control.delete(f"/sandboxes/{theirs}").status_code
    with _data(front, theirs, token) as data:
        seen["read"] = data.get("/files", params={"path": "/home/user/secret.txt"}).status_code
        seen["write"] = data.post("/files", params={"path": "/home/user/secret.txt"},
                                  files={"file": ("secret.txt", b"B")}).status_code
        seen["signal"] = data.post("/process.Process/SendSignal", json={
            "process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"}).status_code
        seen["list-processes"] = data.post("/process.Process/List", json={}).status_code
        seen["start"] = data.post("/process.Process/Start", content=_connect_envelope(
            {"process": {"cmd": "/bin/sh", "args": ["-c", "rm -f /home/user/secret.txt"]}}),
            headers={"Content-Type": "application/connect+json"}).status_code
    with _data(front, theirs, token, INTERPRETER) as interpreter:
        seen["run-code"] = interpreter.post("/execute", json={"code": "open('secret.txt', 'w')"}).status_code
    return seen


def test_another_token_never_reaches_a_sandbox_through_the_router(cluster: tuple[Server, ...], sdk: Server,
                                                                   victim: tuple[Sandbox, int, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    front = cluster[0]
    mine, pid, my_token = victim
    attacker = _create(front, OTHER_TOKEN)
    _point_sdk(monkeypatch, front, OTHER_TOKEN)
    try:
        assert {s.sandbox_id for s in Sandbox.list().next_items()} == {attacker["sandboxID"]}  # B's own only
        with pytest.raises(e2b.NotFoundException):
            Sandbox.get_info(mine.sandbox_id)
        with pytest.raises(e2b.NotFoundException):
            Sandbox.connect(mine.sandbox_id)
        assert Sandbox.kill(mine.sandbox_id) is False
        seen = _attacks(front, mine.sandbox_id, attacker["envdAccessToken"])
        print(f"\nB against A through the router: {seen}")
        control = {k: v for k, v in seen.items() if k in ("info", "connect", "timeout", "pause", "snapshot", "fork",
                                                           "kill")}
        assert set(control.values()) == {404}, seen
        assert set(seen.values()) - {404} == {401}, seen  # the data plane: the node refused B's token for A's id
        # B's own sandbox's id with A's (real) token: refused as well, the token is not that sandbox's.
        with _data(front, attacker["sandboxID"], my_token) as data:
            assert data.get("/files", params={"path": "/home/user/secret.txt"}).status_code == 401
    finally:
        with _control(front, OTHER_TOKEN) as control:
            control.delete(f"/sandboxes/{attacker['sandboxID']}")
    _point_sdk(monkeypatch, front, CLIENT_TOKEN)
    assert mine.files.read("secret.txt") == "A's secret" and Sandbox.get_info(mine.sandbox_id).state.value == "running"
    assert pid in {p.pid for p in mine.commands.list()}
    assert mine.run_code("'still here'").text == "'still here'"


def test_a_page_token_is_its_clients_only(cluster: tuple[Server, ...], sdk: Server) -> None:
    front = cluster[0]
    made = [Sandbox.create(timeout=60) for _ in range(2)]
    try:
        with _control(front, CLIENT_TOKEN) as mine, _control(front, OTHER_TOKEN) as theirs:
            first = mine.get("/v2/sandboxes", params={"limit": 1})
            token = first.headers["X-Next-Token"]
            assert mine.get("/v2/sandboxes", params={"limit": 1, "nextToken": token}).status_code == 200
            stolen = theirs.get("/v2/sandboxes", params={"limit": 1, "nextToken": token})
            altered = mine.get("/v2/sandboxes", params={"limit": 1, "nextToken": "W10" + token[3:]})
            assert (stolen.status_code, altered.status_code) == (400, 400), (stolen.text, altered.text)
            assert stolen.json()["message"] == "nextToken is not one this router gave you"
    finally:
        for one in made:
            one.kill()


# -- ids: forged, altered, another key's, a lost node's -------------------------------------------------------

def _forgeries(real: str) -> dict[str, str]:
    node_name, instance, raw, tag, mac = real.rsplit("-", 4)
    other_key = identity.id_key(b"another-cluster-" + b"k" * 24)
    return {
        "mac-flipped": real[:-1] + ("0" if real[-1] != "0" else "1"),
        "raw-changed": f"{node_name}-{instance}-{raw[:-1]}{'0' if raw[-1] != '0' else '1'}-{tag}-{mac}",
        "other-node": real.replace(node_name, "ghost", 1),
        "another-routers-key": e2b_ids.public(other_key, _token_id(CLIENT_TOKEN), node_name, instance, raw),
        "the-nodes-own-id": raw,
        "long": "a" * 5000,
    }


@pytest.mark.parametrize("shape", ["mac-flipped", "raw-changed", "other-node", "another-routers-key",
                                   "the-nodes-own-id", "long"])
def test_a_forged_or_altered_id_is_refused(cluster: tuple[Server, ...], victim: tuple[Sandbox, int, str],
                                           shape: str) -> None:
    front = cluster[0]
    mine, _, token = victim
    forged = _forgeries(mine.sandbox_id)[shape]
    with _control(front, CLIENT_TOKEN) as control:
        assert control.get(f"/sandboxes/{forged}").status_code == 404
        assert control.delete(f"/sandboxes/{forged}").status_code == 404
    with _data(front, forged, token) as data:
        answer = data.get("/files", params={"path": "/home/user/secret.txt"})
    assert answer.status_code == 502 and "was not found" in answer.json()["message"], answer.text
    assert mine.files.read("secret.txt") == "A's secret" and mine.is_running()


def test_an_id_of_a_lost_node_answers_at_once(cluster: tuple[Server, ...], sdk: Server) -> None:
    """The router's `ghost` node never answers: an id naming it (made with the router's own key) is gone."""
    front = cluster[0]
    lost = e2b_ids.public(KEY, _token_id(CLIENT_TOKEN), "ghost", "0123456789ab", "0" * 32)
    began = time.monotonic()
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(lost)
    assert Sandbox.kill(lost) is False
    with _data(front, lost, "x" * 64) as data:
        answer = data.get("/health")
    assert answer.status_code == 502 and "was not found" in answer.json()["message"]
    assert time.monotonic() - began < 10  # no wait on the node: the router knows it is down


def test_a_node_that_dies_leaves_its_sandboxes_gone(docker_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real node stopped under a sandbox: the SDK's calls on it end promptly, as on a sandbox that is gone."""
    tmp = Path(tempfile.mkdtemp(prefix="re2bl-", dir="/tmp"))
    tmp.chmod(0o755)
    member = node(0, tmp, tag="l").start()
    front = router_at([f"{member.name}={member.url}"]).start()
    try:
        wait_ready([member])
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw its node", interval=0.2)
        _point_sdk(monkeypatch, front)
        made = Sandbox.create(timeout=120)
        assert made.run_code("1 + 1").text == "2"
        member.kill(signal.SIGTERM)
        wait_until(lambda: member.containers() == [], 60, "the node left containers behind")
        wait_until(lambda: nodes_up(front) == 0, 30, "the router never saw its node down", interval=0.2)
        began = time.monotonic()
        with pytest.raises(e2b.NotFoundException):
            Sandbox.get_info(made.sandbox_id)
        assert Sandbox.kill(made.sandbox_id) is False
        assert not made.is_running()
        with pytest.raises(e2b.SandboxException):
            made.commands.run("echo never")
        assert time.monotonic() - began < 30  # ends (the SDK retries a few times on its own)
    finally:
        stop(front, member)


# -- a node that streams without end ----------------------------------------------------------------------------

HOSTILE = {  # the node's behaviour: (route, the router's policy, what the client may receive at most)
    "endless-envelopes": ("process.Process/Start", CAPS, 4 * MiB),
    "huge-envelope": ("process.Process/Start", {**CAPS, "NBEXEC_MAX_DATA": "64m"}, 0),  # under the total
    "endless-lines": ("execute", CAPS, 4 * MiB),
    "long-line": ("execute", {**CAPS, "NBEXEC_MAX_DATA": "64m"}, EVENT_CAP),  # the line's cap, under the total
    "list-flood": ("", CAPS, 0),
    "tenancy": ("", CAPS, 0),
    "body-cap": ("", CAPS, 0),
}


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[tuple[FakeNode, Server]]:
    """A fake node (honest until a test says otherwise) and a router in front of it, with small caps."""
    args = ("--max-body", "512k") if request.param == "body-cap" else ()
    with fake_behind_router(HOSTILE[request.param][1], args) as pair:
        yield pair


def _last_envelope(stream: bytes) -> tuple[int, bytes]:
    """The flag and message of a Connect stream's last whole envelope."""
    at, last = 0, (-1, b"")
    while at + 5 <= len(stream):
        flag, length = struct.unpack(">BI", stream[at:at + 5])
        if at + 5 + length > len(stream):
            break
        last, at = (flag, stream[at + 5:at + 5 + length]), at + 5 + length
    return last


@pytest.mark.parametrize("hostile", [k for k, v in HOSTILE.items() if v[0]], indirect=True)
def test_a_node_streaming_without_end_is_cut_by_the_router(hostile: tuple[FakeNode, Server],
                                                            request: pytest.FixtureRequest) -> None:
    fake, front = hostile
    shape = request.node.callspec.params["hostile"]
    route, _, most = HOSTILE[shape]
    made = _create(front, CLIENT_TOKEN)
    before = peak_kib(front)
    fake.behaviour = Behaviour(e2b=shape)
    port = INTERPRETER if route == "execute" else ENVD
    began, received = time.monotonic(), bytearray()
    with _data(front, made["sandboxID"], made["envdAccessToken"], port) as data, \
            data.stream("POST", f"/{route}", content=b"{}") as answer:
        try:
            for chunk in answer.iter_raw():
                received += chunk
        except httpx.HTTPError:
            pass  # cut off: what the router does to a stream that is not Connect's
    grown = (peak_kib(front) - before) * 1024
    wait_until(lambda: fake.sent.get("e2b"), 30, "the node was never stopped: the router read it to its end")
    print(f"\n{shape}: {len(received) / MiB:.1f} MiB reached the client in {time.monotonic() - began:.1f} s; the "
          f"node sent {sum(fake.sent.get('e2b', [0])) / MiB:.0f} MiB; the router's peak RSS grew {grown / MiB:.1f} MiB")
    assert len(received) <= most + 70 * 1024, f"{len(received)} bytes reached the client past the router's cap"
    assert grown < GROWTH_LIMIT
    assert sum(fake.sent["e2b"]) < 128 * MiB  # the node was stopped too, not read to its end
    if route != "execute":  # a Connect stream ends properly, saying why
        flag, message = _last_envelope(bytes(received))
        assert flag == 2 and json.loads(message)["error"]["code"] == "resource_exhausted", message


@pytest.mark.parametrize("hostile", ["list-flood"], indirect=True)
def test_a_nodes_list_flood_is_bounded(hostile: tuple[FakeNode, Server]) -> None:
    """A node answering every list page with half a MiB of tiny objects and "one more page", forever."""
    fake, front = hostile
    fake.behaviour = Behaviour(e2b="list-flood")
    before = peak_kib(front)
    began = time.monotonic()
    with _control(front, CLIENT_TOKEN) as control:
        answer = control.get("/v2/sandboxes")
    grown = (peak_kib(front) - before) * 1024
    pages = fake.sent.get("e2b-list", [])
    print(f"\nlist-flood: {len(pages)} pages ({sum(pages) / MiB:.1f} MiB) read in {time.monotonic() - began:.1f} s; "
          f"the router's peak RSS grew {grown / MiB:.1f} MiB")
    assert answer.status_code == 200 and answer.json() == []  # nothing that was not a sandbox passed on
    assert sum(pages) <= 3 * MiB and grown < GROWTH_LIMIT


@pytest.mark.parametrize("hostile", ["body-cap"], indirect=True)
def test_a_body_over_the_cap_gives_its_place_back(hostile: tuple[FakeNode, Server]) -> None:
    """Uploads refused mid-body by the router's --max-body, more of them than a client's calls in flight: each
    is 413, and the client's next call is served (no place in flight is kept by a refused body)."""
    _, front = hostile
    made = _create(front, CLIENT_TOKEN)

    def chunks() -> Iterator[bytes]:
        for _ in range(16):
            yield b"x" * 65536

    with _data(front, made["sandboxID"], made["envdAccessToken"]) as data:
        refused = [data.post("/files", params={"path": "big"}, content=chunks()).status_code for _ in range(70)]
        assert set(refused) == {413}, refused
        assert data.post("/process.Process/List", json={}).status_code == 200


@pytest.mark.parametrize("hostile", ["tenancy"], indirect=True)
def test_another_clients_id_never_reaches_a_node(hostile: tuple[FakeNode, Server]) -> None:
    """The router itself refuses a sandbox id of another client (the node would too: here it never sees it)."""
    fake, front = hostile
    made = _create(front, CLIENT_TOKEN)
    raw = made["sandboxID"].rsplit("-", 4)[2]
    with _control(front, OTHER_TOKEN) as theirs:
        seen = {call: theirs.request(method, path, json=body).status_code for call, (method, path, body) in {
            "info": ("GET", f"/sandboxes/{made['sandboxID']}", None),
            "connect": ("POST", f"/v2/sandboxes/{made['sandboxID']}/connect", {}),
            "kill": ("DELETE", f"/sandboxes/{made['sandboxID']}", None)}.items()}
    assert set(seen.values()) == {404}, seen
    assert not fake.received(raw.encode()), "another client's call on the sandbox reached its node"


@pytest.mark.parametrize("hostile", ["tenancy"], indirect=True)
def test_a_clients_api_token_never_reaches_a_node(hostile: tuple[FakeNode, Server]) -> None:
    """Nodes take the node token and the sandbox's own access token: a client's API key stays at the router, on
    the control plane and wherever a client puts it on the data plane."""
    fake, front = hostile
    made = _create(front, CLIENT_TOKEN)
    with _data(front, made["sandboxID"], made["envdAccessToken"]) as data:
        data.get("/files", params={"path": "x"}, headers={"Authorization": f"Bearer {CLIENT_TOKEN}",
                                                          "X-API-KEY": CLIENT_TOKEN})
        data.get("/files", params={"path": "x"}, headers={"Authorization": "Basic dXNlcjo="})
    assert fake.seen and not fake.received(CLIENT_TOKEN.encode())
    assert [s.headers.get("authorization") for s in fake.seen if s.path.startswith("/e2b/sandbox/")] \
        == [None, "Basic dXNlcjo="]  # the user to run as still goes on
