"""Run a notebook's code cells on a sandbox, turning the kernel's messages into cell outputs within the budget.

Everything the result says comes from the kernel protocol's replies and from the sandbox's own view of itself,
never from anything the code could print or write. The wire protocol is spoken by `sandbox.kernel`; this module
keeps the cell loop (tags, deadlines, failures); `budget` keeps the output rules (nbclient's process_message and
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
from dataclasses import dataclass

from nbformat import NotebookNode, from_dict

from nbexec.config import SandboxConfig
from nbexec.errors import ProtocolError
from nbexec.kinds import ErrorKind
from nbexec.notebook import outputs
from nbexec.result import CellError
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.source import ContainerState, SandboxHandle

from . import traces, widgets
from .budget import Budget, CellState, Displays, OutputCallback, tags

OOM_NEWS = 2.0  # seconds the engine is given to report an OOM kill after a SIGKILL exit (see _check_sandbox)

log = logging.getLogger(__name__)


@dataclass
class CellOutcome:
    """How one cell ended. ``status`` is ok, error, timeout, oom, died, limit or protocol; ``error`` is the error
    output that ended it (status error)."""

    status: str
    execution_count: int | None = None
    duration_s: float = 0.0
    message: str = ""
    error: NotebookNode | None = None


def run_cell(sandbox: SandboxHandle, cell: NotebookNode, index: int, *, deadline: float, budget: Budget,
             on_output: OutputCallback | None = None, displays: Displays | None = None,
             widget_state: widgets.WidgetState | None = None) -> CellOutcome:
    """Execute one code cell, filling ``cell.outputs``; stop it at ``deadline`` (a time.monotonic() value).
    ``displays`` (display id -> outputs) and ``widget_state`` span the cells of a session, so an update reaches
    earlier cells and widget models."""
    started = time.monotonic()
    cell.outputs = []
    state = CellState(cell, index, budget, on_output, displays, widget_state)
    try:
        run = sandbox.run(cell.source, deadline=deadline, on_output=state.add)
        outcome = _outcome(sandbox, run)
        if run.exit_value is not None and outcome.status == "ok":
            outcome = _asked_to_exit(state, outcome, run.exit_value)
        if outcome.status == "error" and not state.expected:  # an expected error is kept only within the budget
            outcome.error = state.failure(run)
    except ProtocolError as exc:
        outcome = _misbehaved(sandbox, exc)
        run = None
    finally:
        state.finish()
    outcome.duration_s = time.monotonic() - started
    cell.execution_count = outcome.execution_count
    if run is not None and run.timing:
        cell.metadata["execution"] = dict(run.timing)  # nbclient's per-cell timing keys
    if run is not None and run.late_unread:
        cell.metadata.setdefault("nbexec", {})["output_unread"] = True
    cell.metadata.setdefault("nbexec", {})["duration_s"] = round(outcome.duration_s, 6)
    return outcome


def unread_notes(nb: NotebookNode, first_index: int) -> list[str]:
    """What the cells from ``first_index`` on were still printing when the host stopped reading (``run_cell``)."""
    return [f"cell {index} was still printing when its run ended (a timer or a background task?): what it printed "
            "later is not in this result" for index, cell in enumerate(nb.cells)
            if index >= first_index and cell.get("metadata", {}).get("nbexec", {}).get("output_unread")]


def _asked_to_exit(state: CellState, outcome: CellOutcome, value: str) -> CellOutcome:
    """The cell called exit() or quit(): shown and judged as the SystemExit that sys.exit() raises (its value is
    at most 200 characters: kept whatever the output budget), so the run ends there as a script's would. The
    error output is the one `CellState.failure` keeps at the end of the cell."""
    state.error = (from_dict({"output_type": "error", "ename": "SystemExit", "evalue": value, "traceback": [
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
    # A kernel that went away: Docker is given time to see its container stop.
    if not _state_until(sandbox, lambda state: not state.running, 3.0 if sandbox.kernel_lost else 0).running:
        died = _check_sandbox(sandbox)
        if died is not None:
            return died
    sandbox.kill()
    log.warning("sandbox %s broke the kernel protocol and was stopped: %s", sandbox.id, exc)
    where = f" on node {sandbox.node}" if sandbox.node and sandbox.node not in str(exc) else ""
    return CellOutcome(status="protocol", message=(
        f"The sandbox{where} misbehaved and was stopped: {exc}. The outputs received before are kept. "
        "Code that writes to the kernel's own sockets (or crashes its messaging) causes this."))


def _check_sandbox(sandbox: SandboxHandle) -> CellOutcome | None:
    """Return how the cell ended if the sandbox died; None while all is well."""
    container = sandbox.state()
    if not container.running and container.exit_code == 137 and not container.oom_killed:
        # Under gVisor the engine may hear of an OOM kill a moment after the exit (its `oom` event after `die`):
        # asked again before the death is put down to the code (the sandbox's state() reads that event).
        container = _state_until(sandbox, lambda state: state.oom_killed, OOM_NEWS, container)
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


def _state_until(sandbox: SandboxHandle, done: Callable[[ContainerState], bool], seconds: float,
                 state: ContainerState | None = None) -> ContainerState:
    """The sandbox's state, asked every 0.1 s until ``done`` holds of it or ``seconds`` have passed (``state``:
    one just read, not asked again at once)."""
    give_up = time.monotonic() + seconds
    state = sandbox.state() if state is None else state
    while not done(state) and time.monotonic() < give_up:
        time.sleep(0.1)
        state = sandbox.state()
    return state


# -- the cells of a run ----------------------------------------------------------------------------------

_KIND: dict[str, ErrorKind] = {"timeout": "timeout", "oom": "oom", "died": "kernel_died", "limit": "limit",
                               "protocol": "protocol"}
_NAMES = {"oom": "MemoryError", "died": "DeadKernelError", "limit": "DataLimitError", "protocol": "ProtocolError"}


def run_cells(sandbox: SandboxHandle, nb: NotebookNode, config: SandboxConfig, *, first_index: int = 0,
              on_output: OutputCallback | None = None, displays: Displays | None = None,
              widget_state: widgets.WidgetState | None = None,
              raised: list[CellError] | None = None) -> tuple[CellError | None, int]:
    """Run the code cells from ``first_index`` until the first failure; return (the failure, bytes dropped).

    The standard tags hold: ``skip-execution`` skips a cell; in a ``raises-exception`` cell an exception is
    expected (kept in its outputs) and the run goes on. Given ``raised`` (allow_errors, as nbclient's), every
    exception is appended there and the run goes on too; SystemExit (the code asking to end) still ends it.
    Timeouts, deaths and protocol errors always stop it.
    The widget models (``widget_state``, kept by a session across its runs) end in ``nb.metadata.widgets``."""
    budget = Budget.from_config(config)
    deadline = time.monotonic() + config.timeout
    displays = {} if displays is None else displays  # a display id spans cells (nbclient's _update_display_id)
    widget_state = (widgets.WidgetState() if widget_state is None else widget_state).limit(config)
    error: CellError | None = None
    for index in range(first_index, len(nb.cells)):
        cell = nb.cells[index]
        if cell.cell_type != "code" or not cell.source.strip() or "skip-execution" in tags(cell):
            continue
        cell_limit = min(config.cell_timeout or config.timeout, config.timeout)
        cell_deadline = min(deadline, time.monotonic() + cell_limit)
        with traces.span("nbexec.cell", {"nbexec.cell.index": index}) as current:
            outcome = run_cell(sandbox, cell, index, deadline=cell_deadline, budget=budget, on_output=on_output,
                               displays=displays, widget_state=widget_state)
            traces.mark(current, {"nbexec.cell.status": outcome.status})
            if outcome.status == "error" and "raises-exception" in tags(cell):
                continue
            if outcome.status != "ok":
                traces.fail(current, outcome.status)
        if outcome.status == "error":  # the error output that ended it, kept whatever the caps dropped
            error = outputs.first_error([{"cell_index": index, **(outcome.error or {})}])
            if raised is not None and error is not None and error.ename != "SystemExit":
                raised.append(error)  # allow_errors: kept, and the next cell runs
                error = None
                continue
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
