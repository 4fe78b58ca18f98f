"""`Session.shell` attacked: a command that floods, forks into the background, fork-bombs, ignores SIGTERM past its
time limit, or writes outside /mnt/data. Judged from outside the command: the result, the sandbox's process list
(read by a later cell from /proc: the container's whole pid namespace), what /mnt/data holds, host memory.
Real Docker, the real image, real kernels."""

from __future__ import annotations

import signal
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec.engine.session import Session
from nbexec.errors import ConfigError
from nbexec.sandbox.remote import source as remote

from .. import cluster
from ..conftest import IMAGE, wait_until

_PROCESSES = ("import os\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
              "            print(open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())\n"
              "        except OSError:\n            pass")


def _processes(session: Session) -> str:
    result = session.run(_PROCESSES)
    assert result.ok, result.error
    return result.stdout


def test_a_command_runs_in_mnt_data_with_its_exit_code_and_streams(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        ok = session.shell("pwd; echo out; echo err >&2; printf 'caf\\303\\251\\n'")
        assert (ok.ok, ok.exit_code, ok.error) == (True, 0, None)
        assert ok.stdout == "/mnt/data\nout\ncafé\n" and ok.stderr == "err\n"
        failed = session.shell("echo partial; exit 7")
        assert (failed.ok, failed.exit_code) == (False, 7)
        assert failed.error is not None and failed.error.kind == "exit" and "7" in failed.error.evalue
        assert failed.stdout == "partial\n"
        session.shell("echo kept > made.txt")
        assert session.download("made.txt") == b"kept\n"
        left = session.run("print(sorted(k for k in globals() if 'shell' in k or 'pump' in k.lower()))")
        assert left.stdout == "[]\n"  # nothing of the runner stays in the user's variables


def test_a_background_child_does_not_outlive_the_command(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        result = session.shell("sleep 4242 & (sleep 4343 &) ; echo started")
        assert (result.ok, result.stdout) == (True, "started\n")
        listing = _processes(session)
        assert "sleep 4242" not in listing and "sleep 4343" not in listing, listing


def test_a_command_that_ignores_sigterm_is_killed_at_its_limit(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        result = session.shell("trap '' TERM INT; sleep 4444 & trap '' TERM INT; sleep 4545; echo never", timeout=2)
        assert not result.ok and result.exit_code is None
        assert result.error is not None and result.error.kind == "timeout"
        assert "its process group was killed" in result.error.evalue  # the command's own limit, not the host's
        assert "never" not in result.stdout
        listing = _processes(session)
        assert "sleep 4444" not in listing and "sleep 4545" not in listing, listing
        assert session.run("print(6 * 7)").stdout == "42\n"  # the kernel is fine afterwards


def test_an_interrupt_kills_the_command_and_says_so(config: nbexec.SandboxConfig) -> None:
    import threading

    with Session(config) as session:
        session.start()
        timer = threading.Timer(3.0, session.interrupt)
        timer.start()
        try:
            result = session.shell("sleep 4646; echo never", timeout=60)
        finally:
            timer.cancel()
        assert not result.ok and result.exit_code is None and result.error is not None
        assert "sleep 4646" not in _processes(session)


def test_an_output_flood_is_truncated_and_counted(config: nbexec.SandboxConfig) -> None:
    small = config.replace(max_output="64KB")
    tracemalloc.start()
    try:
        with Session(small) as session:
            result = session.shell("head -c 50000000 /dev/zero | tr '\\0' x; echo; echo done >&2")
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0
    assert len(result.stdout) <= 64 * 1024 and "output truncated" in result.stderr
    assert result.truncated_bytes >= 50_000_000 - 64 * 1024  # what was dropped is counted, not hidden
    assert peak < 30_000_000, peak  # the host never held the flood


def test_a_fork_bomb_meets_the_pids_limit(config: nbexec.SandboxConfig) -> None:
    with Session(config.replace(pids=64)) as session:
        result = session.shell("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", timeout=10)
        assert result.exit_code is not None or result.error is not None
        listing = _processes(session)
        assert "bomb" not in listing and listing.count("/bin/sh") == 0, listing


def test_writes_outside_mnt_data_fail(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        for target in ("/usr/x", "/etc/x", "/opt/x", "/x"):
            result = session.shell(f"echo pwned > {target}")
            assert (result.ok, result.exit_code) == (False, 2), (target, result.stderr)
            assert "Read-only file system" in result.stderr
        assert session.run("import os; print(os.path.exists('/usr/x') or os.path.exists('/etc/x'))").stdout \
            == "False\n"


@pytest.mark.parametrize("command", ["", "   ", "echo \0 x", "echo " + "x" * 70_000])
def test_bad_commands_are_refused_before_the_sandbox_starts(config: nbexec.SandboxConfig, command: str) -> None:
    session = Session(config)
    with pytest.raises(ConfigError):
        session.shell(command)
    assert session.status == "new"
    session.close()


@pytest.fixture
def remote_config(docker_ready: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[nbexec.SandboxConfig]:
    """A session whose sandbox is on a real `nbexec serve` node (NBEXEC_NODES): the shell goes through the seam."""
    tmp = Path(tempfile.mkdtemp(prefix="sh-"))
    tmp.chmod(0o755)
    server = cluster.node(0, tmp, tag="sh").start()
    try:
        cluster.wait_ready([server])
        monkeypatch.setenv("NBEXEC_NODES", server.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
        remote.forget_all()
        yield nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=2,
                                   source="remote")
        remote.forget_all()
    finally:
        server.kill(signal.SIGTERM)
        wait_until(lambda: not server.containers(), 60, "the shell node left containers behind")


def test_a_remote_session_runs_the_same_shell(remote_config: nbexec.SandboxConfig) -> None:
    with Session(remote_config) as session:
        result = session.shell("sleep 4747 & echo far; exit 9")
        assert (result.ok, result.exit_code, result.stdout, result.node is not None) == (False, 9, "far\n", True)
        assert result.error is not None and result.error.kind == "exit"
        timed = session.shell("trap '' TERM; sleep 4848", timeout=2)
        assert timed.error is not None and timed.error.kind == "timeout"
        listing = _processes(session)
        assert "sleep 4747" not in listing and "sleep 4848" not in listing, listing


_STATES = ("import os\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
           "            stat = open(f'/proc/{pid}/stat').read()\n        except OSError:\n            continue\n"
           "        print(stat[stat.rindex(')') + 2])")


def test_a_child_that_leaves_the_group_with_setsid_is_killed_too(config: nbexec.SandboxConfig) -> None:
    with Session(config) as session:
        assert session.run("import subprocess\nkeep = subprocess.Popen(['sleep', '5050'])").ok
        result = session.shell("setsid sleep 5151 >/dev/null 2>&1 </dev/null & "
                               "(setsid sh -c 'sleep 5252 & exec sleep 5353' >/dev/null 2>&1 </dev/null &); echo ok")
        assert (result.ok, result.stdout) == (True, "ok\n")
        listing = _processes(session)
        assert not any(f"sleep {n}" in listing for n in (5151, 5252, 5353)), listing
        assert "sleep 5050" in listing  # the code's own child, started before the command, is not the command's
        assert "Z" not in session.run(_STATES).stdout.split()  # the killed ones were reaped: no zombies left
