"""A local sandbox asleep: its container stopped, so no process runs and it holds no memory or CPU.

Its /mnt/data stays as it is: the data filesystem stays mounted on the host, so nothing is copied. The container
keeps every limit it was made with. `awake` starts a fresh kernel in the same container, over the same files.

The kernel's memory is not kept here. The engine brings it back by replaying the session's cells
(`nbexec.engine.wake`), or a source that can checkpoint memory keeps it first (`SandboxSource.hibernate`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from nbexec.errors import DockerError, SandboxError

from . import daemon, datafs, egress

STOP_TIMEOUT = 0  # seconds `docker stop` waits before it kills: nothing inside needs a clean stop


class Sleeper:
    """The sleep and wake-up of a `container.Sandbox` (see the module docstring)."""

    container: Any
    client: Any
    workdir: Path
    connection: dict[str, Any]
    init_process: tuple[int, str] | None
    freezer: datafs.Freezer | None
    egress: Any
    uid: int
    gid: int
    config: Any

    @property
    def runtime_dir(self) -> Path:
        raise NotImplementedError

    def connect_kernel(self) -> None:
        raise NotImplementedError

    def file_owner(self) -> tuple[int, int] | None:
        raise NotImplementedError

    def sleep(self) -> None:
        """Stop every process of the sandbox (its memory is freed), keeping its container and /mnt/data."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self.freezer is not None:
            self.freezer.thaw()
        if self.egress is not None:
            self.egress.close()
            self.egress = None
        with daemon.translated("stop a sandbox to let it sleep"):
            self.container.stop(timeout=STOP_TIMEOUT)
        self.init_process, self.freezer = None, None

    def awake(self) -> None:
        """Start a fresh kernel in the slept sandbox (a new key, new sockets), over the kept /mnt/data."""
        run = self.runtime_dir
        os.chmod(run, 0o700)
        for name in os.listdir(run):  # the old kernel's sockets and connection file
            os.unlink(run / name)
        info = {**self.connection, "key": secrets.token_hex(32)}
        self.connection = info
        conn = run / "kernel.json"
        fd = os.open(conn, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(info))
        owner = self.file_owner()
        if owner is not None:
            os.chown(conn, *owner)
            os.chmod(run, 0o777)
        os.chmod(conn, 0o400)
        if self.config.network == "allowlist":
            self.egress = egress.open_proxy(self.workdir, self.config)
        try:
            with daemon.translated("wake a sandbox"):
                self.container.start()
                self.container.reload()
        except DockerError as exc:
            raise SandboxError(f"the sleeping sandbox could not be started again: {exc}") from exc
        pid = self.container.attrs.get("State", {}).get("Pid")
        self.init_process = daemon.process_identity(pid)
        if self.init_process is not None:
            self.freezer = datafs.Freezer.of_process(self.init_process[0])
        self.connect_kernel()
        if self.egress is not None:
            egress.start_forwarder(self.client, self.config)
