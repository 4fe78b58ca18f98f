"""How `nbexec run` begins and ends around the run itself: checks made before any sandbox starts, Ctrl-C (exit 130,
no empty folder left behind), a closed stdout (`| head`: a quiet exit), and `--overwrite` of an earlier run's
folder."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from nbexec.files.folders import MARK

from . import variables
from .commands import EXIT_USAGE, fail

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C stopped
EXIT_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`| head -1`)
DEFAULT_ROOT = Path("nbexec-output")
_RUN_FILES = ("notebook.ipynb", MARK)  # what a folder `nbexec run` wrote holds at its top


def earlier_run(folder: Path) -> bool:
    """Whether ``folder`` is the output folder of an earlier `nbexec run` (not a folder of the user's)."""
    return any(os.path.lexists(folder / name) for name in _RUN_FILES)


class RunCommand(click.Command):
    """`nbexec run` with its own beginning and end (see the module docstring); the run itself is main.run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(
            ["--overwrite"], is_flag=True,
            help="Allow a re-run into the same --output-dir: the earlier run's output there (one file's, or a "
                 "batch's folder per file) is replaced; only folders nbexec wrote are removed. Without it, such a "
                 "folder is refused."))

    def invoke(self, ctx: click.Context) -> Any:
        if not ctx.params.get("quiet"):  # held back by the group until -q was read (variables.warn_at_start)
            variables.warn_mistyped(os.environ)
        overwrite = ctx.params.pop("overwrite", False)
        _check_before(ctx.params, overwrite)
        root = Path(ctx.params.get("output_dir") or DEFAULT_ROOT)
        root_existed, started = root.exists(), time.time()
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _remove_empty(root, started, keep_root=root_existed)
            click.echo("nbexec: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            closed_stdout()


def closed_stdout() -> None:
    """Exit quietly because stdout's reader went away: nothing more can be shown, and no traceback is due."""
    with contextlib.suppress(OSError, ValueError):  # later writes (and the final flush) go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(EXIT_PIPE)


def unexpected(exc: Exception) -> None:
    """Before an unexpected failure becomes exit 3: a closed stdout is no failure of nbexec's (re-raised)."""
    if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
        raise exc
    logging.getLogger("nbexec").debug("nbexec failed", exc_info=True)


def _check_before(params: dict[str, Any], overwrite: bool) -> None:
    """Usage errors a run would otherwise meet only at its end, and --overwrite's removal."""
    as_json = bool(params.get("as_json"))
    save = params.get("save_notebook")
    if save is not None and not Path(save).absolute().parent.is_dir():
        fail(f"--save-notebook {save}: the folder {Path(save).absolute().parent} does not exist; create it first "
             "or choose another place", EXIT_USAGE, as_json)
    folder = params.get("output_dir")
    if folder is None or not Path(folder).is_dir():
        return
    # One rule for one file and many: a folder the user named that holds an earlier run's output (its own, or
    # a batch's one folder per file) is refused; --overwrite replaces it. Unnamed, every run gets new folders.
    earlier = [Path(folder)] if earlier_run(Path(folder)) else \
        [child for child in Path(folder).iterdir() if child.is_dir() and not child.is_symlink() and earlier_run(child)]
    if earlier and not overwrite:
        fail(f"--output-dir {folder} holds the output of an earlier run ({_named(earlier)}); pass --overwrite to "
             "replace it, or choose another folder", EXIT_USAGE, as_json)
    if overwrite:
        from nbexec.files.workdir import remove_tree

        for path in earlier:
            remove_tree(path)


def _named(folders: list[Path]) -> str:
    """The earlier run's folders, as a message names them (the first three)."""
    shown = ", ".join(str(path) for path in folders[:3])
    return shown + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")


def _remove_empty(root: Path, since: float, *, keep_root: bool) -> None:
    """Remove the folders under ``root`` (and ``root`` unless kept) that this run made and left empty; never one
    that holds a file, nor one older than the run."""
    if not root.is_dir() or root.is_symlink():
        return
    for path, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        if keep_root and Path(path) == root:
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path).st_mtime >= since - 1 and not os.listdir(path):
                os.rmdir(path)
