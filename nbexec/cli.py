"""The `nbexec` command. Exit codes: 0 success, 1 the code raised or timed out, 2 usage error, 3 nbexec failure."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__, render
from .config import SandboxConfig, describe, from_env, running_as_root, store_from_env
from .errors import ConfigError, NbexecError, NotebookError
from .outputs import clean
from .sandbox import daemon, datafs, image

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
    from . import envfile  # .env of the current folder, under the real environment (commands and services alike)

    try:
        envfile.load()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@main.command(epilog=EXIT_CODES)
@click.argument("inputs", nargs=-1, required=True, metavar="FILE...")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object on stdout.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="One file: where data/, images/ and the notebook go [default: ./nbexec-output/<name>-<id>]. "
                   "Several: the folder that gets one sub-folder per file [default: ./nbexec-output].")
@click.option("--save-notebook", type=click.Path(dir_okay=False, path_type=Path),
              help="Also copy the executed notebook here (one file only).")
@click.option("--store", type=click.Choice(["local", "azure"]), default="local", show_default=True,
              help="Where files and images go: kept locally (file:// links) or uploaded to Azure Blob Storage "
                   "(read-only SAS links; AZURE_* variables, see .env.example).")
@click.option("--upload", type=click.Choice(["azure"]), help="Same as --store azure.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Files run at once, each in its own sandbox.")
@click.option("-p", "--parameter", "parameter_pairs", nargs=2, multiple=True, metavar="NAME VALUE",
              help="Inject NAME = VALUE (a Python/YAML literal) after the cell tagged `parameters` (repeatable).")
@click.option("--parameters-file", type=click.Path(dir_okay=False, path_type=Path),
              help="YAML mapping of parameters (the -p values win).")
@click.option("--junit-xml", type=click.Path(dir_okay=False, path_type=Path), help="Write a JUnit XML report.")
@click.option("--html-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write an HTML render of each executed notebook (images embedded).")
@click.option("--fail-fast", is_flag=True, help="Start no new file after the first failure.")
@click.option("--mount-input", "input_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Mount this host folder read-only at /mnt/input.")
@sandbox_options
def run(inputs: tuple[str, ...], as_json: bool, output_dir: Path | None, save_notebook: Path | None, store: str,
        upload: str | None, jobs: int, parameter_pairs: tuple[tuple[str, str], ...], parameters_file: Path | None,
        junit_xml: Path | None, html_dir: Path | None, fail_fast: bool, input_dir: Path | None,
        **options: Any) -> None:
    """Run FILE... (.py with optional `# %%` cells, .ipynb, folders, globs, or - for stdin), each in a fresh
    sandbox. One file prints what its notebook shows; several print progress and a summary table."""
    from . import batch, parameters

    try:
        single = len(inputs) == 1 and not Path(inputs[0]).is_dir() and not any(c in inputs[0] for c in "*?[") \
            and not (junit_xml or html_dir or fail_fast)
        values = parameters.load_file(parameters_file) if parameters_file else {}
        values.update({name: parameters.parse_value(raw) for name, raw in parameter_pairs})
        parameters.validate(values)
        fixed: dict[str, Any] = {"pool_size": 0 if single or jobs == 1 else min(jobs, 4)}
        if input_dir:
            fixed["input_dir"] = str(input_dir)
        config = build_config(options, **fixed)
        artifact_store = store_from_env(upload or store)
        paths = batch.discover(list(inputs))
    except (NotebookError, ConfigError) as exc:
        _fail(str(exc), EXIT_USAGE, as_json)
    if single:
        _run_single(paths[0], config, artifact_store, values, output_dir, save_notebook, as_json)
    _run_batch(paths, config, batch.BatchOptions(jobs=jobs, output_root=output_dir or Path("nbexec-output"),
                                                 parameters=values, fail_fast=fail_fast, store=artifact_store),
               junit_xml, html_dir, as_json)


def _run_single(path: Path, config: SandboxConfig, artifact_store: Any, values: dict[str, Any],
                output_dir: Path | None, save_notebook: Path | None, as_json: bool) -> None:
    from .execute import execute_notebook
    from .notebook import load
    from .parameters import inject

    try:
        nb = inject(load(path), values)
        if output_dir is None:
            stem = "stdin" if str(path) == "-" else path.stem
            output_dir = Path("nbexec-output") / f"{stem}-{os.urandom(4).hex()}"
        result = execute_notebook(nb, config=config, output_dir=output_dir, store=artifact_store)
        if save_notebook is not None and result.notebook_path:
            shutil.copyfile(result.notebook_path, save_notebook)
        shown = json_text(result.to_json()) if as_json else None
    except (NotebookError, ConfigError) as exc:
        _fail(str(exc), EXIT_USAGE, as_json)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, as_json)
    except Exception as exc:  # a bug or an OS failure in nbexec: still one answer, never a bare traceback
        logging.getLogger("nbexec").debug("nbexec failed", exc_info=True)
        _fail(f"nbexec failed unexpectedly: {type(exc).__name__}: {exc} (run with -vv for the traceback)",
              EXIT_INFRA, as_json)
    if shown is not None:
        click.echo(shown)
    else:
        text = render.for_terminal(result)
        if text:
            click.echo(text)
        if result.error is not None:
            click.echo(render.error_text(result), err=True)
        click.echo(f"notebook: {result.notebook_path}", err=True)
    sys.exit(EXIT_OK if result.ok else EXIT_FAILED)


_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def json_text(text: str) -> str:
    """JSON with every character a terminal could act on (DEL, C1) or no encoder accepts (lone surrogates)
    written as a \\u escape; json.dumps escapes C0 itself. The value read back is unchanged."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _run_batch(paths: list[Path], config: SandboxConfig, options: Any, junit_xml: Path | None,
               html_dir: Path | None, as_json: bool) -> None:
    from . import batch, reports

    progress = Progress(len(paths), live=sys.stderr.isatty() and not as_json)
    try:
        items = batch.run(paths, config, options, on_event=progress.event)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, as_json)
    except Exception as exc:  # as in _run_single: one answer, exit 3
        logging.getLogger("nbexec").debug("nbexec failed", exc_info=True)
        _fail(f"nbexec failed unexpectedly: {type(exc).__name__}: {exc}", EXIT_INFRA, as_json)
    progress.close()
    if junit_xml:
        reports.junit_xml(items, junit_xml)
    if html_dir:
        reports.html(items, html_dir)
    failed = any(i.status != "passed" for i in items)
    if as_json:
        click.echo(json_text(json.dumps({"ok": not failed, "results": [
            {"file": i.name, "status": i.status, "duration_s": round(i.duration_s, 3), "message": i.message,
             "result": i.result.to_dict() if i.result else None} for i in items]}, ensure_ascii=False)))
    else:
        click.echo(reports.summary(items))
    if any(i.status == "error" for i in items):
        sys.exit(EXIT_INFRA)
    sys.exit(EXIT_FAILED if failed else EXIT_OK)


class Progress:
    """A live status line on a terminal; one line per finished file otherwise (CI logs)."""

    def __init__(self, total: int, *, live: bool) -> None:
        self.total, self.live = total, live
        self.done = self.failed = 0
        self.running: list[str] = []

    def event(self, kind: str, subject: Any) -> None:
        if kind == "start":
            self.running.append(str(subject))
        else:
            self.done += 1
            self.failed += subject.status != "passed"
            if subject.name in self.running:
                self.running.remove(subject.name)
            if not self.live:
                note = f" ({subject.message.splitlines()[0][:100]})" if subject.message else ""
                click.echo(f"[{self.done}/{self.total}] {subject.status.upper():7} {subject.name} "
                           f"{subject.duration_s:.1f} s{note}", err=True)
        if self.live:
            line = f"[{self.done}/{self.total}] {self.failed} failed; running: {', '.join(self.running)[:60]}"
            click.echo(f"\r\x1b[K{line}", err=True, nl=False)

    def close(self) -> None:
        if self.live:
            click.echo("\r\x1b[K", err=True, nl=False)


def _fail(message: str, code: int, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"ok": False, "nbexec_error": message, "exit_code": code}))
    click.echo(f"nbexec: {clean(message)}", err=True)
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
    """Check that Docker answers, the image is present and which runtimes work here; print a fix for each problem."""
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
    problems += _check_runtimes(config)
    _check_sandbox_uid(config)
    click.echo(f"warn {datafs.fallback_reason()}" if datafs.fallback_reason() else
               "ok   /mnt/data is a filesystem of its own per sandbox (max_data bytes, max_files inodes)")
    click.echo(f"     policy: {config!r}")
    sys.exit(EXIT_INFRA if problems else EXIT_OK)


def _check_runtimes(config: SandboxConfig) -> int:
    """Start a test container with each supported runtime; a problem only when the configured one fails."""
    from .sandbox import runtimes

    try:
        click.echo(f"ok   runtimes Docker knows: {', '.join(runtimes.engine_runtimes())}")
        checks = runtimes.check_all(config.image, config.runtime)
    except NbexecError as exc:
        click.echo(f"FAIL {exc}")
        return 1
    configured = config.runtime or runtimes.DEFAULT
    problems = 0
    for found in checks:
        what = f"runtime {found.name} ({runtimes.SUPPORTED.get(found.name, 'configured')})"
        mark = " [configured]" if found.name == configured else ""
        if found.works:
            click.echo(f"ok   {what}{mark} runs a test container ({found.seconds:.2f} s)")
            continue
        problems += found.name == configured
        click.echo(f"{'FAIL' if found.name == configured else 'WARN'} {what}{mark} does not work here: "
                   f"{found.reason}")
    return problems


def _check_sandbox_uid(config: SandboxConfig) -> None:
    """Warn when sandboxes run as a login account: code there shares its files' ownership and per-uid limits."""
    import pwd

    if not config.user and running_as_root():
        click.echo("ok   sandbox uid: a fresh uid per sandbox with no account (nbexec runs as root)")
        return
    uid = config.uid_gid()[0]
    try:
        account = pwd.getpwuid(uid)
    except KeyError:
        click.echo(f"ok   sandbox uid {uid}: no account on this host")
        return
    shell = os.path.basename(account.pw_shell or "")
    if shell in ("", "nologin", "false", "sync"):
        click.echo(f"ok   sandbox uid {uid}: account {account.pw_name} cannot log in ({account.pw_shell})")
        return
    where = "NBEXEC_USER / --user" if config.user else "your own uid (nbexec does not run as root)"
    click.echo(f"WARN sandbox uid {uid} is the login account {account.pw_name} ({account.pw_shell}), from {where}: "
               "sandboxed code shares that account's per-uid kernel limits and file ownership. Run nbexec as root "
               "(a fresh uid per sandbox) or set NBEXEC_USER to a uid no account has.")


@main.command(name="mcp", epilog=EXIT_CODES)
@click.option("--transport", type=click.Choice(["stdio", "streamable-http"]), default="stdio", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address for streamable HTTP; a non-loopback address needs bearer tokens.")
@click.option("--port", type=int, default=8765, show_default=True, help="Port for streamable HTTP.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="File with accepted bearer tokens for streamable HTTP, one per line (also NBEXEC_API_TOKENS, "
                   "comma-separated).")
@click.option("--max-sessions", type=int, default=16, show_default=True, help="Clients served at once.")
@sandbox_options
def mcp_command(transport: str, host: str, port: int, token_file: Path | None, max_sessions: int,
                **options: Any) -> None:
    """Serve the execute_python tool over MCP (stdio by default); state is kept per client session."""
    tokens = _tokens(token_file)
    if transport == "streamable-http" and not tokens and not _loopback(host):
        _fail(f"--host {host} is not a loopback address: give bearer tokens with --token-file or "
              "NBEXEC_API_TOKENS (or bind 127.0.0.1)", EXIT_USAGE, False)
    try:
        from .integrations import mcp as mcp_server

        config = build_config(options)
        server, clients = mcp_server.build(config, max_sessions=max_sessions)
    except ImportError as exc:
        _fail(str(exc), EXIT_USAGE, False)
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE, False)
    mcp_server.serve(server, clients, transport=transport, host=host, port=port, tokens=tokens,
                     max_sessions=max_sessions)


def _tokens(token_file: Path | None) -> tuple[bytes, ...]:
    """Bearer tokens from NBEXEC_API_TOKENS and a token file, as bytes (what is compared on the wire)."""
    tokens = [t.strip() for t in os.environ.get("NBEXEC_API_TOKENS", "").split(",") if t.strip()]
    if token_file:
        tokens += [line.strip() for line in token_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(t.encode("utf-8") for t in tokens)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command(epilog=EXIT_CODES)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="File with accepted bearer tokens, one per line (also NBEXEC_API_TOKENS, comma-separated).")
@click.option("--no-auth", is_flag=True, help="Accept requests without a token (only with a loopback --host).")
@click.option("--max-sessions-per-token", type=click.IntRange(1), default=8, show_default=True)
@click.option("--max-running-per-token", type=click.IntRange(1), default=4, show_default=True)
@click.option("--max-body", default="16m", show_default=True, help="Largest request body.")
@click.option("--store", type=click.Choice(["local", "azure"]), default="local", show_default=True,
              help="Where produced files go (azure: read-only SAS links).")
@click.option("--result-ttl", type=click.FloatRange(min=0, min_open=True), default=15 * 60.0, show_default=True,
              help="Seconds a one-shot result's files stay downloadable before they are deleted.")
@sandbox_options
def serve(host: str, port: int, token_file: Path | None, no_auth: bool, max_sessions_per_token: int,
          max_running_per_token: int, max_body: str, store: str, result_ttl: float, **options: Any) -> None:
    """Serve nbexec over authenticated JSON/HTTP (/v1/execute, /v1/sessions, /healthz, /readyz, /metrics)."""
    import ipaddress

    try:
        import uvicorn

        from .service import server
    except ImportError as exc:
        _fail(f"{exc} (pip install 'nbexec-sandbox[server]')", EXIT_USAGE, False)
    tokens = [t.strip() for t in os.environ.get("NBEXEC_API_TOKENS", "").split(",") if t.strip()]
    if token_file:
        tokens += [line.strip() for line in token_file.read_text().splitlines() if line.strip()]
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if no_auth and not loopback:
        _fail("--no-auth is only allowed with a loopback --host (127.0.0.1, ::1, localhost)", EXIT_USAGE, False)
    if no_auth:
        click.echo("nbexec: WARNING: authentication is OFF; anyone who can reach "
                   f"{host}:{port} can run code", err=True)
    try:
        from .config import parse_size

        settings = server.ServerSettings(
            config=build_config(options), tokens=tuple(tokens), auth=not no_auth, store=store_from_env(store),
            max_body=parse_size(max_body), max_sessions_per_token=max_sessions_per_token,
            max_running_per_token=max_running_per_token, result_ttl=result_ttl)
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE, False)
    # On SIGTERM/SIGINT, requests get a few seconds to finish; then the app's shutdown interrupts and closes
    # every run and removes its folders (uvicorn re-raises SIGTERM afterwards: no atexit handler runs).
    uvicorn.run(server.create_app(settings), host=host, port=port, log_level="info", access_log=False,
                timeout_graceful_shutdown=3)


@main.command(epilog=EXIT_CODES)
@click.option("--all", "everything", is_flag=True, help="Also remove containers of nbexec processes still running.")
@click.option("--older-than", metavar="AGE",
              help="Also remove nbexec's own output and working folders (in its private folders in the temporary "
                   "folder, never an --output-dir you chose) unchanged for longer than AGE (30m, 12h, 1d), and the "
                   "containers that use them.")
def cleanup(everything: bool, older_than: str | None) -> None:
    """Remove containers and working folders nbexec left behind (found by label); with --older-than, also old
    output folders. Without it, outputs are kept: the CLI never deletes what it handed back."""
    from . import folders as host_folders
    from .config import parse_duration
    from .sandbox.container import remove_stale_workdirs, remove_tree

    try:
        old = host_folders.older_than(parse_duration(older_than)) if older_than is not None else []
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE, False)
    try:
        removed = daemon.cleanup(daemon.connect(), everything=everything, mounting=old)
    except NbexecError as exc:
        _fail(str(exc), EXIT_INFRA, False)
    for path in old:
        remove_tree(path)
    folders = old + remove_stale_workdirs()
    for item in removed:
        click.echo(f"removed container {item.name} ({item.id}, {item.role or 'unknown role'}, owner {item.owner})")
    for folder in folders:
        click.echo(f"removed folder {folder}")
    click.echo(f"{len(removed)} containers and {len(folders)} folders removed")


if __name__ == "__main__":  # pragma: no cover
    main()
