"""Many notebooks and scripts, each in its own sandbox, a few at a time (the CI use of `nbexec run`)."""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbexec import notebook
from nbexec.config import SandboxConfig
from nbexec.engine import execute
from nbexec.engine.many import Exhausted, Runner, Running, StoppedError
from nbexec.errors import ConfigError, NbexecError, NotebookError
from nbexec.files.folders import MARK
from nbexec.files.inputs import with_folder
from nbexec.languages import LANGUAGES
from nbexec.notebook import parameters
from nbexec.result import ExecutionResult
from nbexec.stores.storage import ArtifactStore

SUFFIXES = (".py", ".ipynb")  # what a folder is searched for
SCRIPTS = (".ipynb", *(suffix for language in LANGUAGES.values() for suffix in language.extensions))  # and a glob
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One input's outcome: ``status`` is passed, failed (the code raised, or the input is not a notebook),
    timeout, error (nbexec or Docker failed) or skipped (--fail-fast)."""

    path: Path
    status: str
    duration_s: float
    result: ExecutionResult | None = None
    message: str = ""

    @property
    def name(self) -> str:
        return str(self.path)


def discover(inputs: list[str]) -> list[Path]:
    """Files from paths, folders (searched recursively for .py and .ipynb) and glob patterns, in order, once each."""
    found: list[Path] = []
    for raw in inputs:
        if any(ch in raw for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(raw, recursive=True))
            files = [m for m in matches if m.is_file() and m.suffix in SCRIPTS]
            if not files:
                raise NotebookError(f"{raw} matches no notebook or script ({', '.join(SCRIPTS)})")
        elif Path(raw).is_dir():
            files = _scan(Path(raw))
            if not files:
                raise NotebookError(f"{raw} is a folder with no .py or .ipynb file in it")
        elif raw == "-" or Path(raw).is_file():
            files = [Path(raw)]
        else:
            raise NotebookError(f"{raw} does not exist")
        found.extend(f for f in files if f not in found)
    return found


def _scan(folder: Path) -> list[Path]:
    """The .py and .ipynb files below ``folder``, sorted; hidden names, checkpoints and nbexec's own output folders
    (marked as holding a sandbox's files: an earlier run's notebook.ipynb and data) are not searched."""
    found: list[Path] = []
    for where, subfolders, names in os.walk(folder):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != ".ipynb_checkpoints"
                         and not os.path.lexists(Path(where, name, MARK))]
        found.extend(Path(where, name) for name in names
                     if not name.startswith(".") and Path(name).suffix in SUFFIXES and Path(where, name).is_file())
    return sorted(found)


def _output_dir(root: Path, path: Path, taken: set[str], lock: threading.Lock) -> Path:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", "stdin" if str(path) == "-" else path.stem) or "input"
    with lock:
        name, n = stem, 1
        while name in taken or (root / name).exists():
            n += 1
            name = f"{stem}-{n}"
        taken.add(name)
    return root / name


@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    """How to run a batch."""

    jobs: int = 1
    output_root: Path = Path("nbexec-output")
    parameters: Mapping[str, Any] | None = None
    fail_fast: bool = False
    store: ArtifactStore | None = None
    packages: tuple[str, ...] = ()  # installed before each file runs (see nbexec.packages)
    mount_folders: bool = False  # each file's folder at /mnt/input, linked from the working folder
    language: str | None = None  # --language: over each file's own (its extension, its kernelspec)
    allow_errors: bool = False  # --allow-errors: every cell runs, each error kept; the file still fails


def _run_one(path: Path, config: SandboxConfig, options: BatchOptions, out: Path, running: Running) -> Item:
    started = time.monotonic()
    try:
        nb = notebook.load(path, options.language, default=config.language)
        parameters.inject(nb, options.parameters or {})
        config = with_folder(config, path) if options.mount_folders else config
        session, nb = execute.prepare(nb, config=config, output_dir=out, store=options.store)
        result = running.run(session, lambda: execute.run_prepared(
            session, nb, packages=options.packages, allow_errors=options.allow_errors))
    except StoppedError:
        raise
    except (NotebookError, ConfigError) as exc:  # this input is bad; the others still run
        return Item(path, "failed", time.monotonic() - started, message=str(exc))
    except NbexecError as exc:  # nbexec or Docker failed
        return Item(path, "error", time.monotonic() - started, message=str(exc))
    status = "passed" if result.ok else ("timeout" if result.error and result.error.kind == "timeout" else "failed")
    message = "" if result.error is None else f"{result.error.ename}: {result.error.evalue}"
    return Item(path, status, time.monotonic() - started, result, message)


def run(paths: list[Path], config: SandboxConfig, options: BatchOptions,
        on_event: Callable[[str, Item | Path], None] = lambda kind, item: None) -> list[Item]:
    """Run every path; ``on_event("start", path)`` and ``on_event("done", item)`` report progress."""
    if options.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    taken: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def task(path: Path, running: Running) -> Item:
        if stop.is_set():
            return Item(path, "skipped", 0.0, message="not run: --fail-fast after an earlier failure")
        on_event("start", path)
        item = _run_one(path, config, options, _output_dir(options.output_root, path, taken, lock), running)
        if options.fail_fast and item.status != "passed":
            stop.set()
        on_event("done", item)
        return item

    # The engine's runner (execute_many's): Ctrl-C interrupts the running files and leaves no sandbox behind.
    items: dict[int, Item] = {}
    runner = Runner(paths, task, options.jobs)
    try:
        while True:
            try:
                done = runner.next()
            except Exhausted:
                break
            assert done is not None
            index, item, error = done
            if error is not None:  # a bug of nbexec's for one file: reported as its error, the others run on
                item = Item(paths[index], "error", 0.0, message=f"{type(error).__name__}: {error}")
            assert item is not None
            items[index] = item
    finally:
        runner.stop()
    return [items[i] for i in range(len(paths))]
