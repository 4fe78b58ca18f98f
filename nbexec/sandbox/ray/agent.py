"""The node's half: one agent per Ray node, run there as a long-lived actor (`source.agent_on`), holding that
node's local source (its Docker engine, its pools, its limits) and the sandboxes it made for drivers.

Every answer is plain data the driver checks and caps (`calls.fetch`): ``{"ok": value}`` or ``{"error": name,
"detail": text}`` for an NbexecError, never an exception object or a host path (a listing is its public shape;
files are read in chunks of at most CHUNK bytes). A run comes back as the remote backend's frames
(`nbexec.sandbox.remote.frames`), the kernel's messages kept within the run's output allowance as a node keeps
them, and only the headers of the rest. The agent runs the code its driver sends: the driver is nbexec's engine,
and a Ray cluster is one trust domain (anyone who can call an actor can run code on the cluster anyway).

Tenancy: each driver's source makes its own agents (unnamed actors, never adopted by name), and every call about
a sandbox or an open file names its owner (the source's random token): another owner's sandbox is answered as
one that does not exist, and `held` lists only the caller's.

Back-pressure: an agent holds at most ``limit`` sandboxes (the driver's cap on this node, `source.node_limit`).
Past it, `acquire` answers SessionLimitError before any sandbox is made, and the driver asks the next node. The
driver names each new sandbox, so it can release one whose answer it never read (it gave up waiting, or was
interrupted): a sandbox released while it is made is removed as soon as it exists, and its slot comes back.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.errors import DiskSpaceError, NbexecError, ProtocolError, SandboxError, SessionLimitError
from nbexec.files import artifacts, transfer
from nbexec.sandbox.docker.local import LocalSource
from nbexec.sandbox.messages import Message
from nbexec.sandbox.remote import frames
from nbexec.sandbox.source import SandboxHandle, SandboxSource

CHUNK = 1 << 20  # bytes of a file sent in one answer
_ID = re.compile(r"[0-9a-f]{32}")  # a sandbox's name, as the driver makes them
MAX_DETAIL = 4096  # characters of an error's text
MAX_HEADERS = 4 * 1024 * 1024  # bytes of message headers kept for the messages past a run's allowance
FRAMES_SLACK = 32 * 1024  # bytes of a run's frames past twice its allowance (their headers); the rest is folded
MAX_FOLDED = 64  # kinds of folded message (channel, type, parent) kept apart; more are summed into the first


class _Run:
    """One run's frames: whole messages within the allowance, then headers alone; past twice the allowance (and
    FRAMES_SLACK) of frames, headers included, or MAX_HEADERS of headers, the rest summed into one dropped message
    per kind, at most MAX_FOLDED kinds (what a cap dropped is still counted, not listed). The first error message
    is always kept whole: it fails the cell."""

    def __init__(self, sandbox: str, allowance: int) -> None:
        self.sandbox, self.allowance = sandbox, frames.Allowance(allowance)
        self.parts: list[bytes] = [frames.begin(sandbox)]
        self.headers = 0
        self.size, self.budget = 0, 2 * allowance + FRAMES_SLACK
        self.folded: dict[tuple[str, str, str], int] = {}

    def take(self, msg: Message) -> None:
        first_error = msg.msg_type == "error" and not self.allowance.error_sent
        keep = self.allowance.keep(msg)
        part = frames.message(msg, keep) if keep or self.headers < MAX_HEADERS else b""
        if part and (first_error or self.size + len(part) <= self.budget):
            self.headers += 0 if keep else len(part)
            self.size += len(part)
            self.parts.append(part)
            return
        key = (msg.channel, msg.msg_type, msg.parent_id)
        if key not in self.folded and len(self.folded) >= MAX_FOLDED:
            key = next(iter(self.folded))
        self.folded[key] = self.folded.get(key, 0) + msg.size

    def reply(self, end: bytes) -> bytes:
        for (channel, kind, parent), size in self.folded.items():
            self.parts.append(frames.message(Message(channel, kind, "", parent, size, b"", False), False))
        return b"".join([*self.parts, end])


class NodeAgent:
    """The sandboxes of one node (see the module docstring). Thread-safe: the actor runs calls concurrently, so
    an interrupt reaches a sandbox while its run waits."""

    def __init__(self, name: str, limit: int = 1 << 30) -> None:
        self.name, self.limit = name, max(1, int(limit))
        self.source: SandboxSource = LocalSource()
        self.making: dict[str, str] = {}  # sandboxes being made (id -> owner): counted against the limit already
        self.abandoned: set[str] = set()  # ids among them their driver released before they existed
        self.handles: dict[str, SandboxHandle] = {}
        self.owners: dict[str, str] = {}  # sandbox id -> the driver's source that made it (`close` is per owner)
        self.streams: dict[str, transfer.FileChunks] = {}
        self.pending: dict[str, bytearray] = {}  # read from a stream, not yet sent (a chunk is at most CHUNK)
        self.lock = threading.Lock()

    # -- answers ------------------------------------------------------------------------------------------

    def _answer(self, work: Callable[[], Any]) -> dict[str, Any]:
        try:
            return {"ok": work()}
        except NbexecError as exc:  # a DiskSpaceError's reason, never its message (a path of this node)
            detail = exc.reason if isinstance(exc, DiskSpaceError) else str(exc)
            return {"error": type(exc).__name__, "detail": detail[:MAX_DETAIL]}

    def _mine(self, owner: str, sandbox: str) -> bool:
        with self.lock:
            made_by = self.owners.get(sandbox) if isinstance(sandbox, str) else None
        return isinstance(owner, str) and made_by is not None and secrets.compare_digest(made_by, owner)

    def _handle(self, owner: str, sandbox: str) -> SandboxHandle:
        """``owner``'s sandbox ``sandbox``; another owner's is answered as missing (no oracle)."""
        found = self.handles.get(sandbox) if self._mine(owner, sandbox) else None
        if found is None:
            raise SandboxError(f"no sandbox {str(sandbox)[:64]!r} on node {self.name}")
        return found

    # -- the node -----------------------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return {"ok": {"node": self.name, "pid": os.getpid()}}

    def capacity(self, config: SandboxConfig) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            ready = self.source.capacity(_local(config))
            with self.lock:
                held = len(self.handles)
            return {"node": self.name, "held": held, "ready": ready.ready, "size": ready.size, "limit": self.limit}
        return self._answer(work)

    def held(self, owner: str) -> dict[str, Any]:
        """The ids of the sandboxes this agent holds for ``owner`` (for tests and the driver's checks)."""
        with self.lock:
            return {"ok": sorted(s for s, made_by in self.owners.items()
                                 if isinstance(owner, str) and secrets.compare_digest(made_by, owner))}

    def acquire(self, config: SandboxConfig, purpose: str, owner: str, sandbox: str = "") -> dict[str, Any]:
        """A new sandbox for ``owner``, named ``sandbox`` by the driver (32 hex digits; made up when empty)."""
        def work() -> dict[str, Any]:
            if not isinstance(owner, str) or not owner:
                raise SandboxError("a sandbox needs its owner")
            name = sandbox or secrets.token_hex(16)
            if not isinstance(name, str) or not _ID.fullmatch(name):
                raise SandboxError("a sandbox's name is 32 hex digits")
            with self.lock:
                if name in self.handles or name in self.making:
                    raise SandboxError("a sandbox of that name exists")
                if len(self.handles) + len(self.making) >= self.limit:
                    raise SessionLimitError(f"node {self.name} holds {self.limit} sandboxes, its limit")
                self.making[name] = owner
            handle: SandboxHandle | None = None
            try:
                handle = self.source.acquire(_local(config), purpose=purpose)
            finally:
                with self.lock:  # one step: no acquire sees neither the slot being made nor the sandbox
                    del self.making[name]
                    given_up = name in self.abandoned
                    self.abandoned.discard(name)
                    if handle is not None and not given_up:
                        self.handles[name] = handle
                        self.owners[name] = owner
            if handle is None:
                raise SandboxError("no sandbox was made")  # not reached: the source raised
            if given_up:
                self.source.release(handle, wait=True)
                raise SandboxError("its driver gave the sandbox up while it was made")
            return {"id": name, "language_info": handle.language_info, "memory": handle.config.memory,
                    "interrupt_grace": handle.config.interrupt_grace}
        return self._answer(work)

    def release(self, owner: str, sandbox: str) -> dict[str, Any]:
        def work() -> None:
            with self.lock:  # still being made: removed as soon as it exists
                made_by = self.making.get(sandbox) if isinstance(sandbox, str) else None
                if made_by is not None and isinstance(owner, str) and secrets.compare_digest(made_by, owner):
                    self.abandoned.add(sandbox)
                    return
            if not self._mine(owner, sandbox):
                return
            with self.lock:
                handle = self.handles.pop(sandbox, None)
                self.owners.pop(sandbox, None)
                gone = [token for token in self.streams if token.startswith(sandbox + ":")]
            for token in gone:
                self._close(token)
            if handle is not None:
                self.source.release(handle, wait=True)
        return self._answer(work)

    def close(self, owner: str) -> dict[str, Any]:
        """Release every sandbox ``owner`` (a driver's source) holds here: that source is closing."""
        with self.lock:
            mine = [sandbox for sandbox, made_by in self.owners.items() if made_by == owner]
        for sandbox in mine:
            self.release(owner, sandbox)
        return {"ok": None}

    # -- the kernel ---------------------------------------------------------------------------------------

    def run(self, owner: str, sandbox: str, code: str, timeout: float) -> dict[str, Any]:
        def work() -> bytes:
            handle = self._handle(owner, sandbox)
            config = handle.config
            run = _Run(sandbox, config.max_output_bytes + config.max_display_bytes)
            try:
                ended = handle.run(code, deadline=time.monotonic() + timeout, on_output=run.take)
                return run.reply(frames.end(sandbox, ended))
            except ProtocolError as exc:
                return run.reply(frames.failure("protocol", str(exc), handle.kernel_lost))
        return self._answer(work)

    def hidden(self, owner: str, sandbox: str, code: str, timeout: float,
               expressions: dict[str, str] | None) -> dict[str, Any]:
        return self._answer(lambda: self._handle(owner, sandbox).run_hidden(code, timeout, expressions=expressions))

    def interrupt(self, owner: str, sandbox: str) -> dict[str, Any]:
        return self._answer(lambda: self._handle(owner, sandbox).interrupt())

    def state(self, owner: str, sandbox: str) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            handle = self._handle(owner, sandbox)
            state = handle.state()
            return {"running": state.running, "exit_code": state.exit_code, "oom_killed": state.oom_killed,
                    "kernel_lost": handle.kernel_lost}
        return self._answer(work)

    def kill(self, owner: str, sandbox: str) -> dict[str, Any]:
        return self._answer(lambda: self._handle(owner, sandbox).kill())

    def notes(self, owner: str, sandbox: str) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            handle = self._handle(owner, sandbox)
            notes, stopped = handle.data_notes()
            return {"data_notes": notes, "stopped": stopped, "input_notes": handle.input_notes()}
        return self._answer(work)

    # -- /mnt/data ----------------------------------------------------------------------------------------

    def put_file(self, owner: str, sandbox: str, name: str, content: bytes) -> dict[str, Any]:
        return self._answer(lambda: self._handle(owner, sandbox).put_file(name, content))

    def list_files(self, owner: str, sandbox: str, limits: artifacts.Limits) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            found = self._handle(owner, sandbox).list_files(limits)
            return {"files": [f.to_dict(public=True) for f in found.files],
                    "skipped_files": [s.to_dict(public=True) for s in found.skipped], "notes": list(found.notes)}
        return self._answer(work)

    def open_file(self, owner: str, sandbox: str, name: str, max_bytes: int) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            size, chunks = self._handle(owner, sandbox).open_file(name, max_bytes=max_bytes)
            token = f"{sandbox}:{secrets.token_hex(8)}"
            with self.lock:
                self.streams[token] = chunks
            return {"stream": token, "size": size}
        return self._answer(work)

    def read(self, owner: str, token: str) -> dict[str, Any]:
        """The next chunk of an open file (at most CHUNK bytes; empty at its end, which closes it)."""
        def work() -> bytes:
            if not self._mine(owner, str(token).split(":")[0]):
                raise SandboxError("no such open file on this node")
            with self.lock:
                chunks = self.streams.get(token)
                pending = self.pending.setdefault(token, bytearray())
            if chunks is None:
                raise SandboxError("no such open file on this node")
            while len(pending) < CHUNK:
                data = next(chunks, b"")
                if not data:
                    break
                pending += data
            out = bytes(pending[:CHUNK])
            del pending[:CHUNK]
            if not out:
                self._close(token)
            return out
        return self._answer(work)

    def close_file(self, owner: str, token: str) -> dict[str, Any]:
        if self._mine(owner, str(token).split(":")[0]):
            self._close(token)
        return {"ok": None}

    def _close(self, token: str) -> None:
        with self.lock:
            chunks = self.streams.pop(token, None)
            self.pending.pop(token, None)
        if chunks is not None:
            with contextlib.suppress(Exception):
                chunks.close()


def _local(config: SandboxConfig) -> SandboxConfig:
    """The driver's config for this node's local source: the same limits, nothing of the driver's host (its
    package cache is a folder there)."""
    return config.replace(source="local", package_cache=None)
