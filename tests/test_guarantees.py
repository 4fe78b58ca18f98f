"""Guarantees a one-line change could remove without any other test noticing, each attacked from outside:
the seccomp filter (a call it refuses), the sandbox's own PID namespace, the read-only input mount, link rewriting
in every text view, reaping by idleness (never a busy session), working folders removed after a one-shot, and a
dead pooled sandbox never handed out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec import Session, execute_notebook
from nbexec.sandbox.docker import daemon, pool

from .conftest import (
    CONTAINER_ID,
    IMAGE,
    container_id,
    own_workdirs,
    pool_workdirs,
    wait_until,
    waiting_sandboxes,
)

# System calls Docker's default seccomp profile refuses and the kernel grants any user (a keyring of one's own):
# refused (EPERM) only by the filter, so their answer is the filter's effect, not a status line about it.
SECCOMP_PROBE = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
calls = {"keyctl": (250, 0, -2, 1), "add_key": (248, b"user", b"nbexec-probe", b"x", 1, -2)}  # x86_64 numbers
seen = {}
for name, (number, *args) in calls.items():
    answer = libc.syscall(number, *args)
    seen[name] = "allowed" if answer >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps(seen))
"""
PROBE = SECCOMP_PROBE.replace("print(json.dumps(seen))", "") + r"""
import os
facts = {"status": open("/proc/self/status").read(), "pid": os.getpid(), "seccomp": seen,
         "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
for what, path, mode in (("append", "/mnt/input/existing.txt", "a"), ("create", "/mnt/input/new.txt", "w")):
    try:
        with open(path, mode) as f:
            f.write("x")
        facts[what] = "written"
    except OSError as exc:
        facts[what] = errno.errorcode[exc.errno]
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder anyone may write (so only the read-only mount can stop a write), with a file anyone may write."""
    folder = tmp_path_factory.mktemp("input")
    folder.chmod(0o777)
    (folder / "existing.txt").write_text("original")
    (folder / "existing.txt").chmod(0o666)
    return folder


@pytest.fixture(scope="module")
def inside(docker_ready: None, input_dir: Path) -> Iterator[dict]:
    """What the sandbox sees of itself (one execution shared by the tests below)."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, input_dir=str(input_dir))
    result = execute_notebook(PROBE, config=config)
    assert result.ok, result.error
    yield json.loads(result.stdout)
    pool.wait_for_teardown()


def test_seccomp_filter_is_on(inside: dict, cleanup_ledger: None) -> None:
    """Calls the profile refuses are refused; the same calls from the same unprivileged user in a container
    without the filter go through (so the filter, not the user or a missing capability, is what refused them)."""
    assert inside["seccomp"] == {"keyctl": "EPERM", "add_key": "EPERM"}, inside["seccomp"]
    labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner(), daemon.LABEL_ROLE: "control"}
    container = daemon.connect().containers.run(
        IMAGE, ["python", "-c", SECCOMP_PROBE], user="1000:1000", detach=True, labels=labels, network_mode="none",
        cap_drop=["ALL"], security_opt=["no-new-privileges", "seccomp=unconfined"])
    try:
        assert container.wait(timeout=120)["StatusCode"] == 0, container.logs()
        assert json.loads(container.logs(stderr=False)) == {"keyctl": "allowed", "add_key": "allowed"}
    finally:
        container.remove(force=True)


def test_sandbox_has_its_own_pid_namespace(inside: dict) -> None:
    """The kernel's PID is small and only the sandbox's few processes are visible, not the host's."""
    assert inside["pid"] < 100, inside["pid"]
    assert len(inside["pids"]) < 50, len(inside["pids"])
    assert os.getpid() not in inside["pids"] or os.getpid() < 100


def test_input_mount_is_read_only(inside: dict, input_dir: Path, cleanup_ledger: None) -> None:
    assert (inside["append"], inside["create"]) == ("EROFS", "EROFS")
    assert (input_dir / "existing.txt").read_text() == "original" and not (input_dir / "new.txt").exists()
    # Positive control: the same folder mounted writable lets the same user write (the mode is not what stops it).
    labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner(), daemon.LABEL_ROLE: "control"}
    container = daemon.connect().containers.run(
        IMAGE, ["python", "-c", "open('/mnt/input/existing.txt', 'a').write('x')"], user="1000:1000", detach=True,
        labels=labels, network_mode="none", volumes={str(input_dir): {"bind": "/mnt/input", "mode": "rw"}})
    try:
        assert container.wait(timeout=120)["StatusCode"] == 0, container.logs()
    finally:
        container.remove(force=True)
    assert (input_dir / "existing.txt").read_text() == "originalx"


def test_links_are_rewritten_in_stdout_stderr_and_text(config: nbexec.SandboxConfig) -> None:
    code = ("import sys\nfor n in 'abc':\n    open(f'/mnt/data/{n}.txt', 'w').write(n)\n"
            "print('out sandbox:/mnt/data/a.txt')\nprint('err sandbox:/mnt/data/b.txt', file=sys.stderr)\n"
            "'res sandbox:/mnt/data/c.txt'")
    result = execute_notebook(code, config=config)
    assert result.ok, result.error
    urls = {f.name: f.url for f in result.files}
    assert all(urls.values()), urls
    assert f"out {urls['a.txt']}" in result.stdout
    assert f"err {urls['b.txt']}" in result.stderr
    assert f"res {urls['c.txt']}" in result.text
    for view in (result.stdout, result.stderr, result.text):
        assert "sandbox:/mnt/data" not in view, view


def test_sessions_are_reaped_by_idleness_not_age(config: nbexec.SandboxConfig) -> None:
    """A session used continually for three TTLs stays open; left idle, it is closed."""
    session = Session(config, ttl=2.0)
    started = time.monotonic()
    while time.monotonic() - started < 6.0:
        assert session.run("1").ok  # a reaped session raises SessionClosedError here
        time.sleep(0.2)  # the gap between two uses, well below the TTL (not a wait for anything)
    assert session.status != "closed"
    wait_until(lambda: session.status == "closed", 15, "the idle session was not reaped")


def test_a_busy_session_is_not_reaped_while_it_runs(config: nbexec.SandboxConfig) -> None:
    """A run three TTLs long: the session is busy, not idle, all along, so it is still there for the next call
    (a reaper that judged it idle mid-run closes it as soon as the run lets go); idle past its TTL, it is reaped."""
    session = Session(config, ttl=3.0)
    result = session.run("import time; time.sleep(9); print('finished')")
    assert result.ok and result.stdout == "finished\n", result.error
    time.sleep(0.5)  # a short pause, far below the TTL (not a wait for anything): the session is idle 0.5 s
    assert session.status != "closed"
    assert session.run("print('next')").stdout == "next\n"  # a closed session raises SessionClosedError here
    wait_until(lambda: session.status == "closed", 20, "the idle session was not reaped")


def test_working_folders_are_removed_after_a_one_shot(cold: nbexec.SandboxConfig) -> None:
    before = set(own_workdirs())
    assert execute_notebook("print(1)", config=cold).ok
    pool.wait_for_teardown()
    assert set(own_workdirs()) - before == set()


def test_a_used_pool_sandbox_leaves_no_working_folder(config: nbexec.SandboxConfig) -> None:
    pool.warm_up(config)
    waiting = wait_until(lambda: pool_workdirs() if pool.ready_count(config) == config.pool_size else set(), 60,
                         "the pool did not fill")
    assert execute_notebook("print(1)", config=config).ok
    pool.wait_for_teardown()
    assert len(waiting - set(own_workdirs())) == 1, "the used sandbox's working folder is still there"


def test_a_dead_pooled_sandbox_is_never_handed_out(cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=30)
    pool.warm_up(config)
    wait_until(lambda: pool.ready_count(config) == 1, 60, "the pool did not fill")
    client = daemon.connect()
    (waiting,) = [s for s in waiting_sandboxes() if s.config == config]
    victim = client.containers.get(waiting.container.name)
    victim.kill()
    wait_until(lambda: client.containers.get(victim.id).status != "running", 30, "the killed sandbox still runs")
    result = execute_notebook(CONTAINER_ID, config=config)
    assert result.ok, result.error  # a dead sandbox would give kernel_died (or hang)
    assert container_id(result.stdout) != victim.id
    pool.shutdown()

