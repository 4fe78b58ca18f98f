"""The nbexec command, run as a user would run it (a real process, real Docker)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import docker.errors
import pytest

from .conftest import IMAGE

EXAMPLES = Path(__file__).parent.parent / "examples"


def nbexec(*args: str, cwd: Path, env: dict[str, str] | None = None,
           stdin: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "NBEXEC_IMAGE": IMAGE, **(env or {})}
    return subprocess.run([sys.executable, "-m", "nbexec.cli", *args], cwd=cwd, env=full_env, input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_example_prints_text_and_saves_plot_and_csv(cleanup_ledger: None, tmp_path: Path) -> None:
    done = nbexec("run", str(EXAMPLES / "analysis.py"), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "best region:" in done.stdout
    assert "[image]" in done.stdout  # shown as it came; where it was saved is listed at the end
    assert "images:\n  " + str(tmp_path / "out" / "images") in done.stdout
    assert (tmp_path / "out" / "data" / "summary.csv").read_text().startswith("region,count,sum,mean")
    assert (tmp_path / "out" / "data" / "revenue.png").read_bytes().startswith(b"\x89PNG")
    assert list((tmp_path / "out" / "images").glob("*.png"))
    assert "summary.csv" in done.stdout


def test_failure_exits_1_with_traceback_and_earlier_output(cleanup_ledger: None, tmp_path: Path) -> None:
    done = nbexec("run", str(EXAMPLES / "failing.py"), cwd=tmp_path)
    assert done.returncode == 1
    assert "loading data" in done.stdout
    assert "ZeroDivisionError" in done.stderr and "Traceback" in done.stderr


def test_json_is_exactly_one_object(cleanup_ledger: None, tmp_path: Path) -> None:
    done = nbexec("run", "--json", "-", cwd=tmp_path, stdin="print('hi')\n")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] is True and data["stdout"] == "hi\n" and data["error"] is None


def test_timeout_flag_exits_1(cleanup_ledger: None, tmp_path: Path) -> None:
    done = nbexec("run", "--json", "--timeout", "1", "-", cwd=tmp_path, stdin="import time; time.sleep(30)\n")
    assert done.returncode == 1
    assert json.loads(done.stdout)["error"]["kind"] == "timeout"


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["run", "missing.py"], None, "does not exist"),
        (["run", "-"], "", "no code to run"),
        (["run", "--memory", "lots", "-"], "1", "not a size"),
        (["run", "--env", "NBEXEC_SURELY_UNSET", "-"], "1", "not set"),
        (["run", "--bogus", "x.py"], None, "No such option"),
    ],
    ids=["missing-file", "empty-stdin", "bad-size", "unset-env", "unknown-option"],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], stdin: str | None, message: str) -> None:
    done = nbexec(*args, cwd=tmp_path, stdin=stdin)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_invalid_notebook_exits_2(tmp_path: Path) -> None:
    (tmp_path / "bad.ipynb").write_text("{oops")
    done = nbexec("run", "bad.ipynb", cwd=tmp_path)
    assert done.returncode == 2 and "not valid notebook JSON" in done.stderr


def test_docker_unreachable_exits_3_naming_docker_host(tmp_path: Path) -> None:
    done = nbexec("run", "-", cwd=tmp_path, stdin="1\n", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert done.returncode == 3
    assert "Docker is not reachable" in done.stderr and "DOCKER_HOST" in done.stderr


def test_missing_image_exits_3_naming_the_command(docker_ready: None, tmp_path: Path) -> None:
    """Another image than the runtime one was asked for: most often mistyped, so the fix named is to choose one
    of those here (the build command is named when the runtime image itself is missing: test_cli_usage)."""
    done = nbexec("run", "--image", "nbexec-missing:none", "-", cwd=tmp_path, stdin="1\n")
    assert done.returncode == 3 and "nbexec image list" in done.stderr, done.stderr


def test_doctor_reports_engine_and_image(docker_ready: None, tmp_path: Path) -> None:
    done = nbexec("doctor", cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert "ok   Docker engine" in done.stdout and f"ok   image {IMAGE}" in done.stdout


def test_cleanup_removes_orphans(docker_ready: None, tmp_path: Path) -> None:
    from nbexec.sandbox.docker import daemon

    client = daemon.connect()
    # A node name of its own: every other nbexec process here (each one sweeps dead owners' containers as it
    # starts, and the tests run in parallel) counts the orphan as another node's and leaves it to this cleanup.
    node = f"orphans-{os.urandom(4).hex()}"
    orphan = client.containers.create(IMAGE, command=["sleep", "60"], labels={
        daemon.LABEL: "1", daemon.LABEL_NODE: node, daemon.LABEL_OWNER: f"{node}:999999999",
        daemon.LABEL_ROLE: "pool"})
    try:
        done = nbexec("cleanup", cwd=tmp_path, env={"NBEXEC_NODE_NAME": node})
        assert done.returncode == 0, done.stderr
        assert orphan.name in done.stdout
        assert not client.containers.list(all=True, sparse=True, filters={"id": orphan.id})
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            orphan.remove(force=True)


def test_ctrl_c_leaves_nothing(docker_ready: None, tmp_path: Path) -> None:
    import signal

    from .conftest import own_workdirs, owned_by, wait_until

    # Ctrl-C at a terminal reaches a process whose SIGINT is at its default. A job a non-interactive shell starts
    # in the background (a CI runner's, `cmd &` in a script) inherits SIGINT ignored, which Python keeps, and then
    # `nbexec run` rightly ignores it as any program does: the run starts as from a terminal. PYTHONFAULTHANDLER: a
    # run that does not end after SIGINT is sent SIGABRT, and its threads' stacks say where it waits.
    as_from_a_terminal = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                          "sys.argv[0] = 'nbexec'; runpy.run_module('nbexec.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", as_from_a_terminal, "run", "-"], cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NBEXEC_IMAGE": IMAGE, "PYTHONFAULTHANDLER": "1"})
    assert proc.stdin is not None
    try:
        # The code leaves a mark in /mnt/data once it runs: the host sees it in the sandbox's working folder,
        # where the data filesystem is mounted (it is copied to the output folder only when the run ends). It
        # sleeps past the wait below, so only the interrupt can end it in time.
        proc.stdin.write("open('/mnt/data/running', 'w').close()\nimport time\ntime.sleep(600)\n")
        proc.stdin.close()
        proc.stdin = None
        wait_until(lambda: owned_by(proc.pid), 60, "the run never started a container")
        wait_until(lambda: any((folder / "data" / "running").exists() for folder in own_workdirs(proc.pid)), 60,
                   "the code never ran")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"`nbexec run` did not end within 120 s of SIGINT; its threads:\n{err[-12000:]}")
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert owned_by(proc.pid) == []
    assert own_workdirs(proc.pid) == []


def test_a_long_tmpdir_still_reaches_the_kernel(docker_ready: None, tmp_path: Path) -> None:
    """The kernel's unix sockets live under TMPDIR; a path past the 107-byte socket-address limit must work."""
    deep = tmp_path / ("long-folder-name-" * 6) / ("x" * 60)
    deep.mkdir(parents=True, mode=0o700)
    assert len(str(deep)) > 120
    done = nbexec("run", "-", "--json", cwd=tmp_path, stdin="print(6 * 7)", env={"TMPDIR": str(deep)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["stdout"] == "42\n"


def _quiet_notebook(folder: Path, last: str) -> Path:
    """An nbformat 4.5 notebook whose cells carry no ids (nbformat warns about those) that prints to both streams."""
    folder.mkdir()
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
              "source": "import sys\nprint('out')\nprint('err', file=sys.stderr)"},
             {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": last}]
    path = folder / "quiet.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


@pytest.mark.parametrize(("last", "code"), [("pass", 0), ("1/0", 1)], ids=["passes", "fails"])
def test_quiet_prints_only_the_codes_output_and_traceback(cleanup_ledger: None, tmp_path: Path, last: str,
                                                          code: int) -> None:
    """`-q` shows what the code printed and its traceback, nothing of nbexec's own: not its warnings (here the one
    every run gives when nbexec cannot mount /mnt/data's filesystem: no mkfs.ext4 on PATH), nor the warnings of the
    libraries it uses (nbformat's about missing cell ids)."""
    notebook = _quiet_notebook(tmp_path / "nb", last)
    done = nbexec("run", "-q", str(notebook), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == code, done.stderr
    assert done.stdout == "out\n"
    if code == 0:
        assert done.stderr == "err\n"
    else:
        assert done.stderr.startswith("err\n") and "ZeroDivisionError" in done.stderr
        assert all(not line.startswith("nbexec:") and "Warning" not in line for line in done.stderr.splitlines())
