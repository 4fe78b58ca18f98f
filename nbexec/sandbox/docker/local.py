"""The local source: sandboxes on this host's Docker engine, one-shots from the warm pool (see `pool`), sessions
started for themselves, each a `container.Sandbox` (the local SandboxHandle)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.errors import NbexecError
from nbexec.files.folders import work_root
from nbexec.files.workdir import WORKDIR_PREFIX, remove_tree
from nbexec.sandbox.source import Capacity, Readiness, SandboxHandle, SandboxSource

from . import adopt, checkpoint, daemon, pool
from .container import Sandbox

log = logging.getLogger(__name__)


class LocalSource(SandboxSource):
    """Sandboxes on this host's Docker engine (see the module docstring)."""

    mounts_host_folders = True

    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        if not claim and (purpose == "oneshot" or config.pool_size):
            return pool.acquire(config)
        return pool.start_sandbox(config, role="session", warm_up=True, claim=claim)

    def adopt(self, config: SandboxConfig, record: dict[str, Any]) -> SandboxHandle:
        return adopt.adopt(config, record)

    def abandon(self, config: SandboxConfig, record: dict[str, Any]) -> None:
        adopt.abandon(config, record)

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        if wait:
            _own(sandbox).destroy()
        else:  # destroyed in the background, and its pool refilled
            pool.release(_own(sandbox))

    def sweep(self) -> None:
        pool.sweep_orphans()

    def capacity(self, config: SandboxConfig) -> Capacity:
        return Capacity(ready=pool.ready_count(config), size=config.pool_size)

    def readiness(self, config: SandboxConfig) -> Readiness:
        """The engine answers, the image is there, and the pool was full once since start (later dips are load,
        not illness); a pool that can be filled is asked to."""
        checks: dict[str, Any] = {"docker": "ok", "image": "ok"}
        try:
            daemon.require_image(daemon.connect(), config.image_tag)
        except NbexecError as exc:
            checks["error"] = str(exc)
        checks["pool_ready"] = pool.ready_count(config)
        checks["pool_filled"] = pool.has_filled(config)
        if "error" not in checks:
            pool.warm_up(config)
        return Readiness("error" not in checks and bool(checks["pool_filled"]), checks)

    def warm_up(self, config: SandboxConfig) -> None:
        pool.warm_up(config)

    def close(self) -> None:
        pool.shutdown()

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        """Checkpoint the sandbox into ``folder`` where its runtime can (gVisor; probed), else None (see
        `checkpoint`)."""
        return checkpoint.hibernate(_own(handle), folder)

    def wake(self, config: SandboxConfig, record: dict[str, Any], folder: Path, *,
             check: Callable[[], None] = lambda: None, deadline: float | None = None) -> SandboxHandle:
        """``check`` carries the caller's deadline into every wait of the restore here."""
        return checkpoint.restore(config, record, folder, check)

    def discard(self, record: dict[str, Any], folder: Path) -> None:
        """Remove the working folder (its /mnt/data, unmounted first) a checkpoint record kept: only a folder of
        nbexec's own working root, by the name the record gives."""
        workdir = record.get("workdir")
        path = Path(workdir) if isinstance(workdir, str) else None
        if path is None or path.parent != work_root() or not path.name.startswith(WORKDIR_PREFIX):
            log.warning("not removing %r: the hibernate record does not name a working folder of nbexec's", workdir)
            return
        remove_tree(path)


def _own(sandbox: SandboxHandle) -> Sandbox:
    if not isinstance(sandbox, Sandbox):
        raise TypeError(f"{sandbox!r} is not a sandbox of this host")
    return sandbox
