"""Where sandboxes come from: the seam between the engine (`nbexec.engine.session`) and the places that run sandboxes.

Two protocols, and everything the engine uses of a sandbox is in them:

``SandboxSource``: ``acquire(config, purpose=...)`` gives a ready sandbox (its kernel answers, /mnt/data is empty
or holds what was put there), ``release(sandbox)`` takes it back for good (a sandbox is never reused), and
``sweep()`` removes what dead processes of this node left behind. ``purpose`` is "oneshot" (one execution: a warm,
pooled sandbox when the config has a pool) or "session" (kept for many runs).

``SandboxHandle``: what a sandbox offers. No method hands out a host path, so a sandbox whose kernel and files
live on another machine implements it over the network: kernel operations (``run``, ``interrupt``,
``kernel_lost``), its life (``state``, ``seems_alive``, ``freeze``, ``kill``, ``destroy``) and its /mnt/data
(``put_file``, ``snapshot`` into an output folder held open here, ``open_file`` for streaming, ``list_files``,
``data_notes``), and what of /mnt/input it withheld (``input_notes``). Every byte a handle returns came from the
sandbox and is treated as hostile by the engine; a remote handle must keep the same limits (``config``'s output
budget, max_data, max_files) on its side of the wire.

``run`` hands each output message to the engine as a `messages.Message` (its size known, its content still raw
bytes), so the engine charges the output budget before anything is parsed; a remote handle builds them from what
its node relays. ``release(sandbox, wait=...)`` destroys before returning, or in the background for a one-shot.

``LocalSource`` is the one implementation today: this host's Docker engine and its warm pools (`pool`), with
`container.Sandbox` as the handle. ``for_config`` picks the source a SandboxConfig names (``config.source``); a new
place to run sandboxes is one class here, its name in `config.SANDBOX_SOURCES`, and a branch in ``for_config``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.result import Connection

from .docker import pool
from .docker.container import ContainerState
from .kernel import Execution, Message


class SandboxHandle(Protocol):
    """A ready sandbox, used by one caller at a time (see the module docstring)."""

    id: str
    config: SandboxConfig
    language_info: dict[str, Any]

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        """Run code on the kernel, each output message to ``on_output``; interrupt at ``deadline``
        (time.monotonic()), kill interrupt_grace seconds later; status "gone" when the sandbox stopped."""

    def interrupt(self) -> None:
        """Interrupt the running cell; safe from another thread."""

    @property
    def kernel_lost(self) -> bool:
        """Whether the kernel closed its connection (it went away)."""

    def state(self) -> ContainerState:
        """Whether the sandbox still runs, and how it ended (its exit code, whether memory ran out)."""

    def seems_alive(self) -> bool:
        """A cheap liveness check; True when it cannot be known."""

    def freeze(self) -> None:
        """Stop every process where it is, so /mnt/data can be collected as one moment."""

    def kill(self) -> None:
        """Stop every process at once; /mnt/data stays readable until destroy."""

    def destroy(self) -> None:
        """Remove the sandbox and its files."""

    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        """Write /mnt/data/``name`` (FileTransferError when it does not fit or the name is unsafe)."""

    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        """Copy the regular files of /mnt/data into ``target`` within ``limits``; ``known`` spares unchanged ones."""

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        """/mnt/data/``name`` for streaming: (its size, its chunks); links and over-size files are refused.
        (A remote handle wraps the response body, a binary file object, in transfer.FileChunks.)"""

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        """The regular files now in /mnt/data within ``limits`` (hashed, never past them; ``known`` spares hashing
        unchanged ones again), the rest as skipped with why: never more than a collection reads."""

    def data_notes(self) -> tuple[list[str], bool]:
        """Notes on /mnt/data running full, and whether that stopped the sandbox."""

    def input_notes(self) -> list[str]:
        """Notes on what of the input folder was withheld from the sandbox (nbexec's own settings files)."""

    def take_connections(self) -> tuple[tuple[Connection, ...], list[str]]:
        """Egress connections since the last call (network="allowlist"), and notes on what was capped."""


class SandboxSource(Protocol):
    """Gives ready sandboxes, takes them back, sweeps what dead processes left."""

    def acquire(self, config: SandboxConfig, *, purpose: str) -> SandboxHandle:
        """A ready sandbox for ``purpose`` ("oneshot" or "session"); NbexecError when none can be had."""

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        """Remove the sandbox: before returning with ``wait``, else in the background (a one-shot's caller
        does not wait for the teardown)."""

    def sweep(self) -> None:
        """Remove sandboxes and folders left by processes of this node that died."""


class LocalSource:
    """Sandboxes on this host's Docker engine: one-shots from the warm pool, sessions started for themselves."""

    def acquire(self, config: SandboxConfig, *, purpose: str) -> SandboxHandle:
        if purpose == "oneshot" or config.pool_size:
            return pool.acquire(config)
        return pool.start_sandbox(config, role="session", warm_up=True)

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        if wait:
            sandbox.destroy()
        else:  # destroyed in the background, and its pool refilled
            pool.release(sandbox)  # type: ignore[arg-type]

    def sweep(self) -> None:
        pool.sweep_orphans()


_LOCAL = LocalSource()


def for_config(config: SandboxConfig) -> SandboxSource:
    """The source ``config.source`` names."""
    if config.source == "local":
        return _LOCAL
    raise ConfigError(f"unknown sandbox source {config.source!r}: use local")
