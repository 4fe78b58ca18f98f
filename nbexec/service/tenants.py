"""What each token of `nbexec serve` holds, and for how long: its sessions and one-shot results, their folders
on the host, and its own worker threads.

Every folder lives under one private root made at start-up (a working folder of this process, so the orphan
sweep of a later nbexec removes it if this one is killed). A session's folder goes when it is deleted or reaped;
a one-shot result's folder goes ``result_ttl`` seconds after its run; the root goes at shutdown, after every
session was interrupted and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from nbexec.config import SandboxConfig
from nbexec.engine import durable, snapshotblobs, sources
from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.errors import NbexecError, SessionLimitError, SessionNotFoundError, ShuttingDownError, StorageError
from nbexec.files.folders import work_root
from nbexec.files.workdir import WORKDIR_PREFIX, remove_tree
from nbexec.hostconfig import host_from_env
from nbexec.result import ExecutionResult
from nbexec.stores.storage import ArtifactStore

from .held import Held

log = logging.getLogger(__name__)
IO_THREADS = 2  # per token, for file and session work besides runs


class RouteStore:
    """Files stay in the server's folder; each one's URL is the (relative) route that serves it to its owner."""

    kind = "local"

    def __init__(self, base: str, folder: Path) -> None:
        self.base = base
        self.folder = folder

    @property
    def prefix(self) -> str:
        return "nbexec"

    @staticmethod
    def url(base: str, route: str, name: str) -> str:
        return f"{base}/{route}/{quote(name)}"

    def upload(self, blob_name: str, content: bytes | BinaryIO, content_type: str, *,
               length: int | None = None) -> str:
        raise StorageError("this file is outside the run's folder and is not served")

    def local_url(self, path: Path) -> str | None:
        try:
            parts = Path(path).relative_to(self.folder).parts
        except ValueError:
            return None
        route = {"data": "files", "images": "images"}.get(parts[0] if parts else "")
        return self.url(self.base, route, "/".join(parts[1:])) if route and len(parts) > 1 else None

    def check(self) -> None:
        """Nothing to reach: the server serves the files itself."""


def _served(store: ArtifactStore | None, base: str, folder: Path) -> ArtifactStore:
    """The operator's store when it uploads (its URLs are the links); else files are served from ``base``."""
    return store if store is not None and store.kind != "local" else RouteStore(base, folder)


def public(result: ExecutionResult, execution_id: str | None = None) -> dict[str, Any]:
    """The result as sent to HTTP clients: its public shape (relative names and URLs, no host path), naming this
    node (a service is one)."""
    data = dataclasses.replace(result, node=host_from_env().node_name).to_dict(public=True)
    if execution_id is not None:
        data["execution_id"] = execution_id
    return data


@dataclass
class _Lanes:
    """One token's worker threads: runs (as many as its execution slots) and I/O."""

    runs: ThreadPoolExecutor
    io: ThreadPoolExecutor


@dataclass
class _Kept:
    owner: str
    folder: Path
    session: Session
    expires: float = math.inf  # time.monotonic() after which the folder is deleted
    doomed: bool = False  # deleted with its batch while it ran: its folder goes at its end


@dataclass
class Tenants:
    """Sessions and results by owner (a token id), their folders, and each owner's threads. Thread-safe."""

    config: SandboxConfig
    max_sessions: int
    session_ttl: float
    result_ttl: float
    runs_per_token: int
    root: Path | None = None
    state_dir: Path | None = None  # durable: sessions and their folders outlive this process (see engine.durable)
    hibernate_after: float | None = None  # idle seconds before a session sleeps (see engine.hibernation)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.source = sources.for_config(self.config)  # where this node's sandboxes come from
        self.held = Held(lambda handle, wait: self.source.release(handle, wait=wait), self.session_ttl)
        self.sessions = SessionManager(self.config, max_sessions=self.max_sessions, ttl=self.session_ttl,
                                       keep_files=False,  # a session's folder goes when it is closed or reaped
                                       state_dir=self.state_dir, hibernate_after=self.hibernate_after)
        self._owners: dict[str, str] = {}  # session id -> owner
        self._making: dict[str, int] = {}  # owner -> sessions being made for it (restores): each holds a place
        self._results: dict[str, _Kept] = {}
        self._lanes: dict[str, _Lanes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> None:
        """Make the private root folder (at start-up: constructors do no I/O). With a state folder, the root is
        kept in it, and the sessions it keeps are found again in the background with their owners (results of
        runs are not): start-up never waits on a kept sandbox (see `nbexec.engine.adoption`)."""
        if self.state_dir is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-serve-", dir=work_root()))
            return
        self.root = durable.hold(self.state_dir).child("outputs")
        self._remove_results()
        self.sessions.adopt_in_background()
        self._owners.update({sid: who for sid, who in self.sessions.kept_owners().items() if who})

    def _remove_results(self) -> None:
        assert self.root is not None
        for entry in os.listdir(self.root):
            if entry.startswith("run-"):
                remove_tree(self.root / entry)

    def _folder(self, name: str) -> Path:
        assert self.root is not None, "Tenants.open() was not called"
        return self.root / name

    def lanes(self, who: str) -> _Lanes:
        with self._lock:
            if self._closed:
                raise RuntimeError("shutting down")
            lanes = self._lanes.get(who)
            if lanes is None:
                lanes = self._lanes[who] = _Lanes(
                    ThreadPoolExecutor(self.runs_per_token, thread_name_prefix=f"nbexec-run-{who[:6]}"),
                    ThreadPoolExecutor(IO_THREADS, thread_name_prefix=f"nbexec-io-{who[:6]}"))
            return lanes

    def capped(self, asked: float | None) -> float:
        """The time limit of a run: the client's, never above the operator's."""
        return min(asked, self.config.timeout) if asked else self.config.timeout

    # -- sessions ---------------------------------------------------------------------------------------

    def new_session(self, who: str, store: ArtifactStore | None, shown: Callable[[str], str] = str,
                    config: SandboxConfig | None = None, place: list[int] | None = None) -> Session:
        """A new session of ``who`` (with ``config``: the service's policy with the image the client chose); its
        files' URLs use the id ``shown`` makes of its id (see identity.View). ``place``: the one `making` holds
        for it, handed to the session as it is registered (counted once, never twice nor not at all)."""
        session_id = uuid.uuid4().hex
        folder = self._folder(f"session-{session_id}")
        session = self.sessions.create(session_id=session_id, output_dir=folder, config=config, owner=who,
                                       store=_served(store, f"/v1/sessions/{shown(session_id)}", folder))
        self._register(session, who, place)
        return session

    def _register(self, session: Session, who: str, place: list[int] | None) -> None:
        with self._lock:
            self._owners[session.id] = who
            if place and place[0]:
                place[0] = 0
                self._release_place(who)

    def _release_place(self, who: str) -> None:
        self._making[who] -= 1
        if not self._making[who]:
            del self._making[who]

    def restore_session(self, who: str, snapshot_id: str, store: ArtifactStore | None,
                        shown: Callable[[str], str] = str, place: list[int] | None = None) -> Session:
        """A new session of ``who`` from their snapshot ``snapshot_id`` (SnapshotError when it is not theirs)."""
        session_id = uuid.uuid4().hex
        folder = self._folder(f"session-{session_id}")
        session = self.sessions.restore(snapshot_id, owner=who, session_id=session_id, output_dir=folder,
                                        store=_served(store, f"/v1/sessions/{shown(session_id)}", folder),
                                        policy=self.config)  # what the service offers now, not then
        self._register(session, who, place)
        return session

    def session(self, who: str, session_id: str) -> Session | None:
        with self._lock:
            if self._owners.get(session_id) != who:
                return None
        try:
            return self.sessions.get(session_id)  # SessionPendingError, SessionLostError: a kept one (see open)
        except SessionNotFoundError:
            return None

    def session_folder(self, session: Session) -> Path | None:
        return session.output_dir

    def live_for(self, who: str) -> int:
        """Sessions and held sandboxes of ``who`` (with those being made or found again): one cap counts both."""
        live = self._live_ids()
        with self._lock:
            return self._live_locked(who, live)

    def _live_ids(self) -> set[str]:
        # Adopting ones first: one adopted in between is then in both, never in neither.
        adopting = self.sessions.adopting()
        return adopting | set(self.sessions.ids())

    def _live_locked(self, who: str, live: set[str]) -> int:
        return self.held.count(who) + self._making.get(who, 0) + sum(
            1 for sid, o in self._owners.items() if o == who and sid in live)

    @contextlib.contextmanager
    def making(self, who: str, cap: int) -> Iterator[list[int]]:
        """Hold one of ``who``'s ``cap`` places while a session is made for it (a restore starts a sandbox and
        replays): taken with the check, so concurrent restores cannot all pass it; SessionLimitError when none
        is free. What it yields is the place: give it to new_session or restore_session, which hand it over."""
        live = self._live_ids()
        with self._lock:
            if self._live_locked(who, live) >= cap:
                raise SessionLimitError(f"{cap} sessions are live for this token; delete one")
            self._making[who] = self._making.get(who, 0) + 1
        place = [1]
        try:
            yield place
        finally:
            with self._lock:
                if place[0]:
                    place[0] = 0
                    self._release_place(who)

    def delete_session(self, session_id: str) -> None:
        with contextlib.suppress(SessionNotFoundError):
            self.sessions.close(session_id)
        with self._lock:
            self._owners.pop(session_id, None)

    # -- one-shot results -------------------------------------------------------------------------------

    def one_shot(self, execution_id: str, store: ArtifactStore | None, shown: Callable[[str], str] = str,
                 config: SandboxConfig | None = None) -> Session:
        """A throwaway session for one execution (so a client that leaves can interrupt it); no I/O yet. Its
        files' URLs use the id ``shown`` makes of ``execution_id``; ``config`` as for ``new_session``."""
        folder = self._folder(f"run-{execution_id}")
        return Session(config or self.config, output_dir=folder, ttl=None, session_id=execution_id,
                       store=_served(store, f"/v1/executions/{shown(execution_id)}", folder))

    def keep(self, who: str, execution_id: str, session: Session) -> None:
        """Record a one-shot run as it starts: shutdown interrupts it, and its files belong to ``who``."""
        assert session.output_dir is None or session.output_dir == self._folder(f"run-{execution_id}")
        with self._lock:
            if self._closed:  # shutdown took its list of runs to stop: one starting now would outlive the process
                raise ShuttingDownError("the node is shutting down")
            self._results[execution_id] = _Kept(who, self._folder(f"run-{execution_id}"), session)

    def finish_one_shot(self, execution_id: str) -> None:
        """Stop the run's sandbox and start the clock on its files."""
        with self._lock:
            kept = self._results.get(execution_id)
        if kept is None:
            return
        self.source.warm_up(kept.session.config)  # the throwaway session took a pooled sandbox: start its replacement
        kept.session.close()
        with self._lock:  # with expire_result's check: a batch deleted now is never missed
            kept.expires = 0.0 if kept.doomed else time.monotonic() + self.result_ttl

    def expire_result(self, execution_id: str) -> None:
        """Let the next sweep delete a run's folder now, or once it finishes (a deleted batch's items)."""
        with self._lock:
            kept = self._results.get(execution_id)
            if kept is not None and kept.expires != math.inf:
                kept.expires = 0.0
            elif kept is not None:  # still running (a cancel that waited no longer)
                kept.doomed = True

    def interrupt_run(self, who: str, execution_id: str) -> str:
        """Interrupt ``who``'s one-shot run ``execution_id``: "interrupted", "finished" (nothing left to stop), or
        "unknown" (no such run of ``who``: another owner's is unknown too)."""
        with self._lock:
            kept = self._results.get(execution_id)
        if kept is None or kept.owner != who:
            return "unknown"
        if kept.expires != math.inf or kept.session.status == "closed":
            return "finished"
        kept.session.interrupt()
        return "interrupted"

    def result_folder(self, who: str, execution_id: str) -> Path | None:
        with self._lock:
            kept = self._results.get(execution_id)
        if kept is None or kept.owner != who or kept.expires <= time.monotonic():
            return None
        return kept.folder

    # -- retention --------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Delete the folders of expired results and of sessions that were reaped; release idle held sandboxes."""
        self.held.reap()
        now = time.monotonic()
        live = set(self.sessions.ids()) | self.sessions.kept()  # a kept one's owner hears 503, then 410
        with self._lock:
            expired = [k for k, kept in self._results.items() if kept.expires <= now]
            gone = [sid for sid in self._owners if sid not in live]
            folders = [self._results.pop(k).folder for k in expired]
            for sid in gone:
                del self._owners[sid]
                folders.append(self._folder(f"session-{sid}"))
        for folder in folders:
            remove_tree(folder)
        self.sweep_snapshots()

    def sweep_snapshots(self) -> None:
        """Remove the folders of snapshot takes whose process died (a node killed mid-take)."""
        try:
            snapshotblobs.store_for(self.sessions.state_dir).sweep()
        except (NbexecError, OSError) as exc:
            log.warning("could not sweep the snapshot store: %s", exc)

    async def sweep_forever(self) -> None:
        interval = max(0.2, min(30.0, self.result_ttl / 4, self.session_ttl / 4))
        await asyncio.to_thread(self.sweep_snapshots)  # at start: a take the last run of the node left
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.sweep)
            except Exception:  # the janitor must outlive one bad folder
                log.exception("could not delete expired folders")

    def close(self) -> None:
        """Shutdown: interrupt every run, close every session and held sandbox, stop the threads, delete every
        folder."""
        self.held.close()
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            one_shots = [kept.session for kept in self._results.values()]
        kept = self.state_dir is not None  # durable sessions run on, for the next start to find again
        live = [*one_shots, *(s for sid in ([] if kept else self.sessions.ids())
                              if (s := _get(self.sessions, sid)) is not None)]
        for session in live:
            with contextlib.suppress(Exception):
                session.interrupt()
        closers = [threading.Thread(target=session.close, daemon=True) for session in live]
        for closer in closers:
            closer.start()
        deadline = time.monotonic() + self.config.interrupt_grace + 10
        for closer in closers:
            closer.join(max(0.0, deadline - time.monotonic()))
        if not kept:
            self.sessions.close_all()
        for lane in lanes:
            lane.runs.shutdown(wait=False, cancel_futures=True)
            lane.io.shutdown(wait=False, cancel_futures=True)
        self.source.close()  # under SIGTERM uvicorn ends the process without atexit handlers: nothing else would
        if self.root is not None and kept:
            self._remove_results()
        elif self.root is not None:
            remove_tree(self.root)


def _get(manager: SessionManager, session_id: str) -> Session | None:
    try:
        return manager.get(session_id)
    except SessionNotFoundError:
        return None
