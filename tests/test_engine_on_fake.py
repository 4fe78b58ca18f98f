"""The engine's own logic on the fake backend (`nbexec.sandbox.fake`), in the fast tier: the output budget, replay
decisions after a sleep, durable records, and what the engine does for a backend without a capability. What a
real kernel or Docker adds (isolation, the kernel wire, end to end) stays in the Docker tier.

Judged from outside the engine: the result's fields and notes, the state folder's record, what the fake's
sandboxes saw (how many cells ran, whether they were killed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import Session
from nbexec.engine import sources
from nbexec.errors import NotOfferedError, SessionLostError
from nbexec.sandbox.fake import FakeSandbox, FakeSource
from nbexec.sandbox.source import SandboxHandle, SandboxSource


class Recording(FakeSource):
    """A fake source that keeps every sandbox it made, released ones too."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[FakeSandbox] = []

    def acquire(self, config: nbexec.SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        handle = super().acquire(config, purpose=purpose, claim=claim)
        assert isinstance(handle, FakeSandbox)
        self.made.append(handle)
        return handle


class Plain(SandboxSource):
    """A backend of the required core only: fake sandboxes, no records, no checkpoints."""

    def __init__(self, inner: FakeSource) -> None:
        self.inner = inner

    def acquire(self, config: nbexec.SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        return self.inner.acquire(config, purpose=purpose, claim=claim)

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        self.inner.release(sandbox, wait=wait)


@pytest.fixture
def fake() -> Iterator[Recording]:
    source = Recording()
    sources.register_for_tests("fake", source)
    try:
        yield source
    finally:
        sources.register_for_tests("fake", None)
        source.close()


def cfg(**changes: Any) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(source="fake", pool_size=0, timeout=10, interrupt_grace=1, **changes)


# -- budgets -------------------------------------------------------------------------------------------------

def test_output_past_the_budget_is_counted_not_kept(fake: Recording) -> None:
    result = nbexec.execute_notebook("for i in range(200):\n    print('x' * 1000)",
                                     config=cfg(max_output="16k"))
    assert result.ok
    assert len(result.stdout.encode()) <= 16 * 1024 + 200
    assert result.truncated_bytes > 100_000


def test_a_one_shot_without_freeze_is_killed_before_its_files_are_collected(fake: Recording) -> None:
    result = nbexec.execute_notebook("open('/mnt/data/out.txt', 'w').write('done')", config=cfg())
    assert result.ok and [f.name for f in result.files] == ["out.txt"]
    assert [s.exit_code for s in fake.made] == [137]  # killed (FREEZE not offered), then released



def test_a_package_on_a_backend_without_wheels_fails_by_name_and_the_cells_run(fake: Recording) -> None:
    result = nbexec.execute_notebook("%pip install six\nprint('after')", config=cfg())
    assert result.ok and result.stdout == "after\n"
    assert [(p.name, p.status, p.reason) for p in result.packages] == \
        [("six", "failed", "the fake sandbox backend does not offer wheels")]


# -- replay decisions ----------------------------------------------------------------------------------------

def test_a_slept_session_wakes_by_replaying_its_cells(fake: Recording) -> None:
    with Session(cfg()) as session:
        assert session.run("x = 40").ok and session.run("x += 2").ok
        assert session.hibernate() and session.status == "asleep"
        result = session.run("print(x)")
        assert (result.ok, result.stdout, result.restored) == (True, "42\n", "replay")
        assert fake.made[0].runs == 3  # replays are hidden runs: only the three cells counted


def test_replay_notes_the_cells_that_end_otherwise(fake: Recording) -> None:
    with Session(cfg()) as session:
        assert not session.run("open('/mnt/data/flag').read()").ok  # fails now, succeeds on replay
        assert session.run("assert not __import__('os').path.exists('/mnt/data/flag')").ok  # the reverse
        assert session.run("open('/mnt/data/flag', 'w').write('1')").ok
        assert session.hibernate()
        notes = " | ".join(session.run("pass").notes)
    assert "replaying cell 0 succeeded (it had failed)" in notes
    assert "replaying cell 1 raised AssertionError" in notes


def test_replay_counts_inside_the_runs_time_limit(fake: Recording) -> None:
    with Session(cfg()) as session:
        for _ in range(3):
            assert session.run("import time\ntime.sleep(0.7)").ok
        assert session.hibernate()
        began = time.monotonic()
        result = session.run("print('ran')", timeout=1)
        took = time.monotonic() - began
    assert took < 3, f"run(timeout=1) on a slept session took {took:.1f} s"
    assert result.restored == "replay" and not result.ok and result.stdout == ""
    assert result.error is not None and result.error.kind == "timeout"
    assert any("were not (fully) replayed" in note for note in result.notes), result.notes


# -- durable records -----------------------------------------------------------------------------------------

def test_a_durable_session_is_found_again_by_its_record(fake: Recording, tmp_path: Path) -> None:
    first = Session(cfg(), state_dir=tmp_path)
    assert first.run("kept = 'across processes'").ok
    records = [json.loads(p.read_text()) for p in tmp_path.rglob("*.session")]
    assert [r["sandbox"]["kind"] for r in records] == ["fake"], records  # the backend's describe() record
    again = Session.resume(first.id, state_dir=tmp_path)
    try:
        assert again.run("print(kept)").stdout == "across processes\n"
    finally:
        again.close()


def test_a_durable_session_whose_sandbox_is_gone_is_lost(fake: Recording, tmp_path: Path) -> None:
    first = Session(cfg(), state_dir=tmp_path)
    assert first.run("x = 1").ok
    fake.made[0].kill()
    with pytest.raises(SessionLostError):
        Session.resume(first.id, state_dir=tmp_path)
    first.close()


def test_a_durable_session_needs_a_backend_that_keeps_records(fake: Recording, tmp_path: Path) -> None:
    sources.register_for_tests("plain", Plain(fake))
    try:
        session = Session(nbexec.SandboxConfig(source="plain", pool_size=0), state_dir=tmp_path)
        with pytest.raises(NotOfferedError, match="Plain sandbox backend does not offer durable sessions"):
            session.run("x = 1")
        session.close()
    finally:
        sources.register_for_tests("plain", None)
    assert fake.made == [], "no sandbox is made for a durable session its backend cannot keep"


def test_a_session_on_a_backend_without_checkpoints_sleeps_by_replay(fake: Recording) -> None:
    assert not fake.offers(nbexec.sandbox.capabilities.Capability.CHECKPOINT)
    with Session(cfg()) as session:
        assert session.run("y = 3").ok and session.hibernate()
        assert fake.made[0].kernel is None  # slept: its kernel dropped, its files kept
        assert session.run("print(y)").restored == "replay"


# -- judging needs hidden code -------------------------------------------------------------------------------------

def test_judging_is_refused_where_hidden_code_is_not_run(fake: Recording, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend offers hidden code by saying so (fails closed), else judges by name (a remote node) or refuses,
    naming itself and the capability, before any file is sent: here, the fake, which does neither."""
    from nbexec.sandbox.capabilities import Capability
    from nbexec.sandbox.docker.container import Sandbox
    from nbexec.sandbox.fake import FakeSandbox
    from nbexec.sandbox.ray.handle import RayHandle
    from nbexec.sandbox.remote.handle import RemoteHandle

    assert (RemoteHandle.hidden_code, FakeSandbox.hidden_code, Sandbox.hidden_code, RayHandle.hidden_code) == \
        (False, False, True, True)
    monkeypatch.setattr(FakeSandbox, "put_file", lambda *a, **k: pytest.fail("a file was sent"))
    assert RemoteHandle.capabilities >= {Capability.JUDGE} and Capability.JUDGE not in FakeSandbox.capabilities
    with pytest.raises(nbexec.NotOfferedError, match="fake sandbox backend does not offer judging by name"):
        nbexec.judge("print(1)", [nbexec.Test(expected="1")], config=cfg())


def test_a_node_lost_during_a_reset_closes_the_sandbox_and_leaves_the_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset's own call (judge_many, reuse="batch") that loses its node answers "not clean" (the sandbox is
    closed) instead of raising, which would turn the item's finished verdicts into an error."""
    from types import SimpleNamespace

    from nbexec.engine import judgemany

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise nbexec.SessionLostError("node node_x is lost (ActorDiedError)")

    monkeypatch.setattr(judgemany, "ask", lost)
    session = SimpleNamespace(_started_handle=lambda: object())
    assert judgemany._in_kernel(session, "[]") is None  # type: ignore[arg-type]
