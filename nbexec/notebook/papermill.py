"""Papermill's view of a run: its metadata on the executed notebook, and its rule for an early sys.exit(). Pure.

Papermill (engines.py `NotebookExecutionManager`) clears the code cells before a run. It marks each cell pending,
running, then completed or failed, and times the notebook and every cell. Papermill-aware tools (scrapbook's
`read_notebook`, dashboards) read `metadata.papermill` of the notebook and of each cell. nbexec writes the same
keys in the same shapes, so those tools read an nbexec run as they read a papermill one.
The rule for an early exit is papermill's `raise_for_execution_errors` (execute.py). A cell whose error outputs are
all `SystemExit` with an empty value or "0" ended the notebook successfully; any other error fails it.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping
from typing import Any

from nbformat import NotebookNode

from nbexec.result import CellError

FORMAT_VERSION = "2.7.0"  # the papermill release whose metadata layout nbexec writes
PENDING, COMPLETED, FAILED = "pending", "completed", "failed"
_CLEAN_EXIT = ("", "0")  # papermill: SystemExit with these values ends a notebook successfully


def start(nb: NotebookNode, first_cell: int) -> None:
    """Prepare the cells from ``first_cell`` for a run, as papermill's notebook_start does.

    Code cells lose an earlier run's outputs and execution counts, so nothing stale is reported as this run's.
    Every cell is pending."""
    for cell in nb.cells[first_cell:]:
        if cell.get("cell_type") == "code":
            cell["execution_count"] = None
            cell["outputs"] = []
        cell.setdefault("metadata", {})["papermill"] = _cell_stamp(PENDING, exception=None)


def clean_exit(nb: NotebookNode, error: CellError | None) -> str | None:
    """The SystemExit value ("" or "0") when ``error`` ends the notebook successfully by papermill's rule; else None.

    Every error output of its cell must be a SystemExit with an empty value or "0". Only an exception qualifies:
    a timeout, a dead kernel or a limit is never a clean exit."""
    if error is None or error.kind != "exception" or error.ename != "SystemExit" or error.cell_index is None \
            or not 0 <= error.cell_index < len(nb.cells):
        return None
    shown = [o for o in nb.cells[error.cell_index].get("outputs", []) if o.get("output_type") == "error"]
    if not shown or any(o.get("ename") != "SystemExit" or o.get("evalue") not in _CLEAN_EXIT for o in shown):
        return None
    return str(shown[0].get("evalue"))


def settle_exit(nb: NotebookNode, error: CellError | None) -> tuple[CellError | None, int | None, tuple[str, ...]]:
    """Settle a run the code ended with sys.exit(0), SystemExit() or exit(): it succeeded, by papermill's rule.

    Returns the error left, the cell it ended in and the note that says so; ``nb.metadata.nbexec.exit`` records it.
    The exit stays in the notebook, where it happened."""
    value = clean_exit(nb, error)
    nb.metadata.get("nbexec", {}).pop("exit", None)
    if value is None or error is None or error.cell_index is None:
        return error, None, ()
    index, left = error.cell_index, cells_after(nb, error.cell_index)
    nb.metadata.setdefault("nbexec", {})["exit"] = {"cell_index": index, "value": value, "cells_not_run": left}
    rest = f"{left} cell after it was not run" if left == 1 else f"{left} cells after it were not run"
    return None, index, (f"The code ended the run at cell {index} with SystemExit({value!r}): a success, as in "
                         f"papermill; {rest}.",)


def stamp(nb: NotebookNode, *, first_cell: int, stopped_at: int | None, started: datetime.datetime,
          ended: datetime.datetime, input_path: str | None, output_path: str | None,
          raised: Collection[int] = ()) -> None:
    """Write papermill's run metadata into ``nb``.

    The run covered the cells from ``first_cell`` and stopped in cell ``stopped_at``: an error, or an exit that
    papermill also marks failed. The cells in ``raised`` failed and the run went on, as with allow_errors."""
    parameters = _get(nb.metadata, "nbexec", "parameters")
    defaults = _get(nb.metadata, "papermill", "default_parameters")  # papermill keeps what the input had
    nb.metadata["papermill"] = {
        "default_parameters": dict(defaults) if isinstance(defaults, Mapping) else {},
        "parameters": dict(parameters) if isinstance(parameters, Mapping) else {},
        "environment_variables": {},
        "version": FORMAT_VERSION,
        "input_path": input_path,
        "output_path": output_path,
        "start_time": started.isoformat(),
        "end_time": ended.isoformat(),
        "duration": round((ended - started).total_seconds(), 6),
        "exception": True if stopped_at is not None or raised else None,
    }
    for index in range(first_cell, len(nb.cells)):
        cell = nb.cells[index]
        if stopped_at is not None and index > stopped_at:
            cell.setdefault("metadata", {})["papermill"] = _cell_stamp(PENDING, exception=None)
        else:
            cell.setdefault("metadata", {})["papermill"] = _ran(cell, failed=index == stopped_at or index in raised)


def _cell_stamp(status: str, *, exception: bool | None, start: str | None = None, end: str | None = None,
                duration: float | None = None) -> dict[str, Any]:
    return {"exception": exception, "start_time": start, "end_time": end, "duration": duration, "status": status}


def _ran(cell: NotebookNode, *, failed: bool) -> dict[str, Any]:
    """A cell the run reached, timed from nbexec's own record: the host's stamps of the kernel's messages.

    A cell that was not executed (markdown, skipped) is completed untimed."""
    metadata = cell.get("metadata", {})
    duration = _get(metadata, "nbexec", "duration_s") if cell.get("cell_type") == "code" else None
    if not isinstance(duration, (int, float)):
        return _cell_stamp(FAILED if failed else COMPLETED, exception=failed)
    end = _latest(metadata.get("execution", {}))
    start = None if end is None else end - datetime.timedelta(seconds=duration)
    return _cell_stamp(FAILED if failed else COMPLETED, exception=failed,
                       start=None if start is None else start.isoformat(),
                       end=None if end is None else end.isoformat(), duration=round(float(duration), 6))


def _get(metadata: Mapping[str, Any], section: str, key: str) -> Any:
    """``metadata[section][key]``, or None where either is missing or not a mapping (input notebooks carry any)."""
    holder = metadata.get(section)
    return holder.get(key) if isinstance(holder, Mapping) else None


def _latest(stamps: Any) -> datetime.datetime | None:
    """The last of a cell's nbclient timing stamps (``cell.metadata.execution``), or None."""
    found = []
    for value in stamps.values() if isinstance(stamps, Mapping) else ():
        try:
            found.append(datetime.datetime.fromisoformat(str(value)))
        except ValueError:
            continue
    aware = [stamp for stamp in found if stamp.tzinfo is not None]
    return max(aware) if aware else None


def cells_after(nb: NotebookNode, index: int) -> int:
    """Code cells after ``index`` that a run stopping there leaves unrun."""
    return sum(1 for cell in nb.cells[index + 1:]
               if cell.get("cell_type") == "code" and str(cell.get("source", "")).strip())
