"""The sandboxes a node holds for library clients (`nbexec.sandbox.remote`): each belongs to the client that made
it (its owner, as the gateway authenticated it: a token, or a router's signed client), is used by one call at a
time, and is released when its client deletes it, after ``ttl`` seconds idle, or at shutdown. Thread-safe.

A held sandbox may sleep (`nbexec.service.sleeping`): ``asleep`` says how it will wake ("replay": its container
stopped, its kernel started fresh by ``awake``; "checkpoint": its memory kept in ``memory_dir`` on this node, its
container gone until ``wake``). Releasing a sleeping one removes what it keeps, its memory too."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbexec.errors import SessionError, ShuttingDownError
from nbexec.files import artifacts
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.source import SandboxHandle

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One held sandbox: whose it is, what for, when it was last used, and what its wheels have cost."""

    owner: str
    handle: SandboxHandle
    purpose: str
    last: float = field(default_factory=time.monotonic)
    hashed: artifacts.Known = field(default_factory=dict)  # files its listings hashed: an unchanged one only once
    wheel_bytes: int = 0
    wheel_count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    asleep: str = ""  # "", "replay" or "checkpoint" (see the module docstring)
    memory: dict[str, Any] | None = None  # the source's record of the kept memory ("checkpoint")
    memory_dir: Path | None = None  # where this node keeps it: private, removed once woken or released
    released: threading.Event = field(default_factory=threading.Event)  # set (under Held's lock) when let go


Owned = Callable[..., Entry]  # (who, sandbox_id, *, asleep_too=False): 404 for another's, 409 for one asleep


class Held:
    """Sandboxes by id, each with its owner (see the module docstring)."""

    def __init__(self, release: Callable[[SandboxHandle, bool], None], ttl: float) -> None:
        self._release = release  # (handle, wait): the node's source takes it back
        self.ttl = ttl
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def count(self, who: str) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.owner == who)

    def add(self, who: str, handle: SandboxHandle, purpose: str) -> str:
        """Hold ``handle`` for ``who``; its id (ShuttingDownError after shutdown began: it is released)."""
        sandbox_id = uuid.uuid4().hex
        with self._lock:
            if not self._closed:
                self._entries[sandbox_id] = Entry(who, handle, purpose)
                return sandbox_id
        self._release(handle, True)
        raise ShuttingDownError("the node is shutting down")

    def get(self, who: str, sandbox_id: str) -> Entry | None:
        """The sandbox ``sandbox_id`` of ``who``; None for anyone else, as for an id that does not exist."""
        with self._lock:
            entry = self._entries.get(sandbox_id)
        return entry if entry is not None and entry.owner == who else None

    @contextlib.contextmanager
    def using(self, entry: Entry) -> Iterator[SandboxHandle]:
        """The entry's handle for one call at a time (SessionError for a second call while one runs)."""
        if not entry.lock.acquire(blocking=False):
            raise SessionError("this sandbox is busy with another call")
        entry.last = time.monotonic()
        try:
            yield entry.handle
        finally:
            entry.last = time.monotonic()
            entry.lock.release()

    def remove(self, who: str, sandbox_id: str) -> bool:
        """Release the sandbox ``sandbox_id`` of ``who`` now (a one-shot's in the background); False when it is not
        theirs or gone."""
        with self._lock:
            entry = self._entries.get(sandbox_id)
            if entry is None or entry.owner != who:
                return False
            del self._entries[sandbox_id]
            entry.released.set()  # a wake under way stops, and never puts its sandbox in this entry
        self._let_go(entry, entry.purpose != "oneshot")
        return True

    def reap(self, now: float | None = None) -> int:
        """Release the sandboxes idle for longer than ``ttl`` (not while a call uses them); how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [k for k, e in self._entries.items() if now - e.last > self.ttl and not e.lock.locked()]
            gone = [self._entries.pop(k) for k in idle]
            for entry in gone:
                entry.released.set()
        for entry in gone:
            log.info("releasing a sandbox of %s after %.0f s idle", entry.owner[:12], now - entry.last)
            self._let_go(entry, True)
        return len(gone)

    def close(self) -> None:
        """Shutdown: interrupt and release every sandbox."""
        with self._lock:
            self._closed = True
            gone, self._entries = list(self._entries.values()), {}
            for entry in gone:
                entry.released.set()
        for entry in gone:
            if not entry.asleep:
                with contextlib.suppress(Exception):
                    entry.handle.interrupt()
            with contextlib.suppress(Exception):
                self._let_go(entry, True)

    def swap(self, entry: Entry, handle: SandboxHandle) -> bool:
        """Put a woken ``handle`` in ``entry``; False when the entry was let go meanwhile (the caller releases it)."""
        with self._lock:
            if entry.released.is_set():
                return False
            entry.handle = handle
            return True

    def _let_go(self, entry: Entry, wait: bool) -> None:
        """Release ``entry``'s sandbox, and the memory it kept asleep."""
        folder, entry.memory_dir, entry.memory = entry.memory_dir, None, None
        try:
            self._release(entry.handle, wait)
        finally:
            if folder is not None:
                remove_tree(folder)
