"""Run a notebook's code cells on a sandbox's kernel, enforcing the time and output limits as it goes.

Everything the result says comes from the kernel protocol's replies and from Docker's view of the container,
never from anything the code could print or write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbformat import NotebookNode, from_dict

from .config import SandboxConfig, parse_size
from .sandbox import Sandbox

log = logging.getLogger(__name__)

OutputCallback = Callable[[int, NotebookNode], None]
_POLL = 0.25  # seconds between checks of the deadline while a cell is silent
_LIVENESS_EVERY = 1.0  # seconds between asking Docker whether the sandbox still runs
_FLOOD = frozenset({"stream"})  # once the text cap is reached, stream messages are counted, not parsed


@dataclass
class Budget:
    """What is left of the execution's output allowance, and what was dropped."""

    text: int
    display: int
    dropped_text: int = 0
    dropped_display: int = 0
    markers: list[NotebookNode] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Budget:
        return cls(text=parse_size(config.max_output), display=parse_size(config.max_display))

    @property
    def dropped(self) -> int:
        return self.dropped_text + self.dropped_display

    def finish(self, text_limit: int) -> None:
        """Write the final counts into the truncation markers."""
        for marker in self.markers:
            marker["text"] = _marker_text(text_limit, self.dropped)


def _marker_text(limit: int, dropped: int) -> str:
    return f"\n[nbexec: output truncated at the {limit:,}-byte limit; {dropped:,} bytes dropped]\n"


@dataclass
class CellOutcome:
    """How one cell ended. ``status`` is ok, error, timeout, oom, died or limit."""

    status: str
    execution_count: int | None = None
    duration_s: float = 0.0
    message: str = ""
    exit_code: int | None = None


class _CellState:
    """Outputs of the running cell, with stream merging, clear_output and display updates."""

    def __init__(self, cell: NotebookNode, index: int, budget: Budget, on_output: OutputCallback | None) -> None:
        self.cell, self.index, self.budget, self.on_output = cell, index, budget, on_output
        self.clear_pending = False
        self.displays: dict[str, list[NotebookNode]] = {}

    def add(self, msg: dict[str, Any]) -> None:
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "clear_output":
            if content.get("wait"):
                self.clear_pending = True
            else:
                self.cell.outputs = []
            return
        if kind == "update_display_data":
            for output in self.displays.get(content.get("transient", {}).get("display_id", ""), []):
                output["data"], output["metadata"] = content["data"], content.get("metadata", {})
            return
        if self.clear_pending:
            self.cell.outputs, self.clear_pending = [], False
        if "skipped_bytes" in content:  # a stream message past the cap, counted unparsed
            self.budget.dropped_text += content["skipped_bytes"]
            self._ensure_marker()
            return
        output = _output(kind, content)
        if kind == "stream":
            self._add_stream(output)
            return
        if kind in ("display_data", "execute_result") and not self._fits(output):
            return
        display_id = content.get("transient", {}).get("display_id")
        if display_id:
            self.displays.setdefault(display_id, []).append(output)
        self._append(output)

    def _append(self, output: NotebookNode) -> None:
        self.cell.outputs.append(output)
        if self.on_output is not None:
            self.on_output(self.index, output)

    def _add_stream(self, output: NotebookNode) -> None:
        text = output["text"]
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.budget.text:
            kept = text.encode("utf-8", "surrogatepass")[: self.budget.text].decode("utf-8", "ignore")
            self.budget.dropped_text += size - len(kept.encode("utf-8"))
            text, size = kept, len(kept.encode("utf-8"))
            self._ensure_marker()
        self.budget.text -= size
        if not text:
            return
        outputs = self.cell.outputs
        last = outputs[-1] if outputs else None
        if self.on_output is not None:
            self.on_output(self.index, NotebookNode(output_type="stream", name=output["name"], text=text))
        if last is not None and last.get("output_type") == "stream" and last["name"] == output["name"] \
                and not any(last is marker for marker in self.budget.markers):
            last["text"] += text
        else:
            outputs.append(NotebookNode(output_type="stream", name=output["name"], text=text))

    def _fits(self, output: NotebookNode) -> bool:
        data = output.get("data", {})
        text_size = sum(len(str(v)) for k, v in data.items() if k.startswith("text/") and k != "text/html")
        display_size = sum(len(str(v)) for k, v in data.items() if not (k.startswith("text/") and k != "text/html"))
        if text_size <= self.budget.text and display_size <= self.budget.display:
            self.budget.text -= text_size
            self.budget.display -= display_size
            return True
        self.budget.dropped_text += text_size
        self.budget.dropped_display += display_size
        self._ensure_marker()
        return False

    def _ensure_marker(self) -> None:
        """Put one truncation marker (filled in at the end) in this cell's outputs."""
        if any(marker is output for marker in self.budget.markers for output in self.cell.outputs):
            return
        marker = NotebookNode(output_type="stream", name="stderr", text="")
        self.budget.markers.append(marker)
        self.cell.outputs.append(marker)


def _output(kind: str, content: dict[str, Any]) -> NotebookNode:
    """An nbformat output from an iopub message (like nbformat's output_from_msg, without re-validating)."""
    if kind == "stream":
        return from_dict({"output_type": "stream", "name": content.get("name", "stdout"), "text": content["text"]})
    if kind == "error":
        return from_dict({"output_type": "error", "ename": content.get("ename", ""),
                          "evalue": content.get("evalue", ""), "traceback": content.get("traceback", [])})
    output = {"output_type": kind, "data": content.get("data", {}), "metadata": content.get("metadata", {})}
    if kind == "execute_result":
        output["execution_count"] = content.get("execution_count")
    return from_dict(output)


def run_cell(sandbox: Sandbox, cell: NotebookNode, index: int, *, config: SandboxConfig, deadline: float,
             budget: Budget, on_output: OutputCallback | None = None) -> CellOutcome:
    """Execute one code cell, filling ``cell.outputs``; stop it at ``deadline`` (a time.monotonic() value)."""
    client = sandbox.client
    assert client is not None
    started = time.monotonic()
    cell.outputs = []
    state = _CellState(cell, index, budget, on_output)
    msg_id = client.execute(cell.source, store_history=True, allow_stdin=False, stop_on_error=True)
    outcome = _wait_idle(sandbox, config, msg_id, state, deadline)
    outcome.duration_s = time.monotonic() - started
    cell.execution_count = outcome.execution_count
    cell.metadata.setdefault("nbexec", {})["duration_s"] = round(outcome.duration_s, 6)
    return outcome


def _wait_idle(sandbox: Sandbox, config: SandboxConfig, msg_id: str, state: _CellState,
               deadline: float) -> CellOutcome:
    outcome = CellOutcome(status="ok")
    next_check = time.monotonic() + _LIVENESS_EVERY
    while True:
        now = time.monotonic()
        skip = _FLOOD if state.budget.text <= 0 else frozenset()
        msg = sandbox.recv("iopub", max(0.0, min(_POLL, deadline - now)), skip=skip)
        if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
            kind = msg["msg_type"]
            if kind == "status":
                if msg["content"]["execution_state"] == "idle":
                    break
            elif kind == "execute_input":
                outcome.execution_count = msg["content"].get("execution_count")
            elif kind == "error":
                outcome.status = "error"
                state.add(msg)
            elif kind != "comm_msg" and not kind.startswith("comm_"):
                state.add(msg)
        now = time.monotonic()
        if now >= deadline:
            return _stop_overrun(sandbox, config.interrupt_grace, msg_id, state, outcome)
        if now >= next_check:
            next_check = now + _LIVENESS_EVERY
            stopped = _check_sandbox(sandbox)
            if stopped is not None:
                stopped.execution_count = outcome.execution_count
                return stopped
    _drain_reply(sandbox, msg_id)
    return outcome


def _check_sandbox(sandbox: Sandbox) -> CellOutcome | None:
    """Return how the cell ended if the sandbox died; None while all is well. (/mnt/data is capped by its own
    filesystem, see `datafs`.)"""
    container = sandbox.state()
    if not container.running:
        if container.oom_killed:
            return CellOutcome(status="oom", exit_code=container.exit_code, message=(
                f"The sandbox ran out of memory (limit {sandbox.config.memory}) and its kernel was killed. "
                "Use less memory (process data in chunks) or raise the limit (--memory / NBEXEC_MEMORY)."))
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
        msg = sandbox.recv("iopub", min(_POLL, max(0.0, give_up - time.monotonic())))
        if msg is None:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            _drain_reply(sandbox, msg_id)
            return CellOutcome(status="timeout", execution_count=outcome.execution_count,
                               message="interrupted")
        if msg["msg_type"] not in ("error", "status"):  # the KeyboardInterrupt traceback is replaced
            state.add(msg)
    sandbox.kill()
    return CellOutcome(status="timeout", execution_count=outcome.execution_count, message="killed")


def _drain_reply(sandbox: Sandbox, msg_id: str) -> None:
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        reply = sandbox.recv("shell", 0.2)
        if reply is not None and reply["parent_header"].get("msg_id") == msg_id:
            return
