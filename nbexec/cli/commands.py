"""The `nbexec` maintenance commands (doctor, cleanup) and what every command shares: the exit codes and the one way
of failing."""

from __future__ import annotations

import json
import os
import sys

import click

from nbexec import __version__
from nbexec.config import SandboxConfig, from_env, running_as_root
from nbexec.errors import ConfigError, NbexecError
from nbexec.notebook.outputs import clean
from nbexec.sandbox.docker import daemon, datafs, image, kernels, users

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
EXIT_CODES = """Exit codes: 0 success; 1 the code raised, timed out or hit a limit; 2 usage error (bad option,
missing or invalid input); 3 nbexec or Docker failure (Docker unreachable, an image that is not here)."""
SERVICE_EXIT_CODES = """Exit codes: 0 stopped (Ctrl-C or SIGTERM, after the runs in flight ended); 2 usage error
(bad option, token or setting); 3 nbexec or Docker failed at start."""



def fail(message: str, code: int, as_json: bool) -> None:
    """Say what went wrong (as JSON too with --json) and exit with ``code``."""
    from . import envfile

    message += envfile.origin(message)  # a bad value from .env says so: the shell's own environment looks fine
    if as_json:
        click.echo(json.dumps({"ok": False, "nbexec_error": message, "exit_code": code}))
    click.echo(f"nbexec: {clean(message)}", err=True)
    sys.exit(code)



@click.command(epilog=EXIT_CODES)
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
    runtime_image = config.replace(language="python").image_tag
    try:
        info = image.describe(runtime_image)
        click.echo(f"ok   image {runtime_image}: {info['id']} ({info['size_mb']} MB, built {info['created'][:19]}); "
                   f"kernels: {', '.join(kernels.of_image(runtime_image))}")
    except NbexecError as exc:
        problems += 1
        click.echo(f"FAIL {exc}")
    problems += _check_kernels(config)
    problems += _check_runtimes(config)
    _check_checkpoints()
    _check_sandbox_uid(config)
    click.echo(f"warn {datafs.fallback_reason()}" if datafs.fallback_reason() else
               "ok   /mnt/data is a filesystem of its own per sandbox (max_data bytes, max_files inodes)")
    problems += _check_disk(config)
    click.echo(f"     policy: {config!r}")
    sys.exit(EXIT_INFRA if problems else EXIT_OK)


def _check_kernels(config: SandboxConfig) -> int:
    """The kernels image's languages when it is here; a problem only when the configured language needs it."""
    try:
        found = kernels.of_image(config.kernels_image)
        click.echo(f"ok   kernels image {config.kernels_image}: kernels: {', '.join(found)}")
    except NbexecError:
        needed = config.language != "python" and config.image_tag == config.kernels_image
        click.echo(f"{'FAIL' if needed else 'info'} kernels image {config.kernels_image} is not here (R, Deno, Bash: "
                   "`nbexec image build --kernels r,deno,bash`)")
        return int(needed)
    return 0


def _check_runtimes(config: SandboxConfig) -> int:
    """Start a test container with each supported runtime; a problem only when the configured one fails."""
    from nbexec.sandbox.docker import runtimes

    try:
        click.echo(f"ok   runtimes Docker knows: {', '.join(runtimes.engine_runtimes())}")
        checks = runtimes.check_all(config.image_tag, config.runtime)
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


def _check_checkpoints() -> None:
    """Say whether the engine serves checkpoints, which hibernated gVisor sessions need to keep their memory."""
    try:
        why = daemon.checkpoint_refusal()
    except NbexecError as exc:
        why = str(exc)
    if why:
        click.echo(f"WARN checkpoints: {why}. Until then hibernated sessions replay their cells.")
    else:
        click.echo("ok   checkpoints: the engine serves `docker checkpoint` (gVisor sessions keep memory asleep)")


def _check_disk(config: SandboxConfig) -> int:
    """State the host disk one sandbox may write and how many the free space has room for; a problem at none."""
    from nbexec.files import folders, space

    found = space.room(config, folders.work_root())
    text = (f"host disk per sandbox: {space.share(config).describe()}, plus {space.size(config.disk_margin_bytes)} "
            f"kept free (disk_margin); {space.size(found.free)} free on the filesystem of {found.place}: room for "
            f"{found.count} sandboxes")
    if found.count:
        click.echo(f"ok   {text}")
        return 0
    click.echo(f"FAIL {text}. {space.KNOBS}")
    return 1


def _check_sandbox_uid(config: SandboxConfig) -> None:
    """Warn when sandboxes run as a login account: code there shares its files' ownership and per-uid limits."""
    import pwd

    if not config.user and running_as_root():
        click.echo("ok   sandbox uid: a fresh uid per sandbox with no account (nbexec runs as root)")
        return
    uid = users.uid_gid(config)[0]
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



@click.command(epilog=EXIT_CODES)
@click.option("--all", "everything", is_flag=True, help="Also remove containers of nbexec processes still running.")
@click.option("--older-than", metavar="AGE",
              help="Also remove nbexec's own output and working folders (in its private folders in the temporary "
                   "folder, never an --output-dir you chose) unchanged for longer than AGE (30m, 12h, 1d), and the "
                   "containers that use them.")
def cleanup(everything: bool, older_than: str | None) -> None:
    """Remove containers and working folders nbexec left behind (found by label); with --older-than, also old
    output folders. Without it, outputs are kept: the CLI never deletes what it handed back."""
    from nbexec.config import parse_duration
    from nbexec.files import folders as host_folders
    from nbexec.files.workdir import remove_stale_workdirs, remove_tree

    try:
        old = host_folders.older_than(parse_duration(older_than)) if older_than is not None else []
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, False)
    try:
        removed = daemon.cleanup(daemon.connect(), everything=everything, mounting=old)
    except NbexecError as exc:
        fail(str(exc), EXIT_INFRA, False)
    for path in old:
        remove_tree(path)
    folders = old + remove_stale_workdirs()
    for item in removed:
        click.echo(f"removed container {item.name} ({item.id}, {item.role or 'unknown role'}, owner {item.owner})")
    for folder in folders:
        click.echo(f"removed folder {folder}")
    click.echo(f"{len(removed)} containers and {len(folders)} folders removed")

