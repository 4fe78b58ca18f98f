"""A sandbox on a node, driven over HTTP: every `SandboxHandle` method is one call to the node's /v1/sandboxes
routes (`nbexec.service.sandboxes`), so the engine runs it exactly as a local one and builds the result here.

What the node sends is hostile and read within this host's limits while it arrives: a run's frames through
`frames.Reader` (each message charged by the bytes that came, before anything is parsed, past this side's frame
limit or allowance read past unkept), every other answer within a cap (`nodes.NodeClient`), files into the local
output folder through directory descriptors (`files`). Every answer must name this sandbox. The run's honesty
travels too: the node's `kernel.Execution` (its reply, its last error, an exit) is checked field by field, and an
error message seen here fails the cell whatever the node's end says.

A node that goes away makes the handle lost for good: for a session, every later call raises SessionLostError
naming the node; for a one-shot, NodeLostError (never retried: the code may have run). A node that breaks the
frame protocol is a sandbox that misbehaved (ProtocolError): the engine stops it and says so in the result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from nbexec.config import SandboxConfig
from nbexec.errors import (
    FileTooLargeError,
    FileTransferError,
    NodeError,
    NodeLostError,
    NodeUnavailableError,
    NotOfferedError,
    ProtocolError,
    SessionLostError,
)
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.result import Connection
from nbexec.sandbox import kernel
from nbexec.sandbox.hidden import Named
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.messages import Message
from nbexec.sandbox.source import ContainerState, SandboxHandle, WheelFile

from . import files, frames, paths
from .lost import OnNode, texts
from .nodes import CONNECT_TIMEOUT, NodeClient, http_error

SMALL = 64 * 1024  # bytes of a small answer (state, notes)
MAX_REPLY = kernel.MAX_REPLY + SMALL  # bytes of a hidden run's answer
MAX_CONNECTIONS = 4 * 1024 * 1024  # bytes of an egress log
JUDGE_REPLY = 16 * 1024**2 + SMALL  # bytes of a judging's answer (a node drops the tests' texts to fit: judgenamed)
JUDGE_TEST = 32 * 1024  # bytes of one test's record at most (its capped texts, each character escaped)
SLACK = 30.0  # seconds past a run's time limit and grace after which a node that has not ended it is given up
RELAYED = frames.RELAYED  # what a node may relay of a run
WAKE_TIMEOUT = 300.0  # seconds a node may take to checkpoint, restore or restart a sandbox's kernel


class RemoteHandle(OnNode, SandboxHandle):
    """One sandbox on one node (see the module docstring); made by `source.RemoteSource.acquire`."""

    losing = (NodeUnavailableError, NodeLostError, SessionLostError)  # unreachable, lost mid-call, the sandbox gone

    def __init__(self, client: NodeClient, answer: Any, config: SandboxConfig, purpose: str) -> None:
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str) or not answer["id"] \
                or not isinstance(answer.get("language_info", {}), dict):
            raise NodeError(f"node {client.name} answered a new sandbox with something else")
        self.client, self.purpose = client, purpose
        self.id: str = answer["id"]
        self.route = "/v1/sandboxes/" + paths.encode(self.id)
        self.node: str | None = str(answer.get("node") or client.name)[:64]
        self.language_info: dict[str, Any] = answer.get("language_info", {})
        memory = answer.get("memory")  # the node's policy: named honestly when the code runs out of it
        self.config = config.replace(memory=memory) if isinstance(memory, str) and len(memory) < 32 else config
        grace = answer.get("interrupt_grace")
        self.grace = float(grace) if isinstance(grace, (int, float)) and 0 <= grace <= 600 else 60.0
        self.input_links: frozenset[str] = frozenset()
        self.lost: str | None = None
        self.asleep = ""  # what its node last said of its sleep (`state`): "", "replay" or "checkpoint"
        self._kernel_lost = False
        self._input_notes: list[str] = []
        self._wheels: set[str] = set()

    def __repr__(self) -> str:
        return f"<RemoteHandle {self.id} on {self.node}>"

    # -- sleep (`nbexec.service.sleeping`: the node keeps what sleeps; the engine here decides when) ----------

    def sleep(self) -> None:
        """No process runs on the node; /mnt/data is kept there for `awake` (the engine replays)."""
        if self._life("sleep", "let a sandbox sleep", timeout=WAKE_TIMEOUT).get("asleep") != "replay":
            raise ProtocolError(f"node {self.node} answered a sleep with something else")

    def awake(self) -> None:
        self._woken(self._life("awake", "wake a sandbox", timeout=WAKE_TIMEOUT))

    def keep_memory(self) -> bool:
        """Ask the node to checkpoint the sandbox's memory there: True when it did (the sandbox then sleeps until
        `wake_memory`), False when its runtime cannot (the sandbox runs on, untouched)."""
        kept = self._life("hibernate", "keep a sandbox's memory", timeout=WAKE_TIMEOUT).get("kept")
        if kept not in (None, "checkpoint"):
            raise ProtocolError(f"node {self.node} answered a checkpoint with something else")
        return kept == "checkpoint"

    def wake_memory(self, **options: Any) -> None:
        self._woken(self._life("wake", "restore a sandbox's memory", **options))  # its limits: `RemoteSource.wake`

    def _life(self, route: str, what: str, **options: Any) -> dict[str, Any]:
        with self._on_node():
            return self._answer(self.client.json("POST", f"{self.route}/{route}", what, SMALL, **options))

    def _woken(self, data: dict[str, Any]) -> None:
        if not isinstance(data.get("language_info"), dict):
            raise ProtocolError(f"node {self.node} answered a wake-up with something else")
        self.language_info, self._kernel_lost = data["language_info"], False

    def describe(self) -> dict[str, Any]:
        """What finds this sandbox again from another process (`RemoteSource.adopt`): its node and id."""
        return {"kind": "remote", "url": self.client.url, "id": self.id, "node": self.node,
                "language_info": self.language_info, "memory": self.config.memory, "interrupt_grace": self.grace}

    def _answer(self, data: Any) -> dict[str, Any]:
        """``data`` when it is an object about this sandbox; ProtocolError for an answer about another."""
        if not isinstance(data, dict) or data.get("sandbox") != self.id:
            raise ProtocolError(f"node {self.node} answered for another sandbox than {self.id}")
        return data

    # -- the kernel ---------------------------------------------------------------------------------------

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        config = self.config
        reader = frames.Reader(self.id, max_message=config.max_output_bytes + config.max_display_bytes
                               + kernel.MAX_HEADER, allowance=config.max_output_bytes + config.max_display_bytes)
        body = {"code": code, "timeout": max(0.001, deadline - time.monotonic())}
        give_up = deadline + self.grace + SLACK
        with self._on_node(), self.client.stream("POST", f"{self.route}/run", "run code", json=body) as response:
            seen = Execution()
            for chunk in response.iter_bytes():  # as they arrive: a chunk size would hold them back
                for frame in reader.feed(chunk):
                    ended = self._take(frame, seen, on_output)
                    if ended is not None:
                        return ended
                if time.monotonic() > give_up:
                    raise frames.FrameError(f"node {self.node} did not end the run {SLACK:g} s after its time limit")
            raise NodeLostError(f"node {self.node} ended the run's stream without its end")

    def _take(self, frame: frames.Frame, seen: Execution, on_output: Callable[[Message], None]) -> Execution | None:
        try:
            return frames.take(frame, seen, on_output, str(self.node))
        except frames.RelayedProtocolError as exc:
            self._kernel_lost = exc.kernel_lost
            raise

    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: Named | None = None) -> dict[str, Any] | None:
        """nbexec's own requests go by name (a node's hidden route takes no code); the user's own runs as a cell."""
        if named is None and expressions:
            raise NotOfferedError("a node evaluates expressions only for nbexec's own named requests")
        if named is None:
            return self._as_cell(code, timeout)
        body = {"operation": named.name, "args": named.args, "timeout": timeout}
        with self._on_node():
            data = self.client.json("POST", f"{self.route}/hidden", "run nbexec's code", MAX_REPLY, json=body,
                                    timeout=timeout + SLACK)
        reply = self._answer(data).get("reply")
        if reply is not None and not isinstance(reply, dict):
            raise ProtocolError(f"node {self.node} answered a hidden run with something else")
        return reply

    def judge(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The node judges ``job`` with its own runner (judging by name): its answer, sized here and checked field
        by field by the caller (`nbexec.engine.judgenamed`)."""
        import httpx  # a remote handle exists only with the cluster extra

        most = min(JUDGE_REPLY, SMALL + len(job.get("tests", ())) * JUDGE_TEST)  # what this job's answer may be
        try:
            with self._on_node():
                data = self.client.json("POST", f"{self.route}/judge", "judge a program", most, json=job,
                                        deadline=time.monotonic() + timeout + SLACK,
                                        timeout=httpx.Timeout(timeout + SLACK, connect=CONNECT_TIMEOUT))
                failed = data.get("error") if isinstance(data, dict) else None
                if isinstance(failed, dict):  # an error after the answer started (its keep-alive spaces)
                    status = failed.get("status")
                    raise http_error(status if isinstance(status, int) else 500, str(failed.get("detail"))[:2000],
                                     str(self.node))
        except FileTransferError as exc:  # 400: what the node's sandbox cannot judge (a compiler its image lacks)
            if isinstance(exc, FileTooLargeError):
                raise
            raise NotOfferedError(f"node {self.node} cannot judge this: {exc}") from None
        judged = self._answer(data).get("judge")
        if not isinstance(judged, dict):
            raise ProtocolError(f"node {self.node} answered a judging with something else")
        return judged

    def _as_cell(self, code: str, timeout: float) -> dict[str, Any] | None:
        """Run ``code`` as a cell; a reply's status and error as a silent run's, or None when it did not end."""
        ended = self.run(code, deadline=time.monotonic() + timeout, on_output=lambda _: None)
        said = ended.error
        return {"status": ended.status, "ename": said.ename if said else "", "evalue": said.evalue if said else ""} \
            if ended.status in ("ok", "error") else None

    def interrupt(self) -> None:
        with contextlib.suppress(NodeError):  # safe from any thread; a lost node has nothing left to interrupt
            self.client.send("POST", f"{self.route}/interrupt", "interrupt a cell")

    @property
    def kernel_lost(self) -> bool:
        return self._kernel_lost

    # -- its life -----------------------------------------------------------------------------------------

    def state(self) -> ContainerState:
        with self._on_node():
            data = self._answer(self.client.json("GET", f"{self.route}/state", "report a sandbox's state", SMALL))
        running, code, oom = data.get("running"), data.get("exit_code"), data.get("oom_killed")
        if not isinstance(running, bool) or not isinstance(oom, bool) \
                or not (code is None or (isinstance(code, int) and not isinstance(code, bool))):
            raise ProtocolError(f"node {self.node} described a sandbox's state with something else")
        asleep = data.get("asleep", "")
        if asleep not in ("", "replay", "checkpoint"):
            raise ProtocolError(f"node {self.node} described a sandbox's sleep with something else")
        self._kernel_lost, self.asleep = self._kernel_lost or data.get("kernel_lost") is True, asleep
        return ContainerState(running, code, oom)

    def seems_alive(self) -> bool:
        return self.lost is None  # a cheap check: no call (the node's own checks run there)

    def freeze(self) -> None:
        with self._on_node():
            self.client.send("POST", f"{self.route}/freeze", "freeze a sandbox")

    def kill(self) -> None:
        with contextlib.suppress(NodeError):  # a lost node's sandbox is stopped already
            self.client.send("POST", f"{self.route}/kill", "stop a sandbox")

    def destroy(self) -> None:
        with contextlib.suppress(NodeError, ProtocolError):  # a lost node took it with it
            self.client.send("DELETE", self.route, "remove a sandbox")

    # -- /mnt/data ----------------------------------------------------------------------------------------

    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        route = f"{self.route}/files/{paths.encode(name)}"  # checked before a byte is sent
        body: Any = content if isinstance(content, bytes) else iter(lambda: content.read(1 << 20), b"")
        with self._on_node():
            self.client.send("PUT", route, "take a file", content=body)

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        cap = files.listing_cap(limits)
        with self._on_node():
            try:
                data = self._answer(self.client.json("GET", f"{self.route}/files", "list files", cap))
            except FileTooLargeError as exc:
                raise NodeError(f"node {self.node} sent a file listing over {cap:,} bytes; refused unread") from exc
        return files.within(files.parse_listing(data, limits.max_files or 10**6, str(self.node)), limits)

    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        """Copy the node's files into ``target`` within ``limits``; ``known`` spares fetching unchanged ones."""
        return files.fetch_into(self, target, limits, known)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        route = f"{self.route}/files/{paths.encode(name)}"  # checked before anything is sent
        with self._on_node():
            stream = self.client.stream("GET", route, f"send {name!r}")
            response = stream.__enter__()
        said = response.headers.get("x-nbexec-size", "")
        if not said.isdigit() or len(said) > 18 or (max_bytes and int(said) > max_bytes):
            stream.__exit__(None, None, None)
            if not said.isdigit() or len(said) > 18:
                raise ProtocolError(f"node {self.node} sent a file without its size")
            raise FileTooLargeError(f"{name!r} on node {self.node} is larger than the cap of {max_bytes:,} bytes "
                                    f"({int(said):,} bytes); nothing was read")
        return int(said), transfer.FileChunks(_Body(stream, response, int(said), self), int(said), 1 << 20)

    def data_notes(self) -> tuple[list[str], bool]:
        with self._on_node():
            return self._noted(self._answer(self.client.json("GET", f"{self.route}/notes", "report on /mnt/data",
                                                             SMALL)))

    def provide_wheels(self, wheels: Sequence[WheelFile]) -> None:
        for wheel in wheels:
            if wheel.filename in self._wheels:
                continue
            route = f"{self.route}/wheels/{paths.encode(wheel.filename)}"
            with self._on_node(), open(wheel.path, "rb") as blob:
                self.client.send("PUT", route, f"take {wheel.filename}", params={"sha256": wheel.sha256},
                                 content=iter(lambda: blob.read(1 << 20), b""))
            self._wheels.add(wheel.filename)

    def take_connections(self) -> tuple[tuple[Connection, ...], list[str]]:
        with self._on_node():
            data = self._answer(self.client.json("POST", f"{self.route}/connections", "report connections",
                                                 MAX_CONNECTIONS))
        try:
            found = tuple(Connection.from_dict(c) for c in data["connections"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"node {self.node} reported connections with something else") from exc
        notes = texts(data.get("notes"))
        if notes is None:
            raise ProtocolError(f"node {self.node} reported connections with something else")
        return found, notes

    def change_egress(self, allow: Sequence[str], deny: Sequence[str]) -> None:
        with self._on_node():  # the node checks it against its own policy too
            self.client.send("POST", f"{self.route}/egress", "change the egress rules",
                             json={"allow": list(allow), "deny": list(deny)})


class _Body:
    """A file's body as a binary file object for `transfer.FileChunks`: never past its declared size (a node
    that sends more is refused), the response closed at the end."""

    def __init__(self, stream: Any, response: Any, size: int, handle: RemoteHandle) -> None:
        self._stream, self._chunks, self._left, self._handle = stream, response.iter_bytes(1 << 20), size, handle
        self._pending = b""
        self.closed = False

    def read(self, count: int) -> bytes:
        if self.closed:
            return b""
        try:
            with self._handle.client.call("send a file"):
                while not self._pending:
                    self._pending = next(self._chunks, b"")
                    if not self._pending:
                        return b""
                    if len(self._pending) > self._left:
                        raise FileTransferError(f"node {self._handle.node} sent a file larger than it said")
                    self._left -= len(self._pending)
        except Exception:
            self.close()
            raise
        data, self._pending = self._pending[:count], self._pending[count:]
        return data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self._stream.__exit__(None, None, None)
