"""Load and faults: many executions at once, containers killed from outside, the Docker engine restarted."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import nbexec
from nbexec.sandbox.docker import daemon, pool

from ..conftest import IMAGE, own_containers, own_workdirs, wait_until

LOAD = int(os.environ.get("NBEXEC_LOAD_COUNT", "40"))


def _load(count: int) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=4, warm_imports=(), timeout=60)

    def one(n: int) -> str:
        return nbexec.execute_notebook(f"print({n} * 3)", config=config).stdout

    started = time.monotonic()
    with ThreadPoolExecutor(8) as callers:
        outputs = list(callers.map(one, range(count)))
    elapsed = time.monotonic() - started
    assert outputs == [f"{n * 3}\n" for n in range(count)]  # nothing lost, nothing mixed up
    pool.shutdown()
    pool.wait_for_teardown()
    assert own_containers(include_pool=True) == []
    assert own_workdirs() == []  # kernels run inside the containers: none left means no kernel left
    print(f"\n{count} executions from 8 callers in {elapsed:.1f} s ({count / elapsed:.2f}/s)")


def test_load_from_eight_callers(cleanup_ledger: None) -> None:
    """A short version by default (NBEXEC_LOAD_COUNT, default 40: five per caller); the soak runs with `-m load`."""
    _load(LOAD)


@pytest.mark.load
def test_load_full_thousand(cleanup_ledger: None) -> None:
    _load(1000)


def test_container_killed_from_outside(cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=30)
    client = daemon.connect()
    started = threading.Event()

    def kill_once_started() -> None:  # every container of this process: the running one and the waiting one
        started.wait(60)
        for name in own_containers(include_pool=True):
            client.containers.get(name).kill()

    with ThreadPoolExecutor(1) as killer:
        killer.submit(kill_once_started)
        result = nbexec.execute_notebook("print('started', flush=True)\nimport time\ntime.sleep(20)", config=config,
                                         on_output=lambda *_: started.set())
    assert result.error is not None and result.error.kind == "kernel_died" and result.stdout == "started\n"
    # The pooled sandbox that was waiting was killed too: the next call must not be handed a dead one.
    again = nbexec.execute_notebook("print('fresh')", config=config)
    assert again.ok and again.stdout == "fresh\n"


def _dockerd_pid() -> int | None:
    """The engine's pid from its pid file (dockerd's default --pidfile), while that process is dockerd."""
    try:
        pid = int(Path("/var/run/docker.pid").read_text())
        return pid if Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd" else None
    except (OSError, ValueError):
        return None


@pytest.mark.alone  # the restart stops every other test's sandboxes: scripts/test.sh runs it after the rest
@pytest.mark.skipif(os.environ.get("NBEXEC_ALLOW_DOCKER_RESTART") != "1",
                    reason="restarts the machine's Docker engine: set NBEXEC_ALLOW_DOCKER_RESTART=1 (.ci/run does)")
def test_docker_engine_restart_mid_run(cleanup_ledger: None, tmp_path: Path) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=60)
    assert nbexec.execute_notebook("print(1)", config=config).ok
    pid = _dockerd_pid()
    assert pid is not None, "dockerd is not running as a process here"
    outcome: list[object] = []
    running = threading.Event()

    def run_during_restart() -> None:
        try:
            outcome.append(nbexec.execute_notebook("print('running', flush=True)\nimport time\ntime.sleep(30)",
                                                   config=config, on_output=lambda *_: running.set()))
        except nbexec.NbexecError as exc:
            outcome.append(exc)

    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(run_during_restart)
        assert running.wait(60), "the execution never started"
        os.kill(pid, 15)
        wait_until(lambda: _dockerd_pid() is None, 60, "dockerd did not stop")
        down = time.monotonic()
        with pytest.raises(nbexec.DockerError, match="Docker"):
            nbexec.execute_notebook("print(2)", config=config.replace(pool_size=0))
        assert time.monotonic() - down < 30, "an execution while the engine is down must fail fast"
        # The engine outlives this test run: it must not inherit the run's private TMPDIR (deleted at the end,
        # after which gVisor's runsc, among others, cannot start a container) nor its working directory.
        engine_env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "PWD", "OLDPWD")}
        subprocess.run(["sh", "-c", "nohup setsid dockerd > /var/log/nbexec-dockerd.log 2>&1 &"], check=True,
                       env=engine_env, cwd="/")
        wait_until(lambda: subprocess.run(["docker", "info"], capture_output=True).returncode == 0, 90,
                   "dockerd did not come back", interval=0.5)
        future.result(timeout=120)
    first = outcome[0]
    assert isinstance(first, nbexec.NbexecError) or (
        isinstance(first, nbexec.ExecutionResult) and first.error is not None), first
    recovered = nbexec.execute_notebook("print('back')", config=config)
    assert recovered.ok and recovered.stdout == "back\n"
    pool.shutdown()
    nbexec.sandbox.docker.pool.wait_for_teardown()
    for name in own_containers(include_pool=True):  # sandboxes the dead engine could not remove
        daemon.connect().containers.get(name).remove(force=True)

