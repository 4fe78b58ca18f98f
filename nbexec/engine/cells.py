"""Run a notebook's code cells on a sandbox, turning the kernel's messages into cell outputs within the budget.

Everything the result says comes from the kernel protocol's replies and from the sandbox's own view of itself,
never from anything the code could print or write. The wire protocol is spoken by `sandbox.kernel`; this module
keeps the cell loop (tags, deadlines, failures) and the output rules (nbclient's process_message and
_update_display_id, for the kinds nbexec keeps).

Why not nbclient's NotebookClient: it was measured driving the same sandbox kernel (benchmarks/nbclient_loop.py,
jupyter_client over libzmq ipc, 2 shared cores): a print() cell took 6.5 ms p50 against 3.8 ms here, and a cell
writing 50 MB to stdout was kept whole (50 MB in the notebook, a 60 MiB host peak) against 1 MB kept (the
max_output budget) and a 4 MiB peak here. nbclient's hooks receive messages jupyter_client has already received in
full and parsed, so no budget can be charged before parsing; it learns of a dead kernel from a local
KernelManager or heartbeats, not from Docker's OOM flag. So nbexec keeps its own loop and holds to nbclient's
behaviours instead: raises-exception and skip-execution tags, execution counts, cell.metadata.execution timing,
display updates across cells, widget state in the notebook's metadata (`widgets`), and `transient: null` and
unknown message kinds ignored (tests/test_cells.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbformat import NotebookNode, from_dict

from nbexec.config import SandboxConfig
from nbexec.errors import ProtocolError
from nbexec.notebook import outputs
from nbexec.result import CellError
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.messages import Message
from nbexec.sandbox.source import SandboxHandle

from . import widgets

log = logging.getLogger(__name__)

OutputCallback = Callable[[int, NotebookNode], None]
Displays = dict[str, list[NotebookNode]]  # display id -> the outputs that show it (update_display_data)
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
        return cls(text=config.max_output_bytes, display=config.max_display_bytes, outputs=config.max_outputs)

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


class _CellState:
    """Outputs of the running cell: each message charged by its raw size before it is parsed, then stream
    merging, clear_output and display updates (nbclient's process_message, for the kinds nbexec keeps)."""

    def __init__(self, cell: NotebookNode, index: int, budget: Budget, on_output: OutputCallback | None,
                 displays: Displays | None = None, widget_state: widgets.WidgetState | None = None) -> None:
        self.cell, self.index, self.budget, self.on_output = cell, index, budget, on_output
        self.clear_pending = False
        self.displays: Displays = {} if displays is None else displays
        self.widgets = widget_state

    def add(self, msg: Message) -> None:
        """Keep what fits of one output message; raises ProtocolError for a malformed one."""
        kind, budget = msg.msg_type, self.budget
        if kind in widgets.KINDS:  # charged against the display allowance, by its raw size, before parsing
            budget.display -= self.widgets.add(msg, budget.display) if self.widgets is not None else 0
            return None
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


def run_cell(sandbox: SandboxHandle, cell: NotebookNode, index: int, *, deadline: float, budget: Budget,
             on_output: OutputCallback | None = None, displays: Displays | None = None,
             widget_state: widgets.WidgetState | None = None) -> CellOutcome:
    """Execute one code cell, filling ``cell.outputs``; stop it at ``deadline`` (a time.monotonic() value).
    ``displays`` (display id -> outputs) and ``widget_state`` span the cells of a session, so an update reaches
    earlier cells and widget models."""
    started = time.monotonic()
    cell.outputs = []
    state = _CellState(cell, index, budget, on_output, displays, widget_state)
    try:
        run = sandbox.run(cell.source, deadline=deadline, on_output=state.add)
        outcome = _outcome(sandbox, run)
        if run.exit_value is not None and outcome.status == "ok":
            outcome = _asked_to_exit(state, outcome, run.exit_value)
    except ProtocolError as exc:
        outcome = _misbehaved(sandbox, exc)
        run = None
    outcome.duration_s = time.monotonic() - started
    cell.execution_count = outcome.execution_count
    if run is not None and run.timing:
        cell.metadata["execution"] = dict(run.timing)  # nbclient's per-cell timing keys
    cell.metadata.setdefault("nbexec", {})["duration_s"] = round(outcome.duration_s, 6)
    return outcome


def _asked_to_exit(state: _CellState, outcome: CellOutcome, value: str) -> CellOutcome:
    """The cell called exit() or quit(): shown and judged as the SystemExit that sys.exit() raises (its value is
    at most 200 characters: kept whatever the output budget), so the run ends there as a script's would."""
    state._append(from_dict({"output_type": "error", "ename": "SystemExit", "evalue": value, "traceback": [
        "The code called exit() or quit(): the run ends here, as with sys.exit().", f"SystemExit: {value}"]}))
    outcome.status = "error"
    return outcome


def _outcome(sandbox: SandboxHandle, run: Execution) -> CellOutcome:
    if run.status == "gone":
        stopped = _check_sandbox(sandbox) or CellOutcome(status="died", message="The sandbox stopped.")
        stopped.execution_count = run.execution_count
        return stopped
    return CellOutcome(status=run.status, execution_count=run.execution_count, message=run.stop)


def _misbehaved(sandbox: SandboxHandle, exc: ProtocolError) -> CellOutcome:
    """The kernel broke the protocol: unless it simply died, stop the sandbox and say so."""
    if sandbox.kernel_lost:  # the kernel went away: give Docker time to see the container stop
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


def _check_sandbox(sandbox: SandboxHandle) -> CellOutcome | None:
    """Return how the cell ended if the sandbox died; None while all is well."""
    container = sandbox.state()
    if not container.running:
        if container.oom_killed:
            return CellOutcome(status="oom", message=(
                f"The sandbox ran out of memory (limit {sandbox.config.memory}) and its kernel was killed. "
                "Use less memory (process data in chunks) or raise the limit (--memory / NBEXEC_MEMORY)."))
        if container.exit_code is None:  # Docker no longer knows it: removed from outside, not by the code
            return CellOutcome(status="died", message=(
                "The sandbox's container was removed from outside nbexec (docker rm, a cleanup job, or the "
                "engine restarted) while the code ran; this is not an error in the code. Run it again."))
        return CellOutcome(status="died", message=(
            f"The kernel died (exit code {container.exit_code}): the code ended the process "
            "(os._exit, a crash in native code, or a fatal signal). Its variables are lost."))
    return None


# -- the cells of a run ----------------------------------------------------------------------------------

_KIND = {"timeout": "timeout", "oom": "oom", "died": "kernel_died", "limit": "limit", "protocol": "protocol"}
_NAMES = {"oom": "MemoryError", "died": "DeadKernelError", "limit": "DataLimitError", "protocol": "ProtocolError"}


def _tags(cell: NotebookNode) -> list[str]:
    tags = cell.get("metadata", {}).get("tags", [])
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def run_cells(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig, *, first_index: int = 0,
              on_output: OutputCallback | None = None, displays: Displays | None = None,
              widget_state: widgets.WidgetState | None = None) -> tuple[CellError | None, int]:
    """Run the code cells from ``first_index`` until the first failure; return (the failure, bytes dropped).

    The standard tags hold: ``skip-execution`` skips a cell; in a ``raises-exception`` cell an exception is
    expected (kept in its outputs) and the run goes on. Timeouts, deaths and protocol errors always stop it.
    The widget models (``widget_state``, kept by a session across its runs) end in ``nb.metadata.widgets``."""
    budget = Budget.from_config(config)
    deadline = time.monotonic() + config.timeout
    displays = {} if displays is None else displays  # a display id spans cells (nbclient's _update_display_id)
    widget_state = (widgets.WidgetState() if widget_state is None else widget_state).limit(config)
    error: CellError | None = None
    for index in range(first_index, len(nb.cells)):
        cell = nb.cells[index]
        if cell.cell_type != "code" or not cell.source.strip() or "skip-execution" in _tags(cell):
            continue
        cell_limit = min(config.cell_timeout or config.timeout, config.timeout)
        cell_deadline = min(deadline, time.monotonic() + cell_limit)
        outcome = run_cell(sandbox, cell, index, deadline=cell_deadline, budget=budget, on_output=on_output,
                           displays=displays, widget_state=widget_state)
        if outcome.status == "error" and "raises-exception" in _tags(cell):
            continue
        if outcome.status == "error":
            error = outputs.first_error([{"cell_index": index, **o} for o in cell.outputs])
            break
        if outcome.status != "ok":
            limit = cell_limit if cell_deadline < deadline else config.timeout
            error = _outcome_error(outcome, index, config, limit)
            cell.outputs.append(from_dict({"output_type": "error", "ename": error.ename, "evalue": error.evalue,
                                           "traceback": [f"{error.ename}: {error.evalue}"]}))
            break
    budget.finish(config.max_output_bytes, config.max_outputs)
    widget_state.save(nb)
    return error, budget.dropped


def _outcome_error(outcome: CellOutcome, index: int, config: SandboxConfig, cell_limit: float) -> CellError:
    if outcome.status == "timeout":
        how = ("was interrupted" if outcome.message == "interrupted"
               else f"did not stop within {config.interrupt_grace:g} s of being interrupted, so the sandbox was killed")
        return CellError("TimeoutError", f"The cell ran past the {cell_limit:g} s time limit and {how}. "
                         "Make it faster, or raise the limit (--timeout / NBEXEC_TIMEOUT).", (), "timeout", index)
    return CellError(_NAMES[outcome.status], outcome.message, (), _KIND[outcome.status], index)
