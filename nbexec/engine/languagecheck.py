"""A run's language, checked before a sandbox starts.

A notebook runs in its session's language. When another language asks for what only a Python kernel offers, the
error says so plainly. Packages need Python because the installer runs in the kernel. `Session.shell` needs it
because a Python snippet starts the command. Warm imports are skipped, with a note when they were set.
Two more refusals live elsewhere. `SandboxConfig` refuses the allowlist network, because its forwarder runs in the
kernel. `sandbox.docker.checkpoint` refuses a checkpoint, and the engine replays the cells instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nbformat import NotebookNode

from nbexec import languages, notebook, packages
from nbexec.config import SandboxConfig
from nbexec.errors import NotOfferedError

_DEFAULT_WARM = next(f.default for f in dataclasses.fields(SandboxConfig) if f.name == "warm_imports")


def checked(config: SandboxConfig, nb: NotebookNode, requested: Sequence[str], first_index: int) -> tuple[str, ...]:
    """Check that ``nb`` (from cell ``first_index``) can run in a session of ``config.language``; the result's notes.

    Its kernelspec must name that language, or none (it is then given it). It must ask for nothing Python-only."""
    language = languages.get(config.language)
    if nb.get("metadata", {}).get("kernelspec") is None:
        nb.setdefault("metadata", {})["kernelspec"] = language.spec
    elif notebook.language_of(nb) is not language:
        raise NotOfferedError(f"the notebook is {notebook.language_of(nb).name} and this session's kernel is "
                          f"{language.name}: run it in a session of its language (language=...)")
    check_run(config, nb, requested, first_index)
    return notes(config)


def check_run(config: SandboxConfig, nb: NotebookNode, requested: Sequence[str], first_index: int) -> None:
    """NotOfferedError (a ConfigError) when a run in a language other than Python asks for packages."""
    if config.language == "python":
        return
    if requested:
        raise NotOfferedError(f"packages ({', '.join(requested)[:200]}) are Python-only, and this code is "
                          f"{config.language}: add what it needs to the image instead (environments/jupyter/"
                          "kernels.Dockerfile)")
    for index in range(first_index, len(nb.cells)):
        cell = nb.cells[index]
        found = packages.scan(cell.source, index) if cell.cell_type == "code" else []
        if found:
            raise NotOfferedError(f"cell {index} has a pip install line (line {found[0].line + 1}): packages are "
                              f"Python-only, and this notebook is {config.language}. Remove the line and add what "
                              "it needs to the image instead (environments/jupyter/kernels.Dockerfile)")


def check_shell(config: SandboxConfig) -> None:
    """NotOfferedError for `Session.shell` in a language other than Python (its runner is Python code)."""
    if config.language != "python":
        instead = ": run the command as code instead" if config.language == "bash" else \
            "; a bash session (language='bash') runs commands as code"
        raise NotOfferedError(f"Session.shell is Python-only (a Python snippet runs the command), and this session "
                              f"is {config.language}{instead}")


def notes(config: SandboxConfig) -> tuple[str, ...]:
    """The result's note when warm imports were set for a language other than Python (they are skipped)."""
    if config.language == "python" or not config.warm_imports or config.warm_imports == _DEFAULT_WARM:
        return ()
    return (f"warm_imports ({', '.join(config.warm_imports)[:200]}) are Python modules: skipped for a "
            f"{config.language} kernel",)
