"""Turn what a run left into its ExecutionResult, once: images saved and the files of /mnt/data copied into the
output folder, both handed to the artifact store, the text views written with their links, then one result.

Two steps, so a one-shot can hand its sandbox back between them: `gather` reads the sandbox (through its
methods only, see `sandbox.source.SandboxHandle`) and writes the output folder; `result` stores and builds.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

from nbformat import NotebookNode

from nbexec import notebook, packages
from nbexec.config import SandboxConfig
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.notebook import links, outputs, papermill
from nbexec.result import CellError, Connection, ExecutionResult, File, Image, Package, SkippedFile
from nbexec.sandbox.source import SandboxHandle
from nbexec.stores import uploads
from nbexec.stores.storage import ArtifactStore

from . import traces


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run of cells, as the engine saw it."""

    execution_id: str
    first_cell: int  # the result covers the cells from here on
    error: CellError | None
    dropped: int  # output bytes dropped past the budget
    started: float  # time.monotonic() when the call began
    timings: dict[str, float]
    packages: tuple[Package, ...] = ()  # what the run asked for and what became of it (nbexec.packages)
    notes: tuple[str, ...] = ()  # what the run itself has to say (widget state not saved, ...)
    exit_cell: int | None = None  # the code ended the run here, successfully (sys.exit(0): see notebook.papermill)
    raised: tuple[CellError, ...] = ()  # allow_errors: the exceptions the run went on past (``error``: what stopped it)


@dataclass(frozen=True)
class Gathered:
    """What the output folder holds after a run, before anything is stored."""

    outputs: tuple[dict[str, object], ...]
    images: list[Image]
    files: list[File]
    skipped: list[SkippedFile]
    notes: list[str]
    error: CellError | None
    notebook_path: str
    connections: tuple[Connection, ...] = ()  # network="allowlist": the proxy's log for this run
    node: str | None = None  # the node whose sandbox ran it (None: this host)


def limits(config: SandboxConfig) -> artifacts.Limits:
    """What a run keeps of /mnt/data, and the most any host read of it costs: max_data per file and in total,
    max_files files."""
    cap = config.max_data_bytes
    return artifacts.Limits(max_file=cap, max_total=cap, max_files=config.max_files)


@traces.spanned("nbexec.collect")
def gather(nb: NotebookNode, run: Run, sandbox: SandboxHandle, folder: OutputFolder, *, notebook_name: str,
           known: artifacts.Known | None = None) -> Gathered:
    """Save the run's images, copy /mnt/data to ``folder``/data (``known``: a session's memory of earlier copies),
    and write the notebook as ``notebook_name`` (replaced atomically), all through the folder's descriptor."""
    flat = outputs.flatten(nb, run.first_cell)
    images, image_notes = transfer.save_images(outputs.images(flat), folder,
                                               max_bytes=sandbox.config.max_display_bytes)
    with folder.child("data") as target:
        found = sandbox.snapshot(target, limits(sandbox.config), known)
    notes, stopped = sandbox.data_notes()
    error = _as_limit(run.error, stopped, notes)
    notes += _went_on(run.raised, error)
    connections, traffic_notes = sandbox.take_connections()
    # nbexec's own links to the input folder are not files the code left behind
    skipped = [s for s in found.skipped if s.name not in sandbox.input_links or "link" not in s.reason]
    _stamp(nb, run, error, str(folder.path / notebook_name))
    path = transfer.replace(folder, notebook_name, notebook.dumps(nb))
    first = run.raised[0] if run.raised else error  # a run that went on past errors still failed: the first one
    return Gathered(tuple(flat), images, found.files, skipped,
                    notes + sandbox.input_notes() + found.notes + traffic_notes + image_notes, first, str(path),
                    connections, sandbox.node)


def _went_on(raised: tuple[CellError, ...], stop: CellError | None) -> list[str]:
    """allow_errors: which cells raised while the run went on, and what stopped it, if anything did."""
    if not raised:
        return []
    cells = ", ".join(f"cell {e.cell_index} ({e.ename})" for e in raised[:10])
    more = f" and {len(raised) - 10} more" if len(raised) > 10 else ""
    end = f"; then cell {stop.cell_index} stopped it ({stop.ename})" if stop is not None else ""
    return [f"allow_errors: the run went on past {len(raised)} error(s): {cells}{more}{end}. The result failed; "
            "its error is the first one, and every error is in the cells' outputs."]


def _stamp(nb: NotebookNode, run: Run, error: CellError | None, output_path: str) -> None:
    """papermill's metadata of this run, beside nbexec's (see `notebook.papermill`)."""
    ended = datetime.datetime.now(datetime.timezone.utc)
    started = ended - datetime.timedelta(seconds=time.monotonic() - run.started)
    source = nb.metadata.get("nbexec", {}).get("input_path")  # a mapping: see notebook._finish
    papermill.stamp(nb, first_cell=run.first_cell, stopped_at=error.cell_index if error is not None else run.exit_cell,
                    started=started, ended=ended, input_path=source if isinstance(source, str) else None,
                    output_path=output_path, raised={e.cell_index for e in run.raised if e.cell_index is not None})


def result(nb: NotebookNode, run: Run, gathered: Gathered, folder: OutputFolder, store: ArtifactStore, *,
           already: MutableMapping[str, str] | None = None) -> ExecutionResult:
    """Store the files and images (``already``: a session's memory of what was stored), rewrite the links in
    the text views, and build the result."""
    with traces.span("nbexec.upload", {"nbexec.files": len(gathered.files), "nbexec.images": len(gathered.images)}):
        stored = uploads.store_all(gathered.files, gathered.images, store, execution_id=run.execution_id,
                                   data_dir=folder.path / "data", already=already)
    urls = {f.name: f.url for f in stored.files if f.url}
    view = outputs.views(gathered.outputs)
    duration = time.monotonic() - run.started
    return ExecutionResult(
        ok=gathered.error is None, execution_id=run.execution_id, stdout=links.rewrite(view.stdout, urls),
        stderr=links.rewrite(view.stderr, urls), text=links.rewrite(view.text, urls), error=gathered.error,
        outputs=gathered.outputs, images=stored.images, files=stored.files, skipped_files=tuple(gathered.skipped),
        notebook=nb, notebook_path=gathered.notebook_path, output_dir=str(folder.path), duration_s=duration,
        timings={**run.timings, "total_s": duration}, truncated_bytes=run.dropped, uploads=stored.uploads,
        notes=tuple(gathered.notes + list(run.notes) + packages.notes(run.packages)), packages=run.packages,
        connections=gathered.connections, node=gathered.node)


def _as_limit(error: CellError | None, stopped: bool, notes: list[str]) -> CellError | None:
    """The cell's error as a "limit" error when it came from the full /mnt/data (ENOSPC inside, or the sampled
    fallback that stopped the sandbox)."""
    if error is None or not notes or not (stopped or (error.kind == "exception" and "No space left" in error.evalue)):
        return error
    return dataclasses.replace(error, kind="limit", evalue=f"{error.evalue} ({notes[0]})")
