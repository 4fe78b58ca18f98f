"""Where sandboxes come from: the seam between the engine (`nbexec.engine.session`) and the places that run them.

Two protocols, and everything the engine, packages, egress and the service use of a sandbox is in them (no
``getattr`` probing, no ``Any`` across):

``SandboxSource``: ``acquire(config, purpose=...)`` gives a ready sandbox (its kernel answers, /mnt/data is empty
or holds what was put there), ``release(sandbox, wait=...)`` takes it back for good (a sandbox is never reused),
``sweep()`` removes what dead processes of this host left behind. ``purpose`` is "oneshot" (one execution: a warm,
pooled sandbox when there is a pool) or "session" (kept for many runs). For a service it also says how much it has
ready (``capacity``), whether it can serve at all (``readiness``), starts filling its pool (``warm_up``) and
removes everything at shutdown (``close``). What it cannot do it says: ``mounts_host_folders`` is False for a
source whose sandboxes do not run on this host (a config with ``input_dir`` is then refused at ``acquire``).

Durable sessions: ``acquire(..., claim=...)`` marks a sandbox a state folder keeps past this process,
``handle.describe()`` is a record that finds it again, ``adopt(config, record)`` connects to it from a new
process. Memory kept across a sleep (durable sessions): ``hibernate(handle, folder)`` stops a sandbox keeping its memory
in a folder and returns a record to ``wake(config, record, folder)`` it from (or to ``discard`` it when its session
closes asleep); the defaults here say "not supported" (None, SandboxError) and the engine then brings memory back by
replaying the session's cells.

``SandboxHandle``: what a sandbox offers. No method hands out a host path, so a sandbox whose kernel and files
live on another machine implements it over the network: kernel operations (``run``, ``run_hidden``,
``interrupt``, ``kernel_lost``), its life (``state``, ``seems_alive``, ``freeze``, ``kill``, ``destroy``), its
/mnt/data (``put_file``, ``snapshot`` into an output folder held open here, ``open_file`` for streaming,
``list_files``, ``data_notes``), its /mnt/wheels (``provide_wheels``), what of /mnt/input it withheld or linked
(``input_notes``, ``input_links``), its egress log (``take_connections``) and rules (``change_egress``). Every
byte a handle returns came from the sandbox and is hostile: a remote handle keeps the same limits (``config``'s
output budget, max_data, max_files) on its side of the wire, where the bytes are kept, as the node keeps them where
they first arrive.

``run`` hands each output message to the engine as a `messages.Message` (its size known, its content still raw
bytes), so the engine charges the output budget before anything is parsed; a remote handle builds them from the
frames its node relays, sized by what arrived.

The sources: `nbexec.sandbox.docker.local.LocalSource` (this host's Docker engine and its warm pools) and
`nbexec.sandbox.remote.source.RemoteSource` (nodes of NBEXEC_NODES); `nbexec.engine.sources.for_config` picks the
one ``config.source`` names. A new place to run sandboxes is a source and a handle beside them, its name in
`config.SANDBOX_SOURCES`, and a branch in ``for_config``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from nbexec.config import SandboxConfig
from nbexec.errors import SandboxError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.result import Connection

from .hidden import Named
from .kernel import Execution
from .messages import Message

DATA_MOUNT = "/mnt/data"  # the sandbox's files: its working folder, collected after each run
HOME_ALIAS = "/home/user"  # the same data filesystem where E2B's clients expect their user's home
INPUT_MOUNT = "/mnt/input"  # a host folder, read-only (sources that mount host folders)
WHEELS_MOUNT = "/mnt/wheels"  # read-only to the code; wheels the host resolved are put there (provide_wheels)
PACKAGES_MOUNT = "/mnt/packages"  # in memory, where the installer unpacks them (exec: native extensions load)


@dataclass(frozen=True)
class ContainerState:
    """Whether a sandbox still runs, and how it ended."""

    running: bool
    exit_code: int | None
    oom_killed: bool


@dataclass(frozen=True)
class WheelFile:
    """A wheel the host resolved for a sandbox, checked against its sha256: ``path`` is this host's copy."""

    filename: str
    sha256: str
    size: int
    path: Path


@dataclass(frozen=True)
class Capacity:
    """What a source has ready for one config: sandboxes waiting warm (``ready``) of the ``size`` it keeps."""

    ready: int
    size: int


@dataclass(frozen=True)
class Readiness:
    """Whether a source can give sandboxes now, and what it checked (for /readyz)."""

    ready: bool
    checks: dict[str, Any] = field(default_factory=dict)


class SandboxHandle(Protocol):
    """A ready sandbox, used by one caller at a time (see the module docstring)."""

    id: str
    config: SandboxConfig
    language_info: dict[str, Any]
    node: str | None  # where it runs: a node's name, or None for this host
    input_links: frozenset[str]  # names in /mnt/data nbexec linked to /mnt/input (never the code's files)

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        """Run code on the kernel, each output message to ``on_output``; interrupt at ``deadline``
        (time.monotonic()), kill interrupt_grace seconds later; status "gone" when the sandbox stopped."""

    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: Named | None = None) -> dict[str, Any] | None:
        """Run ``code`` outside the notebook (silent, no history); its execute_reply content (read within the
        kernel's control limit), or None when it did not finish within ``timeout`` seconds. ``named``: the
        request ``code`` was built from (see `hidden`): a node is sent that, never code; without it a remote
        sandbox runs ``code`` as an ordinary cell (the user's own code, a replay)."""

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
        """/mnt/data/``name`` for streaming: (its size, its chunks); links and over-size files are refused."""

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        """The regular files now in /mnt/data within ``limits`` (hashed, never past them; ``known`` spares hashing
        unchanged ones again), the rest as skipped with why: never more than a collection reads."""

    def data_notes(self) -> tuple[list[str], bool]:
        """Notes on /mnt/data running full, and whether that stopped the sandbox."""

    def input_notes(self) -> list[str]:
        """Notes on what of the input folder was withheld from the sandbox (nbexec's own settings files)."""

    def provide_wheels(self, wheels: Sequence[WheelFile]) -> None:
        """Put ``wheels`` (checked against their sha256 here) into /mnt/wheels; PackageError when one does not
        match or does not fit."""

    def take_connections(self) -> tuple[tuple[Connection, ...], list[str]]:
        """Egress connections since the last call (network="allowlist"), and notes on what was capped."""

    def change_egress(self, allow: Sequence[str], deny: Sequence[str]) -> None:
        """Change the egress rules of a running sandbox (network="allowlist"): ``allow`` then ``deny`` appended, the
        newest match deciding; every new request is judged by them, the open connections they no longer allow are
        closed, and the change is in the next `take_connections` (see `nbexec.egress`). The caller checked the
        change against its policy (`nbexec.egress.check_change`); ConfigError for a bad entry, nothing changed."""

    def sleep(self) -> None:
        """Stop every process of the sandbox (no memory or CPU used), keeping /mnt/data and every limit as they
        are, for `awake`; SandboxError when this sandbox cannot."""

    def awake(self) -> None:
        """Start a fresh kernel in a slept sandbox, over its kept /mnt/data (its memory is not kept: the engine
        replays); SandboxError when it cannot."""

    def describe(self) -> dict[str, Any]:
        """A JSON-able record that finds this sandbox again from another process (`SandboxSource.adopt`); it
        may hold the kernel's key: kept private (see `nbexec.files.statefolder`)."""


class SandboxSource(Protocol):
    """Gives ready sandboxes, takes them back, sweeps what dead processes left (see the module docstring)."""

    mounts_host_folders: bool

    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        """A ready sandbox for ``purpose`` ("oneshot" or "session"); NbexecError when none can be had. A
        ``claim`` (a state folder's, see `nbexec.files.statefolder`) keeps it past this process's death."""

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        """Remove the sandbox: before returning with ``wait``, else in the background (a one-shot's caller
        does not wait for the teardown)."""

    def sweep(self) -> None:
        """Remove sandboxes and folders left by processes of this host that died."""

    def capacity(self, config: SandboxConfig) -> Capacity:
        """Sandboxes ready now for ``config``, of how many kept ready (no I/O)."""

    def readiness(self, config: SandboxConfig) -> Readiness:
        """Whether sandboxes for ``config`` can be had now (may ask the engine or the nodes)."""

    def warm_up(self, config: SandboxConfig) -> None:
        """Start readying sandboxes for ``config`` in the background."""

    def close(self) -> None:
        """Remove every sandbox this source holds ready (at shutdown)."""

    def adopt(self, config: SandboxConfig, record: dict[str, Any]) -> SandboxHandle:
        """The running sandbox a ``describe`` record names, from another (maybe dead) process; SandboxError
        when it is gone or the record does not name one of this source's."""
        raise SandboxError("this sandbox source cannot find sandboxes again")

    def abandon(self, config: SandboxConfig, record: dict[str, Any]) -> None:
        """Remove the sandbox a ``describe`` record names without waiting on its kernel (its adoption failed or
        ran past its deadline); nothing when the record names none of this source's."""

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        """Stop ``handle``'s sandbox keeping its memory in ``folder`` (0700, yours); a JSON-able record to wake it
        from, or None when this source cannot keep memory (the engine then replays). The sandbox is gone after
        a record is returned; on None it is untouched."""
        return None

    def wake(self, config: SandboxConfig, record: dict[str, Any], folder: Path, *,
             check: Callable[[], None] = lambda: None) -> SandboxHandle:
        """A running sandbox from a record ``hibernate`` returned (raises SandboxError when it cannot). Its waits
        call ``check`` between polls: it raises (SandboxError) to end the wake, leaving nothing behind."""
        raise SandboxError("this sandbox source cannot restore memory")

    def discard(self, record: dict[str, Any], folder: Path) -> None:
        """Remove what a ``hibernate`` record keeps, without waking it (its session is closed): the sandbox's
        files, and its memory wherever the source kept it (``folder`` itself is the caller's)."""
