"""Stateful sessions: one kernel kept across runs, its notebook growing cell by cell, /mnt/data kept for its life.

A Session is used by one caller at a time (its methods take a lock). Idle sessions are closed after their TTL
by one background reaper; every live session is closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbformat import NotebookNode

from . import artifacts, folders, notebook, uploads
from . import packages as installs
from .config import SandboxConfig, from_env
from .errors import (
    FileTransferError,
    SessionClosedError,
    SessionDeadError,
    SessionLimitError,
    SessionNotFoundError,
)
from .execute import finish, prepare_output_dir, run_cells
from .result import ExecutionResult, File, Package
from .runner import OutputCallback
from .sandbox import pool
from .sandbox.container import Sandbox, remove_tree
from .storage import ArtifactStore, LocalStore

log = logging.getLogger(__name__)

DEFAULT_TTL = 20 * 60.0
_live: weakref.WeakSet[Session] = weakref.WeakSet()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None
_wake = threading.Event()


class Session:
    """A kernel that keeps its state between ``run()`` calls. Starts on first use or on ``start()``.

    Its output folder is opened once and written only through that descriptor. With ``keep_files=False``,
    ``close()`` also deletes it (services that have delivered the results)."""

    def __new__(cls, *args: Any, **options: Any) -> Any:
        """With NBEXEC_NODES set, ``Session(...)`` is a RemoteSession on a node (the same surface)."""
        from . import remote

        if cls is Session and remote.enabled():
            from .remote_session import RemoteSession

            return RemoteSession(*args, **options)
        return super().__new__(cls)

    def __init__(self, config: SandboxConfig | None = None, *, output_dir: str | Path | None = None,
                 ttl: float | None = DEFAULT_TTL, session_id: str | None = None,
                 store: ArtifactStore | None = None, keep_files: bool = True) -> None:
        self.id = session_id or uuid.uuid4().hex
        self._config = config
        self._requested_dir = output_dir
        self.ttl = ttl
        self.keep_files = keep_files
        self.output_dir: Path | None = None
        self._folder: folders.OutputFolder | None = None
        self.notebook: NotebookNode = notebook.empty()
        self.created_at = time.time()
        self.last_activity = time.monotonic()
        self._sandbox: Sandbox | None = None
        self._dead_reason: str | None = None
        self._closed = False
        self._lock = threading.RLock()
        self.store: ArtifactStore = store if store is not None else LocalStore()
        self._uploaded: dict[str, str] = {}  # name -> sha256 last stored: only new and changed files are sent
        self._copied: artifacts.Known = {}  # files of /mnt/data copied to output_dir/data: only changes are copied

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def config(self) -> SandboxConfig:
        if self._config is None:
            self._config = from_env()
        return self._config

    @property
    def status(self) -> str:
        """new, ready, busy, dead or closed."""
        if self._closed:
            return "closed"
        if self._dead_reason:
            return "dead"
        if self._sandbox is None:
            return "new"
        return "busy" if self._lock_held() else "ready"

    def _lock_held(self) -> bool:
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    def start(self) -> Session:
        """Start the sandbox now (otherwise the first run starts it)."""
        with self._lock:
            self._check_usable()
            if self._sandbox is None:
                if self.output_dir is None:
                    self.output_dir = prepare_output_dir(self._requested_dir, f"session-{uuid.uuid4().hex}")
                    self._folder = folders.OutputFolder.open(self.output_dir)
                self._sandbox = self._new_sandbox()
                _register(self)
            return self

    def _new_sandbox(self) -> Sandbox:
        """A sandbox with an empty /mnt/data of its own; after each run its files are copied to
        ``output_dir/data``."""
        if self.config.pool_size:
            return pool.acquire(self.config)
        return pool.start_sandbox(self.config, role="session", warm_up=True)

    def _check_usable(self) -> None:
        if self._closed:
            raise SessionClosedError(f"Session {self.id} is closed; start a new one.")
        if self._dead_reason:
            raise SessionDeadError(
                f"Session {self.id} is dead: {self._dead_reason} Call restart() for a fresh kernel "
                "(files in /mnt/data are kept), or start a new session.")

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sandbox. Idempotent; files under ``output_dir`` stay unless ``keep_files`` is False."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sandbox, self._sandbox = self._sandbox, None
            folder, self._folder = self._folder, None
        _live.discard(self)
        if sandbox is not None:
            sandbox.destroy()
        if folder is not None:
            if not self.keep_files:
                if folder.still_at_path():
                    remove_tree(folder.path)
                else:
                    log.warning("not deleting %s: it was moved or replaced since the session made it", folder.path)
            folder.close()

    def restart(self) -> None:
        """Replace the kernel with a fresh one (variables are lost, /mnt/data is kept); revives a dead session."""
        with self._lock:
            if self._closed:
                raise SessionClosedError(f"Session {self.id} is closed; start a new one.")
            sandbox, self._sandbox = self._sandbox, None
            if sandbox is not None:
                try:
                    kept = self._copy_out(sandbox)  # its filesystem outlives a dead kernel until destroy
                finally:
                    sandbox.destroy()
            self._dead_reason = None
            self.start()
            if sandbox is not None:
                self._copy_in(kept)

    def _copy_out(self, sandbox: Sandbox) -> list[File]:
        assert self._folder is not None
        cap = self.config.max_data_bytes
        limits = artifacts.Limits(max_file=cap, max_total=cap, max_files=self.config.max_files)
        with self._folder.child("data") as target:
            return artifacts.snapshot(sandbox.data_dir, target, limits, known=self._copied).files

    def _copy_in(self, files: list[File]) -> None:
        """Put the host copies of a previous sandbox's files into the new /mnt/data."""
        sandbox = self._sandbox
        assert sandbox is not None
        for item in files:
            with open(item.path, "rb") as handle:  # a private host folder nbexec made (0700)
                artifacts.put(sandbox.data_dir, item.name, handle, owner=sandbox.file_owner())
        self._copied.clear()  # the new filesystem's files are new: copy them again after the next run

    def interrupt(self) -> None:
        """Interrupt the running cell (safe to call from another thread)."""
        sandbox = self._sandbox
        if sandbox is not None:
            sandbox.interrupt()

    # -- running code -------------------------------------------------------------------------------

    def install(self, *requirements: str) -> tuple[Package, ...]:
        """Fetch ``requirements`` on the host and install them in the sandbox now (see `nbexec.packages`);
        what became of each is returned (and kept in the notebook's metadata). Refusals are data, not errors."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            with installs.prepared(self._sandbox, self.notebook, self.config, requested=requirements,
                                   first_index=len(self.notebook.cells)) as records:
                pass
            self.last_activity = time.monotonic()
            return tuple(records)

    def run(self, code: str, *, timeout: float | None = None, on_output: OutputCallback | None = None,
            packages: Sequence[str] = ()) -> ExecutionResult:
        """Run ``code`` as a new cell of the session's notebook and return that cell's result (``packages`` are
        installed first, as `install` does; the cell's own pip lines are served the same way)."""
        started = time.monotonic()
        cell = notebook.build(code).cells[0]
        with self._lock:
            self.start()
            sandbox = self._sandbox
            assert sandbox is not None and self.output_dir is not None
            self.last_activity = time.monotonic()
            config = self.config.replace(timeout=timeout)
            index = len(self.notebook.cells)
            self.notebook.cells.append(cell)
            if not self.notebook.metadata.get("language_info", {}).get("version"):
                self.notebook.metadata["language_info"] = sandbox.language_info
            with installs.prepared(sandbox, self.notebook, config, requested=packages, first_index=index) as installed:
                error, dropped = run_cells(sandbox, self.notebook, config, on_output=on_output, first_index=index)
            ran = time.monotonic()
            if error is not None and error.kind in ("timeout", "kernel_died", "oom", "limit", "protocol") \
                    and not sandbox.state().running:
                self._dead_reason = error.evalue
            self.last_activity = time.monotonic()
            result = finish(self.notebook, error, execution_id=f"{self.id}-{index}", output_dir=self.output_dir,
                            sandbox=sandbox, notebook_path=self.output_dir / "session.ipynb", started=started,
                            timings={"run_s": ran - started}, dropped=dropped, first_cell=index,
                            known=self._copied, folder=self._folder)
            result = dataclasses.replace(result, packages=tuple(installed),
                                         notes=result.notes + tuple(installs.notes(installed)))
            return uploads.publish(result, self.store, prefix=self.store.prefix, already=self._uploaded)

    def save(self, path: str | Path) -> Path:
        """Write the session's notebook so far to ``path`` (atomically; inside the output folder through its
        descriptor, elsewhere through a descriptor of the folder ``path`` names; never through a final link)."""
        path = Path(path).absolute()
        with self._lock:
            content = notebook.dumps(self.notebook)
            if self._folder is not None and self.output_dir is not None and path.parent == self.output_dir.absolute():
                return artifacts.replace(self._folder, path.name, content)
        # A place the caller chose: its links are the caller's own, so only the final name is never followed.
        with folders.OutputFolder(path.parent, os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)) as parent:
            artifacts.replace(parent, path.name, content)
        return path

    # -- files --------------------------------------------------------------------------------------

    def upload(self, source: str | Path | bytes, name: str | None = None) -> str:
        """Put a host file (streamed) or bytes into /mnt/data as ``name``; return its path inside the sandbox.

        A file that does not fit in /mnt/data (max_data, max_files) raises FileTransferError."""
        if isinstance(source, bytes) and not name:
            raise FileTransferError("upload(bytes) needs a name")
        name = name or Path(str(source)).name
        with self._lock:
            self.start()
            sandbox = self._sandbox
            assert sandbox is not None
            if isinstance(source, bytes):
                artifacts.put(sandbox.data_dir, name, source, owner=sandbox.file_owner())
            else:
                try:
                    handle = open(source, "rb")  # noqa: SIM115 - closed below, after the streamed copy
                except OSError as exc:
                    raise FileTransferError(f"cannot read {source}: {exc.strerror}") from exc
                with handle:
                    limit = self.config.max_data_bytes
                    if limit and os.fstat(handle.fileno()).st_size > limit:
                        raise FileTransferError(f"{name!r} is larger than the /mnt/data cap ({self.config.max_data})")
                    artifacts.put(sandbox.data_dir, name, handle, owner=sandbox.file_owner())
            self.last_activity = time.monotonic()
        return f"/mnt/data/{name}"

    def download(self, name: str) -> bytes:
        """The bytes of /mnt/data/``name`` (a regular file; links are refused)."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            return artifacts.get(self._sandbox.data_dir, name)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, artifacts.FileChunks]:
        """/mnt/data/``name`` as it is now, for streaming: (its size, its chunks); links are refused."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            return artifacts.open_stream(self._sandbox.data_dir, name, max_bytes=max_bytes)

    def files(self) -> list[Any]:
        """The regular files now in /mnt/data (File entries), and nothing else."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            return artifacts.collect(self._sandbox.data_dir)[0]

    def __repr__(self) -> str:
        return f"<Session {self.id} {self.status}>"


# -- reaping ----------------------------------------------------------------------------------------

def _register(session: Session) -> None:
    global _reaper
    _live.add(session)
    _wake.set()  # the reaper recomputes its interval from the shortest TTL
    with _reaper_lock:
        if _reaper is None:
            atexit.register(close_all)
            _reaper = threading.Thread(target=_reap_forever, name="nbexec-session-reaper", daemon=True)
            _reaper.start()


def reap(now: float | None = None) -> list[str]:
    """Close sessions idle for longer than their TTL; return their ids."""
    now = time.monotonic() if now is None else now
    reaped = []
    for session in list(_live):
        if session.ttl and now - session.last_activity > session.ttl and not session._lock_held():
            log.info("closing session %s after %.0f s idle", session.id, now - session.last_activity)
            session.close()
            reaped.append(session.id)
    return reaped


def _reap_forever() -> None:
    while True:
        ttls = [s.ttl for s in list(_live) if s.ttl]
        _wake.wait(max(0.2, min([t / 4 for t in ttls] + [30.0])))
        _wake.clear()
        with contextlib.suppress(Exception):
            reap()


def close_all() -> None:
    """Close every live session (runs at interpreter exit)."""
    for session in list(_live):
        with contextlib.suppress(Exception):
            session.close()


class SessionManager:
    """Sessions by id for a server with many chats: create, get, close, a cap on live sessions. Thread-safe."""

    def __init__(self, config: SandboxConfig | None = None, *, max_sessions: int = 32,
                 ttl: float | None = DEFAULT_TTL, keep_files: bool = True) -> None:
        self.config = config
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.keep_files = keep_files  # False: a session's output folder is deleted when it closes
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def _prune_locked(self) -> None:
        for key in [k for k, s in self._sessions.items() if s.status == "closed"]:
            del self._sessions[key]

    def create(self, *, session_id: str | None = None, **session_options: Any) -> Session:
        """A new session (started lazily), or SessionLimitError when ``max_sessions`` are live."""
        with self._lock:
            self._prune_locked()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitError(
                    f"{len(self._sessions)} sessions are live, the cap is {self.max_sessions}; close one "
                    "(or wait for idle ones to be reaped) before creating another.")
            if session_id is not None and session_id in self._sessions:
                raise SessionLimitError(f"a session with id {session_id!r} already exists")
            session_options.setdefault("keep_files", self.keep_files)
            session = Session(self.config, ttl=self.ttl, session_id=session_id, **session_options)
            self._sessions[session.id] = session
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            self._prune_locked()
            try:
                return self._sessions[session_id]
            except KeyError:
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
