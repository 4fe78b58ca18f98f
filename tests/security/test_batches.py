"""Attacks on /v1/batches of a real `nbexec serve` process, judged from outside: another token's batch, huge and
deep bodies (the node's peak memory and the call's wall time), a stream nobody reads, cancel mid-batch
(containers and folders left), and the per-token caps (429 with Retry-After; other tokens unaffected)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nbexec.files.workdir import remove_tree
from nbexec.sandbox.docker import daemon

from ..cluster import NODE_TOKEN, OTHER_TOKEN, Server, client, running_node, wait_ready
from ..cluster import node as cluster_node
from ..conftest import wait_until

SLEEP = {"code": "import time\ntime.sleep(600)"}


@pytest.fixture(scope="module")
def node(docker_ready: None) -> Iterator[Server]:
    env = {"NBEXEC_API_TOKENS": f"{NODE_TOKEN},{OTHER_TOKEN}", "NBEXEC_POOL_SIZE": "0"}
    with running_node("batch", env, running=3) as server:
        yield server


def peak_rss(server: Server) -> int:
    """The node process's peak resident memory (VmHWM), in bytes."""
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def results_folders(server: Server) -> list[Path]:
    """Folders of batches and of their items' results under the node's TMPDIR."""
    found: list[Path] = []
    for where, folders, _ in os.walk(server.env["TMPDIR"]):  # a folder going while it is walked is skipped
        found.extend(Path(where, name) for name in folders if name.startswith(("run-", "batch-")))
    return found


def events(http: httpx.Client, batch_id: str) -> list[tuple[str, dict]]:
    found: list[tuple[str, dict]] = []
    with http.stream("GET", f"/v1/batches/{batch_id}/events") as response:
        assert response.status_code == 200
        kind = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                found.append((kind, json.loads(line[6:])))
    return found


def test_a_batch_streams_each_result_and_pages_them(node: Server) -> None:
    with client(node, NODE_TOKEN) as http:
        made = http.post("/v1/batches", json=[{"code": "print('a')"}, {"code": "1/0"}, {"code": "print('c')"}])
        assert made.status_code == 202, made.text
        batch_id = made.json()["id"]
        seen = events(http, batch_id)
        items = [data for kind, data in seen if kind == "item"]
        assert sorted(item["index"] for item in items) == [0, 1, 2]
        assert {item["index"]: item["result"]["ok"] for item in items} == {0: True, 1: False, 2: True}
        assert seen[-1][0] == "end" and seen[-1][1]["ok"] == 2 and seen[-1][1]["failed"] == 1
        first = http.get(f"/v1/batches/{batch_id}", params={"limit": 2}).json()
        assert first["status"] == "done" and len(first["items"]) == 2
        rest = http.get(f"/v1/batches/{batch_id}", params={"cursor": first["next_cursor"]}).json()
        assert len(rest["items"]) == 1 and rest["next_cursor"] != first["next_cursor"]
        assert http.get(f"/v1/batches/{batch_id}", params={"cursor": "7"}).status_code == 400  # not a line end
        assert http.delete(f"/v1/batches/{batch_id}").status_code == 204


def test_another_tokens_batch_is_not_found(node: Server) -> None:
    with client(node, NODE_TOKEN) as owner, client(node, OTHER_TOKEN) as other:
        batch_id = owner.post("/v1/batches", json=[{"code": "print(1)"}]).json()["id"]
        assert other.get(f"/v1/batches/{batch_id}").status_code == 404
        assert other.get(f"/v1/batches/{batch_id}/events").status_code == 404
        assert other.delete(f"/v1/batches/{batch_id}").status_code == 404
        assert owner.get(f"/v1/batches/{batch_id}").status_code == 200  # the other's delete did nothing
        assert owner.delete(f"/v1/batches/{batch_id}").status_code == 204
        assert owner.get(f"/v1/batches/{batch_id}").status_code == 404


@pytest.mark.parametrize(("body", "status"), [
    pytest.param(b"[" + b'{"code":"1"},' * 1_000_000 + b'{"code":"1"}]', 413, id="a-million-tiny-items"),
    pytest.param(b"[" + b"[" * 2_000_000 + b"]" * 2_000_000 + b"]", 400, id="deep-nesting-within-the-cap"),
    pytest.param(b'[{"code": "1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]", 400, id="deep-inside-an-item"),
    pytest.param(b"x" * (17 * 1024**2), 413, id="over-the-body-cap"),
    pytest.param(b"[]", 422, id="empty"),
    pytest.param(b'{"code": "1"}', 422, id="not-an-array"),
])
def test_hostile_bodies_are_refused_within_bounded_memory_and_time(node: Server, body: bytes, status: int) -> None:
    before = peak_rss(node)
    with client(node, NODE_TOKEN, timeout=120) as http:
        started = time.monotonic()
        answer = http.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
        took = time.monotonic() - started
    assert answer.status_code == status, answer.text[:300]
    grew = peak_rss(node) - before
    assert grew < 200 * 1024**2, f"the node's peak memory grew by {grew / 1024**2:.0f} MiB"
    assert took < 30, f"the refusal took {took:.1f} s"


def test_a_stream_nobody_reads_holds_the_node_to_little_memory(node: Server) -> None:
    big = {"code": "print('x' * 900_000)"}
    with client(node, NODE_TOKEN) as http:
        batch_id = http.post("/v1/batches", json=[big] * 24).json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}", params={"limit": 1}).json()["status"] == "done",
                   240, "the batch never ended")
        before = peak_rss(node)
        with socket.create_connection(("127.0.0.1", node.port)) as silent:
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            silent.sendall(f"GET /v1/batches/{batch_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           f"Authorization: Bearer {NODE_TOKEN}\r\n\r\n".encode())
            time.sleep(10)  # the node writes what the socket takes, then waits
            grew = peak_rss(node) - before
            assert http.get("/healthz").status_code == 200  # the node still answers
        assert http.delete(f"/v1/batches/{batch_id}").status_code == 204
    assert grew < 14 * 1024**2, f"the node's peak memory grew by {grew / 1024**2:.0f} MiB for a stream of 21 MB"


def test_cancel_mid_batch_interrupts_and_leaves_nothing(node: Server) -> None:
    with client(node, NODE_TOKEN) as http:
        batch_id = http.post("/v1/batches", json=[SLEEP] * 6).json()["id"]
        wait_until(lambda: len(node.containers()) >= 3, 120, "the items never started")
        started = time.monotonic()
        assert http.delete(f"/v1/batches/{batch_id}").status_code == 204
        took = time.monotonic() - started
        assert http.get(f"/v1/batches/{batch_id}").status_code == 404
    assert took < 30, f"cancelling took {took:.1f} s: the running items were not interrupted"
    wait_until(lambda: not node.containers(), 30, "containers were left behind")
    wait_until(lambda: not results_folders(node), 60, "folders were left behind")


def test_caps_answer_429_with_retry_after_and_spare_other_tokens(node: Server) -> None:
    with client(node, NODE_TOKEN) as http, client(node, OTHER_TOKEN) as other:
        kept = [http.post("/v1/batches", json=[{"code": "1"}]).json()["id"] for _ in range(4)]
        refused = http.post("/v1/batches", json=[{"code": "1"}])
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        theirs = other.post("/v1/batches", json=[{"code": "1"}])
        assert theirs.status_code == 202  # another token's caps are its own
        for batch_id in [*kept, theirs.json()["id"]]:
            (other if batch_id == theirs.json()["id"] else http).delete(f"/v1/batches/{batch_id}")
        assert http.post("/v1/batches", json=[SLEEP] * 1001).status_code == 413  # never fits
        queued = http.post("/v1/batches", json=[SLEEP] * 600)
        assert queued.status_code == 202
        over = http.post("/v1/batches", json=[SLEEP] * 600)
        assert over.status_code == 429 and over.headers["Retry-After"].isdigit()
        assert other.post("/v1/execute", json={"code": "print(2)"}).json()["ok"] is True
        assert http.delete(f"/v1/batches/{queued.json()['id']}").status_code == 204
    wait_until(lambda: not node.containers(), 30, "containers were left behind")


def test_a_batch_survives_a_restart_of_a_node_with_a_state_folder(docker_ready: None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bstate-", dir="/tmp"))
    tmp.chmod(0o755)  # the sandbox user reaches its bind mounts through it
    server = cluster_node(0, tmp, running=2, tag="bs")
    server.env.update({"NBEXEC_POOL_SIZE": "0"})
    server.args += ["--state-dir", str(tmp / "state")]
    items = [{"code": f"import time\ntime.sleep(4)\nprint({i})"} for i in range(6)]
    try:
        server.start()
        wait_ready([server])
        with client(server, NODE_TOKEN) as http:
            batch_id = http.post("/v1/batches", json=items).json()["id"]
            wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["done"] >= 2, 120, "no item ended")
        server.kill(signal.SIGTERM)
        server.start()
        wait_ready([server])
        with client(server, NODE_TOKEN) as http:
            wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["status"] == "done", 180,
                       "the batch did not finish after the restart")
            page = http.get(f"/v1/batches/{batch_id}", params={"limit": 100}).json()
            assert page["total"] == 6 and page["done"] == 6 and page["ok"] == 6
            assert {item["index"]: item["result"]["stdout"].strip() for item in page["items"]} == {
                i: str(i) for i in range(6)}  # each item once: none lost, none run twice into the results
            assert http.delete(f"/v1/batches/{batch_id}").status_code == 204
    finally:
        if server.process is not None and server.process.poll() is None:
            server.kill(signal.SIGTERM)
        wait_until(lambda: not server.containers(), 60, "containers were left behind")
        remove_tree(tmp)


# -- reuse=batch: judge items in a few sandboxes of the batch's own --------------------------------------------

# Which sandbox ran it: the container's own folder, from the source of its /etc/hostname mount.
HOST = {"program": "import sys\nsys.stderr.write([line.split()[3] for line in open('/proc/self/mountinfo') "
                   "if line.split()[4] == '/etc/hostname'][0])", "tests": [{"expected": None}]}
SLEEPER = {"program": "import time\ntime.sleep(600)", "tests": [{"expected": None}],
           "limits": {"time": 600, "program": 600}}


def _hosts(seen: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """Each judge item's (mode, the sandbox it ran in), as HOST reports it."""
    judged = [data["result"]["judge"] for kind, data in seen if kind == "item" and "judge" in data.get("result", {})]
    return [(j["mode"], j["tests"][0]["stderr"]) for j in judged]


def _three_at_once(http: httpx.Client) -> list[object]:
    """Three executions at once, as many as the token's run cap: each is ok only if no slot is still held."""
    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        answers = list(threads.map(lambda _: http.post("/v1/execute", json={"code": "import time; time.sleep(2)"}),
                                   range(3)))
    return [answer.json().get("ok") for answer in answers]


def test_reuse_shares_a_few_sandboxes_within_a_batch_and_never_across_batches(node: Server) -> None:
    """A batch's judge items run in at most as many sandboxes as the token's run cap (3), and no sandbox serves
    two batches (nor two tokens): the next batch has sandboxes of its own."""
    earlier = set(results_folders(node))  # the results of executions kept for their time (not a batch's)
    with client(node, NODE_TOKEN) as http, client(node, OTHER_TOKEN) as other:
        assert http.post("/v1/batches", params={"reuse": "all"}, json=[HOST]).status_code == 422
        made = http.post("/v1/batches", params={"reuse": "batch"}, json=[HOST] * 9 + [{"code": "print(1)"}])
        assert made.status_code == 202 and made.json()["reuse"] == "batch"
        seen = events(http, made.json()["id"])
        mine = _hosts(seen)
        theirs = other.post("/v1/batches", params={"reuse": "batch"}, json=[HOST] * 6)  # after: a pool of mine
        their = _hosts(events(other, theirs.json()["id"]))  # it was handed would be closed, one sandbox an item
        assert len({host for _, host in their}) <= 3, their
        assert [data["result"]["ok"] for kind, data in seen if kind == "item" and data["index"] == 9] == [True]
        assert len(mine) == 9 and {mode for mode, _ in mine} == {"batch"}, mine
        assert len({host for _, host in mine}) <= 3, mine  # the cap: sandboxes kept, not one per item
        assert not {host for _, host in mine} & {host for _, host in their}
        assert http.get(f"/v1/batches/{made.json()['id']}").json()["reuse"] == "batch"
        assert http.delete(f"/v1/batches/{made.json()['id']}").status_code == 204
        assert other.delete(f"/v1/batches/{theirs.json()['id']}").status_code == 204
        wait_until(lambda: not node.containers(), 30, "containers were left behind")
        wait_until(lambda: not set(results_folders(node)) - earlier, 60, "folders were left behind")
        assert _three_at_once(http) == [True] * 3  # the batch's slots were given back


def test_cancelling_a_reuse_batch_closes_its_kept_sandboxes_and_frees_its_slots(node: Server) -> None:
    quick = {"program": "print(1)", "tests": [{"expected": "1"}]}
    earlier = set(results_folders(node))  # the results of executions kept for their time (not this batch's)
    with client(node, NODE_TOKEN) as http:
        batch_id = http.post("/v1/batches", params={"reuse": "batch"}, json=[quick] * 3 + [SLEEPER] * 6).json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["done"] >= 3, 120, "the quick items never ran")
        time.sleep(2)  # the sleepers are under way in the kept sandboxes
        started = time.monotonic()
        assert http.delete(f"/v1/batches/{batch_id}").status_code == 204
        took = time.monotonic() - started
        wait_until(lambda: not node.containers(), 30, "containers were left behind")
        assert took < 30, f"cancelling took {took:.1f} s: the running items were not interrupted"
        wait_until(lambda: not set(results_folders(node)) - earlier, 60, "folders were left behind")
        assert _three_at_once(http) == [True] * 3  # its slots were given back



def test_deleting_a_reuse_batch_that_waits_for_slots_stops_it_at_once(node: Server) -> None:
    """Its workers wait for slots another batch holds: DELETE ends them at once, and none runs an item later."""
    with client(node, NODE_TOKEN) as http:
        holding = http.post("/v1/batches", params={"reuse": "batch"}, json=[SLEEPER] * 3).json()["id"]
        wait_until(lambda: len(node.containers()) >= 3, 120, "the sleepers never started")
        waiting = http.post("/v1/batches", params={"reuse": "batch"}, json=[HOST] * 3).json()["id"]
        time.sleep(1)
        started = time.monotonic()
        assert http.delete(f"/v1/batches/{waiting}").status_code == 204
        took = time.monotonic() - started
        assert http.delete(f"/v1/batches/{holding}").status_code == 204
        wait_until(lambda: not node.containers(), 30, "containers were left behind")
        time.sleep(3)  # a worker of the deleted batch left waiting would take the freed slots now
        assert not node.containers(), "a deleted batch ran an item"
        assert _three_at_once(http) == [True] * 3
    assert took < 10, f"deleting a batch that waited for slots took {took:.1f} s"


def test_a_reuse_worker_has_one_sandbox_at_most(node: Server) -> None:
    """An execution after judge items: the worker closes the sandbox it kept before the execution makes its own,
    so the token's 3 slots never hold more than 3 sandboxes."""
    nap = {"code": "import time\ntime.sleep(8)"}
    with client(node, NODE_TOKEN) as http:
        batch_id = http.post("/v1/batches", params={"reuse": "batch"}, json=[HOST] * 3 + [nap] * 3).json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["done"] >= 3, 120, "the judge items never ran")
        time.sleep(4)  # the naps run; a kept sandbox closed before them is gone by now
        alive = daemon.connect().containers.list(filters={"label": f"{daemon.LABEL_NODE}={node.name}",
                                                          "status": "running"})
        assert len(alive) <= 3, f"{len(alive)} sandboxes running on 3 slots"
        assert http.delete(f"/v1/batches/{batch_id}").status_code == 204
    wait_until(lambda: not node.containers(), 30, "containers were left behind")
