"""What local and remote sessions share: their config, whether a call holds one, their status word; and the
reaper: idle sessions closed after their TTL by one background thread, every live one closed at interpreter exit.
Idle sessions are put to sleep on threads of their own (a few at once), so a slow checkpoint never delays a TTL
close or another sleep; a sleep past its deadline is abandoned by closing its session.

A session registers when it starts and is forgotten when it closes; nothing here keeps one alive (a weak set).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import threading
import time
import weakref
from typing import Protocol

from nbexec.config import SandboxConfig, from_env
from nbexec.kinds import SessionStatus
from nbexec.overrides import ConfigOverrides

log = logging.getLogger(__name__)


class SessionBase:
    """The parts of a session that do not depend on where its sandbox runs."""

    _config: SandboxConfig | None
    _overrides: ConfigOverrides
    _closed: bool
    _lock: threading.RLock

    @property
    def config(self) -> SandboxConfig:
        if self._config is None:
            self._config = from_env(**self._overrides)
        return self._config

    @property
    def busy(self) -> bool:
        """Whether a call holds the session now (running code, moving files)."""
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    def _status(self, *, dead: bool, started: bool) -> SessionStatus:
        if self._closed:
            return "closed"
        if dead:
            return "dead"
        if not started:
            return "new"
        return "busy" if self.busy else "ready"


class Reapable(Protocol):
    id: str
    ttl: float | None
    hibernate_after: float | None  # idle seconds after which it sleeps (see engine.hibernation)
    last_activity: float  # time.monotonic() of the last call

    @property
    def busy(self) -> bool: ...

    def close(self) -> None: ...

    def _close_at_exit(self) -> None: ...

    def hibernate(self, *, idle_for: float = 0.0) -> bool: ...


_live: weakref.WeakSet[Reapable] = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_wake = threading.Event()
MAX_SLEEPS = 4  # hibernations under way at once; more wait for a later pass
SLEEP_DEADLINE = 300.0  # seconds after which a hibernation still under way is abandoned: its session is closed
SLEEP_PER_GIB = 120.0  # more seconds per GiB of the sandbox's memory limit: an honest checkpoint grows with memory
_sleeping: dict[str, float] = {}  # session id -> time.monotonic() its hibernation began


def register(session: Reapable) -> None:
    """Watch ``session`` (started now) until it closes."""
    global _thread
    _live.add(session)
    _wake.set()  # the reaper recomputes its interval from the shortest TTL
    with _lock:
        if _thread is None:
            atexit.register(close_all)
            _thread = threading.Thread(target=_reap_forever, name="nbexec-session-reaper", daemon=True)
            _thread.start()


def forget(session: Reapable) -> None:
    _live.discard(session)


def reap(now: float | None = None) -> list[str]:
    """Close sessions idle for longer than their TTL (return their ids); put to sleep those idle for longer than
    their ``hibernate_after``. One being put to sleep is closed in a later pass, once its sleep has ended: a close
    never races a hibernation (nor waits behind one on this thread); one due for both is closed, not put to sleep."""
    now = time.monotonic() if now is None else now
    reaped = []
    for session in list(_live):
        idle = now - session.last_activity
        if session.busy or _asleep_under_way(session):
            continue
        if session.ttl and idle > session.ttl:
            log.info("closing session %s after %.0f s idle", session.id, idle)
            session.close()
            reaped.append(session.id)
        elif session.hibernate_after and idle > session.hibernate_after:
            _sleep_apart(session, now)
    return reaped


def _asleep_under_way(session: Reapable) -> bool:
    with _lock:
        return session.id in _sleeping


def _sleep_apart(session: Reapable, now: float) -> None:
    """Hibernate ``session`` on a thread of its own (once at a time per session, MAX_SLEEPS at once): the reaper
    goes on at once. One still under way past SLEEP_DEADLINE is abandoned: the session is closed (see `_overdue`)
    and no longer holds a place."""
    with _lock:
        if session.id in _sleeping or sum(1 for b in _sleeping.values() if b != math.inf) >= MAX_SLEEPS:
            return
        _sleeping[session.id] = now
    timer = threading.Timer(sleep_deadline(session), _overdue, args=(session,))
    timer.daemon = True

    def sleep() -> None:
        try:
            with contextlib.suppress(Exception):  # one that cannot sleep stays awake (logged by it)
                session.hibernate(idle_for=session.hibernate_after or 0.0)
        finally:
            timer.cancel()
            with _lock:
                _sleeping.pop(session.id, None)

    timer.start()
    threading.Thread(target=sleep, name="nbexec-session-sleep", daemon=True).start()


def sleep_deadline(session: Reapable) -> float:
    """How long ``session``'s sleep may take: SLEEP_DEADLINE, and SLEEP_PER_GIB for each GiB it may hold (a
    checkpoint writes its memory out: about a minute per GiB on a loaded 2-core host)."""
    config = getattr(session, "config", None)
    memory = getattr(config, "memory_bytes", 0) or 0
    return SLEEP_DEADLINE + SLEEP_PER_GIB * memory / 1024**3


def _overdue(session: Reapable) -> None:
    """A sleep past its deadline is abandoned by closing the session. It cannot stay awake and usable: the sleep
    holds the session's lock and may have stopped its kernel half way. close() kills the sandbox (so the sleep's
    waits on it end) and removes it once the sleep lets go; the owner's next call says the session is closed."""
    with _lock:
        if session.id not in _sleeping:
            return
        _sleeping[session.id] = math.inf  # no longer holds one of the MAX_SLEEPS places
    log.warning("session %s: its hibernation ran past %.0f s; the session is closed", session.id,
                sleep_deadline(session))
    with contextlib.suppress(Exception):
        session.close()


def _reap_forever() -> None:
    while True:
        ttls = [t for s in list(_live) for t in (s.ttl, s.hibernate_after) if t]
        _wake.wait(max(0.2, min([t / 4 for t in ttls] + [30.0])))
        _wake.clear()
        with contextlib.suppress(Exception):
            reap()


def close_all() -> None:
    """Close every live session (runs at interpreter exit); durable ones are left to their state folder."""
    for session in list(_live):
        with contextlib.suppress(Exception):
            session._close_at_exit()
