"""Stateful sessions: one kernel kept across runs, its notebook growing cell by cell, /mnt/data kept for its life.

A Session is used by one caller at a time (its methods take a lock). Idle sessions are closed after their TTL
by one background reaper; every live session is closed at interpreter exit."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbformat import NotebookNode

from nbexec import notebook
from nbexec import packages as installs
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, SandboxError, SessionClosedError, SessionDeadError, SessionLostError
from nbexec.files import artifacts, folders, space, statefolder
from nbexec.files.statefolder import StateFolder
from nbexec.files.workdir import remove_tree
from nbexec.kinds import RestoredBy, SessionStatus
from nbexec.notebook import papermill
from nbexec.overrides import ConfigOverrides, Unpack
from nbexec.result import CellError, ExecutionResult, Package
from nbexec.sandbox.source import Capability, SandboxHandle, SandboxSource
from nbexec.stores.storage import ArtifactStore, LocalStore

from . import budget, cells, collect, durable, languagecheck, reaper, rules, shell, sources, traces, widgets
from .budget import OutputCallback
from .hibernation import Hibernation
from .sessionfiles import SessionFiles

log = logging.getLogger(__name__)

DEFAULT_TTL = 20 * 60.0


class Session(rules.LiveRules, reaper.SessionBase, SessionFiles, Hibernation):
    """A kernel that keeps its state between runs: the one engine that runs cells and builds results.

    Starts on first use or on ``start()``. Its output folder is opened once and written only through that
    descriptor; with ``keep_files=False``, ``close()`` also deletes it (services that have delivered the results).
    ``one_shot=True`` makes the throwaway session behind execute_notebook(): its sandbox comes warm from the
    pool, its one run freezes the sandbox before the files are collected (one moment) and hands it back as soon
    as they are copied, and the session is closed with the result."""

    def __init__(self, config: SandboxConfig | None = None, *, output_dir: str | Path | None = None,
                 ttl: float | None = DEFAULT_TTL, session_id: str | None = None,
                 store: ArtifactStore | None = None, keep_files: bool = True, one_shot: bool = False,
                 state_dir: str | Path | None = None, owner: str = "",
                 hibernate_after: float | None = None, **overrides: Unpack[ConfigOverrides]) -> None:
        self.id = session_id or (uuid.uuid4().hex[:16] if one_shot else uuid.uuid4().hex)
        self.state_dir, self.owner = (None if one_shot else state_dir), owner  # durable: see `durable`
        self._state: StateFolder | None = None
        self.hibernate_after = None if one_shot else hibernate_after  # idle seconds before it sleeps (hibernation)
        self._asleep: str | None = None
        self._memory: dict[str, Any] | None = None
        self._memory_dir: Path | None = None
        self._woke: tuple[RestoredBy, tuple[str, ...]] | None = None
        self._config = config.replace(**overrides) if config is not None and overrides else config
        self._overrides = overrides  # without a config: applied to from_env() on first use
        self._requested_dir = output_dir
        self.ttl = ttl
        self.keep_files = keep_files
        self.one_shot = one_shot
        self.output_dir: Path | None = None
        self._folder: folders.OutputFolder | None = None
        self._disk: space.Reservation | None = None  # its output folder's share, when not where sandboxes hold it
        self.notebook: NotebookNode = notebook.empty(
            self._config.language if self._config else overrides.get("language") or "python")
        self.created_at = time.time()
        self.last_activity = time.monotonic()
        self._sandbox: SandboxHandle | None = None
        self._start_s: float | None = None  # how long start() took, reported by the first run
        self._dead_reason: str | None = None
        self._closed = False
        self._handed_back = threading.Event()  # set once a closed session's sandbox is gone or handed to teardown
        self._lock = threading.RLock()
        self.store: ArtifactStore = store if store is not None else LocalStore()
        self._uploaded: dict[str, str] = {}  # name -> sha256 last stored: only new and changed files are sent
        self._copied: artifacts.Known = {}  # files of /mnt/data copied to output_dir/data: only changes are copied
        self._hashed: artifacts.Known = {}  # files of /mnt/data hashed by listings: only changes are hashed again
        self._displays: budget.Displays = {}  # display ids of every run, so an update reaches earlier cells
        self._widgets = widgets.WidgetState()  # widget models of every run, so an update reaches earlier ones

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def status(self) -> SessionStatus:
        """new, ready, busy, asleep, dead or closed."""
        if self._asleep and not self._closed:
            return "asleep"
        return self._status(dead=bool(self._dead_reason), started=self._sandbox is not None)

    def start(self) -> Session:
        """Start the sandbox now (otherwise the first run starts it)."""
        with self._lock:
            self._check_usable()
            self._wake_if_asleep()
            if self._sandbox is None:
                started = time.monotonic()
                opened = self._open_output()
                purpose = "oneshot" if self.one_shot else "session"
                try:
                    with traces.span("nbexec.acquire", {"nbexec.purpose": purpose}):
                        self._sandbox = self._source().acquire(self.config, claim=self._hold(), purpose=purpose)
                except BaseException:
                    if opened is not None:  # nothing of a session that never started stays (nor a folder it made)
                        self._close_folder(remove=opened)
                        self.output_dir = None
                    raise
                self._start_s = time.monotonic() - started
                if not self.one_shot:
                    reaper.register(self)
                self._keep("ready")
            return self

    @classmethod
    def resume(cls, session_id: str, *, state_dir: str | Path, store: ArtifactStore | None = None,
               keep_files: bool = True, hibernate_after: float | None = None,
               policy: SandboxConfig | None = None) -> Session:
        """The durable session ``session_id`` its state folder keeps, found again by a new process: the same
        kernel (its variables) and /mnt/data, under ``policy`` when given (see `durable.under`: today's limits
        and permissions); SessionNotFoundError without a record, SessionLostError when its sandbox is gone or
        needs what ``policy`` no longer gives."""
        folder = durable.hold(state_dir)
        record = durable.load(folder, session_id)
        try:
            config = record.config if policy is None else durable.under(policy, record.config)
            sandbox = None if record.asleep == "checkpoint" else \
                sources.for_config(config).adopt(config, record.sandbox)
        except (SandboxError, ConfigError) as exc:
            raise SessionLostError(f"Session {session_id} cannot be found again: {exc}") from exc
        session = cls(config, session_id=session_id, ttl=record.ttl, store=store, keep_files=keep_files,
                      state_dir=state_dir, owner=record.owner, hibernate_after=hibernate_after)
        session._state, session._sandbox, session.notebook = folder, sandbox, record.notebook
        session._asleep, session._memory = record.asleep, record.memory
        if record.asleep == "checkpoint":
            session._memory_dir = folder.child(f"memory-{session_id}")
        session.created_at = record.created_at
        if record.output_dir is not None:
            session.output_dir = Path(record.output_dir)
            session._folder = folders.OutputFolder.open(session.output_dir)
        reaper.register(session)
        return session

    def _hold(self) -> str:
        """The claim of the state folder this durable session is kept in ("" when not durable)."""
        if self.state_dir is None:
            return ""
        if not self._source().offers(Capability.DURABLE):  # its record could never find the sandbox again
            raise self._source().refusal(Capability.DURABLE)
        if not statefolder.valid_name(self.id + durable.SUFFIX):
            raise ConfigError(f"a durable session's id must be letters, digits and _.- (not {self.id!r})")
        self._state = durable.hold(self.state_dir)
        return self._state.claim

    def _keep(self, status: str) -> None:
        """Write this durable session's record to its state folder (see `durable`)."""
        if self._state is not None and (self._sandbox is not None or self._asleep):
            durable.save(self._state, durable.Record(
                self.id, self.owner, self.config, self._sandbox.describe() if self._sandbox else {},
                str(self.output_dir) if self.output_dir else None, self.notebook, self.ttl, status, self.created_at,
                self._asleep, self._memory))

    def _open_output(self) -> bool | None:
        """Make or open the output folder on the first start: None when it was open already, else whether this
        call made the folder. A requested one on another filesystem than the default output folder (where each
        sandbox's share is held) is admitted first (see `nbexec.files.space`)."""
        if self.output_dir is not None:
            return None
        made = self._requested_dir is None or not os.path.lexists(self._requested_dir)
        if self._requested_dir is not None:
            self._disk = space.reserve_outputs(self.config, Path(self._requested_dir).absolute())
        name = self.id if self.one_shot else f"session-{uuid.uuid4().hex}"
        try:
            self.output_dir = folders.output_dir(self._requested_dir, name)
            self._folder = folders.OutputFolder.open(self.output_dir)
        except BaseException:
            self._close_folder(remove=False)
            self.output_dir = None
            raise
        return made

    def _source(self) -> SandboxSource:
        return sources.for_config(self.config)

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
        """Stop the sandbox (a replay under way ends first). Idempotent; files stay unless ``keep_files`` is False."""
        self._end_calls()
        with self._lock:
            closing, self._closed = not self._closed, True
            sandbox, self._sandbox = (self._sandbox, None) if closing else (None, self._sandbox)
        if not closing:  # closed by another thread, or a one-shot's end, handing its sandbox back now: returning
            if not self._handed_back.is_set():  # sooner would let a process exit mid-removal
                self._handed_back.wait(self.config.startup_timeout)
            return
        try:
            reaper.forget(self)
            if self._asleep == "checkpoint" and self._memory is not None and self._memory_dir is not None:
                self._source().discard(self._memory, self._memory_dir)  # its files and memory, not woken
            self._forget_memory()
            if self._state is not None:
                durable.forget(self._state, self.id)
            if sandbox is not None:
                self._source().release(sandbox, wait=True)
            self._close_folder(remove=not self.keep_files)
        finally:
            self._handed_back.set()

    def _close_at_exit(self) -> None:
        """At interpreter exit: a durable session is left to its state folder (for `resume`); others close."""
        if self._state is None:
            self.close()

    def _close_folder(self, *, remove: bool) -> None:
        disk, self._disk = self._disk, None
        if disk is not None:
            disk.release()
        folder, self._folder = self._folder, None
        if folder is None:
            return
        if remove:
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
                except SessionLostError:  # its node went away with its files: a fresh, empty one
                    kept = []
                finally:
                    self._source().release(sandbox, wait=True)
            self._dead_reason = None
            self.start()
            if sandbox is not None:
                self._copy_in(kept)

    def interrupt(self) -> None:
        """Interrupt the running cell, or a wake's whole replay (safe to call from another thread)."""
        self._stop_wake()
        sandbox = self._sandbox
        if sandbox is not None:
            sandbox.interrupt()

    # -- running code -------------------------------------------------------------------------------

    def install(self, *requirements: str) -> tuple[Package, ...]:
        """Fetch ``requirements`` on the host and install them in the sandbox now (see `nbexec.packages`);
        what became of each is returned (and kept in the notebook's metadata). Refusals are data, not errors."""
        with self._lock:
            languagecheck.check_run(self.config, notebook.empty(), requirements, 0)
            self.start()
            assert self._sandbox is not None
            self.last_activity, self._stopping = time.monotonic(), threading.Event()  # interrupt, close: pip stops
            try:
                with installs.prepared(self._sandbox, self.notebook, self.config, requested=requirements,
                                       first_index=len(self.notebook.cells), stop=self._stopping) as records:
                    pass
            finally:
                self.last_activity, self._stopping = time.monotonic(), None
            return tuple(records)

    def run(self, code: str, *, timeout: float | None = None, on_output: OutputCallback | None = None,
            packages: Sequence[str] = ()) -> ExecutionResult:
        """Run ``code`` as a new cell of the session's notebook and return that cell's result (``packages`` are
        installed first, as `install` does; the cell's own pip lines are served the same way)."""
        return self.run_notebook(notebook.build(code, self.config.language), timeout=timeout, on_output=on_output,
                                 packages=packages)

    def shell(self, command: str, *, timeout: float | None = None) -> ExecutionResult:
        """Run a shell command in the sandbox, as a cell (see `nbexec.engine.shell`): its output budgeted like a
        cell's, its ``exit_code``, and ``error.kind`` "exit" or "timeout" when it failed."""
        languagecheck.check_shell(self.config)  # Python kernels only
        return shell.run(self.run, self.config.timeout, command, timeout)

    @traces.execution
    def run_notebook(self, nb: NotebookNode | str | os.PathLike[str], *, timeout: float | None = None,
                     on_output: OutputCallback | None = None, packages: Sequence[str] = (),
                     allow_errors: bool = False) -> ExecutionResult:
        """Run the code cells of ``nb`` (a notebook, or a .ipynb/.py path: see `notebook.source`) as new cells of
        the session's notebook, until the first failure (``allow_errors``: every cell, each error kept; the result
        still fails, with the first), and return their result. The session's first run takes ``nb`` whole (its
        metadata too). ``packages`` and the cells' pip lines are provided first (see `nbexec.packages`)."""
        started, nb = time.monotonic(), notebook.source(nb, default=self.config.language)
        with self._held_for(timeout):
            budget.admit(self.config, self.notebook, nb, self.one_shot)  # each cell's size, then the session's code
            said = languagecheck.checked(self.config, nb, packages, len(self.notebook.cells))
            limit, deadline = self._wake_for(timeout)  # one limit: the wake and packages in it, cells get the rest
            sandbox = self._sandbox
            assert sandbox is not None and self._folder is not None
            self.last_activity = time.monotonic()
            index = len(self.notebook.cells)
            if index == 0:
                self.notebook = nb
                if sandbox.language_info:
                    nb.metadata["language_info"] = sandbox.language_info
            else:
                self.notebook.cells.extend(notebook.fit_cells(self.notebook, nb.cells))
            self._keep("busy")
            preparing = installs.prepared(sandbox, self.notebook, self.config, requested=packages,
                                          first_index=index, deadline=deadline, stop=self._stopping)
            with traces.entered(preparing, "nbexec.packages") as installed:
                left = self._time_left(deadline, limit, bool(installed))
                run = self._run_cells(sandbox, index, started, left, on_output, [] if allow_errors else None)
            notes = said + run.notes + (
                (f"providing packages took {limit - left:.1f} s of the {limit:g} s time limit; the cells had the rest",)
                if installed and left < limit else ())
            result = self._result(sandbox, dataclasses.replace(run, packages=tuple(installed), notes=notes))
            if self._woke is not None:  # this call woke it: said, with whatever the replay found
                (how, woke), self._woke = self._woke, None
                result = dataclasses.replace(result, restored=how, notes=(*woke, *result.notes))
            self._keep("dead" if self._dead_reason else "ready")
            return result

    def _run_cells(self, sandbox: SandboxHandle, index: int, started: float, timeout: float,
                   on_output: OutputCallback | None, raised: list[CellError] | None) -> collect.Run:
        began = time.monotonic()
        papermill.start(self.notebook, index)
        if timeout > 0:
            error, dropped = cells.run_cells(sandbox, self.notebook, self.config.replace(timeout=timeout),
                                              first_index=index, on_output=on_output, displays=self._displays,
                                              widget_state=self._widgets, raised=raised)
        else:  # the wake or the packages took the whole time limit (or the wake was interrupted): no cell starts
            error, dropped = self._no_time_left(index), 0
        # However long the session lives, its notebook stays within one run's budgets (the oldest outputs go first).
        kept = budget.keep_recent(self.notebook, index, self.config.max_output_bytes + self.config.max_display_bytes,
                                  self._displays)
        ran = time.monotonic()
        self.last_activity = ran
        error, exit_cell, exit_notes = papermill.settle_exit(self.notebook, error)
        execution_id = self.id if self.one_shot else f"{self.id}-{index}"
        self.notebook.metadata.setdefault("nbexec", {}).update(
            {"execution_id": execution_id, "ok": error is None and not raised,
             **({"node": sandbox.node} if sandbox.node else {})})
        timings = {"run_s": ran - began}
        if self._start_s is not None:  # the first run reports the start of the sandbox it waited for
            timings = {"sandbox_s": self._start_s, "run_s": ran - began}
            started, self._start_s = started - self._start_s, None
        if error is not None and error.kind in ("timeout", "kernel_died", "oom", "limit", "protocol") \
                and not sandbox.state().running:
            self._dead_reason = error.evalue
        return collect.Run(execution_id=execution_id, first_cell=index, error=error, dropped=dropped,
                           started=started, timings=timings, exit_cell=exit_cell, raised=tuple(raised or ()),
                           notes=(*self._widgets.take_notes(), *((kept,) if kept else ()), *exit_notes,
                                  *cells.unread_notes(self.notebook, index)))

    def _result(self, sandbox: SandboxHandle, run: collect.Run) -> ExecutionResult:
        assert self._folder is not None
        if self.one_shot:
            sandbox.freeze() if sandbox.offers(Capability.FREEZE) else sandbox.kill()  # nothing runs while copied
        gathered = collect.gather(self.notebook, run, sandbox, self._folder,
                                  notebook_name="notebook.ipynb" if self.one_shot else "session.ipynb",
                                  known=self._copied)
        if self.one_shot:  # handed back before the uploads, so the teardown and refill do not wait for them
            with self._lock:
                self._closed, self._sandbox = True, None
            try:
                self._source().release(sandbox, wait=False)
            finally:
                self._handed_back.set()
        try:
            return collect.result(self.notebook, run, gathered, self._folder, self.store, already=self._uploaded)
        finally:
            if self.one_shot:
                self._close_folder(remove=False)

    def __repr__(self) -> str:
        return f"<Session {self.id} {self.status}>"


