"""The keyword overrides are typed: the TypedDicts stay equal to SandboxConfig's fields and execute_notebook()'s
keywords, and mypy refuses a misspelt key or a value of the wrong type in a user's call."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import nbexec
from nbexec import ConfigOverrides, ExecuteOptions, RunOverrides, SandboxConfig, execute_notebook
from nbexec.engine.options import BatchOptions, RestoreOptions, SessionOptions

ROOT = Path(__file__).resolve().parent.parent


def _members(annotation: Any) -> set[Any]:
    """A union's members (``X | None`` and ``Optional[X]`` alike), or the one type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}


def test_config_overrides_are_the_config_fields_or_none() -> None:
    fields = typing.get_type_hints(SandboxConfig)
    names = [f.name for f in dataclasses.fields(SandboxConfig)]
    overrides = typing.get_type_hints(ConfigOverrides)
    assert sorted(overrides) == sorted(names)
    for name in names:  # None keeps the config's value (SandboxConfig.replace, from_env); a tuple's list is made one
        lists = {list[str]} if fields[name] == tuple[str, ...] else set()
        assert _members(overrides[name]) == _members(fields[name]) | lists | {type(None)}, name


def test_run_overrides_leave_out_the_names_execute_notebook_uses() -> None:
    """execute_notebook()'s ``source`` and ``packages`` are the code and its requirements, not config fields."""
    own = set(inspect.signature(execute_notebook).parameters) - {"overrides"}
    assert set(typing.get_type_hints(RunOverrides)) == set(typing.get_type_hints(ConfigOverrides)) - own
    assert own & set(typing.get_type_hints(ConfigOverrides)) == {"source", "packages"}


def test_execute_options_are_execute_notebooks_keywords() -> None:
    signature = inspect.signature(execute_notebook)
    hints = typing.get_type_hints(execute_notebook)
    keywords = {name for name, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY}
    options = typing.get_type_hints(ExecuteOptions)
    assert set(options) == keywords | set(typing.get_type_hints(RunOverrides))
    for name in keywords:
        assert options[name] == hints[name], name
    assert set(typing.get_type_hints(BatchOptions)) == set(options) - {"on_output"}  # execute_many refuses it


def test_session_options_are_the_sessions_keywords() -> None:
    """SessionManager.create passes on all but the config, id and ttl it sets itself; a restore all but the config
    (the snapshot's) and owner (its own), with the ``policy`` to restore under. ``one_shot`` is the engine's."""
    hints = typing.get_type_hints(nbexec.Session.__init__)
    keywords = set(inspect.signature(nbexec.Session).parameters) - {"overrides", "one_shot"}
    created, restored = typing.get_type_hints(SessionOptions), typing.get_type_hints(RestoreOptions)
    assert set(created) == keywords - {"config", "session_id", "ttl"}
    assert set(restored) == keywords - {"config", "owner"} | {"policy"}
    for name, annotation in {**created, **restored}.items():
        assert annotation == hints.get(name, SandboxConfig | None), name


def test_session_takes_overrides() -> None:
    session = nbexec.Session(nbexec.SandboxConfig(), timeout=5, memory="2g", ttl=None)
    assert (session.config.timeout, session.config.memory) == (5, "2g")
    lazy = nbexec.Session(timeout=7, language="r", ttl=None)  # no config: from_env() on first use, overridden
    assert lazy.notebook.metadata.kernelspec.language == "R"
    assert (lazy.config.timeout, lazy.config.language) == (7, "r")


SNIPPET = '''\
import nbexec
nbexec.execute_notebook("1", timeout=5, memory="2g", network="allowlist", allowed_hosts=("x.org",))
nbexec.execute_notebook("1", timeot=5)
nbexec.Session(memroy="2g")
nbexec.execute_many(["1"], timeout="5")
nbexec.from_env(pool_size=1).replace(pids="many")
nbexec.execute_notebook_async("1", allow_errors=True, on_output=None, cpus=2.0).close()
nbexec.execute_many(["1"], on_output=None)
'''


def test_mypy_refuses_a_misspelt_override(tmp_path: Path) -> None:
    (tmp_path / "calls.py").write_text(SNIPPET)
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
                           "--hide-error-context", str(tmp_path / "calls.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    errors = [line.split(": error: ")[0].rsplit(":", 1)[1] + " " + line.rsplit("[", 1)[1].rstrip("]")
              for line in done.stdout.splitlines() if ": error: " in line]
    assert errors == ["3 call-arg", "4 call-arg", "5 arg-type", "6 arg-type", "8 call-arg"], done.stdout + done.stderr
