"""Idle sessions sleep instead of dying (a base of `session.Session`, driven by the reaper's ``hibernate_after``).

`hibernate` first asks the source to keep the sandbox's memory (`SandboxSource.hibernate`: a checkpoint, where the
runtime can); when it cannot (None, or an error: logged), the sandbox itself sleeps (`SandboxHandle.sleep`: no
process runs, /mnt/data and the container kept as they are). Either way no memory or CPU is used until the next
call, which wakes it (`_wake_if_asleep`): by the source's ``wake`` from the checkpoint, or by starting a fresh
kernel over the kept files and REPLAYING the session's executed code cells in order, silently.

What happened is never hidden: the next run's result says ``restored="checkpoint"`` or ``"replay"``, and its notes
name every replayed cell that did not end as it first did (an error now, or no longer), a cell that timed out, and
a checkpoint that could not be restored (then replayed: files the checkpoint held are named as lost).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from nbformat import NotebookNode

from nbexec import errors
from nbexec.config import SandboxConfig
from nbexec.errors import NbexecError, SessionBusyError, SessionLostError
from nbexec.files.folders import work_root
from nbexec.files.statefolder import StateFolder
from nbexec.files.workdir import WORKDIR_PREFIX, remove_tree
from nbexec.kinds import RestoredBy
from nbexec.overrides import Unpack
from nbexec.result import CellError
from nbexec.sandbox.source import Capability, SandboxHandle, SandboxSource

from . import durable, snapshotblobs, snapshots
from .options import RestoreOptions

log = logging.getLogger(__name__)
S = TypeVar("S", bound="Hibernation")
WAKE_GRACE = 1.0  # seconds a restored kernel's waits always get: an honest one is ready in milliseconds
_NO_TIME_LEFT = ("Providing the packages asked for used the execution's whole time limit, so no cell ran. Ask for "
                 "fewer or cached packages, or raise the limit (--timeout / NBEXEC_TIMEOUT).")
_WAKE_TOOK_ALL = ("Waking the session from its sleep (restoring its memory, or starting its kernel and replaying its "
                  "cells) used the execution's whole time limit, so no cell ran; the notes name any cells not replayed "
                  "(what they made is missing). Raise the limit (--timeout / NBEXEC_TIMEOUT) for a session that wakes "
                  "slowly.")


def replay(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig, *, deadline: float,
           stop: threading.Event) -> tuple[list[str], str]:
    """Run the executed code cells of ``nb`` again in order (silently, outside the history). The cells share one
    budget, what is left before ``deadline`` (a run's own limit); past it, or once ``stop`` is set (an interrupt,
    close), the replay ends there and the cells not replayed are named. Notes on each cell that ended otherwise
    than it first did, and how the replay ended: "", "timeout" or "interrupted"."""
    done = threading.Event()
    threading.Thread(target=_interrupting, args=(sandbox, stop, done), name="nbexec-replay-stop", daemon=True).start()
    try:
        return _replay_cells(sandbox, nb, config, deadline, stop)
    finally:
        done.set()


def _interrupting(sandbox: SandboxHandle, stop: threading.Event, done: threading.Event) -> None:
    """Once ``stop`` is set, interrupt the replayed cell every half second until the replay is done: an interrupt
    that reached the kernel just before its cell began is not lost."""
    while not done.is_set():
        if stop.wait(0.2) and not done.wait(0.5):
            with contextlib.suppress(NbexecError):
                sandbox.interrupt()


def _replay_cells(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig, deadline: float,
                  stop: threading.Event) -> tuple[list[str], str]:
    notes: list[str] = []
    executed = [(i, c) for i, c in enumerate(nb.cells)
                if c.get("cell_type") == "code" and c.get("execution_count") is not None]
    for position, (index, cell) in enumerate(executed):
        failed_before = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        left = min(deadline - time.monotonic(), config.cell_timeout or math.inf)
        reply = sandbox.run_hidden(str(cell.get("source", "")), left) if left > 0 and not stop.is_set() else None
        if reply is None or stop.is_set():  # a cell past its own cell_timeout ends the replay, not the run
            ended = "interrupted" if stop.is_set() else "timeout" if deadline - time.monotonic() < 0.1 else ""
            why = {"interrupted": "was interrupted", "timeout": "ran out of the run's time limit",
                   "": "stopped: the cell ran past its cell time limit"}[ended]
            notes.append(f"the replay {why} at cell {index}: cells "
                         f"{', '.join(str(i) for i, _ in executed[position:])} were not (fully) replayed")
            return notes, ended
        failed_now = reply.get("status") != "ok"
        if failed_now and not failed_before:
            notes.append(f"replaying cell {index} raised {str(reply.get('ename'))[:100]}: "
                         f"{str(reply.get('evalue'))[:300]} (it had succeeded): what it made is missing")
        elif failed_before and not failed_now:
            notes.append(f"replaying cell {index} succeeded (it had failed): the state may differ")
    return notes, ""


def _patience(deadline: float, stop: threading.Event) -> Callable[[], None]:
    """The check a checkpoint wake's waits call: WakeStoppedError once the run's ``deadline`` passed or ``stop``
    is set (an interrupt, close), never in the first WAKE_GRACE s (the session sleeps on, nothing lost)."""
    began: list[float] = []

    def check() -> None:
        now = time.monotonic()
        began[:] = began or [now]
        if (stop.is_set() or now > deadline) and now - began[0] > WAKE_GRACE:
            why = "was interrupted" if stop.is_set() else "ran out of the run's time limit"
            raise errors.WakeStoppedError(f"the wake {why} before the kernel was back; nothing ran, and the session "
                                   "sleeps on with its memory and files")
    return check


class Hibernation:
    """The sleep and wake-up of a session (see the module docstring)."""

    id: str
    hibernate_after: float | None
    last_activity: float
    notebook: NotebookNode
    _lock: threading.RLock
    _closed: bool
    _sandbox: SandboxHandle | None
    _dead_reason: str | None
    _state: StateFolder | None
    _asleep: str | None  # "checkpoint" or "replay": how it will wake
    _memory: dict[str, Any] | None  # the source's record of the kept memory (checkpoint)
    _memory_dir: Path | None
    _woke: tuple[RestoredBy, tuple[str, ...]] | None  # (how, notes) for the next run's result
    _stopping: threading.Event | None = None  # set while a wake or restore replays: an interrupt or close sets it
    _wake_ended: str | None = None  # how this run's wake ended: None (no wake), "", "timeout" or "interrupted"

    @property
    def config(self) -> SandboxConfig:
        raise NotImplementedError

    def _source(self) -> SandboxSource:
        raise NotImplementedError

    def _keep(self, status: str) -> None:
        raise NotImplementedError

    def _hold(self) -> str:
        raise NotImplementedError

    def _check_usable(self) -> None:
        raise NotImplementedError

    def hibernate(self, *, idle_for: float = 0.0) -> bool:
        """Free the session's memory and CPU now, keeping its state (see the module docstring); False when it
        cannot sleep (closed, dead, not started, already asleep, its sandbox cannot, or it was used within the
        last ``idle_for`` seconds: checked under its lock, so a call that just ended keeps it awake)."""
        with self._lock:
            sandbox = self._sandbox
            if self._closed or sandbox is None or self._asleep or self._dead_reason \
                    or time.monotonic() - self.last_activity < idle_for or not sandbox.offers(Capability.SLEEP):
                return False
            folder, source = self._folder_for_memory(), self._source()
            try:
                record = source.hibernate(sandbox, folder) if source.offers(Capability.CHECKPOINT) else None
            except NbexecError as exc:
                log.warning("session %s: its memory could not be kept (%s); it will be replayed", self.id, exc)
                record = None
            if record is not None:
                self._sandbox, self._asleep, self._memory = None, "checkpoint", record
            else:
                try:
                    sandbox.sleep()
                except NbexecError as exc:
                    log.warning("session %s cannot sleep: %s", self.id, exc)
                    return False
                self._asleep = "replay"
            self._keep("asleep")
            return True

    def _folder_for_memory(self) -> Path:
        if self._memory_dir is None:
            if self._state is not None:
                self._memory_dir = self._state.child(f"memory-{self.id}")
            else:
                self._memory_dir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-memory-",
                                                         dir=work_root()))
        return self._memory_dir

    def _wake_if_asleep(self, deadline: float | None = None, run_stop: threading.Event | None = None) -> None:
        """Wake a sleeping session before a call uses it (the caller holds the lock), by ``deadline`` (a run's;
        else the config's time limit from now): its replay has what is left, as one budget. ``run_stop``: the
        run's event an interrupt sets (kept after the wake), else one of the wake's own."""
        if self._asleep is None:
            return
        how: RestoredBy = "checkpoint" if self._asleep == "checkpoint" else "replay"
        started, notes = time.monotonic(), list[str]()
        deadline = started + self.config.timeout if deadline is None else deadline
        stopping = self._stopping = run_stop or threading.Event()  # before the sandbox starts: an interrupt stops it
        try:
            if how == "checkpoint":
                how = self._restore(deadline, stopping, notes)
            else:
                assert self._sandbox is not None
                self._sandbox.awake()
            assert self._sandbox is not None
            if how == "replay":
                notes += self._replay(deadline)
            else:  # a restore that came back (in its first second): what it met stops the run after it
                self._wake_ended = "interrupted" if stopping.is_set() else \
                    "timeout" if deadline - time.monotonic() < 0.1 else ""
        except errors.WakeStoppedError:
            raise  # still asleep, its checkpoint kept: nothing is lost
        except NbexecError as exc:
            self._dead_reason = f"it could not wake from its sleep: {exc}"
            self._asleep = None
            raise SessionLostError(f"Session {self.id} {self._dead_reason}") from exc
        finally:
            self._stopping = run_stop
        self._asleep, self._memory = None, None
        self._forget_memory()
        notes.insert(0, f"the session was asleep; its memory came back by {how} in "
                        f"{time.monotonic() - started:.2f} s")
        self._woke = (how, tuple(notes))
        self._keep("ready")

    def _restore(self, deadline: float, stopping: threading.Event, notes: list[str]) -> RestoredBy:
        """Wake from the checkpoint, its waits ended by ``deadline`` and ``stopping`` (see `_patience`); when it
        cannot be restored, a fresh sandbox (to replay into). How it woke: "checkpoint" or "replay"."""
        assert self._memory is not None and self._memory_dir is not None
        try:
            self._sandbox = self._source().wake(self.config, self._memory, self._memory_dir,
                                                check=_patience(deadline, stopping), deadline=deadline)
            return "checkpoint"
        except errors.WakeStoppedError:
            self._sandbox = None
            raise
        except NbexecError as exc:
            notes.append(f"its checkpoint could not be restored ({exc}): a fresh sandbox replayed its cells, "
                         "and the files of /mnt/data the checkpoint held are lost")
        with contextlib.suppress(NbexecError):  # its working folder: no sandbox will use it again
            self._source().discard(self._memory, self._memory_dir)
        self._sandbox = self._source().acquire(self.config, purpose="session", claim=self._hold())
        return "replay"

    def _replay(self, deadline: float) -> list[str]:
        """Replay the notebook into the sandbox by ``deadline`` (see `replay`); how it ended is kept for the run."""
        assert self._sandbox is not None and self._stopping is not None
        notes, ended = replay(self._sandbox, self.notebook, self.config, deadline=deadline, stop=self._stopping)
        # Less than a tenth of a second left is no time for a cell: the wake is what used the limit.
        self._wake_ended = ended or ("timeout" if deadline - time.monotonic() < 0.1 else "")
        return notes

    # -- a run's time limit covers its wake ---------------------------------------------------------

    @contextlib.contextmanager
    def _held_for(self, timeout: float | None) -> Iterator[None]:
        """The session's lock for a run, waited for within the run's limit: a sleep under way (or another caller)
        may hold it, and the run then ends when its limit would have (SessionBusyError), never later."""
        if not self._lock.acquire(timeout=timeout or self.config.timeout):
            raise SessionBusyError("the session stayed busy (another call, or being put to sleep) for the whole "
                                   "time limit of this run; nothing ran")
        try:
            yield
        finally:
            self._lock.release()

    def _wake_for(self, timeout: float | None) -> tuple[float, float]:
        """Start the session for a run of ``timeout`` seconds (None: the config's): the run's limit and deadline.
        One limit covers the run: a wake (its replay) and the host's package work count inside it, and the cells
        get what is left."""
        self._check_usable()
        self._wake_ended, limit = None, timeout or self.config.timeout
        self._stopping = threading.Event()  # the wake's and the packages': an interrupt until the cells start
        if not self._asleep:  # a first start is reported apart (sandbox_s): the limit starts after it
            self.start()
            return limit, time.monotonic() + limit
        deadline = time.monotonic() + limit
        self._wake_if_asleep(deadline, self._stopping)
        self.start()
        return limit, deadline

    def _time_left(self, deadline: float, limit: float, spent: bool) -> float:
        """The seconds a run's cells get: none after a wake that used them or was interrupted (or an interrupt
        during the packages); all of ``limit`` when neither a wake nor the packages (``spent``) took any."""
        stopping, self._stopping = self._stopping, None  # the cells' interrupt is the kernel's from here
        if stopping is not None and stopping.is_set():
            self._wake_ended = "interrupted"
        if self._wake_ended:
            return 0.0
        if not spent and self._wake_ended is None:
            return limit
        return math.floor((deadline - time.monotonic()) * 10) / 10

    def _no_time_left(self, index: int) -> CellError:
        """Why no cell of a run started: its wake was interrupted or used its time limit, or its packages did."""
        ended, self._wake_ended = self._wake_ended, None
        if ended == "interrupted":
            return CellError("KeyboardInterrupt", "The run was interrupted before its cells started (while the "
                             "session woke from its sleep, or its packages were provided), so no cell ran.", (),
                             "exception", index)
        if ended == "timeout":
            return CellError("TimeoutError", _WAKE_TOOK_ALL, (), "timeout", index)
        return CellError("TimeoutError", _NO_TIME_LEFT, (), "timeout", index)

    def _stop_wake(self) -> bool:
        """Stop a wake's replay under way (from any thread): whether one was."""
        stopping = self._stopping
        if stopping is not None:
            stopping.set()
        return stopping is not None

    def _end_calls(self) -> None:
        """For close(): a run or a replay under way ends now (interrupted, its sandbox killed when the kernel does
        not let go within a second), so close never waits behind a run's limit."""
        replaying = self._stop_wake()
        if not replaying and self._lock.acquire(timeout=0.2):  # nothing runs: close goes on at once
            self._lock.release()
            return
        sandbox = self._sandbox
        if sandbox is None:
            return
        sandbox.interrupt()
        if self._lock.acquire(timeout=1.0):
            self._lock.release()
        else:
            sandbox.kill()

    # -- snapshots (see `snapshots`) -----------------------------------------------------------------

    state_dir: str | Path | None
    owner: str

    def snapshot(self, *, snapshot_dir: str | Path | None = None) -> str:
        """Keep this session's files and notebook as a snapshot (see `snapshots`); its id, restorable by the
        same ``owner`` with `from_snapshot` (or `fork`)."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            store = snapshotblobs.store_for(self.state_dir, snapshot_dir)
            return store.take(self.owner, self.config, self.notebook, self._sandbox)

    def fork(self: S, *, snapshot_dir: str | Path | None = None, **options: Unpack[RestoreOptions]) -> S:
        """A new session from a snapshot of this one (its files, and its memory by replay)."""
        options.setdefault("state_dir", self.state_dir)
        return self.from_snapshot(self.snapshot(snapshot_dir=snapshot_dir), owner=self.owner,
                                  snapshot_dir=snapshot_dir, **options)

    @classmethod
    def from_snapshot(cls: type[S], snapshot_id: str, *, owner: str = "", snapshot_dir: str | Path | None = None,
                      **options: Unpack[RestoreOptions]) -> S:
        """A new session started from snapshot ``snapshot_id`` of ``owner``: its files checked and put into
        /mnt/data, its notebook's executed cells replayed; the first run says ``restored="replay"`` and names
        any cell that replayed otherwise. SnapshotError for an unknown, another owner's or tampered snapshot."""
        restored = snapshotblobs.store_for(options.get("state_dir"), snapshot_dir).open(owner, snapshot_id)
        try:
            return cls._restored(restored, owner, options)
        finally:
            restored.release()  # a blob store's private download is gone once the files are in (or refused)

    @classmethod
    def _restored(cls: type[S], restored: snapshots.Restored, owner: str, options: RestoreOptions) -> S:
        policy = options.pop("policy", None)
        config = restored.config if policy is None else durable.within(policy, restored.config)
        session = cls(config, owner=owner, **options)  # type: ignore[call-arg, misc]
        try:
            session.start()
            assert session._sandbox is not None
            started = time.monotonic()
            snapshots.put_files(session._sandbox, restored)
            session.notebook = restored.notebook
            session._stopping = threading.Event()  # the restore's replay: one time limit, ended by an interrupt
            try:
                notes = session._replay(started + session.config.timeout)
            finally:
                session._stopping, session._wake_ended = None, None
            session._woke = ("replay", (f"restored from a snapshot: its memory came back by replay in "
                                        f"{time.monotonic() - started:.2f} s", *notes))
            session._keep("ready")
        except BaseException:
            session.close()
            raise
        return session

    def close(self) -> None:
        raise NotImplementedError

    def start(self) -> Any:
        raise NotImplementedError

    def _forget_memory(self) -> None:
        folder, self._memory_dir = self._memory_dir, None
        if folder is not None:
            remove_tree(folder)

