"""`nbexec run` in a terminal and in a pipe: outputs stream as they come, colour only on a terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IMAGE

# Prints, then waits until the test lets it go (a file appears in its folder, mounted at /mnt/input): the test
# only lets it go once it has seen the first line, so a run that printed at the end never sees "gate opened".
GATED = """import os, time
print('first line', flush=True)
for _ in range(600):
    if os.path.exists('/mnt/input/go'):
        print('gate', 'opened')
        break
    time.sleep(0.1)
else:
    print('gate', 'timed out')
raise ValueError('at the end')
"""


def start(folder: Path, *, stdout: int, stderr: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Run GATED from ``folder`` (readable by the sandbox's uid: nbexec mounts the script's folder)."""
    folder.mkdir(mode=0o755)
    (folder / "gated.py").write_text(GATED)
    return subprocess.Popen([sys.executable, "-m", "nbexec.cli", "run", str(folder / "gated.py")],
                            cwd=folder, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            env={**os.environ, "NBEXEC_IMAGE": IMAGE, **env})


def read_until(fd: int, marker: bytes) -> bytes:
    """Read ``fd`` until ``marker`` is seen or the stream ends (a pty's master reads EIO then)."""
    seen = b""
    while marker not in seen:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_a_pipe_gets_each_output_as_it_comes(cleanup_ledger: None, tmp_path: Path) -> None:
    proc = start(tmp_path / "work", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={"NO_COLOR": ""})
    assert proc.stdout is not None
    before = read_until(proc.stdout.fileno(), b"first line")
    assert b"first line" in before and b"gate" not in before
    (tmp_path / "work" / "go").touch()
    with proc.stdout:
        rest = before + proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode == 1
    assert b"gate opened" in rest and b"gate timed out" not in rest
    assert b"ValueError: at the end" in rest and b"\x1b[" not in rest  # a pipe never gets colour


@pytest.mark.parametrize(("no_color", "coloured"), [("", True), ("1", False)], ids=["colour", "NO_COLOR"])
def test_a_terminal_gets_live_output_and_colour(cleanup_ledger: None, tmp_path: Path, no_color: str,
                                                coloured: bool) -> None:
    master, slave = pty.openpty()
    try:
        proc = start(tmp_path / "work", stdout=slave, stderr=slave, env={"NO_COLOR": no_color, "TERM": "xterm"})
        os.close(slave)
        before = read_until(master, b"first line")
        assert b"first line" in before and b"gate" not in before
        (tmp_path / "work" / "go").touch()
        rest = before + read_until(master, b"\x00")  # to the end of the stream
        proc.wait(timeout=120)
    finally:
        os.close(master)
    assert proc.returncode == 1
    assert b"gate opened" in rest and b"gate timed out" not in rest
    assert b"ValueError" in rest
    assert (b"\x1b[31m" in rest) is coloured  # the traceback in red, only on a terminal without NO_COLOR


def test_quiet_prints_only_the_code_s_output(cleanup_ledger: None, tmp_path: Path) -> None:
    script = tmp_path / "files.py"
    script.write_text("print('kept')\n_ = open('/mnt/data/out.txt', 'w').write('x')\n")
    env = {**os.environ, "NBEXEC_IMAGE": IMAGE}
    loud = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    quiet = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", "-q", str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert loud.returncode == quiet.returncode == 0
    assert "out.txt" in loud.stdout and "notebook:" in loud.stderr
    assert "--- " not in loud.stderr
    assert quiet.stdout == "kept\n" and quiet.stderr == ""
