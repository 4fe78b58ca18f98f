"""The `nbexec` command. Exit codes: 0 success, 1 the code raised or timed out, 2 usage error, 3 nbexec failure."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from nbexec import __version__
from nbexec.config import MIN_TOKEN_CHARS, SandboxConfig, describe, from_env
from nbexec.errors import ConfigError, NbexecError, NotebookError
from nbexec.notebook.outputs import clean
from nbexec.stores.storage import STORES
from nbexec.stores.storage import from_env as store_from_env

from . import commands, exits, images, papermill, render, terminal, variables
from .commands import EXIT_CODES, EXIT_FAILED, EXIT_INFRA, EXIT_OK, EXIT_USAGE, SERVICE_EXIT_CODES, fail

# Config fields offered as options, each with its help text taken from SandboxConfig.
_OPTION_FIELDS = ("timeout", "cell_timeout", "memory", "cpus", "pids", "network", "image", "language", "max_output",
                  "max_data", "tmp_size", "user", "runtime")


def sandbox_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per SandboxConfig field (defaults come from the config, never re-declared)."""
    fields = {f.name: f for f in dataclasses.fields(SandboxConfig)}
    for name in reversed(_OPTION_FIELDS):
        flag = "--" + name.replace("_", "-")
        kind = str(fields[name].type)
        default = fields[name].default
        help_text = describe(name) + (f" [default: {default}]" if default is not None else "")
        if kind.startswith("bool"):  # network: the switch here, allowlist through --allow-host
            func = click.option(f"{flag}/--no-{name.replace('_', '-')}", name, default=None, help=help_text)(func)
        else:
            click_type = {"int": int, "float": float}.get(kind.split(" ")[0], str)
            func = click.option(flag, name, type=click_type, default=None, help=help_text)(func)
    func = click.option("--allow-host", "allowed_hosts", multiple=True, metavar="HOST[:PORT]",
                        help=describe("allowed_hosts") + " Repeatable; turns network allowlist on.")(func)
    func = click.option("--env", "env_names", multiple=True, metavar="NAME",
                        help="Pass the host variable NAME into the sandbox (repeatable); none is passed otherwise.",
                        )(func)
    return func


def build_config(values: dict[str, Any], **fixed: Any) -> SandboxConfig:
    """The config from NBEXEC_* and the command line (the command line wins)."""
    overrides = {name: values.pop(name) for name in _OPTION_FIELDS if name in values}
    allowed_hosts = values.pop("allowed_hosts", ())
    if allowed_hosts:
        overrides["allowed_hosts"] = tuple(allowed_hosts)
        overrides["network"] = "allowlist" if overrides.get("network") is None else overrides["network"]
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
    variables.warn_at_start()  # -q silences it (see there)


@main.command(epilog=EXIT_CODES, cls=exits.RunCommand)
@click.argument("inputs", nargs=-1, required=True, metavar="FILE...")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object on stdout.")
@click.option("-q", "--quiet", is_flag=True,
              help="Print only what the code prints and its errors (no file list, progress or summary table).")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="One file: where data/, images/ and the notebook go [default: ./nbexec-output/<name>-<id>]. "
                   "Several: the folder that gets one sub-folder per file [default: ./nbexec-output].")
@click.option("--save-notebook", type=click.Path(dir_okay=False, path_type=Path),
              help="Also copy the executed notebook here (one file only).")
@click.option("--store", type=click.Choice(STORES), default="local", show_default=True,
              help="Where files and images go: kept locally (file:// links) or uploaded to Azure Blob Storage, an "
                   "S3-compatible bucket or Google Cloud Storage (read-only links that expire; AZURE_*, AWS_* or "
                   "GOOGLE_* variables and NBEXEC_S3_BUCKET / NBEXEC_GCS_BUCKET, see .env.example).")
@click.option("--upload", type=click.Choice(STORES[1:]), help="Same as --store KIND.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Files run at once, each in its own sandbox.")
@click.option("-p", "--parameter", "--parameters", "parameter_pairs", nargs=2, multiple=True, metavar="NAME VALUE",
              help="Inject NAME = VALUE (a Python/YAML literal) after the cell tagged `parameters` (repeatable).")
@click.option("-r", "--parameter-raw", "--parameters_raw", "raw_pairs", nargs=2, multiple=True,
              metavar="NAME VALUE", help="Inject NAME = VALUE as the string given (repeatable; wins over the others).")
@click.option("-f", "--parameters-file", "--parameters_file", "parameter_files", multiple=True,
              type=click.Path(dir_okay=False, path_type=Path), help="A YAML or JSON file of parameters (repeatable).")
@click.option("-y", "--parameters-yaml", "--parameters_yaml", "yaml_texts", multiple=True, metavar="YAML",
              help="A YAML mapping of parameters, e.g. 'year: 2025' (repeatable).")
@click.option("-b", "--parameters-base64", "--parameters_base64", "base64_texts", multiple=True, metavar="BASE64",
              help="A base64-encoded YAML mapping of parameters (repeatable). Papermill's order: -b, -f, -y, -p, -r.")
@click.option("--junit-xml", type=click.Path(dir_okay=False, path_type=Path), help="Write a JUnit XML report.")
@click.option("--html-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write an HTML render of each executed notebook (images embedded).")
@click.option("--fail-fast", is_flag=True, help="Start no new file after the first failure.")
@click.option("--package", "package_names", multiple=True, metavar="REQUIREMENT",
              help="Install this package before the code runs (repeatable; e.g. tabulate, 'pyarrow==17.*'): fetched "
                   "as a wheel on the host under the package policy, installed offline in the sandbox.")
@click.option("--mount-input", "input_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Mount this host folder read-only at /mnt/input (instead of each file's own folder).")
@click.option("--mount-folder/--no-mount-folder", default=True, show_default=True,
              help="Copy each file's folder into the working folder, so `open('data.csv')` reads (and may overwrite) "
                   "the file next to the notebook; the host's files are never written (not the home folder or /).")
@click.option("--allow-errors", is_flag=True, help="Run every cell and keep each error (the run still fails).")
@sandbox_options
def run(inputs: tuple[str, ...], as_json: bool, quiet: bool, output_dir: Path | None, save_notebook: Path | None,
        store: str, upload: str | None, jobs: int, junit_xml: Path | None, html_dir: Path | None, fail_fast: bool,
        package_names: tuple[str, ...], input_dir: Path | None, mount_folder: bool, **options: Any) -> None:
    """Run FILE... (.py, .R, .ts/.js, .sh with optional `# %%` cells, .ipynb, folders, globs, or - for stdin), each
    in a fresh sandbox. One file streams what its notebook shows; several print progress, a summary table and the
    tracebacks of the files that failed."""
    from nbexec.notebook import parameters

    from . import batch

    shown = _Shown(as_json=as_json, quiet=quiet, painter=terminal.Painter())
    if quiet:
        _quiet()
    try:
        single = len(inputs) == 1 and not Path(inputs[0]).is_dir() and not any(c in inputs[0] for c in "*?[") \
            and not (junit_xml or html_dir or fail_fast)
        values = parameters.gather(base64_texts=options.pop("base64_texts"), files=options.pop("parameter_files"),
                                   yaml_texts=options.pop("yaml_texts"), pairs=options.pop("parameter_pairs"),
                                   raw_pairs=options.pop("raw_pairs"))
        language = options.get("language")  # given, it wins over each file's own (its extension, kernelspec)
        fixed: dict[str, Any] = {"pool_size": 0 if single or jobs == 1 else min(jobs, 4),
                                 **({"input_dir": str(input_dir)} if input_dir else {})}
        config = build_config(options, **fixed)
        artifact_store = store_from_env(upload or store)
        paths = batch.discover(papermill.inputs_only(list(inputs)))  # never OUT of papermill's `IN OUT`
        artifact_store.check()  # reach the store before any code runs (missing extra, bad key, no bucket)
    except (NotebookError, ConfigError) as exc:
        fail(str(exc), EXIT_USAGE, as_json)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, as_json)
    options_ = batch.BatchOptions(jobs=jobs, output_root=output_dir or Path("nbexec-output"), parameters=values,
                                  fail_fast=fail_fast, store=artifact_store, mount_folders=mount_folder,
                                  packages=package_names, language=language, allow_errors=options.pop("allow_errors"))
    if single:
        _run_single(paths[0], config, options_, output_dir, save_notebook, shown)
    _run_batch(paths, config, options_, junit_xml, html_dir, shown)


def _quiet() -> None:
    """-q: nothing of nbexec's own on the terminal (its warnings, its libraries' warnings), only what the code
    printed, its traceback and a failure of nbexec itself (said by `fail`, not logged). -v still logs."""
    root = logging.getLogger()
    if root.level >= logging.WARNING:
        root.setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Shown:
    """How a run shows itself: one JSON object, or text (streamed; quiet: the code's output and errors only)."""

    as_json: bool
    quiet: bool
    painter: terminal.Painter


def _run_single(path: Path, config: SandboxConfig, options: Any, output_dir: Path | None,
                save_notebook: Path | None, shown: _Shown) -> None:
    from nbexec.engine.execute import execute_notebook
    from nbexec.files.inputs import with_folder
    from nbexec.notebook import load
    from nbexec.notebook.parameters import inject

    live = None if shown.as_json else terminal.Live(shown.painter)
    try:
        nb = inject(load(path, options.language, default=config.language), options.parameters)
        if output_dir is None:
            stem = "stdin" if str(path) == "-" else path.stem
            output_dir = Path("nbexec-output") / f"{stem}-{os.urandom(4).hex()}"
        config = with_folder(config, path) if options.mount_folders else config
        result = execute_notebook(nb, config=config, output_dir=output_dir, store=options.store, on_output=live,
                                  packages=options.packages, allow_errors=options.allow_errors)
        if save_notebook is not None and result.notebook_path:
            shutil.copyfile(result.notebook_path, save_notebook)
    except (NotebookError, ConfigError) as exc:
        fail(str(exc), EXIT_USAGE, shown.as_json)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, shown.as_json)
    except Exception as exc:  # a bug or an OS failure in nbexec: still one answer, never a bare traceback
        exits.unexpected(exc)
        fail(f"nbexec failed unexpectedly: {type(exc).__name__}: {exc} (run with -vv for the traceback)",
             EXIT_INFRA, shown.as_json)
    if live is None:
        click.echo(json_text(result.to_json()))
    else:
        live.finish()
        notes = [] if shown.quiet else render.summary_lines(result, images=True)
        if notes:
            click.echo("\n".join(notes))
        if result.error is not None:
            shown.painter.echo(shown.painter.style(render.error_text(result), fg="red"), err=True)
        if not shown.quiet:  # nbexec's notes, the node and the notebook: dimmed, on stderr
            terminal.footer(result, shown.painter)
    sys.exit(EXIT_OK if result.ok else EXIT_FAILED)


_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def json_text(text: str) -> str:
    """JSON with every character a terminal could act on (DEL, C1) or no encoder accepts (lone surrogates)
    written as a \\u escape; json.dumps escapes C0 itself. The value read back is unchanged."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _run_batch(paths: list[Path], config: SandboxConfig, options: Any, junit_xml: Path | None,
               html_dir: Path | None, shown: _Shown) -> None:
    from . import batch, reports

    progress = terminal.Progress(len(paths), live=sys.stderr.isatty() and not shown.as_json, quiet=shown.quiet,
                                 painter=shown.painter)
    try:
        items = batch.run(paths, config, options, on_event=progress.event)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, shown.as_json)
    except Exception as exc:  # as in _run_single: one answer, exit 3
        exits.unexpected(exc)
        fail(f"nbexec failed unexpectedly: {type(exc).__name__}: {exc}", EXIT_INFRA, shown.as_json)
    progress.close()
    if junit_xml:
        reports.junit_xml(items, junit_xml)
    if html_dir:
        reports.html(items, html_dir)
    failed = any(i.status != "passed" for i in items)
    if shown.as_json:
        click.echo(json_text(json.dumps({"ok": not failed, "results": [
            {"file": i.name, "status": i.status, "duration_s": round(i.duration_s, 3), "message": i.message,
             "result": i.result.to_dict() if i.result else None} for i in items]}, ensure_ascii=False)))
    else:
        _show_failures(items, shown.painter)
        table = reports.summary(items, style=shown.painter.status)
        click.echo(table.splitlines()[-1] if shown.quiet else table, color=shown.painter.out or None)
    if any(i.status == "error" for i in items):
        sys.exit(EXIT_INFRA)
    sys.exit(EXIT_FAILED if failed else EXIT_OK)


def _show_failures(items: list[Any], painter: terminal.Painter) -> None:
    """The traceback (or message) of each file that did not pass, on stderr, before the summary."""
    for item in items:
        if item.status in ("passed", "skipped"):
            continue
        text = render.error_text(item.result) if item.result is not None else clean(item.message)
        painter.echo(painter.style(f"--- {clean(item.name)}: {item.status.upper()} ---", bold=True), err=True)
        painter.echo(painter.style(text or item.status, fg="red"), err=True)


@main.command(name="mcp", epilog=SERVICE_EXIT_CODES)
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
    tokens = _tokens(token_file, checked=transport == "streamable-http")
    if transport == "streamable-http" and not tokens and not _loopback(host):
        fail(f"--host {host} is not a loopback address: give bearer tokens with --token-file or "
              "NBEXEC_API_TOKENS (or bind 127.0.0.1)", EXIT_USAGE, False)
    try:
        from nbexec.integrations import mcp as mcp_server

        config = build_config(options)
        server, clients = mcp_server.build(config, max_sessions=max_sessions)
    except ImportError as exc:
        fail(str(exc), EXIT_USAGE, False)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    mcp_server.serve(server, clients, transport=transport, host=host, port=port, tokens=tokens,
                     max_sessions=max_sessions)


def _tokens(token_file: Path | None, *, checked: bool = True) -> tuple[bytes, ...]:
    """Bearer tokens from NBEXEC_API_TOKENS and a token file, as bytes (what is compared on the wire); when they
    will be ``checked`` (a service on the network), a usage error if one is shorter than MIN_TOKEN_CHARS."""
    tokens = [t.strip() for t in os.environ.get("NBEXEC_API_TOKENS", "").split(",") if t.strip()]
    if token_file:
        tokens += [line.strip() for line in token_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    short = sum(len(t) < MIN_TOKEN_CHARS for t in tokens)
    if short and checked:
        fail(f"{short} of the bearer tokens (--token-file, NBEXEC_API_TOKENS) are shorter than {MIN_TOKEN_CHARS} "
             "characters: give only long random ones (python -c 'import secrets; print(secrets.token_urlsafe(32))')",
             EXIT_USAGE, False)
    return tuple(t.encode("utf-8") for t in tokens)


def _loopback(host: str) -> bool:
    import ipaddress
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command(epilog=SERVICE_EXIT_CODES)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="File with accepted bearer tokens, one per line (also NBEXEC_API_TOKENS, comma-separated).")
@click.option("--no-auth", is_flag=True, help="Accept requests without a token (only with a loopback --host).")
@click.option("--max-sessions-per-token", type=click.IntRange(1), default=8, show_default=True)
@click.option("--max-running-per-token", type=click.IntRange(1), default=4, show_default=True)
@click.option("--max-calls-per-token", type=click.IntRange(1), default=64, show_default=True,
              help="With --nodes: calls of one client token in flight through this router (429 past it).")
@click.option("--max-body", default="16m", show_default=True, help="Largest request body.")
@click.option("--store", type=click.Choice(STORES), default="local", show_default=True,
              help="Where produced files go (azure, s3, gcs: read-only links that expire; checked at start).")
@click.option("--result-ttl", type=click.FloatRange(min=0, min_open=True), default=15 * 60.0, show_default=True,
              help="Seconds a one-shot result's files stay downloadable before they are deleted.")
@click.option("--node-name", help="This node's name in results and on its containers (NBEXEC_NODE_NAME; default: "
              "the hostname). Unique per node sharing an engine, kept across restarts.")
@click.option("--nodes", help="Run as a router in front of these nodes: comma-separated name=URL (or URL, then named "
              "host-port); they are called with NBEXEC_NODE_TOKEN. The sandbox options cap what a node may send.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), envvar="NBEXEC_STATE_DIR",
              help="Keep sessions here (private): a restart with it finds them again (NBEXEC_STATE_DIR).")
@sandbox_options
def serve(host: str, port: int, token_file: Path | None, no_auth: bool, max_sessions_per_token: int,
          max_running_per_token: int, max_calls_per_token: int, max_body: str, store: str, result_ttl: float,
          node_name: str | None, nodes: str | None, state_dir: Path | None, **options: Any) -> None:
    """Serve nbexec over authenticated JSON/HTTP (/v1/..., /healthz, /readyz, /metrics) and E2B's API (/e2b): as
    a node on this Docker engine, or with --nodes as a router in front of nodes."""

    if node_name:
        os.environ["NBEXEC_NODE_NAME"] = node_name  # read wherever the node's name is needed (labels, results)
    if nodes:
        from nbexec.service.cluster_cli import router_settings, serve_router

        try:
            policy = build_config(options)
        except ConfigError as exc:
            fail(str(exc), EXIT_USAGE, False)
        serve_router(host, port, router_settings(nodes, _tokens(token_file), max_body, policy, max_calls_per_token))
        return
    try:
        import uvicorn

        from nbexec.service import server
        from nbexec.service import settings as served
    except ImportError as exc:
        fail(f"{exc} (pip install 'nbexec-sandbox[server]')", EXIT_USAGE, False)
    tokens = [t.decode("utf-8") for t in _tokens(token_file, checked=False)]
    if no_auth and not _loopback(host):
        fail("--no-auth is only allowed with a loopback --host (127.0.0.1, ::1, localhost)", EXIT_USAGE, False)
    if no_auth:
        click.echo("nbexec: WARNING: authentication is OFF; anyone who can reach "
                   f"{host}:{port} can run code", err=True)
    try:
        from nbexec.config import parse_size
        artifact_store = store_from_env(store)
        artifact_store.check()  # a store that refuses the key fails the start, not every later request
        settings = served.ServerSettings(
            config=build_config(options), tokens=tuple(tokens), auth=not no_auth, store=artifact_store,
            max_body=parse_size(max_body), max_sessions_per_token=max_sessions_per_token,
            max_running_per_token=max_running_per_token, result_ttl=result_ttl, state_dir=state_dir)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, False)
    # On SIGTERM/SIGINT, requests get a few seconds to finish; then the app's shutdown interrupts and closes
    # every run and removes its folders (uvicorn re-raises SIGTERM afterwards: no atexit handler runs).
    uvicorn.run(server.create_app(settings), host=host, port=port, log_level="info", access_log=False,
                timeout_graceful_shutdown=3)


for _command in (images.image_group, commands.doctor, commands.cleanup, papermill.command):
    main.add_command(_command)

