"""`nbexec papermill`: papermill's command line (2.6/2.7 options, exit codes, warnings), run in nbexec's sandbox.

Exit codes are papermill's: 0 success, 1 the notebook raised (or timed out, or anything else failed), 138 the kernel
died, 2 a usage error. A single path is always the input (papermill takes it as the output when stdin is a pipe:
a deliberate difference, see docs/papermill.md).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from nbexec import __version__
from nbexec.errors import NbexecError, NotebookError

EXIT_DEAD_KERNEL = 138  # papermill's exit code for a dead kernel
_LEVELS = ["NOTSET", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def resolve_type(value: str) -> Any:
    """A -p value as papermill reads it: True, False, None, an int, a float, else the text itself."""
    named = {"True": True, "False": False, "None": None}
    if value in named:
        return named[value]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def gather(values: dict[str, Any]) -> dict[str, Any]:
    """Parameters in papermill's order: the injected paths, then -b, -f, -y, -p, -r (later wins)."""
    from nbexec.notebook import parameters

    found: dict[str, Any] = {}
    for text in values["parameters_base64"]:
        found.update(parameters.from_base64(text) if text else {})
    for name in values["parameters_file"]:
        found.update(parameters.load_file(Path(name)))
    for text in values["parameters_yaml"]:
        found.update(parameters.gather(yaml_texts=[text]))
    found.update({name: resolve_type(value) for name, value in values["parameters"]})
    found.update(dict(values["parameters_raw"]))
    return found


def _paths(notebook_path: str | None, output_path: str | None, help_notebook: bool) -> tuple[str, str]:
    """INPUT and OUTPUT as papermill infers them from pipes (a single path is always the input)."""
    if notebook_path is None and not _piped_in() and not help_notebook:
        raise click.UsageError("Missing argument 'NOTEBOOK_PATH' (or pipe a notebook in)")
    if output_path is None and sys.stdout.isatty() and not help_notebook:
        raise click.UsageError("Missing argument 'OUTPUT_PATH'")
    return notebook_path or "-", output_path or "-"


def _piped_in() -> bool:
    """Whether stdin is a pipe (papermill's test: a FIFO, not merely "not a terminal")."""
    try:
        return stat.S_ISFIFO(os.fstat(0).st_mode)
    except OSError:
        return False


def _logging(level: str) -> None:
    """papermill's log lines on stderr, bare (`Input Notebook: ...`, `Passed unknown parameter: x`)."""
    logger = logging.getLogger("nbexec.papermill")
    logger.handlers = [logging.StreamHandler(sys.stderr)]
    logger.handlers[0].setFormatter(logging.Formatter("%(message)s"))
    logger.setLevel(level)
    logger.propagate = False


@click.command(name="papermill", context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Exit codes (papermill's): 0 success; 1 the notebook raised, timed out or anything else failed; "
                      "2 usage error; 138 the kernel died.")
@click.argument("notebook_path", required=False)
@click.argument("output_path", required=False)
@click.option("--help-notebook", is_flag=True, help="Display parameters information for the given notebook path.")
@click.option("-p", "--parameters", nargs=2, multiple=True, help="Parameters to pass to the parameters cell.")
@click.option("-r", "--parameters_raw", nargs=2, multiple=True, help="Parameters to be read as raw string.")
@click.option("-f", "--parameters_file", multiple=True, help="Path to YAML file containing parameters.")
@click.option("-y", "--parameters_yaml", multiple=True, help="YAML string to be used as parameters.")
@click.option("-b", "--parameters_base64", multiple=True, help="Base64 encoded YAML string as parameters.")
@click.option("--inject-input-path", is_flag=True, help="Insert the input path as PAPERMILL_INPUT_PATH.")
@click.option("--inject-output-path", is_flag=True, help="Insert the output path as PAPERMILL_OUTPUT_PATH.")
@click.option("--inject-paths", is_flag=True, help="Insert both paths as PAPERMILL_INPUT_PATH/PAPERMILL_OUTPUT_PATH.")
@click.option("--engine", help="Not used: nbexec runs every notebook with its own engine, in a fresh sandbox.")
@click.option("--request-save-on-cell-execute/--no-request-save-on-cell-execute", default=True,
              help="Not used: nbexec writes the output notebook once, when the run ends (also on failure).")
@click.option("--autosave-cell-every", type=int, default=30, help="Not used (as --request-save-on-cell-execute).")
@click.option("--prepare-only/--prepare-execute", default=False,
              help="Output the notebook with parameters applied, without executing it.")
@click.option("-k", "--kernel", help="Name of kernel to run (python3, ir, deno, bash: nbexec's languages).")
@click.option("-l", "--language", help="Language for notebook execution (python, r, deno, bash).")
@click.option("--cwd", help="Working directory the notebook runs in: copied into the sandbox, never written.")
@click.option("--progress-bar/--no-progress-bar", default=None, help="A line on stderr when the run ends.")
@click.option("--log-output/--no-log-output", default=False, help="Write the notebook's output to the terminal.")
@click.option("--stdout-file", type=click.File("w", encoding="utf-8"), help="File to write notebook stdout to.")
@click.option("--stderr-file", type=click.File("w", encoding="utf-8"), help="File to write notebook stderr to.")
@click.option("--log-level", type=click.Choice(_LEVELS), default="INFO", help="Set log level.")
@click.option("--start-timeout", "--start_timeout", type=int, default=60,
              help="Time in seconds to wait for the sandbox's kernel to start.")
@click.option("--execution-timeout", type=int, help="Time in seconds to wait for each cell before failing.")
@click.option("--report-mode/--no-report-mode", default=False, help="Flag for hiding input.")
@click.option("--version", is_flag=True, help="Flag for displaying the version.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="nbexec: where the files the notebook wrote go [default: ./nbexec-output/<name>-<id>].")
@click.pass_context
def command(ctx: click.Context, notebook_path: str | None, output_path: str | None, **values: Any) -> None:
    """Execute NOTEBOOK_PATH with parameters in a fresh nbexec sandbox and write the executed notebook to
    OUTPUT_PATH (`-` for stdout), as papermill does. Its options mean what papermill's mean."""
    if values["version"]:
        click.echo(f"nbexec {__version__} (papermill's command line)")
        return
    input_path, target = _paths(notebook_path, output_path, values["help_notebook"])
    level = "ERROR" if target == "-" and values["log_level"] == "INFO" else values["log_level"]
    _logging(level)
    found: dict[str, Any] = {}
    if values["inject_input_path"] or values["inject_paths"]:
        found["PAPERMILL_INPUT_PATH"] = input_path
    if values["inject_output_path"] or values["inject_paths"]:
        found["PAPERMILL_OUTPUT_PATH"] = target
    try:
        found.update(gather(values))
    except NbexecError as exc:  # papermill: an uncaught error, exit 1
        _fail(f"{type(exc).__name__}: {exc}", 1)
    if values["help_notebook"]:
        sys.exit(_help_notebook(ctx, input_path, found))
    _execute(input_path, target, found, values)


def _execute(input_path: str, target: str, found: dict[str, Any], values: dict[str, Any]) -> None:
    import nbexec.papermill as pm

    for option, default in (("engine", None), ("request_save_on_cell_execute", True), ("autosave_cell_every", 30)):
        if values[option] != default and not (option == "request_save_on_cell_execute" and target == "-"):
            logging.getLogger("nbexec.papermill").warning("--%s is not used: %s", option.replace("_", "-"),
                                                          pm.ENGINE_ONLY[option])
    progress = values["progress_bar"] if values["progress_bar"] is not None else not values["log_output"]
    extra: dict[str, Any] = {"output_dir": values["output_dir"] or _default_output(input_path)}
    if values["execution_timeout"]:
        extra["execution_timeout"] = values["execution_timeout"]
    try:
        nb = pm.execute_notebook(
            input_path, target, found, prepare_only=values["prepare_only"], kernel_name=values["kernel"],
            language=values["language"], log_output=values["log_output"], stdout_file=values["stdout_file"],
            stderr_file=values["stderr_file"], start_timeout=values["start_timeout"],
            report_mode=values["report_mode"], cwd=values["cwd"], **extra)
    except pm.PapermillExecutionError as exc:
        error = exc.result.error if exc.result is not None else None
        dead = error is not None and error.kind in ("kernel_died", "oom")
        _fail(f"{type(exc).__name__}: {exc}", EXIT_DEAD_KERNEL if dead else 1)
    except (NbexecError, pm.PapermillException, OSError) as exc:
        _fail(f"{type(exc).__name__}: {exc}", 1)
    if progress and not values["prepare_only"]:
        meta = nb.metadata.get("papermill", {})
        ran = sum(1 for c in nb.cells if c.get("cell_type") == "code" and c.get("execution_count"))
        click.echo(f"Executed {ran} cells in {meta.get('duration') or 0:.1f} s in an nbexec sandbox; files the "
                   f"notebook wrote: {nb.metadata.get('nbexec', {}).get('output_dir')}", err=True)


def _default_output(input_path: str) -> Path:
    stem = "stdin" if input_path == "-" else Path(input_path).stem
    return Path("nbexec-output") / f"{stem}-{os.urandom(4).hex()}"


def _help_notebook(ctx: click.Context, input_path: str, found: dict[str, Any]) -> int:
    """papermill's --help-notebook: the usage line, then each declared parameter; 1 without a parameters cell."""
    import nbexec.papermill as pm
    from nbexec.notebook import inspection

    try:
        nb = pm.prepare(pm.format_path(input_path, found), None, {}, kernel_name=None, language=None,
                        report_mode=False)
    except (NbexecError, pm.PapermillException) as exc:
        _fail(f"{type(exc).__name__}: {exc}", 1)
    click.echo(ctx.command.get_usage(ctx))
    click.echo(f"\nParameters inferred for notebook '{input_path}':")
    if inspection.parameters_cell(nb) is None:
        click.echo("\n  No cell tagged 'parameters'")
        return 1
    declared = inspection.declared(nb)
    if not declared:
        click.echo("\n  Can't infer anything about this notebook's parameters. It may not have any parameter defined.")
    for parameter in declared:
        kind = "Unknown type" if parameter.inferred_type_name == "None" else parameter.inferred_type_name
        line = f"  {parameter.name}: {kind} (default {parameter.default})"
        click.echo(f"{line:<34}{parameter.help}" if len(line) <= 30 else
                   (f"{line}\n{' ' * 34}{parameter.help}" if parameter.help else line))
    return 0


def _fail(message: str, code: int) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def inputs_only(inputs: list[str]) -> list[str]:
    """``inputs`` for `nbexec run`, refusing papermill's shape `IN.ipynb OUT.ipynb` when OUT is meant as the output:
    it does not exist, or it is an executed copy of IN (its papermill metadata names IN as its input). Such a
    second path is never run as an input (NotebookError, a usage error)."""
    if len(inputs) != 2 or not all(name.lower().endswith(".ipynb") for name in inputs):
        return inputs
    first, second = inputs
    if Path(second).exists() and not _executed_from(Path(second), Path(first)):
        return inputs
    why = "does not exist" if not Path(second).exists() else f"is an executed copy of {first}"
    raise NotebookError(f"{second} {why}: `nbexec run` takes inputs only and never treats a path as an output. To "
                        f"write the executed notebook there, run `nbexec papermill {first} {second}` (papermill's "
                        f"command line) or `nbexec run {first} --save-notebook {second}`.")


def _executed_from(candidate: Path, source: Path) -> bool:
    """Whether ``candidate``'s metadata.papermill.input_path names ``source`` (papermill and nbexec both write it)."""
    import json

    try:
        with candidate.open("rb") as handle:
            data = json.loads(handle.read(64 << 20))
    except (OSError, ValueError):
        return False
    meta = data.get("metadata") if isinstance(data, dict) else None
    papermill = meta.get("papermill") if isinstance(meta, dict) else None
    named = papermill.get("input_path") if isinstance(papermill, dict) else None
    if not isinstance(named, str) or not named:
        return False
    return Path(named).name == source.name or Path(named).resolve() == source.resolve()
