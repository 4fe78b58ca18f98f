"""The default policy, observed from inside the sandbox (and the host's environment kept out)."""

from __future__ import annotations

import json
import os

import pytest

import nbexec
from nbexec import execute_notebook

PROBE = r"""
import errno, json, os, socket, subprocess
facts = {"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(), "env": dict(os.environ)}
try:  # /var/tmp is world-writable in the image: only a read-only root filesystem refuses this (EROFS)
    open("/var/tmp/owned", "w")
    facts["rootfs_writable"] = True
except OSError as exc:
    facts["rootfs_writable"] = errno.errorcode.get(exc.errno, str(exc.errno))
facts["root_mount"] = [l.split()[3] for l in open("/proc/self/mounts") if l.split()[1] == "/"][0].split(",")
status = open("/proc/self/status").read()
facts["cap_eff"] = [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0]
facts["no_new_privs"] = [l.split()[1] for l in status.splitlines() if l.startswith("NoNewPrivs")][0]
facts["interfaces"] = sorted(name for _, name in socket.if_nameindex())
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    facts["network"] = True
except OSError:
    facts["network"] = False
try:
    socket.getaddrinfo("pypi.org", 443)
    facts["dns"] = True
except OSError:
    facts["dns"] = False
def read(path):
    try:
        return open(path).read().strip()
    except OSError:
        return None
facts["memory"] = read("/sys/fs/cgroup/memory/memory.limit_in_bytes") or read("/sys/fs/cgroup/memory.max")
facts["memsw_v1"] = read("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")
facts["swap_v2"] = read("/sys/fs/cgroup/memory.swap.max")
facts["pids"] = read("/sys/fs/cgroup/pids/pids.max") or read("/sys/fs/cgroup/pids.max")
facts["cpu"] = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or read("/sys/fs/cgroup/cpu.max")
st = os.statvfs("/tmp")
facts["tmp_bytes"] = st.f_blocks * st.f_frsize
written = 0  # what /tmp takes before the kernel refuses (the effect of its size), 1 MiB past the cap at most
try:
    with open("/tmp/fill", "wb", buffering=0) as f:
        while written <= 257 * 2**20:
            written += f.write(b"x" * 2**20)
    facts["tmp_stop"] = "none"
except OSError as exc:
    facts["tmp_stop"] = errno.errorcode.get(exc.errno, str(exc.errno))
os.remove("/tmp/fill")
facts["tmp_written"] = written
facts["docker_sock"] = os.path.exists("/var/run/docker.sock")
print(json.dumps(facts))
"""


@pytest.fixture
def facts(config: nbexec.SandboxConfig, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("NBEXEC_TEST_SECRET", "hunter2")
    result = execute_notebook(PROBE, config=config)
    assert result.ok, result.error
    return json.loads(result.stdout)


def test_runs_as_non_root_without_capabilities(facts: dict) -> None:
    assert facts["uid"] != 0 and facts["gid"] != 0
    assert int(facts["cap_eff"], 16) == 0
    assert facts["no_new_privs"] == "1"


def test_root_filesystem_is_read_only_and_tmp_is_capped(facts: dict) -> None:
    assert facts["rootfs_writable"] == "EROFS" and "ro" in facts["root_mount"], facts["root_mount"]
    assert facts["cwd"] == "/mnt/data"
    assert facts["tmp_bytes"] == 256 * 1024**2
    assert facts["tmp_stop"] == "ENOSPC" and facts["tmp_written"] <= 256 * 1024**2, facts  # refused by the kernel


def test_no_network(facts: dict) -> None:
    assert facts["interfaces"] == ["lo"]
    assert facts["network"] is False and facts["dns"] is False


def test_limits_are_in_effect(facts: dict) -> None:
    assert int(facts["memory"]) == 1024**3
    # Swap is off. cgroup v1 limits memory + swap (equal to memory: no swap); v2 limits swap itself (0).
    assert (facts["memsw_v1"], facts["swap_v2"]) in ((str(1024**3), None), (None, "0")), facts
    assert int(facts["pids"]) == 256
    assert facts["cpu"] in ("100000", "100000 100000")


def test_host_environment_does_not_leak(facts: dict) -> None:
    assert "NBEXEC_TEST_SECRET" not in facts["env"]
    assert not any("hunter2" in v for v in facts["env"].values())
    assert facts["docker_sock"] is False


def test_env_is_passed_only_when_asked(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook("import os; print(os.environ.get('GREETING'))", config=config.replace(
        env={"GREETING": "hi"}))
    assert result.stdout == "hi\n"


def test_network_can_be_enabled_explicitly(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook("import socket; print(sorted(n for _, n in socket.if_nameindex()))",
                              config=config, network=True)
    assert result.ok and "eth0" in result.stdout


@pytest.mark.parametrize("user", ["0", "00", "0:0", "0:1000", "000:5", "1000:0", "1000:00", "root", "-1", " 0", "+0",
                                  "1000:", ":1000", "", "1e3", "1000:1000:0"])
def test_root_is_refused_in_every_spelling(user: str) -> None:
    """Neither uid 0 nor gid 0 (the root group reads what root's group may) in any spelling Docker accepts."""
    with pytest.raises(nbexec.ConfigError, match="root is not allowed"):
        nbexec.SandboxConfig(user=user)
    assert nbexec.SandboxConfig(user="1000:1000").user == "1000:1000"


def test_config_validation_and_env_reading() -> None:
    with pytest.raises(nbexec.ConfigError, match="root is not allowed"):
        nbexec.SandboxConfig(user="0")
    with pytest.raises(nbexec.ConfigError, match="not a size"):
        nbexec.SandboxConfig(memory="lots")
    with pytest.raises(nbexec.ConfigError, match="NBEXEC_TIMEOUT"):
        nbexec.from_env({"NBEXEC_TIMEOUT": "soon"})
    config = nbexec.from_env({"NBEXEC_MEMORY": "2g", "NBEXEC_NETWORK": "yes", "NBEXEC_WARM_IMPORTS": "numpy",
                              "NBEXEC_ENV_TOKEN": "s3cret"}, cpus=2)
    assert (config.memory, config.network, config.warm_imports, config.cpus) == ("2g", True, ("numpy",), 2)
    assert config.env == {"TOKEN": "s3cret"}
    assert "s3cret" not in repr(config) and "TOKEN" in repr(config)
    assert os.environ.get("NBEXEC_ENV_TOKEN") is None
