"""The Docker options of one sandbox's container, in one place: who the code runs as, no network interface but
loopback (unless asked), no capabilities nor new privileges, a read-only root, memory without swap, CPU, process
and file limits, in-memory /tmp and home, its mounts (/mnt/data, /mnt/wheels read-only, the kernel's sockets,
/mnt/input read-only), and Docker's own log of it capped."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.types

from nbexec import languages
from nbexec.config import SandboxConfig
from nbexec.sandbox.source import DATA_MOUNT, HOME_ALIAS, INPUT_MOUNT, PACKAGES_MOUNT, WHEELS_MOUNT

from . import daemon, egress

RUNTIME_MOUNT = "/run/nbexec"
# The runtime folder is a tmpfs this small (sockets, connection files): the sandbox writes there while a kernel or a
# context starts, and nothing it writes may reach the host's disk. Room for the kernel and MAX_CONTEXTS contexts.
RUNTIME_BYTES, RUNTIME_INODES = 256 * 1024, 128
HOME = "/home/sandbox"
LOG_OPTIONS = {"max-size": "1m", "max-file": "1"}  # Docker's log of a sandbox: about 1 MiB on the host at most
KERNEL_PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}


def connection_info(config: SandboxConfig) -> dict[str, Any]:
    """A new kernel's connection file: unix sockets <RUNTIME_MOUNT>/kernel-N, a fresh key, the language's kernel."""
    return {"transport": "ipc", "ip": f"{RUNTIME_MOUNT}/kernel", "key": secrets.token_hex(32),
            "signature_scheme": "hmac-sha256", "kernel_name": languages.get(config.language).spec["name"],
            **KERNEL_PORTS}


@dataclass(frozen=True)
class Place:
    """Which sandbox the container is: its id, who the code runs as, its working folder on the host (data/, run/,
    wheels/ below it), and the empty stand-ins laid over nbexec's settings files in /mnt/input."""

    sandbox_id: str
    uid: int
    gid: int
    workdir: Path
    input_masks: tuple[docker.types.Mount, ...] = ()
    claim: str = ""  # the state folder that keeps the sandbox past its owner (see nbexec.files.statefolder)


def container_options(config: SandboxConfig, role: str, place: Place) -> dict[str, Any]:
    """The keyword arguments of `containers.create` for the sandbox at ``place``, made for ``role``."""
    uid, gid, memory = place.uid, place.gid, config.memory_bytes
    options: dict[str, Any] = {
        "image": config.image_tag,  # a named image: its newest build
        "command": [languages.get(config.language).launcher, f"{RUNTIME_MOUNT}/kernel.json"],
        "name": f"nbexec-{place.sandbox_id}",
        "hostname": "sandbox",
        "detach": True,
        "user": f"{uid}:{gid}",
        # The uid may have no passwd entry: USER/LOGNAME keep getpass.getuser() and friends working.
        "environment": {"USER": "sandbox", "LOGNAME": "sandbox", **config.env, "HOME": HOME},
        "labels": {**daemon.owner_labels(), daemon.LABEL_ROLE: role, **daemon.claim_labels(place.claim)},
        "network_mode": "bridge" if config.network is True else "none",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={config.tmp_size_bytes},mode=1777",
                  HOME: f"rw,nosuid,nodev,size={64 * 1024**2},uid={uid},gid={gid},mode=700",
                  PACKAGES_MOUNT: f"rw,nosuid,nodev,exec,size={config.tmp_size_bytes},uid={uid},gid={gid},"
                                  "mode=700"},
        "mounts": [docker.types.Mount(DATA_MOUNT, str(place.workdir / "data"), type="bind"),
                   # The same folder again where E2B's clients look for it (nbexec.service.e2b): no new bytes.
                   docker.types.Mount(HOME_ALIAS, str(place.workdir / "data"), type="bind"),
                   docker.types.Mount(WHEELS_MOUNT, str(place.workdir / "wheels"), type="bind", read_only=True),
                   docker.types.Mount(RUNTIME_MOUNT, str(place.workdir / "run"), type="bind")]
        + ([docker.types.Mount(INPUT_MOUNT, config.input_dir, type="bind", read_only=True)]
           if config.input_dir else []),
        "mem_limit": memory,
        "memswap_limit": memory,
        "nano_cpus": int(config.cpus * 1e9),
        "pids_limit": config.pids,
        "shm_size": 64 * 1024**2,
        # The kernel's own stdout/stderr (fd 1 and 2) go to Docker's log on the host's disk: capped.
        "log_config": docker.types.LogConfig(type="json-file", config=LOG_OPTIONS),
        "ulimits": [docker.types.Ulimit(name="core", soft=0, hard=0),
                    docker.types.Ulimit(name="nofile", soft=4096, hard=4096)],
        "working_dir": DATA_MOUNT,
    }
    if config.runtime:
        options["runtime"] = config.runtime
    options["mounts"] += list(place.input_masks)  # over nbexec's settings files in /mnt/input (see inputmount)
    if config.network == "allowlist":  # still no interface: HTTP(S) through the host's proxy
        options["mounts"].append(egress.mount(place.workdir))
        options["environment"].update(egress.ENVIRONMENT)
    return options
