"""Sandboxes on a Ray cluster (`nbexec.sandbox.ray`), tested two ways.

Fast tier: the node's agent and the driver's handle, joined in this process (`raynodes.InProcess`) over the fake
source: a run comes back as frames and reaches the engine's callback sized, files come back into an output
folder, a listing carries no path of the node, a lost node ends a session with SessionLostError naming it.

Docker tier: a real Ray cluster (a head and two workers) in a network namespace of its own, with the driver
inside it too (`raynodes.ray_cluster`, tests/raydriver.py): a one-shot with its files, a session kept on its node,
a batch spread over the nodes, the seam's conformance suite, and a node's raylet killed mid-run. Skipped, saying
why, where a namespace cannot be made.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.errors import NbexecError, NodeLostError, ProtocolError, SessionLimitError, SessionLostError
from nbexec.files import artifacts
from nbexec.files.folders import OutputFolder, make_output_dir
from nbexec.sandbox.fake import FakeSource
from nbexec.sandbox.messages import Message
from nbexec.sandbox.ray import source as raysource
from nbexec.sandbox.ray.agent import NodeAgent
from nbexec.sandbox.ray.handle import RayHandle
from nbexec.sandbox.ray.source import RaySource

from . import raynodes
from .conftest import IMAGE

CONFIG = nbexec.SandboxConfig(pool_size=0, timeout=10, interrupt_grace=2, max_output="4k", max_display="4k")


@pytest.fixture
def agent() -> Iterator[raynodes.InProcess]:
    inner = NodeAgent("node_x")
    inner.source = FakeSource()
    yield raynodes.InProcess(inner)
    for sandbox, owner in list(inner.owners.items()):
        inner.release(owner, sandbox)


def _handle(agent: raynodes.InProcess, purpose: str = "session") -> RayHandle:
    return RayHandle(agent, agent.call("acquire", CONFIG, purpose, "driver", timeout=10, cap=4096, what="make"), CONFIG,
                     purpose, owner="driver")


def test_a_run_on_the_agent_reaches_the_engine_as_sized_messages(agent: raynodes.InProcess) -> None:
    handle = _handle(agent)
    seen: list[Message] = []
    done = handle.run("print('from the node')", deadline=time.monotonic() + 10, on_output=seen.append)
    assert done.status == "ok"
    assert [m.content()["text"] for m in seen if m.msg_type == "stream"] == ["from the node\n"]
    failed = handle.run("raise ValueError('boom')", deadline=time.monotonic() + 10, on_output=seen.append)
    assert failed.status == "error"
    assert [m.content()["ename"] for m in seen if m.msg_type == "error"] == ["ValueError"]


def test_output_past_the_allowance_comes_back_as_headers_alone(agent: raynodes.InProcess) -> None:
    handle = _handle(agent)
    seen: list[Message] = []
    done = handle.run("for i in range(300):\n    print('x' * 1000)", deadline=time.monotonic() + 10,
                      on_output=seen.append)
    assert done.status == "ok"
    kept = sum(len(m.raw_content) for m in seen)
    charged = sum(m.size for m in seen)
    assert kept <= 2 * (4096 + 4096) and charged >= 300 * 1000  # dropped, still counted
    assert any(not m.complete for m in seen)
    answered = [a["ok"] for a in agent.answers if isinstance(a.get("ok"), bytes)]
    assert answered and len(answered[-1]) < 64 * 1024  # the node sent headers past the allowance, not the output


def test_files_come_back_into_the_output_folder_and_listings_carry_no_node_path(agent: raynodes.InProcess,
                                                                                 tmp_path: Path) -> None:
    handle = _handle(agent)
    handle.put_file("given.txt", b"from the driver")
    assert handle.run("open('/mnt/data/made.bin', 'wb').write(bytes(range(256)) * 8192)",
                      deadline=time.monotonic() + 10, on_output=lambda m: None).status == "ok"
    folder = OutputFolder.open(make_output_dir(tmp_path / "out", may_exist=False))
    try:
        copied = handle.snapshot(folder, artifacts.Limits())
    finally:
        os.close(folder.fd)
    made = {f.name: f for f in copied.files}
    assert Path(made["made.bin"].path or "").read_bytes() == bytes(range(256)) * 8192  # 2 MiB: three chunks
    assert Path(made["given.txt"].path or "").read_bytes() == b"from the driver"
    listing = next(a for a in agent.answers if isinstance(a.get("ok"), dict) and "files" in a["ok"])
    fake_folder = str(agent.inner.handles[handle.id].folder)  # type: ignore[attr-defined]
    assert fake_folder not in repr(listing) and all("path" not in f for f in listing["ok"]["files"])


def test_a_lost_node_ends_a_session_naming_it_and_a_one_shot_with_node_lost(agent: raynodes.InProcess) -> None:
    session, oneshot = _handle(agent, "session"), _handle(agent, "oneshot")

    def gone(*args: Any, **kwargs: Any) -> Any:
        raise NodeLostError("node node_x is lost (ActorDiedError): its raylet went away")

    agent.call = gone  # type: ignore[method-assign]
    with pytest.raises(SessionLostError, match="node_x"):
        session.run("print(1)", deadline=time.monotonic() + 5, on_output=lambda m: None)
    with pytest.raises(SessionLostError, match="node_x"):  # for good: no call is made again
        session.state()
    with pytest.raises(NodeLostError, match="node_x") as caught:
        oneshot.run("print(1)", deadline=time.monotonic() + 5, on_output=lambda m: None)
    assert not isinstance(caught.value, SessionLostError)
    session.destroy()  # a lost node took its sandboxes along: nothing to wait for


def test_an_answer_of_another_shape_is_refused(agent: raynodes.InProcess) -> None:
    handle = _handle(agent)
    agent.inner.run = lambda *a: {"ok": "not bytes"}  # type: ignore[method-assign]
    with pytest.raises(ProtocolError, match="node_x"):
        handle.run("print(1)", deadline=time.monotonic() + 5, on_output=lambda m: None)
    agent.inner.state = lambda *a: {"ok": {"running": "yes"}}  # type: ignore[method-assign]
    with pytest.raises(ProtocolError, match="node_x"):
        handle.state()


# -- back-pressure: a node's limit, a full cluster ---------------------------------------------------------------

class _Slow(FakeSource):
    """A fake source whose sandboxes take until ``go`` is set to make."""

    def __init__(self) -> None:
        super().__init__()
        self.asked, self.go = threading.Event(), threading.Event()

    def acquire(self, config: nbexec.SandboxConfig, *, purpose: str, claim: str = "") -> Any:
        self.asked.set()
        assert self.go.wait(10)
        return super().acquire(config, purpose=purpose, claim=claim)


def test_an_agent_refuses_a_sandbox_past_its_limit_before_making_it() -> None:
    inner = NodeAgent("node_x", limit=2)
    fake = inner.source = FakeSource()
    agent = raynodes.InProcess(inner)
    first, second = _handle(agent), _handle(agent)
    with pytest.raises(SessionLimitError, match="node node_x holds 2 sandboxes"):
        _handle(agent)
    assert len(fake.live) == 2  # refused before the source was asked
    assert agent.call("capacity", CONFIG, timeout=5, cap=4096, what="say")["limit"] == 2
    first.destroy()
    third = _handle(agent)  # room again
    for handle in (second, third):
        handle.destroy()
    assert not fake.live and not inner.handles


def test_a_sandbox_being_made_counts_against_the_limit() -> None:
    """Two calls at once on a node with room for one: the second is refused while the first is still made."""
    inner = NodeAgent("node_x", limit=1)
    slow = inner.source = _Slow()
    agent = raynodes.InProcess(inner)
    made: list[RayHandle] = []
    first = threading.Thread(target=lambda: made.append(_handle(agent)))
    first.start()
    assert slow.asked.wait(10)
    try:
        with pytest.raises(SessionLimitError):
            _handle(agent)
    finally:
        slow.go.set()
        first.join(10)
    assert len(made) == 1 and len(slow.live) == 1
    made[0].destroy()


def _full_source(monkeypatch: pytest.MonkeyPatch, agents: list[raynodes.InProcess]) -> RaySource:
    source = RaySource(per_node=1)
    monkeypatch.setattr(source, "candidates", lambda config: [(a.name, a) for a in agents])
    return source


def test_a_cluster_whose_every_node_is_at_its_limit_raises_a_retryable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [NodeAgent(name, limit=1) for name in ("node_a", "node_b")]
    for inner in nodes:
        inner.source = FakeSource()
    agents = [raynodes.InProcess(inner, inner.name) for inner in nodes]
    source = _full_source(monkeypatch, agents)
    held = [source.acquire(CONFIG, purpose="session") for _ in nodes]
    with pytest.raises(nbexec.ClusterFullError, match="2 of the 2 Ray nodes") as caught:
        source.acquire(CONFIG, purpose="session")
    assert isinstance(caught.value, nbexec.NodeUnavailableError) and caught.value.retry_after == 5
    assert sum(len(inner.handles) for inner in nodes) == 2  # nothing was made for the refused call
    source.release(held[0], wait=True)
    held.append(source.acquire(CONFIG, purpose="session"))  # a released sandbox makes room
    for handle in held[1:]:
        source.release(handle, wait=True)


def test_a_node_full_and_a_node_failing_is_full_for_now_and_says_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full node may free a slot, so the call is retryable; the text says the other failed, and names no node
    (a node's name may be its address)."""
    full, broken = NodeAgent("node_a", limit=1), NodeAgent("node_b")
    full.source = FakeSource()
    broken.source = FakeSource()
    broken.acquire = lambda *a: {"error": "DockerError", "detail": "the engine is down"}  # type: ignore[method-assign]
    source = _full_source(monkeypatch, [raynodes.InProcess(full, "node_a"), raynodes.InProcess(broken, "node_b")])
    held = source.acquire(CONFIG, purpose="session")
    with pytest.raises(nbexec.ClusterFullError, match=r"1 of the 2 .* the others could not make one") as caught:
        source.acquire(CONFIG, purpose="session")
    assert "node_a" not in str(caught.value) and "node_b" not in str(caught.value)
    source.release(held, wait=True)


def test_a_driver_counts_what_it_holds_on_a_node_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent replaced after a timeout starts at zero while the old one keeps its sandboxes: the driver's own
    count holds the limit, and the node is not even asked."""
    inner = NodeAgent("node_a")
    inner.source = FakeSource()
    source = _full_source(monkeypatch, [raynodes.InProcess(inner, "node_a")])
    source.limits["node_a"] = 1
    held = source.acquire(CONFIG, purpose="session")
    with pytest.raises(nbexec.ClusterFullError):
        source.acquire(CONFIG, purpose="session")
    assert len(inner.handles) == 1
    source.release(held, wait=True)
    source.release(source.acquire(CONFIG, purpose="session"), wait=True)  # its slot came back


class _Late(raynodes.InProcess):
    """An agent whose answer to a new sandbox comes after the driver stopped waiting (or with another's name)."""

    def __init__(self, inner: NodeAgent, answer: str) -> None:
        super().__init__(inner, inner.name)
        self.answer = answer

    def call(self, method: str, *args: Any, timeout: float, cap: int, what: str) -> Any:
        found = super().call(method, *args, timeout=timeout, cap=cap, what=what)
        if method != "acquire":
            return found
        if self.answer == "late":
            raise NodeLostError(f"node {self.name} did not {what} within {timeout:g} s")
        return {**found, "id": "f" * 32}


@pytest.mark.parametrize("answer", ["late", "renamed"])
def test_a_sandbox_whose_answer_the_driver_never_took_is_released(monkeypatch: pytest.MonkeyPatch,
                                                                   answer: str) -> None:
    inner = NodeAgent("node_a", limit=1)
    fake = inner.source = FakeSource()
    source = _full_source(monkeypatch, [_Late(inner, answer)])
    with pytest.raises(NbexecError):
        source.acquire(CONFIG, purpose="session")
    assert not inner.handles and not fake.live and not inner.making  # released by the name the driver gave it
    assert source.inflight.get("node_a", 0) == 0


def test_a_sandbox_released_while_it_is_made_is_removed_once_it_exists() -> None:
    inner = NodeAgent("node_x", limit=1)
    slow = inner.source = _Slow()
    answers: list[Any] = []
    name = "a" * 32
    making = threading.Thread(target=lambda: answers.append(inner.acquire(CONFIG, "session", "driver", name)))
    making.start()
    assert slow.asked.wait(10)
    inner.release("other-driver", name)  # another owner's release is ignored
    inner.release("driver", name)
    slow.go.set()
    making.join(10)
    assert answers[0]["error"] == "SandboxError" and "gave the sandbox up" in answers[0]["detail"], answers
    assert not inner.handles and not slow.live and not inner.making and not inner.abandoned
    assert "ok" in inner.acquire(CONFIG, "session", "driver", "b" * 32)  # the slot came back
    inner.release("driver", "b" * 32)


def test_network_on_is_refused_on_ray_before_a_node_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    source = RaySource()
    monkeypatch.setattr(source, "candidates", lambda config: pytest.fail("a node was asked"))
    with pytest.raises(nbexec.ConfigError, match="Ray ports"):
        source.acquire(CONFIG.replace(network=True), purpose="oneshot")


@pytest.mark.parametrize(("resources", "per_node", "limit"), [
    ({"CPU": 2.0}, None, 8), ({"CPU": 2.0, "nbexec_sandboxes": 3.0}, None, 3), ({"CPU": 2.0}, 1, 1),
    ({}, None, 4), ({"CPU": 0.5}, None, 4), ({"nbexec_sandboxes": 0.0, "CPU": 1.0}, None, 4), ({"CPU": 2.0}, 0, 1),
])
def test_a_nodes_limit_comes_from_its_resources(resources: dict[str, float], per_node: int | None,
                                                limit: int) -> None:
    assert raysource.node_limit({"Resources": resources}, per_node) == limit
    assert raysource.node_name({"Resources": {**resources, "node_a": 1.0}}) == "node_a"  # never the limit's name


def test_a_full_cluster_is_503_with_retry_after_over_http() -> None:
    from nbexec.service.runs import http_error

    full = http_error(nbexec.ClusterFullError("every node ... (node_a)", 5.0))
    assert (full.status_code, full.headers) == (503, {"Retry-After": "5"}) and "node_a" in full.detail
    down = http_error(nbexec.NodeUnavailableError("no node answers: node_a: http://10.1.2.3:8000 refused"))
    assert (down.status_code, down.headers) == (503, {"Retry-After": "5"}) and "10.1.2.3" not in down.detail


# -- on a real Ray cluster (Docker tier) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[raynodes.RayCluster]:
    why = raynodes.can_make_namespaces()
    if why:
        pytest.skip(f"no Ray cluster: {why}")
    with raynodes.ray_cluster(tmp_path_factory.mktemp("ray")) as cluster:
        cluster.env["NBEXEC_IMAGE"] = IMAGE
        cluster.env["NBEXEC_RAY_TMP"] = str(tmp_path_factory.mktemp("driver"))
        yield cluster
    raynodes.assert_nothing_left(cluster)


def test_a_one_shot_runs_on_the_cluster_and_its_files_come_back(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("oneshot")
    assert found["ok"] and found["stdout"] == "42\n" and found["node"] in raynodes.NODES, found
    assert [(f["name"], f["text"]) for f in found["files"]] == [("out.txt", "made on ray")]
    assert found["files"][0]["path"].startswith(found["output_dir"])  # the caller's output folder
    assert all(ok for _, ok in found["ray_s"]) and all(ok for _, ok in found["local_s"])
    assert not any(found["held"].values()), found["held"]  # released on its node
    print(f"\nRay cluster up in {ray_cluster.started:.1f} s; one-shot on Ray {[round(s, 2) for s, _ in found['ray_s']]}"
          f" s, local {[round(s, 2) for s, _ in found['local_s']]} s (cold, pool_size=0)")


def test_a_session_keeps_its_state_on_its_node(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("session")
    assert found["stdout"] == "42\n" and found["files"] == ["s.txt"]
    node = found["nodes"][0]
    assert node in raynodes.NODES and found["nodes"] == [node, node]
    assert [len(ids) for name, ids in found["held_during"].items() if name == node] == [1]
    assert not any(found["held_after"].values())


def test_a_batch_spreads_over_the_nodes(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("batch")
    assert [(i, out) for i, out, _ in found["results"]] == [(i, f"{i}\n") for i in range(6)], found["errors"]
    assert len({node for *_, node in found["results"]}) >= 2, found["results"]
    assert not any(found["held_after"].values())
    print(f"\nbatch of 6 (1 s each, 3 at a time) on Ray: {found['seconds']:.1f} s over "
          f"{sorted({node for *_, node in found['results']})}, locally {found['local_seconds']:.1f} s; "
          f"nodes' last errors: {found['health']}")


def test_the_seam_conformance_suite_passes_on_ray(ray_cluster: raynodes.RayCluster) -> None:
    done = ray_cluster.inside(str(raynodes.VENV / "python"), "-m", "pytest", "-q", "-p", "no:randomly", "-p",
                              "no:cacheprovider", "tests/test_seam_conformance.py", "-k", "ray", timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    print("\nconformance on Ray:", done.stdout.strip().splitlines()[-1])


def test_a_full_cluster_refuses_with_a_retryable_error_and_takes_the_next_once_one_is_released(
        ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("full")
    assert found["nodes"] == sorted(raynodes.NODES), found  # one each: the limit spread them
    assert found["refused"].startswith("ClusterFullError") and found["retry_after"] == 5, found
    assert set(found["counts"].values()) == {1}, found["counts"]  # nothing made for the refused call
    assert found["again"] in raynodes.NODES and not any(found["left"].values()), found


def test_judging_runs_on_the_cluster_unchanged(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("judge")
    assert found["one"] == ["accepted", "wrong_answer", "runtime_error"] and found["one_mode"] == "fresh", found
    verdicts = [[0, ["accepted", "wrong_answer"]], [1, ["wrong_answer", "accepted"]],
                [2, ["runtime_error", "runtime_error"]]]
    assert [row[:2] for row in found["many"]["None"]] == verdicts, found["many"]
    assert [row[:2] for row in found["many"]["batch"]] == verdicts, found["many"]
    assert {row[2] for row in found["many"]["batch"]} == {"batch"}, found["many"]
    assert not any(found["held_after"].values()), found


def test_the_llm_tool_handler_runs_on_the_cluster_unchanged(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("tools")
    once, first, second = found["said"]
    assert once[0] == "1024\n" and once[1] in raynodes.NODES, found
    assert second[0] == "42\n" and second[1] == first[1] in raynodes.NODES, found  # the session stayed on its node
    assert not any(found["held_after"].values()), found


def test_a_killed_node_fails_by_name_while_the_others_answer(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("kill", "node_a")
    assert found["killed"], "no raylet of node_a was found to kill"
    assert found["error"] == "SessionLostError" and "node_a" in found["message"], found
    assert found["lost_after_s"] < 60, found
    assert found["again"].startswith("SessionLostError") and "node_a" in found["again"]
    assert found["others"] and all(out == "1\n" for _, out in found["others"]), found["others"]
    assert found["elsewhere"][0] == "elsewhere\n" and found["elsewhere"][1] != "node_a"
    assert "node_a" not in found["agents_after"] and not any(found["held_after"].values()), found
    assert found["survivor_containers"] == [], found["survivor_containers"]
    print(f"\nnode_a's loss reached the session {found['lost_after_s']:.1f} s after its raylet was killed")



def test_an_interrupt_and_a_close_reach_a_cell_running_on_a_node(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("stop")
    status, stdout, seconds = found["interrupted"]
    assert status == "exception:KeyboardInterrupt" and stdout == "started\n" and seconds < 30, found  # not 60 s
    assert found["kept"] == "42\n" and found["node"] in raynodes.NODES, found  # the kernel's state stays
    assert found["close_s"] < 30 and not found["runner_alive"], found
    assert found["closed_run"] is not None and found["closed_run"][2] < 40, found  # the run under way ended too
    assert not any(found["held_after"].values()), found


def test_the_reward_actors_example_judges_and_keeps_sessions_on_the_cluster(ray_cluster: raynodes.RayCluster) -> None:
    """examples/ray_rewards.py: the sandboxes are made by Ray actors (a trainer's reward workers), not a driver."""
    found = ray_cluster.driver("rewards")
    assert [(s["reward"], s["verdict"]) for s in found["single"]] == \
        [(1.0, "accepted"), (0.0, "wrong_answer"), (0.5, "wrong_answer")], found
    assert found["group"] == [1.0, 0.0, 0.5], found
    turns = found["turns"]
    assert [t["stdout"] for t in turns[:2]] == ["", "[1, 2, 3]\n"] and turns[2]["error"] == "NameError", turns
    assert turns[0]["node"] == turns[1]["node"] == turns[2]["node"] in raynodes.NODES, turns  # one session


def test_a_node_that_joins_again_is_used_again_by_a_driver_that_knew_it(ray_cluster: raynodes.RayCluster) -> None:
    found = ray_cluster.driver("back", "node_b")
    assert "node_b" in found["known"] and "node_b" not in found["without"], found
    assert found["started"] == 0, found["start_log"]
    assert found["landed"][-1] == "node_b", found  # a session ran on the node that came back
    assert "node_b" in found["after"] and not any(found["held_after"].values()), found


def test_an_oversized_or_silent_actor_is_refused_by_size_and_deadline(ray_cluster: raynodes.RayCluster) -> None:
    """The hostile shapes of tests/security/test_ray_attacks.py that need Ray itself: the answer's size is asked
    of Ray before it is copied here, and a silent actor is given up at the call's deadline."""
    found = ray_cluster.driver("hostile")
    assert found["oversized"].startswith("ProtocolError") and "refused unread" in found["oversized"], found
    assert found["rss_growth_mib"] < 16, found  # 32 MiB answered, never copied here
    assert found["silent"].startswith("NodeLostError") and found["silent_s"] < 10, found
