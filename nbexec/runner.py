"""Run a notebook's code cells on a sandbox's kernel, enforcing the time and output limits as it goes.

Everything the result says comes from the kernel protocol's replies and from Docker's view of the container,
never from anything the code could print or write.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbformat import NotebookNode, from_dict

from . import outputs
from .config import SandboxConfig, parse_size
from .errors import ProtocolError
from .sandbox.container import Sandbox
from .sandbox.kernel import MAX_CONTROL, Message

log = logging.getLogger(__name__)

OutputCallback = Callable[[int, NotebookNode], None]
_POLL = 0.25  # seconds between checks of the deadline while a cell is silent
_LIVENESS_EVERY = 1.0  # seconds between asking Docker whether the sandbox still runs
_IDLE_AFTER_REPLY = 1.0  # seconds to wait for iopub's idle once the shell reply is in (a full PUB queue drops it)
_OUTPUT_KINDS = frozenset({"stream", "display_data", "execute_result", "error", "update_display_data",
                           "clear_output"})
MAX_ERROR = 1024 * 1024  # bytes of an error's name + value + traceback kept; the rest is trimmed with a marker


@dataclass
class Budget:
    """What is left of the execution's output allowance (bytes and outputs), and what was dropped."""

    text: int
    display: int
    outputs: int
    dropped_text: int = 0
    dropped_display: int = 0
    dropped_outputs: int = 0
    dropped_frames: int = 0  # messages streamed past unread: larger than the whole allowance
    errors: int = 0
    markers: list[NotebookNode] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Budget:
        return cls(text=parse_size(config.max_output), display=parse_size(config.max_display),
                   outputs=config.max_outputs)

    @property
    def dropped(self) -> int:
        return self.dropped_text + self.dropped_display

    def finish(self, text_limit: int, output_limit: int = 0) -> None:
        """Write the final counts into the truncation markers."""
        for marker in self.markers:
            marker["text"] = _marker_text(text_limit, self.dropped, output_limit, self.dropped_outputs)
            if self.dropped_frames:
                marker["text"] = marker["text"][:-2] + (
                    f"; {self.dropped_frames:,} messages larger than the whole output allowance dropped]\n")


def _marker_text(limit: int, dropped: int, output_limit: int = 0, dropped_outputs: int = 0) -> str:
    text = f"\n[nbexec: output truncated at the {limit:,}-byte limit; {dropped:,} bytes dropped"
    if dropped_outputs:
        text += f"; {dropped_outputs:,} outputs dropped past the {output_limit:,}-output limit"
    return text + "]\n"


@dataclass
class CellOutcome:
    """How one cell ended. ``status`` is ok, error, timeout, oom, died, limit or protocol."""

    status: str
    execution_count: int | None = None
    duration_s: float = 0.0
    message: str = ""
    exit_code: int | None = None


class _CellState:
    """Outputs of the running cell: each message charged by its raw size before it is parsed, then stream
    merging, clear_output and display updates (nbclient's process_message, for the kinds nbexec keeps)."""

    def __init__(self, cell: NotebookNode, index: int, budget: Budget, on_output: OutputCallback | None) -> None:
        self.cell, self.index, self.budget, self.on_output = cell, index, budget, on_output
        self.clear_pending = False
        self.displays: dict[str, list[NotebookNode]] = {}

    def add(self, msg: Message) -> None:
        """Keep what fits of one output message; raises ProtocolError for a malformed one."""
        kind, budget = msg.msg_type, self.budget
        if not msg.complete:
            return self.drop_frame(msg.size)
        if kind == "stream":
            if budget.text <= 0:
                return self._drop(msg.size, text=True)
            self._add_stream(msg.content())
        elif kind == "error":
            # The first error is always kept (trimmed): it is what the result reports.
            if budget.errors and (budget.text < msg.size or budget.outputs <= 0):
                return self._drop(msg.size, text=True, output=True)
            budget.errors += 1
            budget.text -= msg.size
            budget.outputs -= 1
            self._append(_error_output(msg.content()))
        elif kind == "clear_output":
            if budget.text < msg.size:
                return self._drop(msg.size, text=True)
            budget.text -= msg.size
            self._clear(msg.content())
        elif budget.display < msg.size:
            return self._drop(msg.size, text=False, output=kind != "update_display_data")
        elif kind == "update_display_data":
            budget.display -= msg.size
            self._update(msg.content())
        else:  # display_data, execute_result
            if budget.outputs <= 0:
                return self._drop(msg.size, text=False, output=True)
            budget.display -= msg.size
            self._add_display(kind, msg.content())
        return None

    def drop_frame(self, size: int) -> None:
        """Count a message over the frame limit (``size`` bytes, streamed past unread)."""
        self.budget.dropped_frames += 1
        self._drop(size, text=False)

    def _drop(self, size: int, *, text: bool, output: bool = False) -> None:
        if text:
            self.budget.dropped_text += size
        else:
            self.budget.dropped_display += size
        self.budget.dropped_outputs += output
        self._ensure_marker()

    def _clear(self, content: dict[str, Any]) -> None:
        if content.get("wait"):
            self.clear_pending = True
        else:
            self.cell.outputs = []

    def _update(self, content: dict[str, Any]) -> None:
        data, metadata = _bundle(content)
        for output in self.displays.get(_display_id(content) or "", []):
            output["data"], output["metadata"] = data, metadata

    def _add_display(self, kind: str, content: dict[str, Any]) -> None:
        data, metadata = _bundle(content)
        output: dict[str, Any] = {"output_type": kind, "data": data, "metadata": metadata}
        if kind == "execute_result":
            count = content.get("execution_count")
            output["execution_count"] = count if isinstance(count, int) else None
        text_size = sum(len(str(v)) for k, v in data.items() if k.startswith("text/") and k != "text/html")
        if text_size > self.budget.text:  # the text of rich outputs counts against the text allowance too
            return self._drop(text_size, text=True, output=True)
        self.budget.text -= text_size
        self.budget.outputs -= 1
        node = from_dict(output)
        display_id = _display_id(content)
        if display_id:
            self.displays.setdefault(display_id, []).append(node)
        self._append(node)
        return None

    def _append(self, output: NotebookNode) -> None:
        if self.clear_pending:
            self.cell.outputs, self.clear_pending = [], False
        self.cell.outputs.append(output)
        if self.on_output is not None:
            self.on_output(self.index, output)

    def _add_stream(self, content: dict[str, Any]) -> None:
        name, text = content.get("name"), content.get("text")
        if not isinstance(name, str) or not isinstance(text, str):
            raise ProtocolError("a stream message without a string name and text")
        size = len(text.encode("utf-8"))
        over = 0
        if size > self.budget.text:
            kept = text.encode("utf-8")[: self.budget.text].decode("utf-8", "ignore")
            over, text, size = size - len(kept.encode("utf-8")), kept, len(kept.encode("utf-8"))
        self.budget.text -= size
        if text:
            self._keep_stream(name, text, size)
        if over:
            self._drop(over, text=True)

    def _keep_stream(self, name: str, text: str, size: int) -> None:
        if self.clear_pending:
            self.cell.outputs, self.clear_pending = [], False
        outputs = self.cell.outputs
        last = outputs[-1] if outputs else None
        if last is not None and last.get("output_type") == "stream" and last["name"] == name \
                and not any(last is marker for marker in self.budget.markers):
            last["text"] += text
        elif self.budget.outputs <= 0:
            self._drop(size, text=True, output=True)
            return
        else:
            self.budget.outputs -= 1
            outputs.append(NotebookNode(output_type="stream", name=name, text=text))
        if self.on_output is not None:
            self.on_output(self.index, NotebookNode(output_type="stream", name=name, text=text))

    def _ensure_marker(self) -> None:
        """Put one truncation marker (filled in at the end) in this cell's outputs."""
        if any(marker is output for marker in self.budget.markers for output in self.cell.outputs):
            return
        marker = NotebookNode(output_type="stream", name="stderr", text="")
        self.budget.markers.append(marker)
        self.cell.outputs.append(marker)


def _bundle(content: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    data, metadata = content.get("data", {}), content.get("metadata", {})
    if not isinstance(data, dict) or not isinstance(metadata, dict):
        raise ProtocolError("a display message whose data or metadata is not a JSON object")
    return data, metadata


def _display_id(content: dict[str, Any]) -> str | None:
    # `transient` may be missing or null (nbclient keeps the same scar); anything else odd is ignored too.
    transient = content.get("transient")
    display_id = transient.get("display_id") if isinstance(transient, dict) else None
    return display_id if isinstance(display_id, str) else None


def _error_output(content: dict[str, Any]) -> NotebookNode:
    ename, evalue, traceback = content.get("ename", ""), content.get("evalue", ""), content.get("traceback", [])
    if not isinstance(ename, str) or not isinstance(evalue, str) or not isinstance(traceback, list) \
            or not all(isinstance(line, str) for line in traceback):
        raise ProtocolError("an error message whose ename, evalue or traceback has the wrong type")
    ename, evalue, lines = outputs.trim_error(ename, evalue, traceback, MAX_ERROR)
    return from_dict({"output_type": "error", "ename": ename, "evalue": evalue, "traceback": lines})


def run_cell(sandbox: Sandbox, cell: NotebookNode, index: int, *, config: SandboxConfig, deadline: float,
             budget: Budget, on_output: OutputCallback | None = None) -> CellOutcome:
    """Execute one code cell, filling ``cell.outputs``; stop it at ``deadline`` (a time.monotonic() value)."""
    client = sandbox.client
    assert client is not None
    started = time.monotonic()
    cell.outputs = []
    state = _CellState(cell, index, budget, on_output)
    msg_id = client.execute(cell.source, store_history=True, stop_on_error=True)
    try:
        outcome = _wait_idle(sandbox, config, msg_id, state, deadline)
    except ProtocolError as exc:
        outcome = _misbehaved(sandbox, config, exc)
    outcome.duration_s = time.monotonic() - started
    cell.execution_count = outcome.execution_count
    cell.metadata.setdefault("nbexec", {})["duration_s"] = round(outcome.duration_s, 6)
    return outcome


def _wait_idle(sandbox: Sandbox, config: SandboxConfig, msg_id: str, state: _CellState,
               deadline: float) -> CellOutcome:
    outcome = CellOutcome(status="ok")
    next_check = time.monotonic() + _LIVENESS_EVERY
    replied: float | None = None
    while True:
        now = time.monotonic()
        done, replied = _step(sandbox, msg_id, state, outcome, max(0.0, min(_POLL, deadline - now)), replied)
        if done:
            break
        now = time.monotonic()
        if now >= deadline:
            return _stop_overrun(sandbox, config.interrupt_grace, msg_id, state, outcome)
        if now >= next_check:
            next_check = now + _LIVENESS_EVERY
            stopped = _check_sandbox(sandbox)
            if stopped is not None:
                stopped.execution_count = outcome.execution_count
                return stopped
    if replied is None:
        _drain_reply(sandbox, msg_id)
    return outcome


def _step(sandbox: Sandbox, msg_id: str, state: _CellState, outcome: CellOutcome, timeout: float,
          replied: float | None) -> tuple[bool, float | None]:
    """Wait up to ``timeout`` for one message of the cell; (whether the cell is done, when the reply came)."""
    msg = sandbox.recv("iopub", timeout, parent=msg_id)
    if msg is not None:
        return _handle(msg, state, outcome), replied
    if replied is None:  # silence: a full PUB queue in the kernel drops messages, idle too
        if sandbox.recv("shell", 0, parent=msg_id) is not None:
            return False, time.monotonic()
    elif time.monotonic() - replied >= _IDLE_AFTER_REPLY:
        return True, replied
    return False, replied


def _handle(msg: Message, state: _CellState, outcome: CellOutcome) -> bool:
    """Apply one iopub message of the running cell; True once the kernel is idle."""
    kind = msg.msg_type
    if kind == "status":
        return msg.content(MAX_CONTROL).get("execution_state") == "idle"
    if kind == "execute_input":
        count = msg.content(MAX_CONTROL).get("execution_count")
        outcome.execution_count = count if isinstance(count, int) else None
    elif kind in _OUTPUT_KINDS:
        if kind == "error":
            outcome.status = "error"
        state.add(msg)
    return False  # comm_* and kinds nbexec does not know are ignored, unparsed


def _misbehaved(sandbox: Sandbox, config: SandboxConfig, exc: ProtocolError) -> CellOutcome:
    """The kernel broke the protocol: unless it simply died, stop the sandbox and say so."""
    client = sandbox.client
    if client is not None and client.lost:  # the kernel went away: give Docker time to see the container stop
        give_up = time.monotonic() + 3.0
        while sandbox.state().running and time.monotonic() < give_up:
            time.sleep(0.1)
    if not sandbox.state().running:
        died = _check_sandbox(sandbox)
        if died is not None:
            return died
    sandbox.kill()
    log.warning("sandbox %s broke the kernel protocol and was stopped: %s", sandbox.id, exc)
    return CellOutcome(status="protocol", message=(
        f"The sandbox misbehaved and was stopped: {exc}. The outputs received before are kept. "
        "Code that writes to the kernel's own sockets (or crashes its messaging) causes this."))


def _check_sandbox(sandbox: Sandbox) -> CellOutcome | None:
    """Return how the cell ended if the sandbox died; None while all is well. (/mnt/data is capped by its own
    filesystem, see `datafs`.)"""
    container = sandbox.state()
    if not container.running:
        if container.oom_killed:
            return CellOutcome(status="oom", exit_code=container.exit_code, message=(
                f"The sandbox ran out of memory (limit {sandbox.config.memory}) and its kernel was killed. "
                "Use less memory (process data in chunks) or raise the limit (--memory / NBEXEC_MEMORY)."))
        if container.exit_code is None:  # Docker no longer knows it: removed from outside, not by the code
            return CellOutcome(status="died", message=(
                "The sandbox's container was removed from outside nbexec (docker rm, a cleanup job, or the "
                "engine restarted) while the code ran; this is not an error in the code. Run it again."))
        return CellOutcome(status="died", exit_code=container.exit_code, message=(
            f"The kernel died (exit code {container.exit_code}): the code ended the process "
            "(os._exit, a crash in native code, or a fatal signal). Its variables are lost."))
    return None


def _stop_overrun(sandbox: Sandbox, grace: float, msg_id: str, state: _CellState,
                  outcome: CellOutcome) -> CellOutcome:
    """Interrupt a cell past its deadline; kill the sandbox if the kernel does not come back in time."""
    sandbox.interrupt()
    give_up = time.monotonic() + grace
    while time.monotonic() < give_up:
        msg = sandbox.recv("iopub", min(_POLL, max(0.0, give_up - time.monotonic())), parent=msg_id)
        if msg is None:
            continue
        if msg.msg_type == "status" and msg.content(MAX_CONTROL).get("execution_state") == "idle":
            _drain_reply(sandbox, msg_id)
            return CellOutcome(status="timeout", execution_count=outcome.execution_count,
                               message="interrupted")
        if msg.msg_type in _OUTPUT_KINDS - {"error"}:  # the KeyboardInterrupt traceback is replaced
            state.add(msg)
    sandbox.kill()
    return CellOutcome(status="timeout", execution_count=outcome.execution_count, message="killed")


def _drain_reply(sandbox: Sandbox, msg_id: str) -> None:
    """Read the shell reply of a finished cell, so the next cell's reply is not mistaken for it."""
    with contextlib.suppress(ProtocolError):  # the outputs are complete; a bad reply changes nothing
        sandbox.recv("shell", 1.0, parent=msg_id)
