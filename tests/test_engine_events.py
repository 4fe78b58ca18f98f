"""How a stopped sandbox ended, as the Docker engine tells it: an OOM kill is read from the engine's events,
since its OOMKilled flag keeps what the engine knew at the exit and misses a kill reported after it (gVisor)."""

from __future__ import annotations

import pytest

from nbexec.errors import DockerError
from nbexec.sandbox.docker import daemon

from .conftest import IMAGE


@pytest.mark.parametrize(("stamp", "epoch"), [
    ("2026-11-28T23:17:11.747471798Z", "1795907831.747471798"),
    ("2026-11-28T23:17:11Z", "1795907831.000000000"),
    ("2026-11-28T23:17:11.5Z", "1795907831.500000000"),
    ("2026-11-29T00:17:11.747471798+01:00", "1795907831.747471798"),  # the engine's clock in another zone
    ("2026-11-28T20:17:11.1-03:00", "1795907831.100000000"),
])
def test_the_engines_times_become_the_numbers_its_events_api_reads(stamp: str, epoch: str) -> None:
    assert daemon._epoch(stamp) == epoch


@pytest.mark.parametrize("stamp", ["", "yesterday", "2026-11-28 23:17:11Z", "2026-11-28T23:17:11"])
def test_a_time_the_engine_should_not_send_is_an_error(stamp: str) -> None:
    with pytest.raises(DockerError, match="cannot read"):
        daemon._epoch(stamp)


def test_an_oom_kill_is_told_from_a_sigkill_by_the_engines_events(docker_ready: None, cleanup_ledger: None) -> None:
    """Both containers end with exit code 137; only the one the kernel killed for memory is reported."""
    client = daemon.connect()
    labels = {daemon.LABEL: "1", daemon.LABEL_OWNER: daemon.owner(), daemon.LABEL_ROLE: "control"}
    options = {"detach": True, "labels": labels, "network_mode": "none", "mem_limit": "64m", "memswap_limit": "64m"}
    hungry = client.containers.run(IMAGE, ["python", "-c", "held = b'x' * (256 << 20)"], **options)
    killed = client.containers.run(IMAGE, ["sleep", "60"], **options)
    try:
        killed.kill()
        for container in (hungry, killed):
            container.wait(timeout=120)
            container.reload()
        assert [c.attrs["State"]["ExitCode"] for c in (hungry, killed)] == [137, 137]
        assert daemon.oom_reported(hungry) is True
        assert daemon.oom_reported(killed) is False
    finally:
        for container in (hungry, killed):
            container.remove(force=True)
