"""Kept sessions found again by a new process (a state folder's, see `durable`), each in its own thread and
within its own deadline, so that nothing a kept sandbox does can hold the process that adopts it.

`Adoption.start` reads the records (their ids and owners: small files) and returns; each session is resumed in
the background under the policy the process runs with now (`durable.under`). While that runs the session is
pending (`SessionPendingError`, HTTP 503 with Retry-After). A session whose adoption fails, or has not ended by its
deadline (``startup_timeout`` + DEADLINE_MARGIN seconds), is lost: its sandbox is removed without waiting on its
kernel (`SandboxSource.abandon`), and it is marked lost in the state folder, so the next start answers it as
lost at once and never tries it again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.errors import NbexecError, SessionLostError, SessionNotFoundError, SessionPendingError
from nbexec.files.statefolder import StateFolder
from nbexec.files.workdir import remove_tree

from . import durable, sources
from .session import Session

log = logging.getLogger(__name__)
DEADLINE_MARGIN = 10.0  # seconds past the start-up timeout for the engine calls around the kernel's answer


class Adoption:
    """The kept sessions of one state folder as a new process finds them again. Thread-safe."""

    def __init__(self, state_dir: str | Path, policy: SandboxConfig | None, *, keep_files: bool,
                 hibernate_after: float | None) -> None:
        self.state_dir = state_dir
        self.policy = policy  # None: each resumes in the config it was recorded with (a library's manager)
        self.keep_files = keep_files
        self.hibernate_after = hibernate_after
        self.started = False
        self._owners: dict[str, str] = {}
        self._pending: dict[str, float] = {}  # id -> its deadline (time.monotonic())
        self._adopted: dict[str, Session] = {}
        self._lost: dict[str, str] = {}  # id -> why
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Read the kept records and start adopting each in the background; once."""
        with self._lock:
            if self.started:
                return
            self.started = True
            folder = durable.hold(self.state_dir)
            for session_id, (owner, why, leftover) in durable.lost(folder).items():
                self._owners[session_id], self._lost[session_id] = owner, why
                if leftover:  # its predecessor stopped before removing it
                    threading.Thread(target=self._remove, args=(session_id, owner, why, leftover), daemon=True,
                                     name=f"nbexec-abandon-{session_id[:8]}").start()
            for session_id in durable.ids(folder):
                self._owners[session_id] = _owner(folder, session_id)
                self._begin(session_id)

    def _begin(self, session_id: str) -> None:
        timeout = (self.policy.startup_timeout if self.policy is not None else 60.0) + DEADLINE_MARGIN
        self._pending[session_id] = time.monotonic() + timeout
        worker = threading.Thread(target=self._adopt, args=(session_id,), daemon=True,
                                  name=f"nbexec-adopt-{session_id[:8]}")
        timer = threading.Timer(timeout, self._overdue, args=(session_id, timeout))
        timer.daemon = True
        self._threads.append(worker)
        worker.start()
        timer.start()

    def _adopt(self, session_id: str) -> None:
        try:
            session = Session.resume(session_id, state_dir=self.state_dir, keep_files=self.keep_files,
                                     hibernate_after=self.hibernate_after, policy=self.policy)
        except NbexecError as exc:
            self._fail(session_id, str(exc) if isinstance(exc, (SessionLostError, SessionNotFoundError))
                       else f"Session {session_id} cannot be found again: {exc}")
            return
        except Exception as exc:  # a bug: the session is lost, the thread and the process live on
            log.exception("adopting session %s failed", session_id)
            self._fail(session_id, f"Session {session_id} cannot be found again: {type(exc).__name__}")
            return
        with self._lock:
            late = self._pending.pop(session_id, None) is None
            if not late:
                self._adopted[session_id] = session
        if late:  # lost at its deadline while this ran: its record says so, its sandbox goes
            session.close()

    def _overdue(self, session_id: str, timeout: float) -> None:
        self._fail(session_id, f"Session {session_id} cannot be found again: its adoption did not end within "
                               f"{timeout:g} s (the start-up timeout and {DEADLINE_MARGIN:g} s)")

    def _fail(self, session_id: str, why: str) -> None:
        """Mark ``session_id`` lost (once) and remove its sandbox without waiting on its kernel."""
        with self._lock:
            if self._pending.pop(session_id, None) is None:
                return  # adopted, or already lost
            self._lost[session_id] = why
            owner = self._owners.get(session_id, "")
        log.warning("%s", why)
        try:
            record = durable.load(durable.hold(self.state_dir), session_id)
        except NbexecError as exc:  # unreadable: nothing it names is removed
            log.info("session %s: nothing to remove (%s)", session_id, exc)
            record = None
        self._remove(session_id, owner, why, record.sandbox if record else {})
        if record is not None and not self.keep_files and record.output_dir is not None:
            remove_tree(Path(record.output_dir))

    def _remove(self, session_id: str, owner: str, why: str, leftover: dict[str, Any]) -> None:
        """Mark the session lost first (never adopted again), then remove its sandbox, then say it is gone."""
        try:
            folder = durable.hold(self.state_dir)
            durable.mark_lost(folder, session_id, owner, why, leftover)
            if leftover:
                config = self.policy or SandboxConfig()
                sources.for_config(config).abandon(config, leftover)
                durable.mark_lost(folder, session_id, owner, why)
        except (NbexecError, OSError) as exc:
            log.warning("session %s: could not be marked lost or removed: %s", session_id, exc)

    def take(self) -> dict[str, Session]:
        """The sessions adopted since the last call (the caller keeps them from now on)."""
        with self._lock:
            adopted, self._adopted = self._adopted, {}
            return adopted

    def wait(self) -> None:
        """Until every adoption ended (each within its deadline: the caller's thread never waits longer)."""
        for worker in list(self._threads):
            with self._lock:
                deadline = max(self._pending.values(), default=0.0)
            worker.join(max(0.0, deadline - time.monotonic()))

    def check(self, session_id: str) -> None:
        """SessionPendingError while ``session_id`` is being adopted, SessionLostError once it is lost."""
        with self._lock:
            deadline, why = self._pending.get(session_id), self._lost.get(session_id)
        if deadline is not None:
            left = max(1, math.ceil(deadline - time.monotonic()))
            raise SessionPendingError(f"Session {session_id} is being found again after a restart; retry in "
                                      f"{left} s", left)
        if why is not None:
            raise SessionLostError(why)

    def owners(self) -> dict[str, str]:
        """Every kept session's owner: pending, adopted or lost."""
        with self._lock:
            return dict(self._owners)

    def kept(self) -> set[str]:
        """The sessions pending or lost (not live, yet known)."""
        with self._lock:
            return set(self._pending) | set(self._lost)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def adopting(self) -> set[str]:
        """The sessions being found again now (each holds its owner's place until it is adopted or lost)."""
        with self._lock:
            return set(self._pending)

    def forget(self, session_id: str) -> bool:
        """Drop a lost session (its owner deleted it); False when it is not lost."""
        with self._lock:
            if self._lost.pop(session_id, None) is None:
                return False
            self._owners.pop(session_id, None)
        durable.forget_lost(durable.hold(self.state_dir), session_id)
        return True


def _owner(folder: StateFolder, session_id: str) -> str:
    try:
        return durable.load(folder, session_id).owner
    except (SessionNotFoundError, SessionLostError):  # unreadable or too large: its adoption says why
        return ""
