"""execute_notebook(): code or a notebook in, an ExecutionResult out, through one throwaway sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

from . import artifacts, egress, folders, notebook, outputs, uploads
from . import packages as installs
from .config import SandboxConfig, from_env, parse_size
from .result import CellError, ExecutionResult
from .runner import Budget, CellOutcome, OutputCallback, run_cell
from .sandbox import datafs, pool
from .sandbox.container import Sandbox
from .storage import ArtifactStore, LocalStore

log = logging.getLogger(__name__)

_KIND = {"timeout": "timeout", "oom": "oom", "died": "kernel_died", "limit": "limit", "protocol": "protocol"}


def _outcome_error(outcome: CellOutcome, index: int, config: SandboxConfig, cell_limit: float) -> CellError:
    if outcome.status == "timeout":
        how = ("was interrupted" if outcome.message == "interrupted"
               else f"did not stop within {config.interrupt_grace:g} s of being interrupted, so the sandbox was killed")
        return CellError("TimeoutError", f"The cell ran past the {cell_limit:g} s time limit and {how}. "
                         "Make it faster, or raise the limit (--timeout / NBEXEC_TIMEOUT).", (), "timeout", index)
    names = {"oom": "MemoryError", "died": "DeadKernelError", "limit": "DataLimitError", "protocol": "ProtocolError"}
    return CellError(names[outcome.status], outcome.message, (), _KIND[outcome.status], index)


def run_cells(sandbox: Sandbox, nb: NotebookNode, config: SandboxConfig, *,
              on_output: OutputCallback | None = None, first_index: int = 0) -> tuple[CellError | None, int]:
    """Run every code cell from ``first_index`` until the first failure; return (the failure, bytes dropped)."""
    budget = Budget.from_config(config)
    deadline = time.monotonic() + config.timeout
    error: CellError | None = None
    for index in range(first_index, len(nb.cells)):
        cell = nb.cells[index]
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        cell_limit = min(config.cell_timeout or config.timeout, config.timeout)
        cell_deadline = min(deadline, time.monotonic() + cell_limit)
        outcome = run_cell(sandbox, cell, index, config=config, deadline=cell_deadline, budget=budget,
                           on_output=on_output)
        if outcome.status == "error":
            error = outputs.first_error([{"cell_index": index, **o} for o in cell.outputs])
            break
        if outcome.status != "ok":
            limit = cell_limit if cell_deadline < deadline else config.timeout
            error = _outcome_error(outcome, index, config, limit)
            cell.outputs.append(nbformat.from_dict({"output_type": "error", "ename": error.ename,
                                                    "evalue": error.evalue,
                                                    "traceback": [f"{error.ename}: {error.evalue}"]}))
            break
    budget.finish(parse_size(config.max_output), config.max_outputs)
    return error, budget.dropped


def prepare_output_dir(output_dir: str | os.PathLike[str] | None, execution_id: str) -> Path:
    """Make the run's output folder (0700): ``<tmp>/nbexec-output-<uid>/<id>`` by default. A given one that
    exists must be an empty real folder of ours, else ConfigError (see `folders`)."""
    if output_dir is None:
        return folders.make_output_dir(folders.output_root() / execution_id, may_exist=False)
    return folders.make_output_dir(Path(output_dir).absolute(), may_exist=True)


def finish(nb: NotebookNode, error: CellError | None, *, execution_id: str, output_dir: Path, sandbox: Sandbox,
           notebook_path: Path | None, started: float, timings: dict[str, float], dropped: int,
           first_cell: int = 0, known: artifacts.Known | None = None,
           folder: folders.OutputFolder | None = None) -> ExecutionResult:
    """Save images, copy the files of /mnt/data to ``<output_dir>/data``, and build the result of the cells
    from ``first_cell`` on (shared with sessions; ``known`` is a session's memory of earlier copies). The
    notebook is written to ``notebook_path`` (replaced) or to a new notebook.ipynb. Writes go through
    ``folder`` (the output folder a session holds open) or a descriptor of ``output_dir`` opened now."""
    flat = outputs.flatten(nb, first_cell)
    view = outputs.views(flat)
    config = sandbox.config
    cap = config.max_data_bytes
    with contextlib.nullcontext(folder) if folder else folders.OutputFolder.open(output_dir) as out:
        images = artifacts.save_images(list(outputs.images(flat)), out)
        with out.child("data") as target:
            found = artifacts.snapshot(sandbox.data_dir, target, artifacts.Limits(
                max_file=cap, max_total=cap, max_files=config.max_files), known=known)
        # nbexec's own links to the input folder are not files the code left behind
        skipped = [s for s in found.skipped if s.name not in sandbox.input_links or "link" not in s.reason]
        notes = _data_notes(sandbox)
        error = _as_limit(error, sandbox, notes)
        connections, traffic_notes = egress.take(sandbox)
        if notebook_path is None:
            notebook_path = artifacts.write_new(out, "notebook.ipynb", notebook.dumps(nb))
        else:
            artifacts.replace(out, notebook_path.name, notebook.dumps(nb))
    duration = time.monotonic() - started
    timings = {**timings, "total_s": duration}
    return ExecutionResult(
        ok=error is None, execution_id=execution_id, stdout=view.stdout, stderr=view.stderr, text=view.text,
        error=error, outputs=tuple(flat), images=tuple(images), files=tuple(found.files),
        skipped_files=tuple(skipped), notebook=nb, notebook_path=str(notebook_path),
        output_dir=str(output_dir), duration_s=duration, timings=timings, truncated_bytes=dropped,
        notes=tuple(notes + found.notes + traffic_notes), connections=connections)


def _as_limit(error: CellError | None, sandbox: Sandbox, notes: list[str]) -> CellError | None:
    """The cell's error as a "limit" error when it came from the full /mnt/data (ENOSPC inside, or the sampled
    fallback that stopped the sandbox)."""
    stopped = sandbox.data_watch is not None and sandbox.data_watch.hit
    if error is None or not notes or not (stopped or (error.kind == "exception" and "No space left" in error.evalue)):
        return error
    return dataclasses.replace(error, kind="limit", evalue=f"{error.evalue} ({notes[0]})")


def _data_notes(sandbox: Sandbox) -> list[str]:
    """A note when /mnt/data ran out of space or inodes (its filesystem), or the sampled fallback stopped it."""
    cap = sandbox.config.max_data
    if sandbox.data_watch is not None and sandbox.data_watch.hit:
        return [f"/mnt/data grew past its {cap} cap, so the sandbox was stopped (sampled check: nbexec cannot "
                "mount a filesystem of fixed size here)"]
    use = datafs.usage(sandbox.data_dir) if sandbox.data_fs else None
    if use is None or not use.full:
        return []
    what = "file count cap (max_files)" if use.free_inodes <= 0 else f"{cap} cap"
    return [f"/mnt/data reached its {what}; writes past it failed with 'No space left on device'"]


def execute_notebook(source: Any, *, config: SandboxConfig | None = None,
                     output_dir: str | os.PathLike[str] | None = None, on_output: OutputCallback | None = None,
                     store: ArtifactStore | None = None, files: Mapping[str, bytes] | None = None,
                     packages: Sequence[str] = (), **overrides: Any) -> ExecutionResult:
    """Run code (str), a .py/.ipynb path (os.PathLike) or a notebook in a fresh sandbox and return the result.

    ``config`` defaults to ``from_env()``; keyword overrides (timeout=5, memory="2g", network=True, ...)
    change single fields for this call. The files the code left in /mnt/data (a filesystem of max_data bytes
    that goes with the sandbox) are copied to ``<output_dir>/data``; images go to ``<output_dir>/images`` and
    the executed notebook next to them.
    ``files`` ({name: bytes}) are put into /mnt/data before the code runs (and are listed in the result).
    ``store`` receives every file and image (default: a LocalStore, whose URLs are file:// URLs of the
    files where they lie); links to them replace `sandbox:/mnt/data/...` references in the text views.
    ``packages`` (requirements such as "tabulate" or "pyarrow==17.*") are fetched on the host and installed
    offline before the code runs, as the code's own ``%pip install`` lines are (see `nbexec.packages`).
    Errors in the code are in the result (``ok`` False); only failures of nbexec itself raise.
    """
    from . import remote

    if remote.enabled():  # NBEXEC_NODES: the same call on a remote node
        return remote.execute(source, config=config, output_dir=output_dir, on_output=on_output, store=store,
                              files=files, **overrides)
    started = time.monotonic()
    nb = notebook.coerce(source)
    config = (config or from_env()).replace(**overrides)
    execution_id = uuid.uuid4().hex[:16]
    out = prepare_output_dir(output_dir, execution_id)
    try:
        sandbox = pool.acquire(config)
    except BaseException:
        if output_dir is None:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    acquired = time.monotonic()
    try:
        for name, content in (files or {}).items():
            artifacts.put(sandbox.data_dir, name, content, owner=sandbox.file_owner())
        nb.metadata["language_info"] = sandbox.language_info or nb.metadata.get("language_info", {})
        with installs.prepared(sandbox, nb, config, requested=packages) as installed:
            error, dropped = run_cells(sandbox, nb, config, on_output=on_output)
        ran = time.monotonic()
        sandbox.freeze()  # the files are collected as a snapshot: nothing runs while they are copied
        nb.metadata.setdefault("nbexec", {}).update({"execution_id": execution_id, "ok": error is None})
        result = finish(nb, error, execution_id=execution_id, output_dir=out, sandbox=sandbox,
                        notebook_path=None, started=started,
                        timings={"sandbox_s": acquired - started, "run_s": ran - acquired}, dropped=dropped)
        result = dataclasses.replace(result, packages=tuple(installed),
                                     notes=result.notes + tuple(installs.notes(installed)))
    finally:
        # After the result is built, so the teardown and the pool's refill do not compete with it.
        pool.release(sandbox)
    target: ArtifactStore = store if store is not None else LocalStore()
    return uploads.publish(result, target, prefix=target.prefix)


async def execute_notebook_async(source: Any, **options: Any) -> ExecutionResult:
    """execute_notebook() for asyncio code: the same call, run in a worker thread."""
    return await asyncio.to_thread(execute_notebook, source, **options)
