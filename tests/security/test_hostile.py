"""Hostile programs, each judged from outside the sandbox: what the host sees, what the result says, what is left.

Every case runs through execute_notebook() with the default policy (short limits to keep the suite quick), under
the cleanup ledger, and checks a canary file on the host that the code must not be able to touch. Each case with
a defence also runs once with that defence removed, where the attack must succeed (its positive control; see
hostile_cases.py), so every check is shown to be able to fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.sandbox.docker import daemon, pool

from ..conftest import IMAGE, created, settle, wait_until
from .conftest import Listener
from .hostile_cases import CASES, Case, Observed


@dataclass(frozen=True)
class Run:
    """One case made concrete: its code with the placeholders filled, and what identifies it on the host."""

    case: Case
    code: str
    token: str
    mark: str


def prepare(case: Case, listener: Listener) -> Run:
    token = f"tok-{case.id}-{secrets.token_hex(4)}"
    mark = f"1000.{secrets.randbelow(10**6):06d}"  # a `sleep` duration no other process on the machine has
    code = case.code
    for key, value in {"@HOST@": listener.host, "@TCP@": str(listener.tcp.getsockname()[1]),
                       "@UDP@": str(listener.udp.getsockname()[1]), "@TOKEN@": token, "@MARK@": mark,
                       "@HOSTPID@": str(os.getpid())}.items():
        code = code.replace(key, value)
    return Run(case, code, token, mark)


def contained_config(case: Case, canary: Path) -> nbexec.SandboxConfig:
    base = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=4, interrupt_grace=2,
                                max_data="64m", env={"PLANTED_PATH": str(canary)})
    return base.replace(**{"timeout": 20 if case.wall_s > 30 else 4, **case.contained})


def _pids_cgroups(container: str) -> list[Path]:
    """Where the container's pids cgroup lives, for each cgroup version and driver Docker may use. A process
    cannot leave it, and Docker cannot remove it while it holds one."""
    root = Path("/sys/fs/cgroup")
    return [root / "pids" / "docker" / container, root / "pids" / "system.slice" / f"docker-{container}.scope",
            root / "docker" / container, root / "system.slice" / f"docker-{container}.scope"]


def survivors(containers: list[str], mark: str) -> list[str]:
    """Command lines of the processes carrying this run's unique mark in these containers' cgroups (no scan of
    the machine's processes: only what the test's own sandboxes hold)."""
    found = []
    for path in (p for container in containers for p in _pids_cgroups(container)):
        try:
            pids = (path / "cgroup.procs").read_text().split()
        except OSError:  # gone with its container, or another layout
            continue
        for pid in pids:
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if mark in line:
                found.append(line)
    return found


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_program_is_contained(case: Case, canary: Path, listener: Listener, cleanup_ledger: None) -> None:
    run = prepare(case, listener)
    before = (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest())
    started = time.monotonic()
    with created() as seen:
        result = nbexec.execute_notebook(run.code, config=contained_config(case, canary))
    elapsed = time.monotonic() - started
    case.check(result)
    assert elapsed < case.wall_s, f"took {elapsed:.1f} s"
    assert (canary.stat().st_mtime_ns, hashlib.sha256(canary.read_bytes()).hexdigest()) == before
    assert "s3cret-canary" not in json.dumps(result.to_dict())
    assert os.path.exists(result.notebook_path or "")
    assert listener.got(run.token) == b"", "the host listener received data from the sandbox"
    pool.wait_for_teardown()  # nothing the code started survives on the host once its sandbox is gone
    sandboxes = seen.ids()
    assert sandboxes, "the run's sandbox was not seen"
    settle(lambda: not survivors(sandboxes, run.mark), 5)
    assert survivors(sandboxes, run.mark) == []


CONTROLLED = [c for c in CASES if c.control is not None]


def run_bare(run: Run, options: dict[str, Any], canary: Path) -> str:
    """Run the code in a bare container of the image: root, Docker's default capabilities, seccomp and network,
    a writable root filesystem (labelled as this process's, so the cleanup ledger sees it)."""
    options = dict(options)
    if options.pop("mount_canary", False):
        options["volumes"] = {str(canary.parent): {"bind": str(canary.parent), "mode": "ro"}}
    client = daemon.connect()
    labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner(), daemon.LABEL_ROLE: "control"}
    container = client.containers.run(IMAGE, ["python", "-c", run.code], user="0:0", detach=True, labels=labels,
                                      environment={"PLANTED_PATH": str(canary)}, **options)
    try:
        container.wait(timeout=120)
        return str(container.logs(stdout=True, stderr=True).decode(errors="replace"))
    finally:
        container.remove(force=True)


def observe(run: Run, config: nbexec.SandboxConfig, listener: Listener) -> Observed:
    control = run.case.control
    assert control is not None
    if control.kept:  # the sandbox stays up (a session): the marked processes must be visible on the host
        with created() as seen, nbexec.Session(config) as session:
            result = session.run(run.code)
            sandboxes = seen.ids()
            settle(lambda: bool(survivors(sandboxes, run.mark)), 10)
            seen = tuple(survivors(sandboxes, run.mark))
        pool.wait_for_teardown()
        return Observed(result.stdout, result, survivors=seen, sandboxes=tuple(sandboxes))
    result = nbexec.execute_notebook(run.code, config=config)
    settle(lambda: bool(listener.got(run.token)), 3 if "@TOKEN@" in run.case.code else 0)
    return Observed(result.stdout, result, listener.got(run.token))


@pytest.mark.parametrize("case", CONTROLLED, ids=[c.id for c in CONTROLLED])
def test_attack_succeeds_with_its_defence_removed(case: Case, canary: Path, listener: Listener,
                                                  cleanup_ledger: None) -> None:
    """The positive control: the case's check can tell. Controls run with a 30 s time limit, so only the time
    cases are loosened by it."""
    run, control = prepare(case, listener), case.control
    assert control is not None
    if control.bare is not None:
        stdout = run_bare(run, dict(control.bare), canary)
        control.succeeded(Observed(stdout, None, listener.got(run.token)))
        return
    config = contained_config(case, canary).replace(**{"timeout": 30, **control.loosen})
    seen = observe(run, config, listener)
    control.succeeded(seen)
    assert seen.result is not None
    if not control.kept:  # the case's own check rejects what the loosened run produced
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            case.check(seen.result)
    if control.kept:  # and once the session is closed, the marked processes are gone
        wait_until(lambda: not survivors(list(seen.sandboxes), run.mark), 10,
                   "marked processes outlived the closed session")


def test_every_case_has_a_control_or_says_why_not() -> None:
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    for case in CASES:
        assert (case.control is None) != (case.no_control == ""), case.id
    assert len(CONTROLLED) >= 30
