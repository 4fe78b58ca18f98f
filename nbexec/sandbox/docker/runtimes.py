"""The OCI runtimes nbexec supports: which ones the engine knows, whether each really runs a sandbox here, and how
to register gVisor.

A runtime is what Docker uses to start a container: ``runc`` (Docker's default), ``runsc`` (gVisor: the code talks
to a user-space kernel instead of the host's) and ``crun``. Docker only lists the runtimes registered in its
daemon.json, and a listed runtime may still refuse this host (crun 1.8 and a hybrid cgroup layout), so `check`
starts a tiny container shaped like a sandbox rather than trusting the list.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError
from nbexec.files.folders import work_root

from . import daemon, users

DEFAULT = "runc"
SUPPORTED = {
    "runc": "Docker's default",
    "runsc": "gVisor: a user-space kernel between the code and the host's",
    "crun": "a lighter runc written in C",
}
SETUP_SCRIPT = "scripts/setup-gvisor.sh"
# The flags gVisor needs here (scripts/setup-gvisor.sh says why): no network stack of its own, and sockets the
# sandbox binds in a bind mount (the kernel's ipc:// sockets) are host sockets, while connecting to host sockets
# stays denied.
RUNSC_ARGS = ("--network=none", "--host-uds=create")
PROBE_LABEL = "runtime-check"  # the nbexec.role of a check's container
PROBE_MARK = "nbexec-runtime-ok"
_PROBE_MOUNT = "/run/nbexec"
_PROBE_CODE = (f"import socket; s = socket.socket(socket.AF_UNIX); s.bind('{_PROBE_MOUNT}/probe'); "
               f"print('{PROBE_MARK}')")
_HYBRID_HINT = (" (this runtime needs cgroups v1 only or v2 only, and this host mounts both; use runc or runsc, or "
                "boot the host with the unified cgroup v2 hierarchy)")
_lock = threading.Lock()
_known: set[str] = set()  # runtimes this process has seen the engine list (an engine never forgets one on its own)


@dataclass(frozen=True)
class RuntimeCheck:
    """What a test container said about one runtime on this engine."""

    name: str
    registered: bool  # the engine lists it
    works: bool  # a test container ran with it, and the host saw the socket it bound
    reason: str  # why it does not work, quoting the engine where it refused ("" when it works)
    seconds: float  # how long the test container took, start to removal


def registration(name: str) -> str:
    """How to register runtime ``name`` with Docker (gVisor and crun from Debian packages), keeping the engine up."""
    if name == "runsc":
        entry = f'"runsc": {{"path": "/usr/bin/runsc", "runtimeArgs": ["{RUNSC_ARGS[0]}", "{RUNSC_ARGS[1]}"]}}'
        install = "apt-get install runsc"
        script = f"Run `sudo {SETUP_SCRIPT}` from the nbexec repository, or by hand: "
    elif name == "crun":
        entry = '"crun": {"path": "/usr/bin/crun"}'
        install = "apt-get install crun"
        script = f"Run `sudo {SETUP_SCRIPT} --crun` from the nbexec repository, or by hand: "
    else:
        entry = f'"{name}": {{"path": "/path/to/{name}"}}'
        install = f"install {name}"
        script = ""
    return (f"{script}`{install}`, add {entry} under \"runtimes\" in /etc/docker/daemon.json (keep its other "
            "keys), then reload the engine without stopping its containers: `sudo kill -HUP $(pidof dockerd)`. "
            "Or unset NBEXEC_RUNTIME (--runtime) to use Docker's default.")


def engine_runtimes(client: docker.DockerClient | None = None) -> list[str]:
    """The runtimes the engine lists (`docker info` → Runtimes), sorted."""
    client = client or daemon.connect()
    with daemon.translated("list the engine's runtimes"):
        found = client.info().get("Runtimes") or {}
    names = sorted(str(name) for name in found)
    with _lock:
        _known.update(names)
    return names


def require(config: SandboxConfig) -> None:
    """Raise ConfigError with the registration when the engine does not know ``config.runtime``.

    Asks the engine once per runtime and process, so a warm pool pays nothing after its first sandbox."""
    name = config.runtime
    if name is None or name in _known:
        return
    known = engine_runtimes()
    if name not in known:
        raise ConfigError(f"Docker does not know the runtime {name!r} (it has: {', '.join(known)}). "
                          + registration(name))


def check(name: str, *, image: str, client: docker.DockerClient | None = None, timeout: float = 60.0
          ) -> RuntimeCheck:
    """Start a tiny container with runtime ``name``, hardened like a sandbox, and say whether it worked and why not.

    The container binds a Unix socket in a bind-mounted host folder, as the kernel does with its ipc:// sockets,
    and the host checks that it sees a socket there. It is labelled like nbexec's sandboxes and always removed."""
    client = client or daemon.connect()
    started = time.monotonic()
    if name not in engine_runtimes(client):
        reason = f"Docker does not know the runtime {name!r}. {registration(name)}"
        return RuntimeCheck(name, False, False, reason, 0.0)
    folder = Path(tempfile.mkdtemp(prefix=f"nbexec-{os.getpid()}-{PROBE_LABEL}-", dir=work_root()))
    try:
        os.chmod(folder, 0o777)  # the probe's uid is not ours when nbexec runs as root
        reason = _probe(client, name, image, folder, timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return RuntimeCheck(name, True, not reason, reason, round(time.monotonic() - started, 3))


def _probe(client: docker.DockerClient, name: str, image: str, folder: Path, timeout: float) -> str:
    """Run the probe container; return "" when it worked, else the reason."""
    uid, gid = users.uid_gid(SandboxConfig(image=image))
    container: Any = None
    try:
        container = client.containers.create(
            image, ["python3", "-c", _PROBE_CODE], runtime=name, detach=True, network_mode="none",
            user=f"{uid}:{gid}", read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
            mem_limit=256 * 1024**2, memswap_limit=256 * 1024**2, pids_limit=64,
            labels={**daemon.owner_labels(), daemon.LABEL_ROLE: PROBE_LABEL},
            mounts=[docker.types.Mount(_PROBE_MOUNT, str(folder), type="bind")])
        container.start()
        status = container.wait(timeout=timeout)
        logs = container.logs(stdout=True, stderr=True, tail=20).decode(errors="replace").strip()
    except docker.errors.ImageNotFound:
        return f"the image {image} is missing: build it with `nbexec image build`"
    except docker.errors.APIError as exc:
        said = str(exc.explanation or exc)
        hint = _HYBRID_HINT if "hybrid mode not supported" in said else ""
        return f"Docker refused to run a container with it: {said}{hint}"
    except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
        return f"the test container did not finish in {timeout:.0f} s ({exc.__class__.__name__})"
    finally:
        if container is not None:
            with contextlib.suppress(docker.errors.DockerException, requests.exceptions.RequestException):
                container.remove(force=True)
    if status.get("StatusCode") != 0 or PROBE_MARK not in logs:
        return f"the test container exited with code {status.get('StatusCode')}: {logs[-500:]}"
    probe = folder / "probe"
    if not (probe.exists() and stat.S_ISSOCK(os.lstat(probe).st_mode)):
        hint = f" (gVisor needs {RUNSC_ARGS[1]}: {registration('runsc')})" if name == "runsc" else ""
        return ("a socket bound in a bind-mounted folder is not visible to the host, so nbexec cannot reach the "
                f"kernel's ipc:// sockets{hint}")
    return ""


def check_all(image: str, configured: str | None = None) -> list[RuntimeCheck]:
    """Check every supported runtime, and ``configured`` when it is another one."""
    names = list(SUPPORTED) + ([configured] if configured and configured not in SUPPORTED else [])
    client = daemon.connect()
    return [check(name, image=image, client=client) for name in names]
