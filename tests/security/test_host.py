"""Host-side attacks: another local user, and what one sandbox can do to another through shared host state.

The attacker is a real local account made for the test (``useradd``); its steps run in a forked child that drops to
its uid. Judged from outside: what nbexec raises, which files exist where, who can read them, which uid the sandbox
code sees, which containers are left.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec.sandbox.docker import daemon, pool

from ..conftest import IMAGE

DAY = 24 * 3600


@pytest.fixture(scope="module")
def attacker() -> Iterator[int]:
    """The uid of a fresh local account (no home, no password, a login shell), deleted afterwards."""
    if os.getuid() != 0:
        pytest.fail("these tests make a local user: run them as root", pytrace=False)
    name = f"nbx{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(uid: int, step: Callable[[], object]) -> object:
    """Run ``step`` in a forked child under ``uid``; return what it returned or the exception it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            outcome = repr(step())
        except BaseException as exc:
            outcome = f"raised {type(exc).__name__}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A /tmp-like folder (sticky, world-writable) that nbexec uses as its temporary folder in this test."""
    tmp_path_factory.getbasetemp()  # pytest's own folder stays where it was
    base = Path(tempfile.mkdtemp(prefix="nbexec-host-test-", dir="/tmp"))
    base.chmod(0o1777)
    previous = tempfile.tempdir
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    try:
        yield base
    finally:
        # Sandboxes are removed in the background, in folders under this one: let them finish here, and let what
        # runs after (the leak ledger's checks) make its folders in the real temporary folder, not in this one.
        pool.wait_for_teardown()
        tempfile.tempdir = previous
        shutil.rmtree(base, ignore_errors=True)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("planted", ["folder", "symlink"])
@pytest.mark.parametrize("root", ["nbexec", "nbexec-output"])
def test_roots_pre_created_by_another_user_are_refused(
        cold: nbexec.SandboxConfig, attacker: int, shared_tmp: Path, root: str, planted: str) -> None:
    trap, me = shared_tmp / "attacker-owned", os.getuid()

    def plant() -> None:
        trap.mkdir(mode=0o777)
        trap.chmod(0o777)
        for name in (root, f"{root}-{me}"):
            if planted == "folder":
                (shared_tmp / name).mkdir(mode=0o777)
                (shared_tmp / name).chmod(0o777)
            else:
                (shared_tmp / name).symlink_to(trap)

    as_user(attacker, plant)
    with pytest.raises(nbexec.ConfigError, match=r"another user|not a real folder|link"):
        nbexec.execute_notebook("print('ran')", config=cold)
    assert _listing(trap) == []
    for name in (root, f"{root}-{os.getuid()}"):
        if planted == "folder":
            assert _listing(shared_tmp / name) == []


@pytest.mark.parametrize("planted", ["folder", "symlink"])
def test_given_output_dir_of_another_user_is_refused(
        cold: nbexec.SandboxConfig, attacker: int, shared_tmp: Path, planted: str) -> None:
    trap, given = shared_tmp / "trap", shared_tmp / "out"

    def plant() -> None:
        trap.mkdir(mode=0o777)
        if planted == "folder":
            given.mkdir(mode=0o700)
        else:
            given.symlink_to(trap)

    as_user(attacker, plant)
    with pytest.raises(nbexec.ConfigError):
        nbexec.execute_notebook("print('ran')", config=cold, output_dir=given)
    assert _listing(trap) == [] and (planted == "symlink" or _listing(given) == [])


def test_output_is_private_to_its_owner(cold: nbexec.SandboxConfig, attacker: int, shared_tmp: Path) -> None:
    code = ("import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\n"
            "open('/mnt/data/table.csv', 'w').write('a,b\\n1,2\\n'); print('ok')")
    result = nbexec.execute_notebook(code, config=cold.replace(warm_imports=()))
    assert result.ok and result.images and result.files, result.error
    out = Path(result.output_dir)
    for folder in (out, out.parent, out / "images"):
        assert stat.S_IMODE(folder.lstat().st_mode) == 0o700, folder
    for path in (Path(result.notebook_path), Path(result.images[0].path)):
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600, path
    for path in (result.notebook_path, result.images[0].path, result.files[0].path, str(out)):
        assert as_user(attacker, lambda p=path: os.listdir(p) if os.path.isdir(p) else Path(p).read_bytes()) \
            == "raised PermissionError", path


def test_swapped_output_folder_does_not_redirect_session_writes(
        config: nbexec.SandboxConfig, attacker: int, shared_tmp: Path, tmp_path: Path) -> None:
    """The user keeps session output in a folder another user controls; between two runs that user swaps the
    session's folder for a link to a private folder of the victim."""
    shared = shared_tmp / "shared"
    as_user(attacker, lambda: shared.mkdir(mode=0o777))
    victim = tmp_path / "victim-private"
    victim.mkdir(mode=0o700)
    given = shared / "run"
    with nbexec.Session(config, output_dir=given) as session:
        assert session.run("import matplotlib.pyplot as plt\nplt.plot([1]); plt.show()").ok
        as_user(attacker, lambda: (given.rename(shared / "moved"), given.symlink_to(victim)))
        second = session.run("plt.plot([2]); plt.show(); print('second')")
        assert second.ok, second.error
        session.save(given / "session-copy.ipynb")
    assert _listing(victim) == [], "writes followed the swapped-in link"
    moved = shared / "moved"
    assert sorted(p.name for p in (moved / "images").iterdir()) == ["cell0-1.png", "cell1-1.png"]
    assert b"second" in (moved / "session.ipynb").read_bytes()
    assert (moved / "session-copy.ipynb").exists()


def test_concurrent_sandboxes_get_distinct_uids_without_accounts(cold: nbexec.SandboxConfig) -> None:
    code = "import os, getpass\nprint(os.getuid(), os.getgid(), getpass.getuser())"
    with nbexec.Session(cold) as first, nbexec.Session(cold) as second:
        seen = [first.run(code), second.run(code)]
    ids = []
    for result in seen:
        assert result.ok, result.error
        uid, gid, user = result.stdout.split()
        ids.append(int(uid))
        with pytest.raises(KeyError):
            pwd.getpwuid(int(uid))
        import grp
        with pytest.raises(KeyError):
            grp.getgrgid(int(gid))
        assert user
    assert ids[0] != ids[1]
    assert all(uid >= 2_000_000_000 for uid in ids)


def test_doctor_warns_when_sandboxes_would_run_as_a_login_account(docker_ready: None, attacker: int) -> None:
    done = _cli("doctor", env={"NBEXEC_USER": str(attacker)})
    assert f"WARN sandbox uid {attacker} is the login account" in done.stdout, done.stdout
    done = _cli("doctor")
    assert "WARN sandbox uid" not in done.stdout and "sandbox uid" in done.stdout, done.stdout


def test_session_without_keep_files_deletes_its_folder_at_close(config: nbexec.SandboxConfig) -> None:
    kept = nbexec.Session(config)
    dropped = nbexec.SessionManager(config, keep_files=False).create()
    for session in (kept, dropped):
        assert session.run("open('/mnt/data/x.txt', 'w').write('x')").ok
        session.close()
    assert kept.output_dir is not None and (kept.output_dir / "data" / "x.txt").exists()
    assert dropped.output_dir is not None and not dropped.output_dir.exists()
    shutil.rmtree(kept.output_dir)


_EXHAUST = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 100000:
    fd = libc.inotify_init()
    if fd < 0:
        break
    held.append(fd)
print(len(held), ctypes.get_errno())
"""
_ONE = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.inotify_init(), ctypes.get_errno())"


def test_inotify_exhaustion_stays_in_one_sandbox(cold: nbexec.SandboxConfig) -> None:
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    with nbexec.Session(cold) as greedy, nbexec.Session(cold) as victim:
        victim.start()
        taken = greedy.run(_EXHAUST)  # keeps every instance open while the other sandbox asks for one
        asked = victim.run(_ONE)
    assert taken.ok and asked.ok, (taken.error, asked.error)
    count, err = map(int, taken.stdout.split())
    assert err == 24 and count <= limit, taken.stdout  # EMFILE: the per-uid limit was reached
    fd, err = map(int, asked.stdout.split())
    assert fd >= 0, f"the second sandbox could not create an inotify instance (errno {err})"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbexec.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NBEXEC_IMAGE": IMAGE, **(env or {})})


def test_cleanup_older_than_removes_old_folders_and_their_containers(
        cleanup_ledger: None, shared_tmp: Path) -> None:
    from nbexec.files import folders
    from nbexec.sandbox.docker import container as sandbox

    outputs = {age: folders.output_dir(None, f"age-{age}") for age in ("old", "new")}
    for folder in outputs.values():
        (folder / "notebook.ipynb").write_text("{}")
    workdirs = {age: sandbox.work_root() / f"nbexec-{os.getpid()}-{age}" for age in ("old", "new")}
    client = daemon.connect()
    containers = {}
    try:
        for age, workdir in workdirs.items():
            (workdir / "run").mkdir(parents=True)
            containers[age] = client.containers.create(
                IMAGE, command=["sleep", "60"], labels={daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner()},
                volumes={str(workdir / "run"): {"bind": "/run/nbexec", "mode": "rw"}})
        long_ago = time.time() - 2 * DAY
        for path in (outputs["old"], workdirs["old"]):
            os.utime(path, (long_ago, long_ago))
        done = _cli("cleanup", "--older-than", "1d", env={"TMPDIR": str(shared_tmp)})
        assert done.returncode == 0, done.stderr
        assert not os.path.exists(outputs["old"]) and not workdirs["old"].exists(), done.stdout
        assert os.path.exists(outputs["new"]) and workdirs["new"].exists(), done.stdout
        ids = [c.id for c in containers.values()]
        left = {c.id for c in client.containers.list(all=True, sparse=True, filters={"id": ids})}
        assert containers["old"].id not in left and containers["new"].id in left
        assert _cli("cleanup", "--older-than", "yesterday").returncode == 2
    finally:
        for container in containers.values():
            with contextlib.suppress(Exception):
                container.remove(force=True)


def test_sweep_on_start_finds_dead_previous_instance_of_this_node(docker_ready: None, tmp_path: Path) -> None:
    """A service restarted in a container is PID 1 again on the same node: its old containers must go; those
    of another node (a live scale-out peer) must stay."""
    node = socket.gethostname()
    client = daemon.connect()
    made = []
    try:
        for who in (node, "another-node"):
            labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: f"{who}:1", "nbexec.node": who,
                      "nbexec.owner.start": "00000000-dead-beef-0000-000000000000/1"}
            made.append(client.containers.create(IMAGE, command=["sleep", "60"], labels=labels))
        done = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", "-"], input="print(1)\n", cwd=tmp_path,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_NODE_NAME": node})
        assert done.returncode == 0, done.stderr
        left = {c.id for c in client.containers.list(all=True, sparse=True, filters={"id": [c.id for c in made]})}
        assert made[0].id not in left, "the dead previous instance's container was not swept"
        assert made[1].id in left, "another node's container was swept"
    finally:
        for container in made:
            with contextlib.suppress(Exception):
                container.remove(force=True)
