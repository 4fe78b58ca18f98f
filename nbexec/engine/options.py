"""The keyword options that calls pass on, as TypedDicts: execute_notebook()'s (for the async one and
execute_many) and a Session's (for SessionManager and snapshots). An editor completes them and mypy refuses a
misspelt one; tests/test_overrides.py keeps them equal to the keywords they stand for."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypedDict

from nbexec.config import SandboxConfig
from nbexec.overrides import RunOverrides
from nbexec.stores.storage import ArtifactStore

from .budget import OutputCallback


class BatchOptions(RunOverrides, total=False):
    """execute_many()'s options: execute_notebook()'s, the same for every item, but ``on_output``."""

    config: SandboxConfig | None
    output_dir: str | os.PathLike[str] | None
    store: ArtifactStore | None
    files: Mapping[str, bytes] | None
    packages: Sequence[str]
    mount_folder: bool
    allow_errors: bool


class ExecuteOptions(BatchOptions, total=False):
    """execute_notebook()'s keyword options (execute_notebook_async takes them too)."""

    on_output: OutputCallback | None


class SessionOptions(TypedDict, total=False):
    """Session's keywords that SessionManager.create passes on (its config, id and ttl are its own)."""

    output_dir: str | Path | None
    store: ArtifactStore | None
    keep_files: bool
    state_dir: str | Path | None
    owner: str
    hibernate_after: float | None


class RestoreOptions(TypedDict, total=False):
    """Session's keywords for a session made from a snapshot (Session.from_snapshot, fork, SessionManager.restore;
    the owner is theirs), and ``policy``: the config a service allows now (see `durable.within`)."""

    session_id: str | None
    output_dir: str | Path | None
    ttl: float | None
    store: ArtifactStore | None
    keep_files: bool
    state_dir: str | Path | None
    hibernate_after: float | None
    policy: SandboxConfig | None
