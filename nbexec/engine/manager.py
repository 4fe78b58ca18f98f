"""Sessions by id, for a server with many chats: create, get, close, and a cap on live sessions.

With a ``state_dir`` the sessions are durable (see `durable`): each is kept in that folder, and a manager of a
new process finds them again (`ids`, `get`) after its predecessor died: the same ids, kernels and files, under the
manager's config as it is now (see `adoption`). `adopt_in_background` starts that and returns (a service: meanwhile
such a session raises SessionPendingError); otherwise the first call waits for it, each session within its own
deadline."""

from __future__ import annotations

import threading
from pathlib import Path

from nbexec.config import SandboxConfig
from nbexec.errors import SessionLimitError, SessionNotFoundError
from nbexec.overrides import Unpack

from .adoption import Adoption
from .options import RestoreOptions, SessionOptions
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
        self._restoring = 0  # restores under way: each holds its place from the check on (see `restore`)
        self._adoption = None if state_dir is None else \
            Adoption(state_dir, config, keep_files=keep_files, hibernate_after=hibernate_after)
        self._lock = threading.Lock()

    def adopt_in_background(self) -> None:
        """Start finding again the sessions the state folder keeps, and return (see `adoption`)."""
        if self._adoption is not None:
            self._adoption.start()

    def kept_owners(self) -> dict[str, str]:
        """The owner of every session the state folder keeps: being found again, found, or lost."""
        return {} if self._adoption is None else self._adoption.owners()

    def kept(self) -> set[str]:
        """Sessions not live but known: being found again, or lost."""
        return set() if self._adoption is None else self._adoption.kept()

    def adopting(self) -> set[str]:
        """Sessions being found again now: not live yet, but each will be (or be lost) within its deadline."""
        return set() if self._adoption is None else self._adoption.adopting()

    def _adopt_locked(self) -> None:
        """Take the sessions found again; the first call without `adopt_in_background` waits for them."""
        if self._adoption is None:
            return
        if not self._adoption.started:
            self._adoption.start()
            self._adoption.wait()
        self._sessions.update(self._adoption.take())

    def _prune_locked(self) -> None:
        self._adopt_locked()
        for key in [k for k, s in self._sessions.items() if s.status == "closed"]:
            del self._sessions[key]

    def create(self, *, session_id: str | None = None, config: SandboxConfig | None = None,
               **session_options: Unpack[SessionOptions]) -> Session:
        """A new session (started lazily) with ``config`` (default: the manager's), or SessionLimitError when
        ``max_sessions`` are live."""
        with self._lock:
            self._prune_locked()
            if len(self._sessions) + self._pending() + self._restoring >= self.max_sessions:
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
                **session_options: Unpack[RestoreOptions]) -> Session:
        """A new session of this manager from snapshot ``snapshot_id`` of ``owner`` (see Session.from_snapshot),
        within ``max_sessions``: its place is taken with the check, before its sandbox starts, so concurrent
        restores cannot all pass it."""
        with self._lock:
            self._prune_locked()
            if len(self._sessions) + self._pending() + self._restoring >= self.max_sessions:
                raise SessionLimitError(f"{len(self._sessions) + self._restoring} sessions are live or being "
                                        f"restored, the cap is {self.max_sessions}")
            self._restoring += 1
        session_options = {"keep_files": self.keep_files, "state_dir": self.state_dir,
                           "hibernate_after": self.hibernate_after, "ttl": self.ttl, **session_options}
        try:
            session = Session.from_snapshot(snapshot_id, owner=owner, snapshot_dir=snapshot_dir, **session_options)
            with self._lock:
                self._sessions[session.id] = session
        finally:
            with self._lock:
                self._restoring -= 1
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            self._prune_locked()
            try:
                return self._sessions[session_id]
            except KeyError:
                if self._adoption is not None:
                    self._adoption.check(session_id)  # being found again, or lost
                raise SessionNotFoundError(f"no session with id {session_id!r} (closed, reaped or never made)") \
                    from None

    def close(self, session_id: str) -> None:
        with self._lock:
            self._prune_locked()
            session = self._sessions.pop(session_id, None)
        if session is None and self._adoption is not None and self._adoption.forget(session_id):
            return  # a lost one: its owner has been told
        if session is None:
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        session.close()

    def _pending(self) -> int:
        return 0 if self._adoption is None else self._adoption.pending()

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
