"""Sessions by id, for a server with many chats: create, get, close, and a cap on live sessions.

With a ``state_dir`` the sessions are durable (see `durable`): each is kept in that folder, and a manager of a
new process finds them again (`ids`, `get`) after its predecessor died: the same ids, kernels and files."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.errors import SessionLimitError, SessionLostError, SessionNotFoundError

from . import durable
from .session import DEFAULT_TTL, Session


class SessionManager:
    """Sessions by id for a server with many chats: create, get, close, a cap on live sessions. Thread-safe."""

    def __init__(self, config: SandboxConfig | None = None, *, max_sessions: int = 32,
                 ttl: float | None = DEFAULT_TTL, keep_files: bool = True,
                 state_dir: str | Path | None = None, hibernate_after: float | None = None) -> None:
        self.config = config
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.keep_files = keep_files  # False: a session's output folder is deleted when it closes
        self.state_dir = state_dir
        self.hibernate_after = hibernate_after  # idle seconds before a session sleeps (None: never)
        self._sessions: dict[str, Session] = {}
        self._lost: dict[str, str] = {}  # kept sessions that could not be found again: why
        self._adopted = state_dir is None
        self._lock = threading.Lock()

    def _adopt_locked(self) -> None:
        """Once: find again the sessions the state folder keeps (no I/O before the first call)."""
        if self._adopted or self.state_dir is None:
            return
        self._adopted = True
        for session_id in durable.ids(durable.hold(self.state_dir)):
            try:
                self._sessions[session_id] = Session.resume(session_id, state_dir=self.state_dir,
                                                            keep_files=self.keep_files,
                                                            hibernate_after=self.hibernate_after)
            except (SessionLostError, SessionNotFoundError) as exc:
                self._lost[session_id] = str(exc)

    def _prune_locked(self) -> None:
        self._adopt_locked()
        for key in [k for k, s in self._sessions.items() if s.status == "closed"]:
            del self._sessions[key]

    def create(self, *, session_id: str | None = None, config: SandboxConfig | None = None,
               **session_options: Any) -> Session:
        """A new session (started lazily) with ``config`` (default: the manager's), or SessionLimitError when
        ``max_sessions`` are live."""
        with self._lock:
            self._prune_locked()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitError(
                    f"{len(self._sessions)} sessions are live, the cap is {self.max_sessions}; close one "
                    "(or wait for idle ones to be reaped) before creating another.")
            if session_id is not None and session_id in self._sessions:
                raise SessionLimitError(f"a session with id {session_id!r} already exists")
            session_options.setdefault("keep_files", self.keep_files)
            session_options.setdefault("state_dir", self.state_dir)
            session_options.setdefault("hibernate_after", self.hibernate_after)
            session = Session(config or self.config, ttl=self.ttl, session_id=session_id, **session_options)
            self._sessions[session.id] = session
            return session

    def restore(self, snapshot_id: str, *, owner: str = "", snapshot_dir: str | Path | None = None,
                **session_options: Any) -> Session:
        """A new session of this manager from snapshot ``snapshot_id`` of ``owner`` (see Session.from_snapshot),
        within ``max_sessions``."""
        with self._lock:
            self._prune_locked()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitError(f"{len(self._sessions)} sessions are live, the cap is {self.max_sessions}")
        for name, value in (("keep_files", self.keep_files), ("state_dir", self.state_dir),
                            ("hibernate_after", self.hibernate_after), ("ttl", self.ttl)):
            session_options.setdefault(name, value)
        session = Session.from_snapshot(snapshot_id, owner=owner, snapshot_dir=snapshot_dir, **session_options)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            self._prune_locked()
            try:
                return self._sessions[session_id]
            except KeyError:
                if session_id in self._lost:
                    raise SessionLostError(self._lost[session_id]) from None
                raise SessionNotFoundError(f"no session with id {session_id!r} (closed, reaped or never made)") \
                    from None

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        session.close()

    def ids(self) -> list[str]:
        with self._lock:
            self._prune_locked()
            return list(self._sessions)

    def __len__(self) -> int:
        return len(self.ids())

    def close_all(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()
