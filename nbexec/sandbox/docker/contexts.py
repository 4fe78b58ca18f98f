"""More kernels in one running sandbox: E2B's code contexts (`nbexec.service.e2b.contexts`).

A context kernel is started by the sandbox's process supervisor, as the sandbox's user, inside the same container:
the same limits (memory, pids, CPU), the same /mnt/data, no new door. Its sockets live in a folder of their own in
the runtime folder, made by the host. The folder is writable by the sandbox only until the kernel has bound its
sockets; then the host locks it, checks that each name is a socket (never a link) and only then connects. Code that
raced the kernel to bind a name only talks to itself: every byte the host reads is judged as any kernel's is.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbexec import languages
from nbexec.config import SandboxConfig, running_as_root
from nbexec.errors import SandboxError
from nbexec.sandbox import kernel
from nbexec.sandbox.source import ContainerState

from .container import Sandbox
from .options import KERNEL_PORTS, RUNTIME_MOUNT
from .supervisor import Subscription, Supervisor, SupervisorError

TAG = "nbexec-context"  # the supervisor's tag of a context kernel: hidden from the door's process list
_POLL = 0.01
_GREETING = 2.0  # seconds one try at the kernel's handshake waits (a live kernel greets within milliseconds)


class ContextKernel:
    """One more kernel in ``sandbox``: the kernel half of a sandbox handle (run, interrupt, state, kill), for
    `nbexec.engine.cells.run_cell`. Its files, limits and life are the sandbox's."""

    def __init__(self, sandbox: Sandbox, supervisor: Supervisor, language: str, folder: Path) -> None:
        self.sandbox, self.supervisor, self.folder = sandbox, supervisor, folder
        self.language = languages.get(language)
        self.config: SandboxConfig = sandbox.config
        self.id, self.node = sandbox.id, sandbox.node
        self.pid = 0
        self.client: kernel.KernelClient | None = None
        self.language_info: dict[str, Any] = {}
        self._sub: Subscription | None = None

    @classmethod
    def start(cls, sandbox: Sandbox, supervisor: Supervisor, language: str, *, cwd: str, timeout: float,
              check: Callable[[], None] = lambda: None) -> ContextKernel:
        """Start a ``language`` kernel in ``sandbox`` with its working folder ``cwd``; ready within ``timeout``
        seconds, or SandboxError and nothing left."""
        name, deadline = f"c{secrets.token_hex(6)}", time.monotonic() + timeout  # the launch counts too
        context = cls(sandbox, supervisor, language, sandbox.runtime_dir / name)
        try:
            context._launch(name, cwd)
            context._connect(deadline, check)
        except BaseException:
            context.close()
            raise
        return context

    def _launch(self, name: str, cwd: str) -> None:
        owner = self.sandbox.file_owner()
        self.folder.mkdir(mode=0o700)
        (self.folder / "conn").mkdir(mode=0o700)  # stays the kernel's: it rewrites its connection file late
        info = {"transport": "ipc", "ip": f"{RUNTIME_MOUNT}/{name}/kernel", "key": secrets.token_hex(32),
                "signature_scheme": "hmac-sha256", "kernel_name": self.language.spec["name"], **KERNEL_PORTS}
        self.connection = info
        conn = self.folder / "conn" / "kernel.json"
        fd = os.open(conn, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as file:
            json.dump(info, file)
        if owner is not None:
            for path in (conn, conn.parent, self.folder):
                os.chown(path, *owner)
        self._sub = self.supervisor.spawn([self.language.launcher, f"{RUNTIME_MOUNT}/{name}/conn/kernel.json"],
                                          cwd=cwd, tag=TAG)
        self.pid = self._sub.pid
        self.supervisor.mute(self._sub)  # its own output (logs) stays in the sandbox

    def _connect(self, deadline: float, check: Callable[[], None]) -> None:
        names = [self.folder / f"kernel-{KERNEL_PORTS[port]}" for port in ("shell_port", "iopub_port")]
        while not all(path.exists() for path in names):
            self._check(deadline, check)
            time.sleep(_POLL)
        self._lock()
        time.sleep(0.05)  # the kernel binds its sockets a moment before it listens on the last
        frame_limit = self.config.max_output_bytes + self.config.max_display_bytes + kernel.MAX_HEADER
        while self.client is None:  # short tries, the checks between: a kernel stopped before it greets holds no
            try:                    # thread past a kill of its sandbox (the handshake's wait sees no check)
                self.client = kernel.KernelClient.connect(
                    self.folder / "kernel", self.connection, max_message=frame_limit,
                    timeout=max(0.1, min(_GREETING, deadline - time.monotonic())))
            except SandboxError:
                self._check(deadline, check)
        self.client.asks_last_error, self.client.settle = self.language.is_python, self.language.settle
        info = self.client.wait_ready(lambda: self._check(deadline, check))
        self.language_info = dict(info)
        self.client.wait_subscribed(lambda: self._check(deadline, check))
        with contextlib.suppress(OSError):  # read by now; the key need not stay on disk
            (self.folder / "conn" / "kernel.json").unlink()

    def _lock(self) -> None:
        """The sandbox may no longer change the folder's names; each is the socket the kernel bound, not a link."""
        if running_as_root():
            os.chown(self.folder, 0, 0)
            os.chmod(self.folder, 0o555)
        for port in KERNEL_PORTS.values():
            path = self.folder / f"kernel-{port}"
            with contextlib.suppress(FileNotFoundError):  # hb is never connected to
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise SandboxError("the context's kernel folder holds something other than its sockets")

    def _check(self, deadline: float, check: Callable[[], None]) -> None:
        check()
        if not self.alive():
            raise SandboxError(f"the {self.language.name} kernel of the context exited while starting")
        if time.monotonic() > deadline:
            raise SandboxError(f"the {self.language.name} kernel of the context did not start in time")

    # -- the kernel half of a sandbox handle ----------------------------------------------------------------------

    def alive(self) -> bool:
        return bool(self.pid) and self.supervisor.running(self.pid) and self.sandbox.state().running

    def run(self, code: str, *, deadline: float, on_output: Callable[[kernel.Message], None]) -> kernel.Execution:
        assert self.client is not None
        return self.client.run(code, deadline=deadline, grace=self.config.interrupt_grace, on_output=on_output,
                               alive=self.alive, kill=self.kill, interrupt=self.interrupt)

    def interrupt(self) -> None:
        if self.language.interrupt == "signal":
            with contextlib.suppress(SupervisorError):
                self.supervisor.signal(self.pid, signal.SIGINT)
        elif self.client is not None:
            self.client.interrupt()

    @property
    def kernel_lost(self) -> bool:
        return self.client is None or bool(self.client.lost)

    def state(self) -> ContainerState:
        """The kernel's state, as a sandbox's: gone when its process ended (never an out-of-memory kill of it
        alone: the sandbox's memory is shared, and the sandbox's own state says when the cgroup ran out)."""
        outer = self.sandbox.state()
        return outer if not outer.running else ContainerState(self.alive(), None if self.alive() else 1, False)

    def kill(self) -> None:
        """End this kernel (its process group); the sandbox runs on."""
        if self.pid:
            with contextlib.suppress(SupervisorError):
                self.supervisor.signal(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Kill the kernel, disconnect, remove its folder."""
        self.kill()
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._sub is not None:
            self._sub.close()
        with contextlib.suppress(OSError):  # the rest goes with the sandbox's folder
            shutil.rmtree(self.folder)
