"""Finding a sandbox again after the process that made it is gone (durable sessions, see `nbexec.engine.durable`).

A record (`container.Sandbox.describe`, kept private in a state folder) names the container, the working folder,
the sandbox user and the kernel's connection. Nothing in it is trusted beyond what it names. The working folder
must be nbexec's: a direct child of the work root, ours, private. The container must be nbexec's, named for the
sandbox, mounting that folder's run/, and still running. Its memory, CPU and process limits are then set to
today's config, and a new kernel client connects with the recorded key. A running cell of the dead owner is
interrupted, since nobody waits for it. `abandon` removes such a sandbox without a word to its kernel, after an
adoption that failed or ran past its deadline.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import Any

import docker.errors

from nbexec.config import SandboxConfig
from nbexec.errors import DockerError, SandboxError
from nbexec.files import space
from nbexec.files.folders import work_root
from nbexec.files.workdir import WORKDIR_PREFIX

from . import daemon, datafs, egress
from .container import Sandbox


def _field(record: dict[str, Any], name: str, kind: type) -> Any:
    value = record.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SandboxError(f"the sandbox record has no valid {name!r}")
    return value


def _workdir(raw: str) -> Path:
    path = Path(raw)
    root = work_root()
    if path.parent != root or not path.name.startswith(WORKDIR_PREFIX):
        raise SandboxError(f"the sandbox record names {raw!r}, not a working folder of nbexec")
    try:
        info = os.lstat(path)
    except OSError:
        raise SandboxError(f"the sandbox's working folder {raw} is gone") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SandboxError(f"{raw} is not a private working folder of nbexec")
    return path


def adopt(config: SandboxConfig, record: dict[str, Any]) -> Sandbox:
    """The running sandbox ``record`` describes, its kernel connected again and held to ``config``'s limits.

    SandboxError when it is gone or cannot be adopted."""
    sandbox, asleep = _found(config, record)
    try:
        _limit(sandbox, config)
        sandbox.disk = space.reserve(space.sandbox_needs(config, sandbox.workdir), config.disk_margin_bytes)
        if not asleep:  # a slept sandbox gets its kernel and proxy when it wakes (`sleep.Sleeper.awake`)
            _reconnect(sandbox)
            if config.network == "allowlist":  # its forwarder runs on; the proxy it reaches died with the owner
                sandbox.egress = egress.open_proxy(sandbox.workdir, config)
    except BaseException:
        if sandbox.egress is not None:
            sandbox.egress.close()
            sandbox.egress = None
        if sandbox.client is not None:
            sandbox.client.close()
            sandbox.client = None
        if sandbox.disk is not None:
            sandbox.disk.release()
        raise
    return sandbox


def abandon(config: SandboxConfig, record: dict[str, Any]) -> None:
    """Remove the sandbox ``record`` describes (container, data filesystem, working folder), leaving its kernel be.

    Only what `adopt` would have accepted as that sandbox is removed."""
    try:
        sandbox, _ = _found(config, record)
    except SandboxError:
        found = _remains(config, record)
        if found is None:
            return
        sandbox = found
    sandbox.destroy()


def _remains(config: SandboxConfig, record: dict[str, Any]) -> Sandbox | None:
    """What is left of a sandbox `_found` refused: its checked working folder, and its container if still its own.

    None when the record names no folder of nbexec's."""
    try:
        sandbox = Sandbox(config, _field(record, "id", str), _workdir(_field(record, "workdir", str)))
    except SandboxError:
        return None
    with contextlib.suppress(SandboxError, DockerError), daemon.translated("find a kept sandbox"):
        container = daemon.connect().containers.get(_field(record, "container", str))
        _check_container(container, sandbox, asleep=True)
        sandbox.container = container
    return sandbox


def _found(config: SandboxConfig, record: dict[str, Any]) -> tuple[Sandbox, bool]:
    """The sandbox ``record`` names, its container checked and attached; whether it sleeps."""
    if record.get("kind") != "local":
        raise SandboxError("the sandbox record is not of this host's source")
    workdir = _workdir(_field(record, "workdir", str))
    sandbox = Sandbox(config, _field(record, "id", str), workdir)
    sandbox.uid, sandbox.gid = _field(record, "uid", int), _field(record, "gid", int)
    sandbox.connection = dict(_field(record, "connection", dict))
    sandbox.language_info = dict(_field(record, "language_info", dict))
    try:
        with daemon.translated("find a kept sandbox"):
            container = daemon.connect().containers.get(_field(record, "container", str))
    except DockerError as exc:
        if isinstance(exc.__cause__, docker.errors.NotFound):
            raise SandboxError(f"the sandbox {sandbox.id}'s container is gone") from None
        raise
    asleep = record.get("asleep") is True and not container.attrs.get("State", {}).get("Running")
    _check_container(container, sandbox, asleep=asleep)
    sandbox.container = container
    sandbox.data_fs = bool(record.get("data_fs")) and os.path.ismount(sandbox.data_dir)
    pid = container.attrs.get("State", {}).get("Pid")
    sandbox.init_process = daemon.process_identity(pid)
    if sandbox.init_process is not None:
        sandbox.freezer = datafs.Freezer.of_process(sandbox.init_process[0])
    return sandbox, asleep


def _limit(sandbox: Sandbox, config: SandboxConfig) -> None:
    """Bring the container's memory, CPU and process limits to today's ``config``, not the one it was made with.

    SandboxError when the engine refuses, for example when the memory in use is above the new limit."""

    assert sandbox.container is not None
    host = sandbox.container.attrs.get("HostConfig", {})
    wanted = {"Memory": config.memory_bytes, "MemorySwap": config.memory_bytes, "NanoCpus": int(config.cpus * 1e9),
              "PidsLimit": config.pids}
    if all(host.get(name) == value for name, value in wanted.items()):
        return
    api = daemon.connect().api  # docker-py's update_container has no NanoCpus or PidsLimit: the engine's route
    try:
        with daemon.translated("bring a kept sandbox to today's limits"):
            api._result(api._post_json(api._url("/containers/{0}/update", sandbox.container.id), data=wanted), True)
    except DockerError as exc:
        raise SandboxError(f"the kept sandbox {sandbox.id} cannot be brought to this node's limits "
                           f"(memory {config.memory}, cpus {config.cpus:g}, pids {config.pids}): {exc}") from None


def _check_container(container: Any, sandbox: Sandbox, *, asleep: bool) -> None:
    attrs = container.attrs
    labels = attrs.get("Config", {}).get("Labels") or {}
    mounts = {Path(m.get("Source", "")) for m in attrs.get("Mounts") or []}
    if labels.get(daemon.LABEL) != "1" or attrs.get("Name", "").lstrip("/") != f"nbexec-{sandbox.id}" \
            or sandbox.runtime_dir not in mounts:
        raise SandboxError(f"the container of the record is not the sandbox {sandbox.id}")
    if not attrs.get("State", {}).get("Running") and not asleep:
        raise SandboxError(f"the sandbox {sandbox.id}'s container stopped while its owner was away")


def _reconnect(sandbox: Sandbox) -> None:
    config = sandbox.config
    deadline = time.monotonic() + config.startup_timeout

    def check() -> None:
        if not sandbox.state().running:
            raise SandboxError(f"the sandbox {sandbox.id} stopped while it was being adopted")
        if time.monotonic() > deadline:
            raise SandboxError(f"the kept sandbox {sandbox.id}'s kernel did not answer within "
                               f"{config.startup_timeout:g} s")

    try:
        sandbox.client = sandbox.open_client()
    except OSError as exc:
        raise SandboxError(f"cannot reach the kept sandbox {sandbox.id}'s kernel: {exc}") from exc
    sandbox.interrupt()  # a cell its dead owner started: nobody waits for it
    sandbox.client.wait_ready(check)
    sandbox.client.wait_subscribed(check)
