"""execute_notebook(): code or a notebook in, an ExecutionResult out, through a throwaway session (see `session`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nbformat import NotebookNode

from nbexec import notebook
from nbexec.config import SandboxConfig, from_env
from nbexec.files import inputs
from nbexec.overrides import RunOverrides, Unpack
from nbexec.result import ExecutionResult
from nbexec.stores.storage import ArtifactStore

from . import cellsize, sources, traces
from .cells import OutputCallback
from .options import ExecuteOptions
from .session import Session


def execute_notebook(source: Any, *, config: SandboxConfig | None = None,
                     output_dir: str | os.PathLike[str] | None = None, on_output: OutputCallback | None = None,
                     store: ArtifactStore | None = None, files: Mapping[str, bytes] | None = None,
                     packages: Sequence[str] = (), mount_folder: bool = True, allow_errors: bool = False,
                     **overrides: Unpack[RunOverrides]) -> ExecutionResult:
    """Run code (str), a .py/.ipynb path or a notebook in a fresh sandbox and return the result.

    A path is an os.PathLike, or a str of one line ending in .ipynb or .py (papermill's habit): such a str is
    never run as code, and one that names no file is a NotebookError (see `notebook.is_path`).

    ``config`` defaults to ``from_env()``; keyword overrides (timeout=5, memory="2g", network=True, ...)
    change single fields for this call. The language is ``language=`` when given, else the source's own (a
    notebook's kernelspec, a script's extension: .R, .ts, .sh ...), else the config's (code as a str).
    The files the code left in /mnt/data (a filesystem of max_data bytes
    that goes with the sandbox) are copied to ``<output_dir>/data``; images go to ``<output_dir>/images`` and
    the executed notebook next to them.
    ``files`` ({name: bytes}) are put into /mnt/data before the code runs (and are listed in the result).
    ``store`` receives every file and image (default: a LocalStore, whose URLs are file:// URLs of the
    files where they lie); links to them replace `sandbox:/mnt/data/...` references in the text views.
    ``packages`` (requirements such as "tabulate" or "pyarrow==17.*") are fetched on the host and installed
    offline before the code runs, as the code's own ``%pip install`` lines are (see `nbexec.packages`).
    A notebook or script given as a path brings its folder, as `nbexec run` does: mounted read-only at
    /mnt/input and copied into the working folder, so `open('data.csv')` reads the file next to it (never the
    home folder or /; ``mount_folder=False`` mounts nothing, a config's input_dir wins). A source whose sandboxes
    run elsewhere (NBEXEC_NODES: a remote node) mounts no folder of this host.
    ``allow_errors=True`` runs every cell and keeps each error (nbclient's option); the result still fails, and
    its ``error`` is the first one. SystemExit, timeouts and a dead kernel still end the run.
    The code may overwrite those inputs and write into their sub-folders: the host's files stay as they were,
    the new versions are the result's files and a note names what was shadowed (see `sandbox.docker.inputcopy`).
    Errors in the code are in the result (``ok`` False); only failures of nbexec itself raise.
    """
    session, nb = prepare(source, config=config, output_dir=output_dir, store=store, mount_folder=mount_folder,
                          **overrides)
    return run_prepared(session, nb, files=files, on_output=on_output, packages=packages, allow_errors=allow_errors)


def prepare(source: Any, *, config: SandboxConfig | None = None,
            output_dir: str | os.PathLike[str] | None = None, store: ArtifactStore | None = None,
            mount_folder: bool = True, **overrides: Unpack[RunOverrides]) -> tuple[Session, NotebookNode]:
    """execute_notebook()'s first half: the notebook and its throwaway session, not started (no sandbox yet), so
    another thread can interrupt the run once it starts (see `many`)."""
    config = (config or from_env()).replace(**overrides)
    nb = notebook.coerce(source, overrides.get("language"), default=config.language)
    config = config.replace(language=notebook.language_of(nb).name)
    cellsize.check(config, nb)  # before the sandbox starts
    named = isinstance(source, os.PathLike) or (isinstance(source, str) and notebook.is_path(source))
    if mount_folder and named and sources.for_config(config).mounts_host_folders:
        config = inputs.with_folder(config, Path(source))
    session = Session(config, output_dir=None if output_dir is None else os.fspath(output_dir), ttl=None,
                      store=store, one_shot=True)
    return session, nb


def run_prepared(session: Session, nb: NotebookNode, *, files: Mapping[str, bytes] | None = None,
                 on_output: OutputCallback | None = None, packages: Sequence[str] = (),
                 allow_errors: bool = False) -> ExecutionResult:
    """execute_notebook()'s second half: start the session, put the files, run the notebook, close the session."""
    try:
        with traces.root(session):  # the sandbox's acquisition is part of the execution's trace
            session.start()
            for name, content in (files or {}).items():
                session.upload(content, name)
            return session.run_notebook(nb, on_output=on_output, packages=packages, allow_errors=allow_errors)
    finally:
        session.close()


async def execute_notebook_async(source: Any, **options: Unpack[ExecuteOptions]) -> ExecutionResult:
    """execute_notebook() for asyncio code: the same call, run in a worker thread."""
    return await asyncio.to_thread(execute_notebook, source, **options)
