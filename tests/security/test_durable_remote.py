"""Durable sessions over the wire (issue #26): a library `Session` whose sandbox is on a node (NBEXEC_NODES) sleeps
and wakes through the same engine as a local one, its node keeping what sleeps (`nbexec.service.sleeping`): under
runc the container is stopped and the cells replayed, under gVisor the memory is checkpointed on the node. A
session closed asleep leaves nothing behind, here or on the node; a sleeping sandbox answers only its owner, and
only to be woken or removed; a node that answers a sleep with something else leaves the session awake and honest.

Judged from outside: the node's containers as Docker sees them, its working and memory folders on disk, what the
code finds after the wake (a file the cells append to tells a replay from a checkpoint), the result's fields.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import nbexec
from nbexec import Session
from nbexec.sandbox.docker import daemon
from nbexec.sandbox.remote import source as remote

from .. import cluster, seamnode
from ..conftest import IMAGE, wait_until
from ..fakenode import for_header, raw_id

NODE_TOKEN = cluster.NODE_TOKEN
SLEEP_ROUTES = ("/sleep", "/awake", "/hibernate", "/wake")


@pytest.fixture(scope="module", params=["runc", "runsc"])
def member(request: pytest.FixtureRequest, docker_ready: None) -> Iterator[cluster.Server]:
    """A node on ``runtime`` (no pool: every sandbox is a session's)."""
    with cluster.running_node(f"z{request.param}", {"NBEXEC_POOL_SIZE": "0", "NBEXEC_RUNTIME": request.param}) \
            as server:
        yield server


@pytest.fixture
def on_node(member: cluster.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[nbexec.SandboxConfig]:
    monkeypatch.setenv("NBEXEC_NODES", member.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    remote.forget_all()
    yield nbexec.SandboxConfig(image=IMAGE, source="remote", pool_size=0, warm_imports=(), timeout=60)
    remote.forget_all()


def runtime_of(member: cluster.Server) -> str:
    return member.env["NBEXEC_RUNTIME"]


def node_work(member: cluster.Server) -> Path:
    """The node's working root (its TMPDIR's nbexec-<uid>): sandboxes' folders and kept memory."""
    return Path(member.env["TMPDIR"]) / f"nbexec-{os.getuid()}"


def node_containers(member: cluster.Server) -> list[Any]:
    return daemon.connect().containers.list(all=True, filters={"label": f"{daemon.LABEL_NODE}={member.name}"})


def kept_on_node(member: cluster.Server) -> list[Path]:
    root = node_work(member)
    return sorted(p for p in root.iterdir() if p.name.startswith("nbexec-")) if root.exists() else []


def test_a_remote_session_sleeps_and_wakes_through_the_one_engine(member: cluster.Server,
                                                                  on_node: nbexec.SandboxConfig) -> None:
    runtime = runtime_of(member)
    with Session(on_node) as session:
        session.upload(b"kept bytes", "kept.bin")
        assert session.run("x = 41\nopen('runs.txt', 'a').write('r')").ok
        (container,) = node_containers(member)
        assert session.hibernate()
        assert session.status == "asleep"
        if runtime == "runsc":  # the memory is on the node, in a private folder; no container runs
            assert node_containers(member) == [], probe_said(member)
            memory = [p for p in kept_on_node(member) if "-memory-" in p.name]
            assert len(memory) == 1 and (memory[0].stat().st_mode & 0o777) == 0o700, memory
        else:  # stopped where it is: no process, no memory
            container.reload()
            assert container.attrs["State"]["Running"] is False and container.attrs["State"]["Pid"] == 0
        result = session.run("print(x + 1, open('kept.bin').read(), open('runs.txt').read())")
        expected = "checkpoint" if runtime == "runsc" else "replay"
        assert result.ok and result.restored == expected, (result.restored, result.notes, result.error)
        # A checkpoint brings the memory back as it was; a replay runs the cell again (its append too).
        assert result.stdout == ("42 kept bytes r\n" if expected == "checkpoint" else "42 kept bytes rr\n")
        assert any(f"came back by {expected}" in note for note in result.notes), result.notes
        assert session.run("print(x)").restored is None
        assert not [p for p in kept_on_node(member) if "-memory-" in p.name]  # removed once woken


def probe_said(member: cluster.Server) -> str:
    """What the node said about its runtime's checkpoints (its log's word when its probe failed)."""
    said = [line for line in member.log.read_text(errors="replace").splitlines() if "cannot keep memory" in line]
    return "\n".join(said) or "the node's log says nothing of its checkpoint probe"


def test_a_remote_session_closed_asleep_leaves_nothing_on_the_node(member: cluster.Server,
                                                                   on_node: nbexec.SandboxConfig) -> None:
    before = kept_on_node(member)
    session = Session(on_node)
    assert session.run("x = 1").ok
    assert session.hibernate()
    if runtime_of(member) == "runsc":  # its memory is kept on the node until the session goes
        assert [p for p in kept_on_node(member) if "-memory-" in p.name], probe_said(member)
    session.close()
    wait_until(lambda: node_containers(member) == [], 60, "the sleeping sandbox's container was left")
    assert kept_on_node(member) == before, "its working folder or its memory was left on the node"


def test_the_reaper_puts_an_idle_remote_session_to_sleep(member: cluster.Server,
                                                          on_node: nbexec.SandboxConfig) -> None:
    with Session(on_node, hibernate_after=0.5) as session:
        assert session.run("y = 'still here'").ok
        wait_until(lambda: session.status == "asleep", 60, "the idle remote session never went to sleep")
        result = session.run("print(y)")
        assert result.ok and result.stdout == "still here\n" and result.restored is not None


# -- who may make a sandbox sleep, and what a sleeping one answers --------------------------------------------------

def _as(http: httpx.Client, method: str, path: str, who: str, **options: Any) -> httpx.Response:
    return http.request(method, path, headers=for_header(method, path, who, "r0", NODE_TOKEN), **options)


def test_only_its_owner_reaches_a_sandbox_asleep_and_only_to_wake_it(member: cluster.Server) -> None:
    with cluster.client(member, NODE_TOKEN, timeout=120) as http:
        made = _as(http, "POST", "/v1/sandboxes", "alice", json={"purpose": "session"})
        assert made.status_code == 201, made.text
        box = f"/v1/sandboxes/{raw_id(made.json()['id'])}"
        try:
            assert _as(http, "PUT", f"{box}/files/secret.txt", "alice", content=b"alice's").status_code == 201
            for route in SLEEP_ROUTES:  # another client, every sleep route: as for an id that does not exist
                assert _as(http, "POST", box + route, "bob").status_code == 404, route
            assert _as(http, "GET", f"{box}/state", "alice").json()["running"] is True
            assert _as(http, "POST", f"{box}/sleep", "alice").json()["asleep"] == "replay"
            for method, route, options in [("POST", "/run", {"json": {"code": "1", "timeout": 30}}),
                                           ("POST", "/hidden", {"json": {"operation": "packages.setup",
                                                                             "timeout": 30}}),
                                           ("GET", "/files", {}), ("GET", "/files/secret.txt", {}),
                                           ("PUT", "/files/x.txt", {"content": b"x"}), ("POST", "/sleep", {}),
                                           ("POST", "/hibernate", {}), ("POST", "/wake", {}),
                                           ("POST", "/freeze", {})]:
                answer = _as(http, method, box + route, "alice", **options)
                assert answer.status_code == 409 and b"alice's" not in answer.content, (route, answer.text)
            state = _as(http, "GET", f"{box}/state", "alice").json()
            assert state["asleep"] == "replay" and state["running"] is False
            assert _as(http, "POST", f"{box}/awake", "bob").status_code == 404
            woke = _as(http, "POST", f"{box}/awake", "alice")
            assert woke.status_code == 200 and woke.json()["language_info"]["name"] == "python", woke.text
            assert _as(http, "POST", f"{box}/awake", "alice").status_code == 409  # awake already
            assert _as(http, "GET", f"{box}/files/secret.txt", "alice").content == b"alice's"
        finally:
            assert _as(http, "DELETE", box, "alice").status_code == 204


def test_a_sandbox_asleep_on_its_node_counts_and_goes_with_its_owner(member: cluster.Server) -> None:
    before = kept_on_node(member)
    with cluster.client(member, NODE_TOKEN, timeout=120) as http:
        made = _as(http, "POST", "/v1/sandboxes", "carol", json={"purpose": "session"})
        box = f"/v1/sandboxes/{raw_id(made.json()['id'])}"
        kept = _as(http, "POST", f"{box}/hibernate", "carol").json()["kept"]
        assert kept == ("checkpoint" if runtime_of(member) == "runsc" else None)
        if kept is None:  # this runtime cannot keep memory: the sandbox runs on, untouched
            assert _as(http, "GET", f"{box}/state", "carol").json()["running"] is True
            assert _as(http, "POST", f"{box}/sleep", "carol").status_code == 200
        assert _as(http, "DELETE", box, "carol").status_code == 204
    wait_until(lambda: node_containers(member) == [], 60, "a sleeping sandbox's container was left")
    assert kept_on_node(member) == before


# -- a node that answers a sleep with something else --------------------------------------------------------------

@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch) -> Iterator[seamnode.SeamNode]:
    with seamnode.SeamNode() as node:
        monkeypatch.setenv("NBEXEC_NODES", node.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
        remote.forget_all()
        try:
            yield node
        finally:
            remote.forget_all()


def _answer(data: Any) -> seamnode.Answer:
    return lambda method, rest, query, body: seamnode.json_reply(data)


LYING_SLEEPS = {
    "kept-something-else": {"/hibernate": {"sandbox": seamnode.SANDBOX, "kept": "everything"},
                            "/sleep": {"sandbox": seamnode.SANDBOX, "asleep": "checkpoint"}},
    "another-sandbox": {"/hibernate": {"sandbox": "0ther", "kept": "checkpoint"},
                        "/sleep": {"sandbox": "0ther", "asleep": "replay"}},
    "not-an-object": {"/hibernate": ["checkpoint"], "/sleep": "asleep"},
    "asleep-otherwise": {"/hibernate": {"sandbox": seamnode.SANDBOX, "kept": None},
                         "/sleep": {"sandbox": seamnode.SANDBOX, "asleep": "deeply"}},
}


@pytest.mark.parametrize("shape", list(LYING_SLEEPS))
def test_a_node_that_lies_about_a_sleep_leaves_the_session_awake(hostile: seamnode.SeamNode, shape: str,
                                                                 tmp_path: Path) -> None:
    for route, data in LYING_SLEEPS[shape].items():
        hostile.answers[route] = _answer(data)
    config = nbexec.SandboxConfig(image=IMAGE, source="remote", timeout=5)
    with Session(config, output_dir=tmp_path / "out") as session:
        assert session.run("print('hi')").ok
        assert not session.hibernate()  # neither its checkpoint nor its sleep is believed
        assert session.status == "ready"
        assert ("POST", f"/v1/sandboxes/{seamnode.SANDBOX}/wake") not in hostile.seen
        result = session.run("print('hi')")
        assert result.ok and result.restored is None


def test_a_wake_answered_with_something_else_is_an_honest_loss(hostile: seamnode.SeamNode, tmp_path: Path) -> None:
    hostile.answers["/hibernate"] = _answer({"sandbox": seamnode.SANDBOX, "kept": "checkpoint"})
    hostile.answers["/wake"] = _answer({"sandbox": seamnode.SANDBOX, "language_info": "python"})
    config = nbexec.SandboxConfig(image=IMAGE, source="remote", timeout=5)
    with Session(config, output_dir=tmp_path / "out") as session:
        assert session.run("print('hi')").ok
        assert session.hibernate() and session.status == "asleep"
        result = session.run("print('again')")
        # The checkpoint could not be restored: a fresh sandbox replayed the cells, and the result says so.
        assert result.restored == "replay", (result.restored, result.notes)
        assert any("could not be restored" in note for note in result.notes), result.notes


# -- and here: a local session closed asleep (its memory checkpointed) ------------------------------------------

def test_a_local_session_closed_asleep_leaves_no_working_folder(cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, runtime="runsc")
    session = Session(config)
    assert session.run("x = 1").ok
    assert session._sandbox is not None
    workdir = Path(session._sandbox.describe()["workdir"])  # the test looks at the real folder behind the handle
    assert session.hibernate() and session._asleep == "checkpoint"
    assert workdir.exists()  # kept while asleep: its /mnt/data
    session.close()
    assert not workdir.exists(), "a session closed asleep left its working folder (and /mnt/data) behind"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(workdir) not in mounts, "its data filesystem is still mounted"


def test_an_abandoned_remote_sandbox_is_removed_from_its_node(member: cluster.Server,
                                                              on_node: nbexec.SandboxConfig) -> None:
    """Attack (#36, attacker's read): a kept session on a node whose adoption failed is abandoned. Before: the
    remote source had the seam's no-op default, so its container ran on at the node until the node's own TTL."""
    source = remote.RemoteSource.from_env()
    handle = source.acquire(on_node, purpose="session")
    try:
        assert len(node_containers(member)) == 1
        source.abandon(on_node, handle.describe())
        wait_until(lambda: node_containers(member) == [], 30, "the abandoned sandbox still runs on its node")
        source.abandon(on_node, {"kind": "remote", "url": "http://127.0.0.1:9", "id": "x"})  # not ours: nothing
    finally:
        with contextlib.suppress(nbexec.NbexecError):  # gone already: abandoned
            source.release(handle, wait=True)
