"""The NBEXEC_* variables nbexec reads, so that a mistyped one is warned about instead of silently ignored."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping

import click

from nbexec.config import SandboxConfig
from nbexec.hostconfig import HostConfig

# Read outside the two config classes (stores, the service, snapshots, packages). tests/test_cli_front_door.py
# checks this list against every name the code reads, so a new variable cannot be warned about by mistake.
_OTHERS = ("API_TOKENS", "BLOB_PREFIX", "CA_BUNDLE", "E2B_MAX_TIMEOUT", "E2B_PORTS", "EGRESS_WIDEN", "GCS_BUCKET",
           "HIBERNATE_AFTER", "LINK_EXPIRY", "PACKAGE_RESOLVER_PYTHON", "S3_ADDRESSING_STYLE", "S3_BUCKET",
           "SAS_EXPIRY", "SNAPSHOT_BUCKET", "SNAPSHOT_CONTAINER", "SNAPSHOT_DIR", "SNAPSHOT_KEY", "SNAPSHOT_PREFIX",
           "SNAPSHOT_STORE", "SNAPSHOT_TTL", "STATE_DIR", "STATE_GRACE")
# Read by the project's scripts, CI and examples, not by nbexec: set in those environments, never a typo.
_TOOLS = ("AIRGAPPED", "ALLOW_DOCKER_RESTART", "CHANGED_SINCE", "FULL", "LOAD_COUNT", "TEST_WORKERS", "TOKEN", "URL")
PREFIX = "NBEXEC_"
PASSED = "NBEXEC_ENV_"  # NBEXEC_ENV_<NAME> passes NAME into the sandbox: any name is right


def known() -> frozenset[str]:
    """Every NBEXEC_ name nbexec reads."""
    fields = [f.name for cls in (SandboxConfig, HostConfig) for f in dataclasses.fields(cls) if f.name != "env"]
    return frozenset(PREFIX + name.upper() for name in (*fields, *_OTHERS, *_TOOLS))


def mistyped(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """(name, the known name it is closest to or None) for each NBEXEC_ variable nbexec does not read."""
    names = known()
    return [(name, next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.75)), None))
            for name in sorted(environ) if name.startswith(PREFIX) and not name.startswith(PASSED)
            and name not in names]


def warn_mistyped(environ: Mapping[str, str]) -> None:
    """One warning on stderr per NBEXEC_ variable that nbexec ignores, with the name it probably meant."""
    for name, close in mistyped(environ):
        hint = f"did you mean {close}? " if close else ""
        click.echo(f"nbexec: warning: {name} is not a variable nbexec reads ({hint}see .env.example); it is "
                   "ignored", err=True)


def warn_at_start() -> None:
    """The group's start: warn now, unless the command about to run has -q. That one warns once its options are
    read (`exits.RunCommand`), so that -q silences the warning as it does nbexec's other ones."""
    ctx = click.get_current_context()
    group, name = ctx.command, ctx.invoked_subcommand
    command = group.get_command(ctx, name) if isinstance(group, click.Group) and name else None
    if command is None or not any(param.name == "quiet" for param in command.params):
        warn_mistyped(os.environ)
