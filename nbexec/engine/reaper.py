"""What local and remote sessions share: their config, whether a call holds one, their status word; and the
reaper: idle sessions closed after their TTL by one background thread, every live one closed at interpreter exit.
Idle sessions are put to sleep on threads of their own (a few at once), so a slow checkpoint never delays a TTL
close or another sleep.

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

log = logging.getLogger(__name__)


class SessionBase:
    """The parts of a session that do not depend on where its sandbox runs."""

    _config: SandboxConfig | None
    _closed: bool
    _lock: threading.RLock

    @property
    def config(self) -> SandboxConfig:
        if self._config is None:
            self._config = from_env()
        return self._config

    @property
    def busy(self) -> bool:
        """Whether a call holds the session now (running code, moving files)."""
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    def _status(self, *, dead: bool, started: bool) -> str:
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

    def close_at_exit(self) -> None: ...

    def hibernate(self, *, idle_for: float = 0.0) -> bool: ...


_live: weakref.WeakSet[Reapable] = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_wake = threading.Event()
MAX_SLEEPS = 4  # hibernations under way at once; more wait for a later pass
SLEEP_DEADLINE = 300.0  # seconds after which a hibernation still under way is logged and stops holding a place
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
    their ``hibernate_after``."""
    now = time.monotonic() if now is None else now
    reaped = []
    for session in list(_live):
        if session.hibernate_after and now - session.last_activity > session.hibernate_after and not session.busy:
            _sleep_apart(session, now)
        if session.ttl and now - session.last_activity > session.ttl and not session.busy:
            log.info("closing session %s after %.0f s idle", session.id, now - session.last_activity)
            session.close()
            reaped.append(session.id)
    return reaped


def _sleep_apart(session: Reapable, now: float) -> None:
    """Hibernate ``session`` on a thread of its own (once at a time per session, MAX_SLEEPS at once): the reaper
    goes on at once. One past SLEEP_DEADLINE is logged and no longer holds a place (a thread cannot be stopped)."""
    with _lock:
        overdue = [sid for sid, began in _sleeping.items() if now - began > SLEEP_DEADLINE]
        for sid in overdue:
            log.warning("session %s: its hibernation has run for over %.0f s", sid, SLEEP_DEADLINE)
            _sleeping[sid] = math.inf  # logged once; it still blocks a second sleep of the same session
        if session.id in _sleeping or sum(1 for b in _sleeping.values() if b != math.inf) >= MAX_SLEEPS:
            return
        _sleeping[session.id] = now

    def sleep() -> None:
        try:
            with contextlib.suppress(Exception):  # one that cannot sleep stays awake (logged by it)
                session.hibernate(idle_for=session.hibernate_after or 0.0)
        finally:
            with _lock:
                _sleeping.pop(session.id, None)

    threading.Thread(target=sleep, name="nbexec-session-sleep", daemon=True).start()


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
            session.close_at_exit()
