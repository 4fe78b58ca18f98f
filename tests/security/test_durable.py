"""Durable sessions (issue #26): a session kept in a state folder survives the SIGKILL of its process; the sweep
keeps what a live state folder claims and removes it once its holder is gone for good; records and state folders
are private, held by one process, and a hostile record finds nothing it should not.

Each test judges by the effect: the variables and files a new process finds, containers and working folders on
the host, the modes of files on disk, what a refused call leaves behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

import nbexec
from nbexec import Session, SessionManager
from nbexec.files import statefolder
from nbexec.files.folders import work_root
from nbexec.files.workdir import remove_stale_workdirs, remove_tree
from nbexec.sandbox.docker import daemon

from ..conftest import IMAGE

pytestmark = pytest.mark.usefixtures("docker_ready")  # owner processes and services reach the engine

CHILD = textwrap.dedent("""
    import os, signal, sys
    import nbexec
    config = nbexec.SandboxConfig(image=sys.argv[2], pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3,
                                  runtime=sys.argv[4] or None)
    session = nbexec.Session(config, state_dir=sys.argv[1])
    assert session.run("x = 41\\nopen('kept.txt', 'w').write('still here')").ok
    if sys.argv[3] == "sleep-then-die":
        assert session.hibernate()
    print(session.id, flush=True)
    if sys.argv[3] == "sleep-then-die":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[3] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[3] == "die-running":
        import threading
        threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        session.run("import time\\nwhile True: time.sleep(0.1)")
    sys.stdin.read()  # "live": held until the test closes stdin
""")


def claimed_containers(state_dir: Path) -> list[docker.models.containers.Container]:
    client = daemon.connect()
    # ignore_removed: a container removed between the list and its inspect (adoption removing it) is not an error.
    found = client.containers.list(all=True, filters={"label": daemon.LABEL_STATE}, ignore_removed=True)
    return [c for c in found if c.labels.get(daemon.LABEL_STATE, "").endswith(":" + str(state_dir.absolute()))]


def claimed_workdirs(state_dir: Path) -> list[Path]:
    out = []
    for entry in work_root().iterdir():
        claim = entry / "claim"
        if claim.is_file() and claim.read_text().endswith(":" + str(state_dir.absolute())):
            out.append(entry)
    return out


CHILDREN: list[subprocess.Popen[str]] = []


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    while CHILDREN:
        child = CHILDREN.pop()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        if child.poll() is None:
            child.kill()
        child.wait(60)
    for container in claimed_containers(path):  # whatever a failing test left
        container.remove(force=True)
    for workdir in claimed_workdirs(path):
        remove_tree(workdir)


def owner_process(state_dir: Path, how: str, runtime: str = "") -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(state_dir), IMAGE, how, runtime], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
    assert child.stdout is not None
    session_id = child.stdout.readline().strip()
    assert session_id, f"the owner process did not start its session (exit {child.poll()})"
    CHILDREN.append(child)
    return child, session_id


def sweep() -> None:
    """What a restarted process does first: remove what dead owners left (containers, working folders)."""
    daemon.cleanup(daemon.connect())
    remove_stale_workdirs()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_session_survives_sigkill_of_its_process(state_dir: Path, config: nbexec.SandboxConfig, runtime: str) -> None:
    child, session_id = owner_process(state_dir, "die", runtime)
    assert child.wait(60) == -signal.SIGKILL
    sweep()  # the new process's sweep must keep what the state folder claims
    assert len(claimed_containers(state_dir)) == 1
    session = Session.resume(session_id, state_dir=state_dir)
    try:
        assert session.id == session_id
        result = session.run("print(x + 1, open('kept.txt').read())")
        assert result.ok and result.stdout == "42 still here\n"
        assert session.download("kept.txt") == b"still here"
        assert [c.source for c in session.notebook.cells][-1] == "print(x + 1, open('kept.txt').read())"
    finally:
        session.close()
    assert claimed_containers(state_dir) == [] and claimed_workdirs(state_dir) == []
    assert not (state_dir / f"{session_id}.session").exists()


def test_sigkill_mid_execution_keeps_the_kernel(state_dir: Path, config: nbexec.SandboxConfig) -> None:
    child, session_id = owner_process(state_dir, "die-running")
    assert child.wait(60) == -signal.SIGKILL
    manager = SessionManager(config, state_dir=state_dir)
    try:
        assert session_id in manager.ids()
        session = manager.get(session_id)
        result = session.run("print(x)")  # the runaway cell of the dead owner was interrupted
        assert result.ok and result.stdout == "41\n"
        manager.close(session_id)
    finally:
        manager.close_all()
    assert claimed_containers(state_dir) == []


def test_dead_owner_that_never_comes_back_is_swept(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child, _ = owner_process(state_dir, "die")
    assert child.wait(60) == -signal.SIGKILL
    sweep()
    assert len(claimed_containers(state_dir)) == 1  # within the grace period: kept
    monkeypatch.setenv("NBEXEC_STATE_GRACE", "0")
    sweep()
    assert claimed_containers(state_dir) == [] and claimed_workdirs(state_dir) == []


def test_live_holder_keeps_its_sandboxes_whatever_the_grace(state_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    child, _ = owner_process(state_dir, "live")
    try:
        monkeypatch.setenv("NBEXEC_STATE_GRACE", "0")
        sweep()
        assert len(claimed_containers(state_dir)) == 1 and len(claimed_workdirs(state_dir)) == 1
        with pytest.raises(nbexec.SessionLimitError, match="held by another live process"):
            statefolder.StateFolder.open(state_dir)  # one holder at a time
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(60)  # a normal exit leaves a durable session to its state folder
    assert len(claimed_containers(state_dir)) == 1
    sweep()  # dead holder, grace 0: swept
    assert claimed_containers(state_dir) == [] and claimed_workdirs(state_dir) == []


def test_adopting_process_keeps_them_whatever_the_grace(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dead owner's sandboxes, found again by this (live) process: its holding keeps them, not the grace."""
    child, session_id = owner_process(state_dir, "die")
    assert child.wait(60) == -signal.SIGKILL
    session = Session.resume(session_id, state_dir=state_dir)
    try:
        monkeypatch.setenv("NBEXEC_STATE_GRACE", "0")
        sweep()
        assert len(claimed_containers(state_dir)) == 1 and len(claimed_workdirs(state_dir)) == 1
        assert session.run("print(x)").stdout == "41\n"
    finally:
        session.close()


def test_state_folder_is_private(state_dir: Path, config: nbexec.SandboxConfig) -> None:
    cfg = config.replace(pool_size=0)
    with Session(cfg, state_dir=state_dir) as session:
        session.run("y = 1")
        assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
        for entry in state_dir.iterdir():
            assert stat.S_IMODE(entry.lstat().st_mode) == 0o600, entry
        record = json.loads((state_dir / f"{session.id}.session").read_text())
        assert record["sandbox"]["connection"]["key"]  # the key is in it: hence 0600 in a 0700 folder


def test_state_folder_not_ours_is_refused(tmp_path: Path, config: nbexec.SandboxConfig) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(nbexec.ConfigError, match="private"):
        Session(config.replace(pool_size=0), state_dir=shared).start()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(nbexec.ConfigError):
        Session(config.replace(pool_size=0), state_dir=link).start()
    assert not list((tmp_path / "elsewhere").iterdir())


def _tamper(state_dir: Path, session_id: str, change: dict[str, object] | bytes) -> None:
    path = state_dir / f"{session_id}.session"
    if isinstance(change, bytes):
        path.write_bytes(change)
        return
    record = json.loads(path.read_text())
    for key, value in change.items():
        target, _, leaf = key.rpartition(".")
        (record[target] if target else record)[leaf] = value
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("change", [
    {"sandbox.workdir": "/etc"},  # a folder that is not nbexec's
    {"sandbox.workdir": "/tmp"},
    {"sandbox.container": "0" * 64},  # a container that does not exist
    {"sandbox.kind": "remote"},
    {"config": {"memory": "1t", "bogus": 1}},  # an unknown config field
    {"config": {"network": "yes"}},  # an invalid one
    {"id": "other"},  # a record renamed
    {"version": 99},
    b"{\"truncated",
    b"",
    b"x" * (statefolder.MAX_RECORD + 1),  # oversized: not read
], ids=["workdir-etc", "workdir-tmp", "container", "kind", "config-field", "config-value", "renamed", "version",
        "truncated", "empty", "oversized"])
def test_tampered_record_finds_nothing(state_dir: Path, config: nbexec.SandboxConfig,
                                       change: dict[str, object] | bytes) -> None:
    child, session_id = owner_process(state_dir, "die")
    assert child.wait(60) == -signal.SIGKILL
    _tamper(state_dir, session_id, change)
    with pytest.raises((nbexec.SessionNotFoundError, nbexec.SessionLostError)):
        Session.resume(session_id, state_dir=state_dir)
    assert os.path.isdir("/etc") and os.path.isdir("/tmp")


def test_record_of_another_sandbox_is_refused(state_dir: Path, config: nbexec.SandboxConfig) -> None:
    """A record pointing at another sandbox's working folder (a swapped record) finds nothing."""
    first, first_id = owner_process(state_dir, "die")
    assert first.wait(60) == -signal.SIGKILL
    second, second_id = owner_process(state_dir, "die")
    assert second.wait(60) == -signal.SIGKILL
    other = json.loads((state_dir / f"{second_id}.session").read_text())["sandbox"]["workdir"]
    _tamper(state_dir, first_id, {"sandbox.workdir": other})
    with pytest.raises(nbexec.SessionLostError, match="not the sandbox"):
        Session.resume(first_id, state_dir=state_dir)
    session = Session.resume(second_id, state_dir=state_dir)  # the other one is untouched
    try:
        assert session.run("print(x)").stdout == "41\n"
    finally:
        session.close()


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden", "x" * 200])
def test_unsafe_ids_are_refused(state_dir: Path, config: nbexec.SandboxConfig, bad: str) -> None:
    with pytest.raises((nbexec.SessionNotFoundError, nbexec.ConfigError)):
        Session.resume(bad, state_dir=state_dir)
    if bad:  # an empty id means "make one"
        with pytest.raises(nbexec.ConfigError):
            Session(config.replace(pool_size=0), state_dir=state_dir, session_id=bad).start()
    assert sorted(p.name for p in state_dir.iterdir()) == ["holder", "identity", "lock"] or not bad
