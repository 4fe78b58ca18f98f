"""The reaper against its own threads (issue #36, attacker's read): a TTL that ends while a session is being put
to sleep, and a sleep that passes its deadline.

Judged from outside: the session's status, how often its sandbox was released, the containers and folders left
(the cleanup ledger), and exceptions raised in any thread (threading.excepthook).
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.engine import reaper
from nbexec.sandbox.docker.local import LocalSource
from nbexec.sandbox.source import SandboxHandle

from ..conftest import own_containers, wait_until
from .test_time_budgets_replay import On, cfg


class HeldSleep(LocalSource):
    """A source whose hibernation waits ``hold`` seconds before it begins (a slow checkpoint's preparation), and
    that counts the sandboxes given back to it."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.hold, self.entered, self.released = hold, threading.Event(), 0

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        self.entered.set()
        time.sleep(self.hold)
        return super().hibernate(handle, folder)

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        self.released += 1
        super().release(sandbox, wait=wait)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException | None]]:
    """Exceptions that ended any thread while the test ran."""
    seen: list[BaseException | None] = []
    before = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        yield seen
    finally:
        threading.excepthook = before


class Due:
    """A reapable session whose sleep waits until told to go, and that never looks busy: the window between a
    sleep thread's start and its taking the session's lock, held open."""

    def __init__(self, *, ttl: float, hibernate_after: float, idle: float) -> None:
        self.id, self.ttl, self.hibernate_after = uuid.uuid4().hex, ttl, hibernate_after
        self.last_activity, self.busy = time.monotonic() - idle, False
        self.sleeping, self.go = threading.Event(), threading.Event()
        self.slept, self.closes = 0, []  # closes: whether a sleep was under way at each close

    def hibernate(self, *, idle_for: float = 0.0) -> bool:
        self.slept += 1
        self.sleeping.set()
        self.go.wait(30)
        self.sleeping.clear()
        return True

    def close(self) -> None:
        self.closes.append(self.sleeping.is_set())

    def _close_at_exit(self) -> None:
        self.close()


def _reaping(monkeypatch: pytest.MonkeyPatch, session: Due) -> None:
    monkeypatch.setattr(reaper, "_live", weakref.WeakSet([session]))
    monkeypatch.setattr(reaper, "_sleeping", {})


def test_a_session_due_for_both_is_closed_not_put_to_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the reaper started its sleep and closed it in the same pass (the sleep ran on a closed session)."""
    due = Due(ttl=1, hibernate_after=1, idle=10)
    _reaping(monkeypatch, due)
    assert reaper.reap() == [due.id]
    wait_until(lambda: not reaper._sleeping, 10, "a sleep is under way")
    assert (due.slept, due.closes) == (0, [False])


def test_a_ttl_that_ends_during_a_sleep_closes_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the TTL close ran while the session was being put to sleep."""
    due = Due(ttl=5, hibernate_after=1, idle=2)
    _reaping(monkeypatch, due)
    assert reaper.reap() == [] and due.sleeping.wait(10)
    assert reaper.reap(time.monotonic() + 10) == [], "closed while its sleep was under way"
    due.go.set()
    wait_until(lambda: not reaper._sleeping, 10, "the sleep never ended")
    assert reaper.reap(time.monotonic() + 10) == [due.id]
    assert (due.slept, due.closes) == (1, [False])


@pytest.mark.parametrize(("ttl", "hold"), [(0.5, 4.0), (2.0, 4.0)], ids=["same-pass", "ttl-during-sleep"])
def test_ttl_that_ends_during_a_sleep_closes_the_session_once(cleanup_ledger: None, thread_errors: list[Any],
                                                              ttl: float, hold: float) -> None:
    """The TTL ends while the session is being put to sleep: it is closed exactly once, nothing is left behind,
    and no thread fails."""
    source = HeldSleep(hold)
    session = On(source, cfg(), ttl=ttl, hibernate_after=0.5, keep_files=False)
    assert session.run("x = 1").ok
    folder = session.output_dir
    wait_until(lambda: session.status == "closed", hold + 20, "the session was not closed on its TTL")
    wait_until(lambda: not reaper._sleeping, hold + 20, "the hibernation never ended")
    wait_until(lambda: not own_containers(), 20, "the session's container was left behind")
    assert source.released == 1, f"its sandbox was released {source.released} times"
    assert folder is not None
    wait_until(lambda: not folder.exists(), 20, "the session's output folder was left behind")
    assert thread_errors == []


def test_a_ttl_close_never_waits_behind_a_sleep(cleanup_ledger: None, thread_errors: list[Any]) -> None:
    """A session whose TTL and sleep come due in the same pass is not closed behind its own slow hibernation on
    the reaper's thread: another session is still closed on its 2 s TTL."""
    source = HeldSleep(15.0)
    due = On(source, cfg(), ttl=0.5, hibernate_after=0.5, keep_files=False)
    other = nbexec.Session(cfg(), ttl=2)
    try:
        assert due.run("x = 1").ok and other.run("1").ok
        began = time.monotonic()
        wait_until(lambda: other.status == "closed", 12, "the reaper closed nothing while a sleep was slow")
        assert time.monotonic() - began < 12
    finally:
        other.close()
        due.close()
    wait_until(lambda: not reaper._sleeping, 30, "the hibernation never ended")
    assert thread_errors == []


class StuckSleep(LocalSource):
    """A source whose hibernation waits on a kernel that does not answer for two minutes (a checkpoint's
    preparation held by the sandbox): only an interrupt or the sandbox's end lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        self.entered.set()
        handle.run_hidden("import time\ntime.sleep(120)", 150)
        return super().hibernate(handle, folder)


def test_a_sleep_past_its_deadline_is_abandoned(cleanup_ledger: None, thread_errors: list[Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleep that passes SLEEP_DEADLINE is abandoned: the session is closed (its sandbox removed) instead of
    left half-asleep, and the place it held is free."""
    monkeypatch.setattr(reaper, "SLEEP_DEADLINE", 2.0)
    monkeypatch.setattr(reaper, "SLEEP_PER_GIB", 0.0)  # the deadline alone, whatever the sandbox's memory
    source = StuckSleep()
    session = On(source, cfg(), ttl=None, hibernate_after=0.5, keep_files=False)
    try:
        assert session.run("x = 1").ok
        assert source.entered.wait(30), "the reaper never tried to put the session to sleep"
        wait_until(lambda: session.status == "closed", 20, "a sleep past its deadline was only logged")
        wait_until(lambda: not own_containers(), 20, "the session's container was left behind")
        with pytest.raises(nbexec.SessionClosedError):
            session.run("1")
    finally:
        session.close()
    wait_until(lambda: not reaper._sleeping, 20, "the abandoned sleep still holds a place")
    assert thread_errors == []
