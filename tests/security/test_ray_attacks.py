"""The Ray backend facing a misbehaving node: what its agent answers is as hostile as what a node sends over HTTP.

Fast tier: a hostile agent in this process (`Liar`: each answer replaced by a crafted one) against the driver's
handle: a run's frames about another sandbox, a message kind a run never relays, a run with no end, an answer of
another shape, an error name that is no nbexec error, a file longer than declared, a listing with a negative
size or more files than the cap. Each ends in an honest error naming the node, nothing of it kept.

On a real cluster (tests/test_ray.py, which holds the namespace's cluster): an actor that answers 32 MiB where
1 MiB is the cap is refused by its size before a byte is copied to the driver, and one that never answers is
given up at the call's deadline.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import nbexec
from nbexec import errors
from nbexec.errors import FileTransferError, NbexecError, NodeError, NodeLostError, NodeUnavailableError, ProtocolError
from nbexec.files import artifacts
from nbexec.sandbox.fake import FakeSource
from nbexec.sandbox.ray import source as raysource
from nbexec.sandbox.ray.agent import NodeAgent
from nbexec.sandbox.ray.calls import unwrap
from nbexec.sandbox.ray.handle import RayHandle
from nbexec.sandbox.remote import frames

from .. import raynodes

CONFIG = nbexec.SandboxConfig(pool_size=0, timeout=10, interrupt_grace=2, max_output="4k", max_display="4k")


class Liar(raynodes.InProcess):
    """An agent whose answers to some methods are replaced (``lies``: method -> a function of its arguments)."""

    def __init__(self, inner: NodeAgent) -> None:
        super().__init__(inner)
        self.lies: dict[str, Callable[..., Any]] = {}

    def call(self, method: str, *args: Any, timeout: float, cap: int, what: str) -> Any:
        if method in self.lies:
            return unwrap(self.lies[method](*args), self.name, what)
        return super().call(method, *args, timeout=timeout, cap=cap, what=what)


@pytest.fixture
def liar() -> Iterator[Liar]:
    inner = NodeAgent("node_x")
    inner.source = FakeSource()
    yield Liar(inner)
    for sandbox, owner in list(inner.owners.items()):
        inner.release(owner, sandbox)


def _session(liar: Liar) -> RayHandle:
    answer = liar.call("acquire", CONFIG, "session", "driver", timeout=10, cap=4096, what="make")
    return RayHandle(liar, answer, CONFIG, "session", owner="driver")


def _message(kind: str, content: bytes, **header: Any) -> bytes:
    fields = {"type": kind, "channel": "iopub", "id": "m", "parent": "p", "size": len(content), "complete": True,
              "content": len(content), "buffers": [], "length": len(content), **header}
    return b"M " + json.dumps(fields).encode() + b"\n" + content


RUNS = {
    "another-sandbox-begins": lambda sid: frames.begin("f" * 32),
    "not-an-output": lambda sid: frames.begin(sid) + _message("execute_request", b'{"code": "x"}'),
    "no-end": lambda sid: frames.begin(sid) + _message("stream", b'{"name": "stdout", "text": "hi"}'),
    "size-smaller-than-bytes": lambda sid: frames.begin(sid) + _message("stream", b"x" * 100, size=10),
    "garbage": lambda sid: b"\x00\xff" * 1000,
}


@pytest.mark.parametrize("shape", sorted(RUNS))
def test_a_lying_run_is_a_protocol_error_naming_the_node(liar: Liar, shape: str) -> None:
    handle = _session(liar)
    liar.lies["run"] = lambda owner, sid, code, timeout: {"ok": RUNS[shape](sid)}
    seen: list[Any] = []
    with pytest.raises(ProtocolError):
        handle.run("print(1)", deadline=time.monotonic() + 5, on_output=seen.append)
    assert all(m.msg_type == "stream" for m in seen)  # nothing but an output reached the engine


@pytest.mark.parametrize("answer", [
    {"ok": 1, "extra": 2}, {"error": "SandboxError"}, ["ok"], None, {"error": 5, "detail": "x"}, b"ok"])
def test_an_answer_of_another_shape_is_refused(liar: Liar, answer: Any) -> None:
    with pytest.raises(ProtocolError, match="node_x"):  # the envelope itself, before any method reads it
        unwrap(answer, "node_x", "say something")
    handle = _session(liar)
    liar.lies["state"] = lambda owner, sid: answer
    with pytest.raises(ProtocolError, match="node_x"):
        handle.state()


@pytest.mark.parametrize("name", ["SystemExit", "KeyboardInterrupt", "__class__", "Exception", "x" * 10_000])
def test_an_error_name_that_is_no_nbexec_error_is_a_node_error(liar: Liar, name: str) -> None:
    handle = _session(liar)
    liar.lies["state"] = lambda owner, sid: {"error": name, "detail": "y" * 100_000}
    with pytest.raises(NodeError) as caught:
        handle.state()
    assert len(str(caught.value)) < 4200  # the detail is cut


def test_a_file_longer_than_declared_is_refused(liar: Liar) -> None:
    handle = _session(liar)
    handle.put_file("f.txt", b"abc")
    liar.lies["read"] = lambda owner, token: {"ok": b"x" * 10}
    size, chunks = handle.open_file("f.txt")
    assert size == 3
    with pytest.raises(FileTransferError, match="larger than it said"):
        b"".join(chunks)


@pytest.mark.parametrize("listing", [
    {"files": [{"name": "a", "size": -5, "mime": "text/plain", "sha256": "0" * 64}]},
    {"files": "not a list"},
    {"files": [{"name": "a"}]},
])
def test_a_lying_listing_is_a_node_error(liar: Liar, listing: Any) -> None:
    handle = _session(liar)
    liar.lies["list_files"] = lambda owner, sid, limits: {"ok": listing}
    with pytest.raises(NodeError, match="node_x"):
        handle.list_files(artifacts.Limits(max_files=10))


def test_a_listing_of_more_files_than_the_cap_keeps_the_cap(liar: Liar) -> None:
    handle = _session(liar)
    many = [{"name": f"f{i}", "size": 1, "mime": "text/plain", "sha256": "0" * 64} for i in range(5000)]
    liar.lies["list_files"] = lambda owner, sid, limits: {"ok": {"files": many, "skipped_files": [], "notes": []}}
    found = handle.list_files(artifacts.Limits(max_files=10))
    assert len(found.files) == 10 and any("more files" in note for note in found.notes)



# -- the findings of the attacker's read of the package (each: before, after) -----------------------------------

def test_another_driver_can_neither_list_nor_reach_my_sandboxes(liar: Liar) -> None:
    """Before: the agent was one named actor per node shared by every driver (get_if_exists), `held()` listed every
    id and no call checked its owner, so driver B read driver A's session variables. After: every call names its
    owner; B's `held` is empty and A's sandbox is, to B, one that does not exist."""
    inner, mine = liar.inner, _session(liar)
    mine.run("secret = 'hunter2'", deadline=time.monotonic() + 5, on_output=lambda m: None)
    assert inner.held("driver-B")["ok"] == [] and inner.held("driver")["ok"] == [mine.id]
    sid = mine.id
    for method, args in [("run", ("print(secret)", 5.0)), ("hidden", ("x", 5.0, {"s": "secret"})), ("state", ()),
                         ("put_file", ("x.txt", b"x")), ("open_file", ("x.txt", 0)), ("notes", ()),
                         ("list_files", (artifacts.Limits(),)), ("kill", ()), ("interrupt", ())]:
        answer = getattr(inner, method)("driver-B", sid, *args)
        assert answer.get("error") == "SandboxError" and "hunter2" not in repr(answer), (method, answer)
    inner.release("driver-B", sid)
    inner.close("driver-B")
    assert inner.held("driver")["ok"] == [sid]
    said = []
    mine.run("print(secret)", deadline=time.monotonic() + 5, on_output=said.append)
    assert [m.content()["text"] for m in said if m.msg_type == "stream"] == ["hunter2\n"]  # untouched


def test_a_source_never_adopts_a_named_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: agents were named "nbexec-agent-<node>" and found again with get_if_exists, so a driver adopted an
    agent another driver made (or planted). After: each source makes unnamed agents of its own."""
    options: list[dict[str, Any]] = []

    class _Remote:
        def options(self, **kw: Any) -> _Remote:
            options.append(kw)
            return self

        def remote(self, *a: Any) -> str:
            return "actor"

    monkeypatch.setattr(raysource.ray, "remote", lambda cls: _Remote())
    monkeypatch.setattr(raysource.Agent, "call", lambda self, *a, **kw: {"node": "n", "pid": 1})
    assert not isinstance(raysource.RaySource()._agent("ab" * 28, "node_a", 1.0), str)
    assert options and not any({"name", "get_if_exists", "lifetime"} & set(kw) for kw in options), options


def _cluster(monkeypatch: pytest.MonkeyPatch, sources: dict[str, FakeSource]) -> tuple[raysource.RaySource, list]:
    made: list[raynodes.InProcess] = []
    monkeypatch.setattr(raysource.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(raysource.ray, "nodes", lambda: [
        {"NodeID": name * 8, "Alive": True, "Resources": {name: 1.0}} for name in sources])

    def agent_on(self: raysource.RaySource, node_id: str, name: str, wait: float) -> raynodes.InProcess:
        inner = NodeAgent(name)
        inner.source = sources[name]
        made.append(raynodes.InProcess(inner, name))
        return made[-1]

    monkeypatch.setattr(raysource.RaySource, "_agent", agent_on)
    return raysource.RaySource(), made


def _failing(kind: type[NbexecError]) -> FakeSource:
    class _Broken(FakeSource):
        def acquire(self, config: Any, *, purpose: str, claim: str = "") -> Any:
            raise kind(f"{kind.__name__} on this node")
    return _Broken()


@pytest.mark.parametrize("kind", [errors.DockerUnavailableError, errors.ImageNotFoundError, errors.DockerError,
                                  errors.SandboxError, errors.FileTransferError])
def test_one_node_failing_to_make_sandboxes_does_not_stop_the_cluster(monkeypatch: pytest.MonkeyPatch,
                                                                      kind: type[NbexecError]) -> None:
    """Before: only NodeError and ProtocolError moved on to the next node: a node with a broken Docker or no image
    failed half the acquires while another node was healthy. After: any NbexecError of a node rests it and the
    next node is asked; what was counted in flight on the broken node is given back."""
    source, _ = _cluster(monkeypatch, {"node_a": _failing(kind), "node_b": FakeSource()})
    for _ in range(8):
        source.release(source.acquire(CONFIG, purpose="oneshot"), wait=True)
    assert all(count == 0 for count in source.inflight.values()), source.inflight


def test_a_disk_full_node_is_a_disk_space_error_without_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the driver built DiskSpaceError with one argument (a TypeError escaped) and the node's message named
    its filesystem path. After: a DiskSpaceError whose message and reason carry the node's reason alone."""
    class _DiskFull(FakeSource):
        def acquire(self, config: Any, *, purpose: str, claim: str = "") -> Any:
            raise errors.DiskSpaceError("the filesystem of /var/lib/node-secret-path has 1 GiB free",
                                        "the host is short of disk")

    source, _ = _cluster(monkeypatch, {"node_a": _DiskFull()})
    with pytest.raises(errors.DiskSpaceError) as caught:
        source.acquire(CONFIG, purpose="oneshot")
    assert caught.value.reason == "the host is short of disk"
    assert "/var/lib" not in str(caught.value) and source.inflight == {"node_a" * 8: 0}


def test_a_dead_agent_on_a_live_node_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an agent that died (its owner exited, the OOM killer, a ray.kill) stayed in the source's agents and
    its alive node was never served again. After: it is dropped, and a new one is made after the node's backoff."""
    source, made = _cluster(monkeypatch, {"node_a": FakeSource()})
    source.release(source.acquire(CONFIG, purpose="oneshot"), wait=True)

    def dead(*args: Any, **kwargs: Any) -> Any:
        raise NodeLostError("node node_a is lost (ActorDiedError): the actor died")

    made[0].call = dead  # type: ignore[method-assign]
    outcomes = []
    for _ in range(4):
        try:
            source.release(source.acquire(CONFIG, purpose="oneshot"), wait=True)
            outcomes.append("ok")
        except NbexecError as exc:
            outcomes.append(type(exc).__name__)
        time.sleep(0.6)  # past the first backoff
    assert "ok" in outcomes and len(made) == 2, (outcomes, len(made))


def test_a_node_that_cannot_start_its_agent_rests_and_is_not_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a node whose agent never started cost every acquire AGENT_TIMEOUT (120 s), again and again. After:
    the wait is at most the config's startup_timeout, and the node then rests its backoff."""
    waits: list[float] = []
    good = NodeAgent("node_a")
    good.source = FakeSource()
    monkeypatch.setattr(raysource.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(raysource.ray, "nodes", lambda: [
        {"NodeID": h * 28, "Alive": True, "Resources": {n: 1.0}} for n, h in (("node_a", "aa"), ("node_b", "bb"))])

    class _Remote:
        def options(self, **kw: Any) -> _Remote:
            return self

        def remote(self, *a: Any) -> str:
            return "actor"

    monkeypatch.setattr(raysource.ray, "remote", lambda cls: _Remote())

    class _Agent(raynodes.InProcess):
        def __init__(self, name: str, actor: Any) -> None:
            super().__init__(good, name)

        def call(self, method: str, *args: Any, timeout: float, cap: int, what: str) -> Any:
            if self.name == "node_b":
                waits.append(timeout)
                raise NodeLostError(f"node node_b did not start its agent within {timeout:g} s")
            return super().call(method, *args, timeout=timeout, cap=cap, what=what)

    monkeypatch.setattr(raysource, "Agent", _Agent)
    source = raysource.RaySource()
    for _ in range(3):
        source.release(source.acquire(CONFIG, purpose="oneshot"), wait=True)
    assert len(waits) == 1 and waits[0] <= CONFIG.startup_timeout, waits


def test_waiting_for_another_thread_to_start_agents_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `nodes()` waited on the joining lock without end while another thread started agents. After: the
    wait is bounded, and ends in NodeUnavailableError."""
    monkeypatch.setattr(raysource, "CLUSTER_TIMEOUT", 0.05)
    monkeypatch.setattr(raysource.RaySource, "_nodes", lambda self, wait: {})  # never the real cluster
    source, outcome = raysource.RaySource(), []

    def ask() -> None:
        try:
            source.nodes(0.1)
        except NbexecError as exc:
            outcome.append(exc)

    source._joining.acquire()
    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(5)
    waited_on = asking.is_alive()
    source._joining.release()
    asking.join(5)
    assert not waited_on and len(outcome) == 1 and isinstance(outcome[0], NodeUnavailableError), outcome


def test_a_streamed_upload_with_no_data_cap_arrives_whole(liar: Liar) -> None:
    """Before: with max_data "0" (no cap) a file object was read with read(0 + 1): one byte arrived, reported as a
    success. After: the whole upload is sent."""
    config = CONFIG.replace(max_data="0")
    handle = RayHandle(liar, liar.call("acquire", config, "session", "driver", timeout=10, cap=4096, what="make"),
                       config, "session", owner="driver")
    handle.put_file("up.bin", io.BytesIO(b"0123456789" * 1000))
    size, chunks = handle.open_file("up.bin")
    assert size == 10_000 and b"".join(chunks) == b"0123456789" * 1000


def test_the_agents_run_answer_is_bounded_by_the_charged_allowance(liar: Liar) -> None:
    """Before: 7,000 small messages within a 257 KiB allowance came back as 1.5 MB of frames (their headers were
    never charged). After: a run's frames stay within twice the allowance and a slack; the rest is folded, still
    counted."""
    config = CONFIG.replace(max_output="256k", max_display="1k")
    handle = RayHandle(liar, liar.call("acquire", config, "session", "driver", timeout=10, cap=4096, what="make"),
                       config, "session", owner="driver")
    allowance = config.max_output_bytes + config.max_display_bytes
    seen: list[Any] = []
    done = handle.run("for i in range(7000):\n    print('x')", deadline=time.monotonic() + 30, on_output=seen.append)
    answer = [a["ok"] for a in liar.answers if isinstance(a.get("ok"), bytes)][-1]
    assert done.status == "ok" and len(answer) <= 2 * allowance + 64 * 1024, len(answer)
    assert sum(m.size for m in seen) >= 7000 * 2  # what was folded is still counted


def test_a_call_given_up_at_its_deadline_leaves_nothing_held(liar: Liar) -> None:
    """Before: a run the driver gave up at its deadline made the handle lost, and its release was never sent, so a
    live agent held the sandbox for good. After: the release is sent anyway (unwaited)."""
    handle = _session(liar)
    real = liar.call

    def slow(method: str, *args: Any, **kw: Any) -> Any:
        if method == "run":
            real(method, *args, **kw)
            raise NodeLostError("node node_x did not run code within 42 s")
        return real(method, *args, **kw)

    liar.call = slow  # type: ignore[method-assign]
    with pytest.raises(errors.SessionLostError):
        handle.run("print(1)", deadline=time.monotonic() + 5, on_output=lambda m: None)
    handle.destroy()
    assert liar.inner.held("driver")["ok"] == []
