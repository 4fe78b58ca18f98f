"""A wake through a node stays within the caller's time limit: a library `Session` whose sandbox sleeps on a node
by checkpoint (`RemoteSource.hibernate`) wakes it with one call to the node's wake route. That call tells the node
the time left (the node's route stops its wake there and answers 409, the sandbox asleep), and a node that says
nothing is given up shortly after: the run ends near its own limit, the session still asleep, never after the
node's own (minutes) or the client's five-minute wake timeout.

Judged from outside against a fake node on loopback (`tests.seamnode`): what the node was sent, the run's wall
time, the session's state afterwards. No Docker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec import Session
from nbexec.sandbox.remote import source as remote

from .. import cluster, seamnode

HOLD = 60.0  # seconds the fake node sits on a wake before answering (a restore whose kernel never comes back)


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> Iterator[seamnode.SeamNode]:
    with seamnode.SeamNode() as fake:
        monkeypatch.setenv("NBEXEC_NODES", fake.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
        remote.forget_all()
        try:
            yield fake
        finally:
            remote.forget_all()


def _kept(node: seamnode.SeamNode, wake: seamnode.Answer) -> list[bytes]:
    """The node keeps the sandbox's memory on hibernate and answers a wake with ``wake``; the wake bodies sent."""
    bodies: list[bytes] = []
    node.answers["/hibernate"] = lambda m, r, q, b: seamnode.json_reply({"sandbox": seamnode.SANDBOX,
                                                                         "kept": "checkpoint"})

    def answer(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> seamnode.Reply:
        bodies.append(body)
        return wake(method, rest, query, body)
    node.answers["/wake"] = answer
    return bodies


def _silent(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> seamnode.Reply:
    """A node whose restore never comes back: it answers after HOLD seconds (the client is long gone by then)."""
    gone = threading.Event()
    gone.wait(HOLD)
    return seamnode.json_reply({"sandbox": seamnode.SANDBOX, "language_info": {}})


def _stopped_at_limit(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> seamnode.Reply:
    """An honest node: it stops its wake at the time limit it was sent, and answers 409 (the sandbox asleep)."""
    sent = json.loads(body or b"{}").get("timeout")
    threading.Event().wait(min(float(sent), HOLD) if isinstance(sent, (int, float)) else HOLD)
    return seamnode.json_reply({"detail": "the wake stopped before the kernel was back (it ran out of its time "
                                          "limit); nothing ran, and the sandbox sleeps on with its memory"}, 409)


@pytest.mark.parametrize("wake", [_silent, _stopped_at_limit], ids=["silent-node", "node-stops-at-the-limit"])
def test_a_wake_through_a_node_ends_within_the_runs_limit(node: seamnode.SeamNode, wake: seamnode.Answer,
                                                          tmp_path: Path) -> None:
    bodies = _kept(node, wake)
    config = nbexec.SandboxConfig(source="remote", timeout=30)
    with Session(config, output_dir=tmp_path / "out") as session:
        assert session.run("print('hi')").ok
        assert session.hibernate() and session.status == "asleep"
        started = time.monotonic()
        with pytest.raises(nbexec.WakeStoppedError):
            session.run("print('again')", timeout=3)
        took = time.monotonic() - started
        assert session.status == "asleep"  # nothing lost: the next call wakes it again
    assert len(bodies) == 1
    sent = json.loads(bodies[0] or b"{}").get("timeout")
    assert isinstance(sent, (int, float)) and 0 < sent <= 3, f"the node was told {sent!r}, not the time left"
    assert took < 3 + 10, f"a wake of a 3 s run took {took:.1f} s"
