"""The `nbexec` command. Exit codes: 0 success, 1 the code raised or timed out, 2 usage error, 3 nbexec failure."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__, daemon, image, render
from .config import SandboxConfig, describe, from_env
from .errors import ConfigError, NbexecError, NotebookError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
EXIT_CODES = """Exit codes: 0 success; 1 the code raised, timed out or hit a limit; 2 usage error (bad option,
missing or invalid input); 3 nbexec or Docker failure."""

# Config fields offered as options, each with its help text taken from SandboxConfig.
_OPTION_FIELDS = ("timeout", "cell_timeout", "memory", "cpus", "pids", "network", "image", "max_output", "max_data",
                  "tmp_size", "user", "runtime")


def sandbox_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per SandboxConfig field (defaults come from the config, never re-declared)."""
    fields = {f.name: f for f in dataclasses.fields(SandboxConfig)}
    for name in reversed(_OPTION_FIELDS):
        flag = "--" + name.replace("_", "-")
        kind = str(fields[name].type)
        default = fields[name].default
        help_text = describe(name) + (f" [default: {default}]" if default is not None else "")
        if kind == "bool":
            func = click.option(f"{flag}/--no-{name.replace('_', '-')}", name, default=None, help=help_text)(func)
        else:
            click_type = {"int": int, "float": float}.get(kind.split(" ")[0], str)
            func = click.option(flag, name, type=click_type, default=None, help=help_text)(func)
    func = click.option("--env", "env_names", multiple=True, metavar="NAME",
                        help="Pass the host variable NAME into the sandbox (repeatable); none is passed otherwise.",
                        )(func)
    return func


def build_config(values: dict[str, Any], **fixed: Any) -> SandboxConfig:
    """The config from NBEXEC_* and the command line (the command line wins)."""
    overrides = {name: values.pop(name) for name in _OPTION_FIELDS if name in values}
    env_names = values.pop("env_names", ())
    missing = [n for n in env_names if n not in os.environ]
    if missing:
        raise click.UsageError(f"--env names variables that are not set: {', '.join(missing)}")
    config = from_env(**overrides, **fixed)
    if env_names:
        config = config.replace(env={**config.env, **{n: os.environ[n] for n in env_names}})
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="nbexec")
@click.option("-v", "--verbose", count=True, help="Log what nbexec does (-vv for debug).")
def main(verbose: int) -> None:
    """Run untrusted Python as a notebook in a throwaway, locked-down Docker sandbox."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="nbexec: %(message)s", stream=sys.stderr)


@main.command(epilog=EXIT_CODES)
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (the result) on stdout.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where data/, images/ and the executed notebook go [default: ./nbexec-output/<name>-<id>].")
@click.option("--save-notebook", type=click.Path(dir_okay=False, path_type=Path),
              help="Also copy the executed notebook here.")
@sandbox_options
def run(file: Path, as_json: bool, output_dir: Path | None, save_notebook: Path | None, **options: Any) -> None:
    """Run FILE (.py with optional `# %%` cells, .ipynb, or - for stdin) in a fresh sandbox."""
    from .execute import execute_notebook
    from .notebook import load

    try:
        config = build_config(options, pool_size=0)  # one run per process: a warm pool would only cost
        nb = load(file)
        if output_dir is None:
            stem = "stdin" if str(file) == "-" else file.stem
            output_dir = Path("nbexec-output") / f"{stem}-{os.urandom(4).hex()}"
        result = execute_notebook(nb, config=config, output_dir=output_dir)
    except (NotebookError, ConfigError) as exc:
        _fail(str(exc), EXIT_USAGE, as_json)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, as_json)
    if save_notebook is not None and result.notebook_path:
        shutil.copyfile(result.notebook_path, save_notebook)
    if as_json:
        click.echo(result.to_json())
    else:
        text = render.for_terminal(result)
        if text:
            click.echo(text)
        if result.error is not None:
            click.echo(render.error_text(result), err=True)
        click.echo(f"notebook: {result.notebook_path}", err=True)
    sys.exit(EXIT_OK if result.ok else EXIT_FAILED)


def _fail(message: str, code: int, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"ok": False, "nbexec_error": message, "exit_code": code}))
    click.echo(f"nbexec: {message}", err=True)
    sys.exit(code)


@main.group(name="image")
def image_group() -> None:
    """Build and inspect the runtime image."""


@image_group.command(name="build", epilog=EXIT_CODES)
@click.option("--tag", default=None,
              help="Image tag to build [default: the config's image].")
@click.option("--base-image", help="Base image (build argument BASE_IMAGE) [default: python:3.12-slim].")
@click.option("--debootstrap", is_flag=True,
              help="No registry: make a Debian base with debootstrap + docker import (root), and build on it.")
@click.option("--mirror", help="Debian mirror for --debootstrap [default: http://deb.debian.org/debian].")
@click.option("--ca-bundle", type=click.Path(dir_okay=False, exists=True, path_type=Path), envvar="NBEXEC_CA_BUNDLE",
              help="CA certificates for pip inside the build (a TLS-inspecting proxy or private mirror).")
@click.option("--no-cache", is_flag=True, help="Build every layer anew.")
def image_build(tag: str | None, base_image: str | None, debootstrap: bool, mirror: str | None,
                ca_bundle: Path | None, no_cache: bool) -> None:
    """Build the runtime image, showing Docker's progress."""
    tag = tag or from_env().image
    try:
        if debootstrap:
            base_image = base_image or image.DEFAULT_BASE
            if image.exists(base_image):
                click.echo(f"nbexec: using the existing base image {base_image}", err=True)
            else:
                image.make_base(base_image, mirror=mirror)
        options = image.BuildOptions(tag=tag, base_image=base_image, ca_bundle=ca_bundle, no_cache=no_cache)
        image_id = image.build(options, progress=lambda line: click.echo(line, err=True))
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE, False)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, False)
    click.echo(f"built {tag} ({image_id})")


@main.command(epilog=EXIT_CODES)
def doctor() -> None:
    """Check that Docker answers and the image is present; print a fix for each problem."""
    problems = 0
    config = from_env()
    click.echo(f"nbexec {__version__}, Python {sys.version.split()[0]}")
    try:
        client = daemon.connect()
        version = client.version()
        click.echo(f"ok   Docker engine {version.get('Version')} (API {version.get('ApiVersion')})")
    except NbexecError as exc:
        click.echo(f"FAIL {exc}")
        sys.exit(EXIT_INFRA)
    try:
        info = image.describe(config.image)
        click.echo(f"ok   image {config.image}: {info['id']} ({info['size_mb']} MB, built {info['created'][:19]})")
    except NbexecError as exc:
        problems += 1
        click.echo(f"FAIL {exc}")
    if config.runtime:
        runtimes = client.info().get("Runtimes", {})
        if config.runtime not in runtimes:
            problems += 1
            click.echo(f"FAIL runtime {config.runtime} is not installed in Docker (have: {', '.join(runtimes)}). "
                       "Install it (gVisor: runsc install) and restart Docker, or unset NBEXEC_RUNTIME.")
        else:
            click.echo(f"ok   runtime {config.runtime}")
    click.echo(f"     policy: {config!r}")
    sys.exit(EXIT_INFRA if problems else EXIT_OK)


@main.command(epilog=EXIT_CODES)
@click.option("--all", "everything", is_flag=True, help="Also remove containers of nbexec processes still running.")
def cleanup(everything: bool) -> None:
    """Remove containers and working folders nbexec left behind (found by label)."""
    from .sandbox import remove_stale_workdirs

    try:
        removed = daemon.cleanup(daemon.connect(), everything=everything)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, False)
    folders = remove_stale_workdirs()
    for item in removed:
        click.echo(f"removed container {item.name} ({item.id}, {item.role or 'unknown role'}, owner {item.owner})")
    for folder in folders:
        click.echo(f"removed folder {folder}")
    click.echo(f"{len(removed)} containers and {len(folders)} folders removed")


if __name__ == "__main__":  # pragma: no cover
    main()
