"""Past one machine: three real node processes and a router on loopback, sharing this Docker engine.

One-shots spread over nodes; sessions keep their state through the router (and across a router restart); a node
killed with SIGKILL mid-run gives explicit errors naming it, never a hang or a silent retry, while the others go
on; a restarted node sweeps what its dead life left and is used again; every hop needs its token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import nbexec

from .cluster import CLIENT_TOKEN, NODE_TOKEN, OTHER_TOKEN, ROOT, Server, all_up, client, node, router, stop, wait_ready
from .conftest import wait_until

# Prints a dot a second, so a stream is never quiet for long. The clients' read timeout (60 s) only bounds a hang:
# a loaded CI machine may take many seconds to start a sandbox before the first line.
LONG = ("print('started', flush=True)\nimport time\nfor _ in range({seconds}):\n    time.sleep(1)\n"
        "    print('.', end='', flush=True)\nprint('done')")


@pytest.fixture(scope="module")
def cluster(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cluster")
    tmp.chmod(0o755)
    nodes = [node(i, tmp).start() for i in range(3)]
    front = router(nodes).start()
    try:
        wait_ready(nodes)
        wait_until(lambda: all_up(front, 3), 60, "the router never saw three nodes up", interval=0.2)
        yield {"nodes": nodes, "router": front}
    finally:
        # A node a test killed and did not start again (it failed before) is not judged: its sweep is a later
        # life's, which never came. Its containers are removed all the same.
        judged = [n for n in nodes if n.process is not None and n.process.poll() is None]
        try:
            stop(front, *nodes)
            for server in judged:
                wait_until(lambda s=server: not s.containers(), 60, f"{server.name} left containers behind")
        finally:
            for server in nodes:
                server.remove_containers()


def _stream(server: Server, path: str, code: str, token: str = CLIENT_TOKEN) -> tuple[str, Iterator[str], Any]:
    """Start a streamed run; return (the node it went to, its lines, what closes its response and its client).

    The client is closed too: a pooled connection left to the garbage collector warns in whichever test runs
    next."""
    held = contextlib.ExitStack()
    http = held.enter_context(client(server, token, timeout=60))
    response = held.enter_context(http.stream("POST", f"{path}?stream=true", json={"code": code}))
    assert response.status_code == 200, response.read()
    return response.headers["x-nbexec-node"], response.iter_lines(), held


def _until_event(lines: Iterator[str], kinds: tuple[str, ...]) -> tuple[str, Any]:
    """Read events until one of ``kinds``; the client's read timeout bounds every wait."""
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind in kinds:
            return kind, json.loads(line[6:])
    raise AssertionError(f"the stream ended without {kinds}")


def test_one_shots_spread_over_the_nodes(cluster: dict[str, Any]) -> None:
    front: Server = cluster["router"]
    results: list[dict[str, Any]] = []

    def run() -> None:
        with client(front) as http:
            for _ in range(3):
                results.append(http.post("/v1/execute", json={"code": "print(6 * 7)"}).json())

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r["stdout"] for r in results] == ["42\n"] * 9
    names = {n.name for n in cluster["nodes"]}
    assert {r["node"] for r in results} <= names and len({r["node"] for r in results}) >= 2, results


def test_session_state_and_files_through_the_router(cluster: dict[str, Any]) -> None:
    front: Server = cluster["router"]
    with client(front) as http, client(front, OTHER_TOKEN) as other:
        sid = http.post("/v1/sessions").json()["id"]
        assert sid.split(".")[0] in {n.name for n in cluster["nodes"]}
        assert http.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).json()["ok"]
        assert http.put(f"/v1/sessions/{sid}/files/in/a.txt", content=b"hello").status_code == 201
        ran = http.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x + 1)\n"
                        "open('out.txt', 'w').write(open('in/a.txt').read().upper())"}).json()
        assert ran["stdout"] == "42\n" and ran["execution_id"].startswith(sid)
        urls = {f["name"]: f["url"] for f in ran["files"]}
        assert urls["out.txt"] == f"/v1/sessions/{sid}/files/out.txt"
        assert http.get(urls["out.txt"]).content == b"HELLO"
        assert other.get(f"/v1/sessions/{sid}").status_code == 404  # another token: as on a single node
        assert other.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}).status_code == 404
        once = http.post("/v1/execute", json={"code": "open('/mnt/data/r.txt', 'w').write('r')"}).json()
        assert http.get(once["files"][0]["url"]).content == b"r"
        assert other.get(once["files"][0]["url"]).status_code == 404
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204


def test_tokens_are_required_on_every_hop(cluster: dict[str, Any]) -> None:
    front: Server = cluster["router"]
    member: Server = cluster["nodes"][0]
    with client(front, None) as anonymous, client(front, NODE_TOKEN) as node_token_at_router:
        assert anonymous.post("/v1/execute", json={"code": "1"}).status_code == 401
        assert node_token_at_router.post("/v1/sessions").status_code == 401  # the nodes' token is not a client's
    with client(member, None) as anonymous, client(member, CLIENT_TOKEN) as client_at_node:
        assert anonymous.get("/v1/capacity").status_code == 401
        assert client_at_node.post("/v1/execute", json={"code": "1"}).status_code == 401  # clients go through routers
    with client(member, NODE_TOKEN) as router_like:
        capacity = router_like.get("/v1/capacity").json()
        assert capacity["node"] == member.name and {"sessions", "pool_free", "running"} <= capacity.keys()


def test_router_restart_keeps_sessions(cluster: dict[str, Any]) -> None:
    front: Server = cluster["router"]
    with client(front) as http:
        sid = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{sid}/execute", json={"code": "kept = 'across routers'"}).json()["ok"]
    front.kill(signal.SIGKILL)
    front.start()
    wait_until(lambda: all_up(front, 3), 60, "the restarted router never saw the nodes", interval=0.2)
    with client(front) as http:
        assert http.post(f"/v1/sessions/{sid}/execute", json={"code": "print(kept)"}).json()["stdout"] == \
            "across routers\n"
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204


def _session_on(front: Server, victim: str) -> str:
    """A session on the node named ``victim`` (sessions made elsewhere are deleted)."""
    with client(front) as http:
        for _ in range(30):
            sid = http.post("/v1/sessions").json()["id"]
            if sid.startswith(victim + "."):
                return str(sid)
            http.delete(f"/v1/sessions/{sid}")
    raise AssertionError(f"no session landed on {victim}")


def test_a_killed_node_fails_explicitly_and_comes_back(cluster: dict[str, Any], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       request: pytest.FixtureRequest) -> None:
    front: Server = cluster["router"]
    by_name = {n.name: n for n in cluster["nodes"]}
    opened = contextlib.ExitStack()
    request.addfinalizer(opened.close)  # closed however the test ends
    streams = [_stream(front, "/v1/execute", LONG.format(seconds=12)) for _ in range(3)]
    for *_, held in streams:
        opened.push(held)
    victim = by_name[streams[0][0]]
    sid = _session_on(front, victim.name)
    with client(front) as http:
        assert http.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"}).json()["ok"]
    session_run = _stream(front, f"/v1/sessions/{sid}/execute", LONG.format(seconds=60))
    opened.push(session_run[2])
    monkeypatch.setenv("NBEXEC_NODES", victim.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    local = nbexec.Session(output_dir=tmp_path / "remote-session")
    kept = local.run("open('/mnt/data/kept.txt', 'w').write('downloaded before the node died')").files[0]
    lost_one_shot: list[BaseException] = []
    library_run = threading.Thread(target=lambda: _catch(lost_one_shot, LONG.format(seconds=60)))
    library_run.start()
    for _, lines, _ in [streams[0], session_run]:
        assert _until_event(lines, ("output",))[1]["text"] == "started\n"
    wait_until(lambda: victim.name in _running_on(victim), 90, "the library's one-shot never started")  # under load

    victim.kill(signal.SIGKILL)
    kind, data = _until_event(streams[0][1], ("result", "error"))
    assert (kind, data["status"], data["error"], data["node"]) == ("error", 502, "node_lost", victim.name), data
    kind, data = _until_event(session_run[1], ("result", "error"))
    assert (kind, data["status"], data["error"]) == ("error", 410, "session_lost"), data
    library_run.join(timeout=60)
    assert not library_run.is_alive() and isinstance(lost_one_shot[0], nbexec.NodeLostError), lost_one_shot
    assert victim.name in str(lost_one_shot[0])
    with pytest.raises(nbexec.SessionLostError, match=victim.name):
        local.run("print(1)")
    assert Path(kept.path).read_text() == "downloaded before the node died"  # files already downloaded stay
    local.close()
    for node_name, lines, _ in streams[1:]:  # the other nodes' runs are unaffected
        if node_name != victim.name:
            assert _until_event(lines, ("result", "error"))[1]["stdout"].endswith(".done\n")
    opened.close()

    wait_until(lambda: all_up(front, 2), 60, "the router never marked the dead node down", interval=0.1)
    monkeypatch.setenv("NBEXEC_NODES", ",".join(n.url for n in cluster["nodes"]))
    elsewhere = nbexec.execute_notebook("print('elsewhere')")  # the library skips the dead node too
    assert elsewhere.stdout == "elsewhere\n" and elsewhere.node != victim.name
    with client(front) as http:
        lost = http.post(f"/v1/sessions/{sid}/execute", json={"code": "x"})
        assert lost.status_code == 410 and lost.json()["error"] == "session_lost", lost.text
        moved = http.post("/v1/execute", json={"code": "print('elsewhere')"}).json()
        assert moved["stdout"] == "elsewhere\n" and moved["node"] != victim.name

    others = [n for n in cluster["nodes"] if n is not victim]
    others_before = {c for n in others for c in n.containers()}
    victim.start()
    wait_ready([victim])
    wait_until(lambda: not [c for c in victim.containers() if _owner_pid(c) == "dead"], 60,
               "the restarted node did not sweep its dead life's containers")
    assert others_before and others_before <= {c for n in others for c in n.containers()}  # theirs are left alone
    wait_until(lambda: all_up(front, 3), 30, "the router never saw the node come back", interval=0.2)
    with client(front) as http:
        assert http.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}).status_code == 410  # a new instance
        wait_until(lambda: http.post("/v1/execute", json={"code": "1"}).json()["node"] == victim.name, 60,
                   "the node that came back is never used again")


def _catch(errors: list[BaseException], code: str) -> None:
    try:
        nbexec.execute_notebook(code)
    except BaseException as exc:  # the test asserts which
        errors.append(exc)


def _running_on(victim: Server) -> str:
    with client(victim, NODE_TOKEN) as http:
        return victim.name if http.get("/v1/capacity").json()["running"] >= 3 else ""


def _owner_pid(container: str) -> str:
    from nbexec.sandbox.docker import daemon

    labels = daemon.connect().containers.get(container.lstrip("/")).labels
    pid = labels.get(daemon.LABEL_OWNER, "").rpartition(":")[2]
    return "alive" if pid.isdigit() and Path(f"/proc/{pid}").exists() else "dead"


def _normalised(text: str, folder: Path) -> str:
    return re.sub(r"\S*" + re.escape(folder.name) + r"\S*", "<out>", text)


def test_nbexec_run_on_nodes_matches_a_local_run(cluster: dict[str, Any], tmp_path: Path) -> None:
    """`NBEXEC_NODES=... nbexec run examples/analysis.py`: the local run's output, the node named, files here."""
    script = ROOT / "examples" / "analysis.py"
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    base.pop("NBEXEC_NODES", None)
    remote_env = {**base, "NBEXEC_NODES": ",".join(n.url for n in cluster["nodes"]), "NBEXEC_NODE_TOKEN": NODE_TOKEN}
    runs = {}
    for label, env in (("local", base), ("remote", remote_env)):
        out = tmp_path / label
        done = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", str(script), "--output-dir", str(out)],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        runs[label] = (_normalised(done.stdout, out), done.stderr, out)
    assert runs["remote"][0] == runs["local"][0]
    assert re.search(r"^node: test\d+-n\d$", runs["remote"][1], re.MULTILINE), runs["remote"][1]
    for name in ("summary.csv", "revenue.png"):
        remote_file = runs["remote"][2] / "data" / name
        assert remote_file.stat().st_mode & 0o077 == 0  # private, as a local run's
        if name.endswith(".csv"):
            assert remote_file.read_bytes() == (runs["local"][2] / "data" / name).read_bytes()
    assert (runs["remote"][2] / "images" / "cell2-1.png").is_file()
    notebook = json.loads((runs["remote"][2] / "notebook.ipynb").read_text())
    assert notebook["metadata"]["nbexec"]["node"].startswith("test")


def test_typescript_client_works_against_the_router(cluster: dict[str, Any], tmp_path: Path) -> None:
    tsc = ROOT / ".tools" / "node_modules" / ".bin" / "tsc"
    node_binary = shutil.which("node")
    assert node_binary and tsc.exists(), "needs Node.js and TypeScript in .tools/ (run scripts/setup.sh --test)"
    compiled = subprocess.run([str(tsc), str(ROOT / "examples" / "typescript" / "client.ts"), "--target", "es2022",
                               "--module", "nodenext", "--types", "node", "--typeRoots",
                               str(ROOT / ".tools" / "node_modules" / "@types"), "--outDir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stdout
    done = subprocess.run([node_binary, str(tmp_path / "client.js")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NBEXEC_URL": cluster["router"].url, "NBEXEC_TOKEN": CLIENT_TOKEN})
    assert done.returncode == 0, done.stderr
    assert "one-shot: ok=true stdout=5050" in done.stdout
    assert "session: ok=true stdout=43 files=input.csv,sums.csv" in done.stdout
    assert "download: ,0 | a,4 | b,6" in done.stdout
    assert "error: ZeroDivisionError: division by zero" in done.stdout


def test_capacity_counts_sessions(cluster: dict[str, Any]) -> None:
    front: Server = cluster["router"]
    # A probe slower than its 3 s on a loaded machine marks a node down for a moment: wait for all three.
    wait_until(lambda: all_up(front, 3), 60, "the router never saw three nodes up", interval=0.2)
    with client(front) as http:
        assert http.get("/v1/capacity").json()["nodes"] == 3
        sid = http.post("/v1/sessions").json()["id"]
        member = next(n for n in cluster["nodes"] if sid.startswith(n.name + "."))
        with client(member, NODE_TOKEN) as direct:
            assert direct.get("/v1/capacity").json()["sessions"] >= 1
        http.delete(f"/v1/sessions/{sid}")
    assert httpx.get(f"{front.url}/readyz", timeout=5).json()["ready"] is True
    wait_until(lambda: "nbexec_router_nodes_up 3" in httpx.get(f"{front.url}/metrics", timeout=5).text, 60,
               "the router's metrics never counted three nodes up", interval=0.2)


def test_llm_tool_calls_run_on_the_nodes(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool handlers are unchanged: with NBEXEC_NODES they run one-shots and sessions on the nodes."""
    from nbexec.integrations import toolcall

    monkeypatch.setenv("NBEXEC_NODES", ",".join(n.url for n in cluster["nodes"]))
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    names = {n.name for n in cluster["nodes"]}
    once = toolcall.run({"code": "print(2 ** 10)"})
    assert isinstance(once, nbexec.ExecutionResult) and once.stdout == "1024\n" and once.node in names
    sessions = nbexec.SessionManager(max_sessions=2, keep_files=False)
    try:
        first = toolcall.run({"code": "total = 41"}, sessions=sessions, conversation="chat")
        assert isinstance(first, nbexec.ExecutionResult) and first.node in names
        session_id = re.search(r"session_id: (\S+);", first.text)[1]  # type: ignore[index]
        second = toolcall.run({"code": "print(total + 1)", "session_id": session_id}, sessions=sessions,
                              conversation="chat")
        assert isinstance(second, nbexec.ExecutionResult) and second.stdout == "42\n" and second.node == first.node
    finally:
        sessions.close_all()


# Loaded into a node process (sitecustomize): its worker thread lingers after each call before it lets go of the
# sandbox, and after each run before it gives back the token's slot, as a thread descheduled on a busy machine does.
LINGERING_NODE = '''
import contextlib, time
from nbexec.service import held

_using = held.Held.using

@contextlib.contextmanager
def _lingering(self, entry):
    with _using(self, entry) as handle:
        yield handle
        time.sleep(0.5)

held.Held.using = _lingering

from nbexec.service import sandboxes

_work = sandboxes._Run.work

def _slow_work(self, code, timeout):
    _work(self, code, timeout)
    time.sleep(0.5)

sandboxes._Run.work = _slow_work
'''


def test_a_node_lets_go_of_the_sandbox_and_the_slot_before_it_says_a_run_ended(
        docker_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that has read a run's end calls on the sandbox at once (the files' freeze, the next cell): by then
    the node has let go of the sandbox and of the token's execution slot, however late its worker thread runs
    (CI once saw "busy with another call" on a loaded machine). Judged on a node whose thread lingers half a
    second after each call, with one slot per token: a notebook of three cells writing a file, then a session's
    cells back to back, all run."""
    import nbformat

    from nbexec.sandbox.remote import source as remote_source

    from .cluster import running_node
    from .conftest import IMAGE

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LINGERING_NODE)
    with running_node("slow", {"PYTHONPATH": f"{hook}:{ROOT}", "NBEXEC_POOL_SIZE": "0"}, running=1) as server:
        monkeypatch.setenv("NBEXEC_NODES", server.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
        remote_source.forget_all()
        try:
            config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, source="remote")
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in (
                "x = 6", "open('/mnt/data/answer.txt', 'w').write(str(x * 7))", "print(x * 7)")])
            result = nbexec.execute_notebook(nb, config=config, output_dir=tmp_path / "out")
            assert result.ok and result.stdout == "42\n", result.to_dict()
            assert [f.name for f in result.files] == ["answer.txt"]
            with nbexec.Session(config) as session:
                said = [session.run(f"print({n})") for n in range(4)]
            assert [r.ok and r.stdout for r in said] == ["0\n", "1\n", "2\n", "3\n"], [r.to_dict() for r in said]
        finally:
            remote_source.forget_all()
