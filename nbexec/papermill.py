"""papermill's Python API, run in nbexec's sandbox: `import nbexec.papermill as pm` is the one-line switch.

`execute_notebook` and `inspect_notebook` take papermill's arguments and return what papermill returns (the executed
NotebookNode, written to ``output_path``; the declared parameters). A notebook whose code raised is written with
papermill's error marker cells, then a `PapermillExecutionError` with papermill's attributes and message is raised.
What nbexec does differently (an engine of its own, local paths only, a sandbox per run) is in docs/papermill.md;
the arguments that only papermill's engines use are accepted and logged once as not used.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import nbformat
from nbformat import NotebookNode

from nbexec import notebook
from nbexec.config import SandboxConfig, from_env
from nbexec.engine.execute import execute_notebook as _run
from nbexec.errors import NotebookError
from nbexec.files import inputs
from nbexec.notebook import inspection, parameters
from nbexec.notebook import papermill as stamps
from nbexec.result import CellError, ExecutionResult

__all__ = ["PapermillException", "PapermillExecutionError", "PapermillMissingParameterException",
           "execute_notebook", "inspect_notebook"]

logger = logging.getLogger("nbexec.papermill")
ERROR_MARKER_TAG = "papermill-error-cell-tag"  # papermill's tag: its runs and nbexec's remove each other's markers
ENGINE_ONLY = {  # papermill's options for its own engines, and what nbexec does instead
    "engine": "nbexec runs every notebook with its own engine, in a fresh sandbox",
    "request_save_on_cell_execute": "nbexec writes the output notebook once, when the run ends (also on failure)",
    "autosave_cell_every": "nbexec writes the output notebook once, when the run ends (also on failure)",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class PapermillException(Exception):
    """Base of the papermill-shaped errors (papermill.exceptions.PapermillException)."""


class PapermillMissingParameterException(PapermillException):
    """A path names a {parameter} that was not given."""


class PapermillExecutionError(PapermillException):
    """The notebook's code raised: papermill's attributes and message, and nbexec's ``result``."""

    def __init__(self, cell_index: int | None, exec_count: int | None, source: str, ename: str, evalue: str,
                 traceback: list[str], result: ExecutionResult | None = None) -> None:
        super().__init__(cell_index, exec_count, source, ename, evalue, traceback)
        self.cell_index, self.exec_count, self.source = cell_index, exec_count, source
        self.ename, self.evalue, self.traceback = ename, evalue, traceback
        self.result = result

    def __str__(self) -> str:
        shown = _ANSI.sub("", "\n".join(self.traceback))
        return f'\n{"-" * 75}\nException encountered at "In [{self.exec_count}]":\n{shown}\n'


def inspect_notebook(notebook_path: str | os.PathLike[str], parameters: Mapping[str, Any] | None = None
                     ) -> dict[str, dict[str, Any]]:
    """The parameters the notebook declares in its cell tagged `parameters`: name -> {name, inferred_type_name,
    default, help}, as papermill's inspect_notebook (``parameters`` fill {name}s in the path)."""
    path = format_path(os.fspath(notebook_path), parameters)
    return inspection.as_dict(inspection.declared(_load(path)))


def execute_notebook(input_path: str | os.PathLike[str] | NotebookNode, output_path: str | os.PathLike[str] | None,
                     parameters: Mapping[str, Any] | None = None, engine_name: str | None = None,
                     request_save_on_cell_execute: bool = True, prepare_only: bool = False,
                     kernel_name: str | None = None, language: str | None = None, progress_bar: bool = True,
                     log_output: bool = False, stdout_file: IO[str] | None = None, stderr_file: IO[str] | None = None,
                     start_timeout: float = 60, report_mode: bool = False, cwd: str | os.PathLike[str] | None = None,
                     **engine_kwargs: Any) -> NotebookNode:
    """Run the notebook as papermill's execute_notebook does, in a fresh nbexec sandbox; return it executed.

    nbclient's ``execution_timeout`` / ``timeout`` (seconds per cell) and ``allow_errors`` are taken; so are
    nbexec's own ``config`` (a SandboxConfig), ``output_dir`` (where the files the code wrote go) and any
    SandboxConfig field (memory="2g", ...). ``cwd`` is the folder the code sees as its working folder (copied,
    never written); by default the notebook's own. ``kernel_name`` and ``language`` choose among nbexec's
    languages (python, r, deno, bash)."""
    if engine_name is not None:
        logger.info("engine_name=%r is not used: %s", engine_name, ENGINE_ONLY["engine"])
    if engine_kwargs.pop("autosave_cell_every", None):
        logger.info("autosave_cell_every is not used: %s", ENGINE_ONLY["autosave_cell_every"])
    values = dict(parameters or {})
    paths = {"pm": {"run_uuid": str(uuid.uuid4()), "current_datetime_local": datetime.datetime.now(),
                    "current_datetime_utc": datetime.datetime.now(datetime.timezone.utc)}, **values}
    source = input_path if isinstance(input_path, NotebookNode) else format_path(os.fspath(input_path), paths)
    target = None if output_path is None else format_path(os.fspath(output_path), paths)
    logger.info("Input Notebook:  %s", "<NotebookNode>" if isinstance(source, NotebookNode) else source)
    logger.info("Output Notebook: %s", target)
    nb = prepare(source, target, values, kernel_name=kernel_name, language=language, report_mode=report_mode)
    if prepare_only:
        write(nb, target)
        return nb
    config = _config(engine_kwargs, start_timeout, cwd, source)
    result = _run(nb, config=config, output_dir=engine_kwargs.pop("output_dir", None),
                  allow_errors=bool(engine_kwargs.pop("allow_errors", False)),
                  on_output=_streams(log_output, stdout_file, stderr_file), **engine_kwargs)
    executed = result.notebook
    executed.metadata.setdefault("papermill", {}).update(input_path=nb.metadata.papermill.get("input_path"),
                                                         output_path=target)
    executed.metadata.setdefault("nbexec", {})["output_dir"] = result.output_dir
    raise_for_result(result, executed, target)
    write(executed, target)
    return executed


def format_path(path: str, parameters: Mapping[str, Any] | None) -> str:
    """``path`` with its {name}s filled from ``parameters``, as papermill's parameterize_path."""
    try:
        return path.format(**(parameters or {}))
    except KeyError as exc:
        raise PapermillMissingParameterException(f"Missing parameter {exc}") from exc
    except (IndexError, ValueError):
        return path  # braces that are not a format: papermill would fail; a plain path is kept


def prepare(source: str | NotebookNode, target: str | None, values: Mapping[str, Any], *, kernel_name: str | None,
            language: str | None, report_mode: bool) -> NotebookNode:
    """The notebook as papermill hands it to its engine: earlier error markers removed, parameters injected
    (each unknown one warned about), input hidden in report mode, papermill's paths recorded."""
    nb = _load(source) if isinstance(source, str) else nbformat.from_dict(source)
    chosen = language or _language_of_kernel(kernel_name)
    if chosen:
        nb = notebook.from_json(nbformat.writes(nb), language=chosen)
    nb.cells = [c for c in nb.cells if ERROR_MARKER_TAG not in c.get("metadata", {}).get("tags", [])]
    if values:
        known = {p.name for p in inspection.declared(nb)}
        for name in values:
            if name not in known:
                logger.warning("Passed unknown parameter: %s", name)
        parameters.inject(nb, values)
    if report_mode:
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
    papermill = nb.metadata.setdefault("papermill", {})
    papermill.update(input_path=source if isinstance(source, str) else None, output_path=target,
                     parameters=dict(values), environment_variables={}, version=stamps.FORMAT_VERSION)
    papermill.setdefault("default_parameters", {})
    return nb


def _load(path: str) -> NotebookNode:
    """A notebook from a local path or `-` (stdin); a URL is refused (nbexec reads local files only)."""
    if "://" in path:
        raise NotebookError(f"{path}: nbexec reads and writes local paths only (papermill's S3, GCS, Azure and "
                            "HTTP handlers are not offered); copy the notebook here first")
    return notebook.load(path)


def _language_of_kernel(kernel_name: str | None) -> str | None:
    if kernel_name is None:
        return None
    from nbexec.languages import of_kernelspec

    return of_kernelspec({"name": kernel_name}).name


def _config(engine_kwargs: dict[str, Any], start_timeout: float, cwd: str | os.PathLike[str] | None,
            source: str | NotebookNode) -> SandboxConfig:
    """The sandbox's config: ``config`` (else from the environment), nbclient's per-cell timeout, and the folder
    the code works in (``cwd``, else the notebook's own), copied in (see `nbexec.files.inputs`)."""
    config = engine_kwargs.pop("config", None) or from_env()
    cell_timeout = engine_kwargs.pop("execution_timeout", None) or engine_kwargs.pop("timeout", None)
    engine_kwargs.pop("kernel_name", None)
    changes: dict[str, Any] = {"startup_timeout": float(start_timeout)}
    if cell_timeout:
        changes["cell_timeout"] = float(cell_timeout)
    config = config.replace(**changes)
    if cwd is not None:
        return config.replace(input_dir=str(Path(os.fspath(cwd)).resolve()), link_input=True)
    return inputs.with_folder(config, Path(source)) if isinstance(source, str) else config


def _streams(log_output: bool, stdout_file: IO[str] | None, stderr_file: IO[str] | None) -> Any:
    """The on_output callback that copies stream text to the log and the files, as papermill's engine does."""
    if not (log_output or stdout_file or stderr_file):
        return None

    def copy(index: int, output: NotebookNode) -> None:
        if output.get("output_type") != "stream":
            return
        text = str(output.get("text", ""))
        if log_output:  # papermill's engine logs stdout at INFO, stderr at WARNING
            logger.log(logging.WARNING if output.get("name") == "stderr" else logging.INFO, "%s", text.rstrip("\n"))
        handle = stderr_file if output.get("name") == "stderr" else stdout_file
        if handle is not None:
            handle.write(text)
            handle.flush()
    return copy


def raise_for_result(result: ExecutionResult, nb: NotebookNode, target: str | None) -> None:
    """papermill's judgement of a failed run: the notebook written with its error markers, then the error."""
    if result.ok or result.error is None:
        return
    error = _execution_error(result.error, nb, result)
    anchor = nbformat.v4.new_markdown_cell('<span id="papermill-error-cell" style="color:red; font-size:2em">'
                                           "Execution using nbexec encountered an exception here and stopped:</span>")
    banner = nbformat.v4.new_markdown_cell(
        '<span style="color:red; font-size:2em">An Exception was encountered at '
        f"'<a href=\"#papermill-error-cell\">In [{error.exec_count}]</a>'.</span>")
    for cell in (anchor, banner):
        cell.metadata["tags"] = [ERROR_MARKER_TAG]
        if not notebook.has_ids(nb):
            cell.pop("id", None)
    if error.cell_index is not None:
        nb.cells.insert(error.cell_index, anchor)
    nb.cells.insert(0, banner)
    write(nb, target)
    raise error


def _execution_error(error: CellError, nb: NotebookNode, result: ExecutionResult) -> PapermillExecutionError:
    index = error.cell_index
    cell = nb.cells[index] if index is not None and 0 <= index < len(nb.cells) else {}
    shown = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"] if cell else []
    traceback = [str(line) for line in shown[0].get("traceback", [])] if shown else list(error.traceback)
    return PapermillExecutionError(index, cell.get("execution_count"), str(cell.get("source", "")), error.ename,
                                   error.evalue, traceback, result)


def write(nb: NotebookNode, target: str | None) -> None:
    """Write ``nb`` to ``target``: a local path, `-` for stdout, None for nowhere."""
    if target is None:
        return
    text = notebook.dumps(nb).decode("utf-8")
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if "://" in target:
        raise NotebookError(f"{target}: nbexec writes local paths only (papermill's S3, GCS, Azure and HTTP handlers "
                            "are not offered); write here and copy it")
    Path(target).write_text(text, encoding="utf-8")
