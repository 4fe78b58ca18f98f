"""`nbexec run` and the library as a new user meets them: the exit code and message of each wall (an interrupt, a
closed pipe, a missing folder, a limit beyond the machine, a stray JSON file, a mistyped variable), what a run of
a folder runs, the notes a person sees, and what the library leaves in the temporary folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbexec.hostconfig import host_from_env

from .conftest import IMAGE
from .test_cli import nbexec
from .test_env_example import read_by_code

_AS_FROM_A_TERMINAL = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "sys.argv[0] = 'nbexec'; runpy.run_module('nbexec.cli', run_name='__main__')")
_NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/nbexec-test.sock"}


def test_a_run_of_a_folder_never_runs_its_own_outputs(cleanup_ledger: None, tmp_path: Path) -> None:
    (tmp_path / "report.py").write_text("print('ran')\n")
    for _ in range(2):  # the first run leaves ./nbexec-output/report/notebook.ipynb inside the folder
        done = nbexec("run", ".", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert [item["file"] for item in json.loads(done.stdout)["results"]] == ["report.py"]


def test_a_cell_over_the_limit_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("x = " + repr("a" * 1_100_000) + "\n")
    done = nbexec("run", "big.py", cwd=tmp_path, env=_NO_DOCKER)  # refused before any sandbox: Docker unused
    assert done.returncode == 2, done.stderr
    assert "--max-output" in done.stderr and "misbehav" not in done.stderr


def test_save_notebook_into_a_missing_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("print(1)\n")
    done = nbexec("run", "x.py", "--save-notebook", "nowhere/out.ipynb", cwd=tmp_path, env=_NO_DOCKER)
    assert done.returncode == 2, done.stderr
    assert "--save-notebook" in done.stderr and "does not exist" in done.stderr
    assert not (tmp_path / "nbexec-output").exists()


def test_ctrl_c_exits_130_and_leaves_no_empty_folder(docker_ready: None, tmp_path: Path) -> None:
    from .conftest import own_workdirs, owned_by, wait_until

    proc = subprocess.Popen([sys.executable, "-c", _AS_FROM_A_TERMINAL, "run", "-"], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NBEXEC_IMAGE": IMAGE})
    try:
        assert proc.stdin is not None
        proc.stdin.write("open('/mnt/data/running', 'w').close()\nimport time\ntime.sleep(600)\n")
        proc.stdin.close()
        proc.stdin = None
        wait_until(lambda: any((folder / "data" / "running").exists() for folder in own_workdirs(proc.pid)), 90,
                   "the code never ran")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Aborted" not in err
    assert not (tmp_path / "nbexec-output").exists(), list((tmp_path / "nbexec-output").rglob("*"))
    assert owned_by(proc.pid) == []


def test_a_closed_stdout_ends_the_run_quietly(cleanup_ledger: None, tmp_path: Path) -> None:
    """`nbexec run big.py | head -1`: no traceback, no "nbexec failed" (exit 3); the run stops as a pipe's writer
    does (128 + SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "-m", "nbexec.cli", "run", "-"], cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "NBEXEC_IMAGE": IMAGE})
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b"import time\nfor i in range(600):\n    print('line', i, flush=True)\n    time.sleep(0.05)\n")
    proc.stdin.close()
    assert proc.stdout.readline().startswith(b"line 0")
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    proc.wait(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "failed unexpectedly" not in err


def test_rerunning_into_an_output_dir_needs_overwrite(cleanup_ledger: None, tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import os\nopen(os.environ.get('NAME', 'first.txt'), 'w').write('x')\n")
    assert nbexec("run", "a.py", "--output-dir", "out", cwd=tmp_path).returncode == 0
    refused = nbexec("run", "a.py", "--output-dir", "out", cwd=tmp_path)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr, refused.stderr
    (tmp_path / "a.py").write_text("open('second.txt', 'w').write('x')\n")
    again = nbexec("run", "a.py", "--output-dir", "out", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "data").iterdir()) == ["second.txt"]


def test_a_batch_rerun_into_an_output_dir_needs_overwrite_too(cleanup_ledger: None, tmp_path: Path) -> None:
    """One rule for one file and many: a batch re-run is refused as a single one is (it made `a-2` folders)."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(f"open('{name}.txt', 'w').write('x')\n")

    def folders() -> list[str]:
        return sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir())

    assert nbexec("run", "a.py", "b.py", "--output-dir", "out", cwd=tmp_path).returncode == 0
    refused = nbexec("run", "a.py", "b.py", "-j", "2", "--output-dir", "out", cwd=tmp_path)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr, refused.stderr
    assert folders() == ["a", "b"]
    (tmp_path / "a.py").write_text("open('again.txt', 'w').write('x')\n")
    again = nbexec("run", "a.py", "b.py", "-j", "2", "--output-dir", "out", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert folders() == ["a", "b"]
    assert sorted(p.name for p in (tmp_path / "out" / "a" / "data").iterdir()) == ["again.txt"]


def test_overwrite_never_removes_a_folder_nbexec_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    (tmp_path / "x.py").write_text("print(1)\n")
    done = nbexec("run", "x.py", "--output-dir", "out", "--overwrite", cwd=tmp_path, env=_NO_DOCKER)
    assert done.returncode != 0
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"


def test_cpus_beyond_the_machine_is_a_usage_error_naming_the_option(docker_ready: None, tmp_path: Path) -> None:
    done = nbexec("run", "--cpus", "64", "-", cwd=tmp_path, stdin="print(1)\n")
    assert done.returncode == 2, done.stderr
    assert "--cpus" in done.stderr and "Docker refused" not in done.stderr


def test_a_missing_image_lists_the_images_here(docker_ready: None, tmp_path: Path) -> None:
    done = nbexec("run", "--image", "nbexec-nosuch:tag", "-", cwd=tmp_path, stdin="1\n")
    assert done.returncode == 3  # as the exit-code table says for an image that is not here (docs/cli.md)
    assert IMAGE in done.stderr and "--image" in done.stderr
    assert "nbexec-nosuch:tag is not here" in done.stderr and "image build" not in done.stderr, done.stderr


@pytest.mark.parametrize(("asked", "here", "build"), [("default", "", True), ("default", "Images here: a. ", True),
                                                      ("other", "Images here: a. ", False), ("other", "", True)])
def test_the_build_command_is_named_when_the_runtime_image_is_missing(asked: str, here: str, build: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime image missing, or no image here at all: build it. Another image asked for while some are here:
    most often mistyped, so the fix is to choose one."""
    from nbexec.sandbox.docker import daemon

    monkeypatch.setattr(daemon, "_present_images", lambda: here)
    name = daemon.DEFAULT_IMAGE if asked == "default" else "nbexec-nosuch:tag"
    said = daemon._missing_image(f"No such image: {name}")
    assert f"{name} is not here" in said and ("nbexec image build" in said) is build, said


@pytest.mark.parametrize("document", [{"foo": 1}, {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": "x"},
                                      {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": ["x"]}, [1]],
                         ids=["stray-json", "cells-not-a-list", "cell-not-an-object", "array"])
def test_a_json_file_that_is_no_notebook_says_so(tmp_path: Path, document: object) -> None:
    (tmp_path / "x.ipynb").write_text(json.dumps(document))
    done = nbexec("run", "x.ipynb", cwd=tmp_path, env=_NO_DOCKER)
    assert done.returncode == 2
    assert "x.ipynb is not a notebook" in done.stderr, done.stderr
    assert "attribute" not in done.stderr and "version 1" not in done.stderr


@pytest.mark.parametrize("command", ["serve", "mcp"])
def test_service_help_gives_its_own_exit_codes(tmp_path: Path, command: str) -> None:
    done = nbexec(command, "--help", cwd=tmp_path)
    said = " ".join(done.stdout.split())  # click wraps the epilog
    assert done.returncode == 0 and "Exit codes" in said
    assert "the code raised" not in said and "failed at start" in said


def test_a_bad_value_from_dotenv_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir(mode=0o700)
    (folder / ".env").write_text("NBEXEC_TIMEOUT=soon\n")
    (folder / ".env").chmod(0o600)
    (folder / "x.py").write_text("print(1)\n")
    env = {k: v for k, v in os.environ.items() if k != "NBEXEC_TIMEOUT"}
    done = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", "x.py"], cwd=folder, capture_output=True,
                          text=True, env={**env, **_NO_DOCKER}, timeout=120)
    assert done.returncode == 2
    assert "NBEXEC_TIMEOUT" in done.stderr and str(folder / ".env") in done.stderr


def test_a_mistyped_variable_is_warned_about(tmp_path: Path) -> None:
    done = nbexec("run", "missing.py", cwd=tmp_path, env={"NBEXEC_TIMOUT": "5", "NBEXEC_TIMEOUT": "30"})
    assert "NBEXEC_TIMOUT" in done.stderr and "did you mean NBEXEC_TIMEOUT?" in done.stderr
    assert "NBEXEC_TIMEOUT is not" not in done.stderr  # a name nbexec reads is never warned about


@pytest.mark.parametrize("args", [["run", "-q", "missing.py"], ["run", "missing.py", "--quiet"]], ids=["-q", "--quiet"])
def test_quiet_silences_the_mistyped_variable_warning_but_not_errors(tmp_path: Path, args: list[str]) -> None:
    done = nbexec(*args, cwd=tmp_path, env={"NBEXEC_TIMOUT": "5"})
    assert done.returncode == 2
    assert "NBEXEC_TIMOUT" not in done.stderr and "missing.py does not exist" in done.stderr, done.stderr


def test_every_variable_nbexec_reads_is_known_to_the_typo_check() -> None:
    from nbexec.cli import variables

    read = {name for name in read_by_code() if name.startswith("NBEXEC_") and name != "NBEXEC_ENV_"}
    assert read <= variables.known(), sorted(read - variables.known())
    assert variables.mistyped({"NBEXEC_ENV_ANYTHING": "1", "NBEXEC_MEMORY": "1g"}) == []


def test_the_library_output_folder_drops_runs_older_than_a_week(tmp_path: Path) -> None:
    root = tmp_path / f"nbexec-output-{os.getuid()}"
    root.mkdir(mode=0o700)
    old, recent = root / "old-run", root / "recent-run"
    for folder in (old, recent):
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "f.txt").write_text("x")
    week_ago = time.time() - 8 * 86400
    os.utime(old, (week_ago, week_ago))
    script = "from nbexec.files import folders; print(folders.output_dir(None, 'new-run'))"
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not old.exists() and (recent / "data" / "f.txt").exists() and (root / "new-run").is_dir()


def test_a_short_script_starts_no_sandbox_it_will_not_use(docker_ready: None, tmp_path: Path) -> None:
    """One call and exit: the pool (2 by default) is not filled behind it, so the script neither starts
    containers nobody uses nor waits at exit for them to start and be removed."""
    from nbexec.sandbox.docker import daemon

    node = f"short-{os.urandom(4).hex()}"
    script = "import nbexec\nprint(nbexec.execute_notebook('print(6 * 7)').stdout, end='')\n"
    since = time.time() - 1
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_NODE_NAME": node})
    assert done.returncode == 0 and done.stdout == "42\n", done.stderr
    events = daemon.connect().events(since=since, until=time.time() + 1, decode=True, filters={
        "type": "container", "event": "create", "label": f"{daemon.LABEL_NODE}={node}"})
    assert len(list(events)) == 1


def test_nbexec_nodes_takes_the_name_equals_url_form_of_nodes() -> None:
    host = host_from_env({"NBEXEC_NODES": "east=http://10.0.0.1:8080, http://10.0.0.2:8080/",
                          "NBEXEC_NODE_TOKEN": "t" * 32})
    assert host.nodes == ("http://10.0.0.1:8080", "http://10.0.0.2:8080")


def test_nbexecs_notes_reach_a_person_on_stderr(cleanup_ledger: None, tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text("# %%\nimport sys\nprint('first')\nsys.exit(0)\n# %%\nprint('never')\n")
    done = nbexec("run", "stop.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "first" in done.stdout and "never" not in done.stdout
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: ")]
    assert notes and "note" not in done.stdout, done.stderr
    quiet = nbexec("run", "-q", "stop.py", cwd=tmp_path)
    assert "note: " not in quiet.stderr
