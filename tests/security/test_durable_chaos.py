"""Durable sessions under chaos (issue #26), with real `nbexec serve` processes on loopback (tests/cluster.py): a
node started with --state-dir that is killed with SIGKILL (idle, or in the middle of a run) and started again
answers the same session ids, through the router, with the same variables and files; a node without a state
folder comes back as a new instance (its sessions answer 410/404 as before).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from nbexec import Session
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.docker import daemon

from ..cluster import NODE_TOKEN, OTHER_TOKEN, Server, all_up, client, node, router, stop, wait_ready
from ..conftest import wait_until
from .test_durable import claimed_containers, claimed_workdirs


@pytest.fixture
def durable_node(docker_ready: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    tmp = tmp_path / "cluster"
    tmp.mkdir(mode=0o755)
    tmp.chmod(0o755)
    state = tmp_path / "state"
    member = node(0, tmp, tag="durable")
    member.args += ["--state-dir", str(state)]
    member.start()
    front = router([member]).start()
    try:
        wait_ready([member])
        wait_until(lambda: all_up(front, 1), 60, "the router never saw the node up", interval=0.2)
        yield {"node": member, "router": front, "state": state}
    finally:
        stop(front, member)
        for container in claimed_containers(state):
            container.remove(force=True)
        for workdir in claimed_workdirs(state):
            remove_tree(workdir)
        wait_until(lambda: not member.containers(), 60, "the node left containers behind")


def restart(member: Server, front: Server) -> None:
    member.kill(signal.SIGKILL)
    wait_until(lambda: not all_up(front, 1), 60, "the router never saw the node go", interval=0.2)
    member.start()
    wait_ready([member])
    wait_until(lambda: all_up(front, 1), 60, "the router never saw the node come back", interval=0.2)


def test_node_sigkill_and_restart_keeps_the_session(durable_node: dict[str, Any]) -> None:
    member, front = durable_node["node"], durable_node["router"]
    with client(front) as http:
        session = http.post("/v1/sessions").json()["id"]
        first = http.post(f"/v1/sessions/{session}/execute",
                          json={"code": "x = 41\nopen('kept.txt', 'w').write('still here')"}).json()
        assert first["ok"], first
    restart(member, front)
    with client(front) as http:
        answer = http.post(f"/v1/sessions/{session}/execute", json={"code": "print(x + 1, open('kept.txt').read())"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["stdout"] == "42 still here\n"
        assert http.get(f"/v1/sessions/{session}").json()["cells"] == 2
        assert http.delete(f"/v1/sessions/{session}").status_code == 204
    assert claimed_containers(durable_node["state"]) == []


def test_node_sigkill_mid_execution_keeps_the_session(durable_node: dict[str, Any]) -> None:
    member, front = durable_node["node"], durable_node["router"]
    with client(front) as http:
        session = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{session}/execute", json={"code": "y = 7"}).json()["ok"]
    started = threading.Event()

    def long_run() -> None:
        with client(front, timeout=30) as http:
            started.set()
            with contextlib.suppress(httpx.HTTPError):  # its node was killed under it
                http.post(f"/v1/sessions/{session}/execute",
                          json={"code": "import time\nwhile True: time.sleep(0.1)"})

    runner = threading.Thread(target=long_run)
    runner.start()
    started.wait(10)
    wait_until(lambda: "busy" in httpx.get(f"{front.url}/v1/sessions/{session}", timeout=5,
                                           headers={"Authorization": client(front).headers["Authorization"]}).text,
               30, "the long run never started", interval=0.1)
    restart(member, front)
    runner.join(60)
    with client(front) as http:
        answer = http.post(f"/v1/sessions/{session}/execute", json={"code": "print(y)"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["stdout"] == "7\n"
        assert http.delete(f"/v1/sessions/{session}").status_code == 204


def test_snapshot_fork_and_restore_over_http(durable_node: dict[str, Any]) -> None:
    front = durable_node["router"]
    with client(front) as http, client(front, OTHER_TOKEN) as other:
        session = http.post("/v1/sessions").json()["id"]
        assert http.post(f"/v1/sessions/{session}/execute",
                         json={"code": "x = 41\nopen('f.txt', 'w').write('kept')"}).json()["ok"]
        answer = http.post(f"/v1/sessions/{session}/snapshot")
        assert answer.status_code == 201, answer.text
        snapshot = answer.json()["snapshot"]
        restored = http.post("/v1/sessions", json={"from_snapshot": snapshot})
        assert restored.status_code == 201, restored.text
        result = http.post(f"/v1/sessions/{restored.json()['id']}/execute",
                           json={"code": "print(x + 1, open('f.txt').read())"}).json()
        assert result["stdout"] == "42 kept\n" and result["restored"] == "replay"
        forked = http.post(f"/v1/sessions/{session}/fork")
        assert forked.status_code == 201, forked.text
        assert http.post(f"/v1/sessions/{forked.json()['id']}/execute",
                         json={"code": "print(x)"}).json()["stdout"] == "41\n"
        # another token, a changed id, garbage: 404, and no session made
        for asked, who in ((snapshot, other), (snapshot[:-1] + ("0" if snapshot[-1] != "0" else "1"), http),
                           ("../../etc", http), ("", http)):
            refused = who.post("/v1/sessions", json={"from_snapshot": asked})
            assert refused.status_code in (404, 201 if asked == "" else 404), refused.text
            if refused.status_code == 201:
                who.delete(f"/v1/sessions/{refused.json()['id']}")
        for made in (session, restored.json()["id"], forked.json()["id"]):
            assert http.delete(f"/v1/sessions/{made}").status_code == 204


REMOTE_OWNER = """
import os, signal, sys, nbexec
config = nbexec.SandboxConfig(source="remote", pool_size=0, warm_imports=(), timeout=30)
session = nbexec.Session(config, state_dir=sys.argv[1])
assert session.run("x = 41\\nopen('kept.txt', 'w').write('on the node')").ok
print(session.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_library_on_nodes_survives_sigkill(durable_node: dict[str, Any], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same engine, over the remote source: a library process using a node is killed, a new one finds its
    session again (the sandbox the node holds), the same variables and files."""
    member = durable_node["node"]
    env = {**os.environ, "NBEXEC_NODES": member.url, "NBEXEC_NODE_TOKEN": NODE_TOKEN}
    state = tmp_path / "library-state"
    child = subprocess.run([sys.executable, "-c", REMOTE_OWNER, str(state)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    monkeypatch.setenv("NBEXEC_NODES", member.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    session = Session.resume(child.stdout.strip(), state_dir=state)
    try:
        result = session.run("print(x + 1, open('kept.txt').read())")
        assert result.ok and result.stdout == "42 on the node\n" and result.node == member.name
    finally:
        session.close()


def test_sessions_sleep_and_wake_under_load_on_a_node(docker_ready: None, tmp_path: Path) -> None:
    """A node with NBEXEC_HIBERNATE_AFTER: several idle sessions go to sleep (status asleep, no process), and a
    concurrent call to each wakes it (restored: replay), each with its own variables."""
    tmp = tmp_path / "cluster"
    tmp.mkdir(mode=0o755)
    tmp.chmod(0o755)
    member = node(0, tmp, tag="sleepy")
    member.env["NBEXEC_HIBERNATE_AFTER"] = "1"
    member.start()
    front = router([member]).start()
    try:
        wait_ready([member])
        wait_until(lambda: all_up(front, 1), 60, "the router never saw the node up", interval=0.2)
        with client(front) as http:
            ids = [http.post("/v1/sessions").json()["id"] for _ in range(4)]
            for number, session in enumerate(ids):
                assert http.post(f"/v1/sessions/{session}/execute", json={"code": f"n = {number}"}).json()["ok"]
            for session in ids:
                wait_until(lambda s=session: http.get(f"/v1/sessions/{s}").json()["status"] == "asleep", 120,
                           "an idle session never went to sleep", interval=0.2)
        answers: dict[str, Any] = {}

        def wake(session: str) -> None:
            with client(front) as http:
                answers[session] = http.post(f"/v1/sessions/{session}/execute", json={"code": "print(n)"}).json()

        threads = [threading.Thread(target=wake, args=(s,)) for s in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for number, session in enumerate(ids):
            assert answers[session]["stdout"] == f"{number}\n" and answers[session]["restored"] == "replay"
        with client(front) as http:
            for session in ids:
                assert http.delete(f"/v1/sessions/{session}").status_code == 204
    finally:
        stop(front, member)
        wait_until(lambda: not member.containers(), 60, "the node left containers behind")


def test_node_lost_for_good_session_restored_on_another(docker_ready: None, tmp_path: Path) -> None:
    """Two nodes sharing a snapshot folder (NBEXEC_SNAPSHOT_DIR: shared storage): a session's node dies for good;
    its last snapshot, asked for through the router, starts on the other node with its files and variables."""
    tmp = tmp_path / "cluster"
    tmp.mkdir(mode=0o755)
    tmp.chmod(0o755)
    shared = tmp_path / "snapshots"
    members = [node(i, tmp, tag="pair") for i in range(2)]
    for member in members:
        member.env["NBEXEC_SNAPSHOT_DIR"] = str(shared)
        member.start()
    front = router(members).start()
    try:
        wait_ready(members)
        wait_until(lambda: all_up(front, 2), 60, "the router never saw two nodes up", interval=0.2)
        with client(front) as http:
            session = http.post("/v1/sessions").json()["id"]
            first = http.post(f"/v1/sessions/{session}/execute",
                              json={"code": "x = 41\nopen('kept.txt', 'w').write('moved')"})
            lost = next(m for m in members if m.name == first.headers["x-nbexec-node"])
            snapshot = http.post(f"/v1/sessions/{session}/snapshot").json()["snapshot"]
        lost.kill(signal.SIGKILL)
        wait_until(lambda: all_up(front, 1), 60, "the router never saw the node go", interval=0.2)
        with client(front) as http:
            assert http.post(f"/v1/sessions/{session}/execute", json={"code": "x"}).status_code in (404, 410, 502,
                                                                                                  503)
            restored = http.post("/v1/sessions", json={"from_snapshot": snapshot})
            assert restored.status_code == 201, restored.text
            again = http.post(f"/v1/sessions/{restored.json()['id']}/execute",
                              json={"code": "print(x + 1, open('kept.txt').read())"})
            assert again.headers["x-nbexec-node"] != lost.name
            assert again.json()["stdout"] == "42 moved\n" and again.json()["restored"] == "replay"
            assert http.delete(f"/v1/sessions/{restored.json()['id']}").status_code == 204
    finally:
        stop(front, *members)
        client_ = daemon.connect()
        for member in members:  # the dead node's session container: its process is gone, swept by name
            for name in member.containers():
                with contextlib.suppress(docker.errors.NotFound):  # another test process's sweep may be first
                    client_.containers.get(name.lstrip("/")).remove(force=True)
        # A node killed with SIGKILL leaves its sandbox's data filesystem mounted in its folder: as the operator's
        # next `nbexec serve` in that folder would, unmount it and remove the folder.
        remove_tree(tmp)
