"""A sandbox on a Ray node, driven through that node's agent: every `SandboxHandle` method is one actor call
(`calls.Agent.call`) with a deadline from the call's own limit and a cap on its answer.

What the agent answers is read as a remote node's would be: a run's frames through `frames.Reader` and
`frames.take` (each message charged by its size, past this side's allowance kept as a header alone; an error
message fails the cell whatever the end says), a listing through `files.parse_listing` and `files.within`, files
into the output folder through `files.fetch_into` and `files.save`. A node that is lost makes the handle lost for
good: SessionLostError for a session, NodeLostError for a one-shot (never retried: the code may have run).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from nbexec.config import SandboxConfig
from nbexec.errors import (
    FileTooLargeError,
    FileTransferError,
    NodeLostError,
    ProtocolError,
    SessionLostError,
)
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.sandbox import kernel
from nbexec.sandbox.hidden import Named
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.messages import Message
from nbexec.sandbox.remote import files, frames
from nbexec.sandbox.remote.lost import OnNode
from nbexec.sandbox.source import ContainerState, SandboxHandle

from .agent import CHUNK, MAX_HEADERS
from .calls import Agent

SMALL = 64 * 1024  # bytes of a small answer (state, notes)
SLACK = 30.0  # seconds past a call's own limit after which a node that has not answered is given up
LIFE_TIMEOUT = 60.0  # seconds for a state, kill, notes or file call (Docker on a loaded node)
MAX_END = frames.MAX_END + kernel.MAX_HEADER  # bytes of a run's end frame and its header
MAX_REPLY = kernel.MAX_REPLY + SMALL  # bytes of a hidden run's reply


class RayHandle(OnNode, SandboxHandle):
    """One sandbox on one Ray node (see the module docstring); made by `source.RaySource.acquire`."""

    backend = "ray"
    losing, where = (NodeLostError,), "Ray node"
    hidden_code = True  # the agent runs the driver's code in the kernel, as this host does

    def __init__(self, agent: Agent, answer: Any, config: SandboxConfig, purpose: str, *, owner: str) -> None:
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str) or len(answer["id"]) != 32 \
                or not isinstance(answer.get("language_info"), dict):
            raise ProtocolError(f"node {agent.name} answered a new sandbox with something else")
        self.agent, self.purpose = agent, purpose
        self.owner = owner  # the source's token: the agent answers about this sandbox to its owner alone
        self.id: str = answer["id"]
        self.node: str | None = agent.name
        self.language_info: dict[str, Any] = answer["language_info"]
        grace = answer.get("interrupt_grace")
        self.grace = float(grace) if isinstance(grace, (int, float)) and 0 <= grace <= 600 else 60.0
        self.config = config
        self.input_links: frozenset[str] = frozenset()
        self.lost: str | None = None
        self.ray_node = ""  # its Ray node id (`source.RaySource` counts what it holds on each node)
        self._kernel_lost = False
        self._input_notes: list[str] = []

    def __repr__(self) -> str:
        return f"<RayHandle {self.id} on {self.node}>"

    def _call(self, method: str, *args: Any, timeout: float = LIFE_TIMEOUT, cap: int = SMALL, what: str) -> Any:
        with self._on_node():
            return self.agent.call(method, self.owner, self.id, *args, timeout=timeout, cap=cap, what=what)

    # -- the kernel ---------------------------------------------------------------------------------------

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        config = self.config
        allowance = config.max_output_bytes + config.max_display_bytes
        reader = frames.Reader(self.id, max_message=allowance + kernel.MAX_HEADER, allowance=allowance)
        limit = max(0.001, deadline - time.monotonic())
        # What an honest agent sends at most: the allowance and one error past it, whole, and the headers of the rest.
        cap = 2 * allowance + MAX_END + 2 * (MAX_HEADERS + frames.MAX_LINE * 64)
        data = self._call("run", code, limit, timeout=limit + self.grace + SLACK, cap=cap, what="run code")
        if not isinstance(data, bytes):
            raise ProtocolError(f"node {self.node} answered a run with something else")
        seen = Execution()
        for at in range(0, len(data), CHUNK):
            for frame in reader.feed(data[at:at + CHUNK]):
                try:
                    ended = frames.take(frame, seen, on_output, str(self.node))
                except frames.RelayedProtocolError as exc:
                    self._kernel_lost = exc.kernel_lost
                    raise
                if ended is not None:
                    return ended
        raise ProtocolError(f"node {self.node} answered a run without its end")

    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: Named | None = None) -> dict[str, Any] | None:
        reply = self._call("hidden", code, timeout, expressions, timeout=timeout + SLACK, cap=MAX_REPLY,
                           what="run nbexec's code")
        if reply is not None and not isinstance(reply, dict):
            raise ProtocolError(f"node {self.node} answered a hidden run with something else")
        return reply

    def interrupt(self) -> None:
        if self.lost is None:
            self.agent.send("interrupt", self.owner, self.id)

    @property
    def kernel_lost(self) -> bool:
        return self._kernel_lost

    # -- its life -----------------------------------------------------------------------------------------

    def state(self) -> ContainerState:
        data = self._call("state", what="report a sandbox's state")
        running, code, oom = (data.get("running"), data.get("exit_code"), data.get("oom_killed")) \
            if isinstance(data, dict) else (None, None, None)
        if not isinstance(running, bool) or not isinstance(oom, bool) \
                or not (code is None or (isinstance(code, int) and not isinstance(code, bool))):
            raise ProtocolError(f"node {self.node} described a sandbox's state with something else")
        self._kernel_lost = self._kernel_lost or (isinstance(data, dict) and data.get("kernel_lost") is True)
        return ContainerState(running, code, oom)

    def seems_alive(self) -> bool:
        return self.lost is None  # a cheap check: no call

    def kill(self) -> None:
        with contextlib.suppress(NodeLostError, SessionLostError):  # a lost node's sandbox is stopped already
            self._call("kill", what="stop a sandbox")

    def destroy(self) -> None:
        if self.lost is not None:  # given up (a deadline, a dead actor): asked anyway, unwaited, in case it lives
            self.agent.send("release", self.owner, self.id)
            return
        with contextlib.suppress(NodeLostError, SessionLostError, ProtocolError):  # a lost node took it along
            self._call("release", timeout=LIFE_TIMEOUT + self.grace, what="remove a sandbox")

    # -- /mnt/data ----------------------------------------------------------------------------------------

    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        transfer.relative_parts(name)  # an unsafe name is refused before anything is sent
        cap = self.config.max_data_bytes
        data = content if isinstance(content, bytes) else content.read(cap + 1) if cap else content.read()
        if cap and len(data) > cap:
            raise FileTooLargeError(f"{name!r} is larger than /mnt/data's cap of {cap:,} bytes")
        self._call("put_file", name, data, timeout=LIFE_TIMEOUT + len(data) / 1e6, what="take a file")

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        data = self._call("list_files", limits, cap=files.listing_cap(limits), what="list files")
        return files.within(files.parse_listing(data, limits.max_files or 10**6, str(self.node)), limits)

    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        return files.fetch_into(self, target, limits, known)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        transfer.relative_parts(name)
        data = self._call("open_file", name, max_bytes, what=f"send {name[:200]!r}")
        token, size = (data.get("stream"), data.get("size")) if isinstance(data, dict) else (None, None)
        if not isinstance(token, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ProtocolError(f"node {self.node} opened a file with something else")
        if max_bytes and size > max_bytes:
            self.agent.send("close_file", self.owner, token)
            raise FileTooLargeError(f"{name!r} on node {self.node} is larger than the cap of {max_bytes:,} bytes "
                                    f"({size:,} bytes); nothing was read")
        return size, transfer.FileChunks(_Body(self, token, size), size, CHUNK)

    def data_notes(self) -> tuple[list[str], bool]:
        return self._noted(self._call("notes", what="report on /mnt/data"))


class _Body:
    """A file on a node as a binary file object for `transfer.FileChunks`: one agent call per chunk, each at most
    CHUNK bytes, never past the size the agent declared."""

    def __init__(self, handle: RayHandle, token: str, size: int) -> None:
        self._handle, self._token, self._left = handle, token, size
        self._pending = b""
        self.closed = False

    def read(self, count: int) -> bytes:
        if self.closed:
            return b""
        if not self._pending:
            try:
                data = self._handle.agent.call("read", self._handle.owner, self._token, timeout=LIFE_TIMEOUT, cap=CHUNK,
                                               what="send a file")
            except Exception:
                self.close()
                raise
            if not isinstance(data, bytes) or len(data) > min(CHUNK, self._left):
                self.close()
                raise FileTransferError(f"node {self._handle.node} sent a file larger than it said")
            self._left -= len(data)
            self._pending = data
        data, self._pending = self._pending[:count], self._pending[count:]
        return data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._handle.agent.send("close_file", self._handle.owner, self._token)
