"""Idle sessions sleep instead of dying (a base of `session.Session`, driven by the reaper's ``hibernate_after``).

`hibernate` first asks the source to keep the sandbox's memory (`SandboxSource.hibernate`: a checkpoint, where the
runtime can); when it cannot (None, or an error: logged), the sandbox itself sleeps (`SandboxHandle.sleep`: no
process runs, /mnt/data and the container kept as they are). Either way no memory or CPU is used until the next
call, which wakes it (`wake_if_asleep`): by the source's ``wake`` from the checkpoint, or by starting a fresh
kernel over the kept files and REPLAYING the session's executed code cells in order, silently.

What happened is never hidden: the next run's result says ``restored="checkpoint"`` or ``"replay"``, and its notes
name every replayed cell that did not end as it first did (an error now, or no longer), a cell that timed out, and
a checkpoint that could not be restored (then replayed: files the checkpoint held are named as lost).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError, NotOfferedError, SessionLostError
from nbexec.files.folders import work_root
from nbexec.files.statefolder import StateFolder
from nbexec.sandbox.docker.workdir import WORKDIR_PREFIX, remove_tree
from nbexec.sandbox.source import SandboxHandle, SandboxSource

from . import snapshotblobs, snapshots

log = logging.getLogger(__name__)
S = TypeVar("S", bound="Hibernation")


def replay(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig) -> list[str]:
    """Run the executed code cells of ``nb`` again in order (silently, outside the history); notes on each cell
    that ended otherwise than it first did. A cell gets the execution's time limit; one that overruns stops the
    replay (the cells after it are not run: named)."""
    notes: list[str] = []
    executed = [(i, c) for i, c in enumerate(nb.cells)
                if c.get("cell_type") == "code" and c.get("execution_count") is not None]
    for position, (index, cell) in enumerate(executed):
        failed_before = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        reply = sandbox.run_hidden(str(cell.get("source", "")), config.cell_timeout or config.timeout)
        if reply is None:
            left = [str(i) for i, _ in executed[position + 1:]]
            notes.append(f"replaying cell {index} did not finish within its time limit; "
                         + (f"cells {', '.join(left)} were not replayed" if left else "it was the last one"))
            break
        failed_now = reply.get("status") != "ok"
        if failed_now and not failed_before:
            notes.append(f"replaying cell {index} raised {str(reply.get('ename'))[:100]}: "
                         f"{str(reply.get('evalue'))[:300]} (it had succeeded): what it made is missing")
        elif failed_before and not failed_now:
            notes.append(f"replaying cell {index} succeeded (it had failed): the state may differ")
    return notes


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
    _woke: tuple[str, tuple[str, ...]] | None  # (how, notes) for the next run's result

    @property
    def config(self) -> SandboxConfig:
        raise NotImplementedError

    def _source(self) -> SandboxSource:
        raise NotImplementedError

    def _keep(self, status: str) -> None:
        raise NotImplementedError

    def _hold(self) -> str:
        raise NotImplementedError

    def hibernate(self, *, idle_for: float = 0.0) -> bool:
        """Free the session's memory and CPU now, keeping its state (see the module docstring); False when it
        cannot sleep (closed, dead, not started, already asleep, its sandbox cannot, or it was used within the
        last ``idle_for`` seconds: checked under its lock, so a call that just ended keeps it awake)."""
        with self._lock:
            sandbox = self._sandbox
            if self._closed or sandbox is None or self._asleep or self._dead_reason \
                    or time.monotonic() - self.last_activity < idle_for:
                return False
            folder = self._folder_for_memory()
            try:
                record = self._source().hibernate(sandbox, folder)
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

    def wake_if_asleep(self) -> None:
        """Wake a sleeping session before a call uses it (the caller holds the lock)."""
        how = self._asleep
        if how is None:
            return
        started, notes = time.monotonic(), []
        try:
            if how == "checkpoint":
                assert self._memory is not None and self._memory_dir is not None
                try:
                    self._sandbox = self._source().wake(self.config, self._memory, self._memory_dir)
                except NbexecError as exc:
                    notes.append(f"its checkpoint could not be restored ({exc}): a fresh sandbox replayed its cells, "
                                 "and the files of /mnt/data the checkpoint held are lost")
                    self._sandbox = self._source().acquire(self.config, purpose="session", claim=self._hold())
                    how = "replay"
            else:
                assert self._sandbox is not None
                self._sandbox.awake()
            assert self._sandbox is not None
            if how == "replay":
                notes += replay(self._sandbox, self.notebook, self.config)
        except NbexecError as exc:
            self._dead_reason = f"it could not wake from its sleep: {exc}"
            self._asleep = None
            raise SessionLostError(f"Session {self.id} {self._dead_reason}") from exc
        self._asleep, self._memory = None, None
        self.forget_memory()
        notes.insert(0, f"the session was asleep; its memory came back by {how} in "
                        f"{time.monotonic() - started:.2f} s")
        self._woke = (how, tuple(notes))
        self._keep("ready")

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

    def fork(self: S, *, snapshot_dir: str | Path | None = None, **options: Any) -> S:
        """A new session from a snapshot of this one (its files, and its memory by replay)."""
        options.setdefault("state_dir", self.state_dir)
        return self.from_snapshot(self.snapshot(snapshot_dir=snapshot_dir), owner=self.owner,
                                  snapshot_dir=snapshot_dir, **options)

    @classmethod
    def from_snapshot(cls: type[S], snapshot_id: str, *, owner: str = "", snapshot_dir: str | Path | None = None,
                      **options: Any) -> S:
        """A new session started from snapshot ``snapshot_id`` of ``owner``: its files checked and put into
        /mnt/data, its notebook's executed cells replayed; the first run says ``restored="replay"`` and names
        any cell that replayed otherwise. SnapshotError for an unknown, another owner's or tampered snapshot."""
        restored = snapshotblobs.store_for(options.get("state_dir"), snapshot_dir).open(owner, snapshot_id)
        try:
            return cls._restored(restored, owner, options)
        finally:
            restored.release()  # a blob store's private download is gone once the files are in (or refused)

    @classmethod
    def _restored(cls: type[S], restored: snapshots.Restored, owner: str, options: dict[str, Any]) -> S:
        policy: SandboxConfig | None = options.pop("policy", None)
        config = restored.config if policy is None else _within(policy, restored.config)
        session = cls(config, owner=owner, **options)  # type: ignore[call-arg]
        try:
            session.start()
            assert session._sandbox is not None
            started = time.monotonic()
            snapshots.put_files(session._sandbox, restored)
            session.notebook = restored.notebook
            notes = replay(session._sandbox, session.notebook, session.config)
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

    def forget_memory(self) -> None:
        folder, self._memory_dir = self._memory_dir, None
        if folder is not None:
            remove_tree(folder)


def _within(policy: SandboxConfig, kept: SandboxConfig) -> SandboxConfig:
    """The config a snapshot restores in for a caller of ``policy`` (a service's, MCP's): the policy as it is now,
    with the snapshot's image and language only while the policy still offers them (NotOfferedError otherwise)."""
    try:
        chosen = policy.choose_image(None if kept.image == policy.image else kept.image)
    except ConfigError as exc:
        raise NotOfferedError(f"the snapshot's image is not offered here any more: {exc}") from None
    return chosen.offer_language(kept.language)
