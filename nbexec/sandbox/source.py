"""Where sandboxes come from: the seam between the engine (`nbexec.engine.session`) and the places that run them.

Two base classes, and everything the engine, packages, egress and the service use of a sandbox is in them (no
``getattr`` probing, no ``Any`` across). Each has a small required core (abstract: what every backend must do
to run a cell and move files) and optional capabilities (`capabilities.Capability`: sleep, freeze, egress
changes, wheels, durable records, checkpoints) whose defaults raise NotOfferedError naming the backend and the
capability. A backend offers a capability by defining its methods; the engine asks ``offers(...)`` first.

``SandboxSource``: ``acquire(config, purpose=...)`` gives a ready sandbox (its kernel answers, /mnt/data is empty
or holds what was put there), ``release(sandbox, wait=...)`` takes it back for good (a sandbox is never reused).
``purpose`` is "oneshot" (one execution: a warm, pooled sandbox when there is a pool) or "session" (kept for many
runs). Defaults a backend may keep: ``sweep()`` removes what dead processes of this host left behind; for a
service, how much it has ready (``capacity``), whether it can serve (``readiness``), filling its pool
(``warm_up``), removing everything at shutdown (``close``). ``mounts_host_folders`` is False for a source whose
sandboxes do not run on this host (a config with ``input_dir`` is then refused at ``acquire``).

DURABLE: ``acquire(..., claim=...)`` marks a sandbox a state folder keeps past this process,
``handle.describe()`` is a record that finds it again, ``adopt(config, record)`` connects to it from a new
process. CHECKPOINT: ``hibernate(handle, folder)`` stops a sandbox keeping its memory in a folder and returns a
record to ``wake(config, record, folder)`` it from (or to ``discard`` it when its session closes asleep). Without
it, the engine brings memory back by replaying the session's cells (SLEEP, or a fresh sandbox).

``SandboxHandle``: what a sandbox offers. No method hands out a host path, so a sandbox whose kernel and files
live on another machine implements it over the network. The core: kernel operations (``run``, ``run_hidden``,
``interrupt``, ``kernel_lost``), its life (``state``, ``kill``, ``destroy``), its /mnt/data (``put_file``,
``snapshot`` into an output folder held open here, ``open_file`` for streaming, ``list_files``). Plain defaults:
``seems_alive``, ``data_notes``, ``input_notes``, ``input_links``, the egress log (``take_connections``).
Capabilities: ``freeze``, ``provide_wheels``, ``change_egress``, ``sleep``/``awake``, ``describe``. Every byte a
handle returns came from the sandbox and is hostile: a remote handle keeps the same limits (``config``'s output
budget, max_data, max_files) on its side of the wire, where the bytes are kept, as the node keeps them where they
first arrive.

``run`` hands each output message to the engine as a `messages.Message` (its size known, its content still raw
bytes), so the engine charges the output budget before anything is parsed; a remote handle builds them from the
frames its node relays, sized by what arrived.

The backends: `nbexec.sandbox.docker.local.LocalSource` (this host's Docker engine and its warm pools),
`nbexec.sandbox.remote.source.RemoteSource` (nodes of NBEXEC_NODES) and, for tests only, `nbexec.sandbox.fake`;
`nbexec.engine.sources.for_config` picks the one ``config.source`` names. The recipe for a new one, and the files
it touches: docs/design/backends.md; tests/test_seam_conformance.py is the contract it must pass.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from nbexec.config import SandboxConfig
from nbexec.errors import NotOfferedError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.result import Connection

from .capabilities import Capability, not_offered, offered
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


class SandboxHandle(abc.ABC):
    """A ready sandbox, used by one caller at a time (see the module docstring). The abstract methods are the
    required core; the rest have defaults: plain ones where "nothing" is a true answer (no notes, no egress log),
    and NotOfferedError for a `Capability` the backend does not define (see `capabilities`)."""

    backend: ClassVar[str] = ""  # its name in errors ("local Docker"); the class's name when empty
    capabilities: ClassVar[frozenset[Capability]] = frozenset()  # computed for each subclass

    id: str
    config: SandboxConfig
    language_info: dict[str, Any]
    node: str | None = None  # where it runs: a node's name, or None for this host
    # Whether run_hidden runs any code out of the notebook: judging needs it. A backend says so itself (a remote
    # node takes named requests only), so a new one is refused until it does.
    hidden_code: ClassVar[bool] = False
    input_links: frozenset[str] = frozenset()  # names in /mnt/data nbexec linked to /mnt/input (never the code's)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = offered(cls, SandboxHandle, 0)

    def offers(self, capability: Capability) -> bool:
        """Whether this sandbox's backend defines ``capability`` (the engine asks before it relies on one)."""
        return capability in self.capabilities

    def refusal(self, capability: Capability) -> NotOfferedError:
        """The error for asking this backend for a capability it does not offer (it names both)."""
        return not_offered(self.backend or type(self).__name__, capability)

    # -- the required core: run a cell, move files, know whether it lives, end it --------------------------

    @abc.abstractmethod
    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        """Run code on the kernel, each output message to ``on_output``; interrupt at ``deadline``
        (time.monotonic()), kill interrupt_grace seconds later; status "gone" when the sandbox stopped."""

    @abc.abstractmethod
    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: Named | None = None) -> dict[str, Any] | None:
        """Run ``code`` outside the notebook (silent, no history); its execute_reply content (read within the
        kernel's control limit), or None when it did not finish within ``timeout`` seconds. ``named``: the
        request ``code`` was built from (see `hidden`): a node is sent that, never code; without it a remote
        sandbox runs ``code`` as an ordinary cell (the user's own code, a replay)."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Interrupt the running cell; safe from another thread."""

    @property
    @abc.abstractmethod
    def kernel_lost(self) -> bool:
        """Whether the kernel closed its connection (it went away)."""

    @abc.abstractmethod
    def state(self) -> ContainerState:
        """Whether the sandbox still runs, and how it ended (its exit code, whether memory ran out)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop every process at once; /mnt/data stays readable until destroy."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Remove the sandbox and its files."""

    @abc.abstractmethod
    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        """Write /mnt/data/``name`` (FileTransferError when it does not fit or the name is unsafe)."""

    @abc.abstractmethod
    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        """Copy the regular files of /mnt/data into ``target`` within ``limits``; ``known`` spares unchanged ones."""

    @abc.abstractmethod
    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        """/mnt/data/``name`` for streaming: (its size, its chunks); links and over-size files are refused."""

    @abc.abstractmethod
    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        """The regular files now in /mnt/data within ``limits`` (hashed, never past them; ``known`` spares hashing
        unchanged ones again), the rest as skipped with why: never more than a collection reads."""

    # -- defaults that are true answers for a backend without the feature ---------------------------------

    def seems_alive(self) -> bool:
        """A cheap liveness check; True when it cannot be known."""
        return True

    def data_notes(self) -> tuple[list[str], bool]:
        """Notes on /mnt/data running full, and whether that stopped the sandbox."""
        return [], False

    def input_notes(self) -> list[str]:
        """Notes on what of the input folder was withheld from the sandbox (nbexec's own settings files)."""
        return []

    def take_connections(self) -> tuple[tuple[Connection, ...], list[str]]:
        """Egress connections since the last call (network="allowlist"), and notes on what was capped."""
        return (), []

    # -- capabilities: NotOfferedError unless the backend defines them ------------------------------------

    def freeze(self) -> None:
        """FREEZE: stop every process where it is, so /mnt/data can be collected as one moment."""
        raise self.refusal(Capability.FREEZE)

    def judge(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """JUDGE: judge ``job`` (a batch's judge item, as JSON data) in this sandbox with the runner of the side
        that runs it, within ``timeout`` seconds; its JudgeResult as a dict (the caller checks every field)."""
        raise self.refusal(Capability.JUDGE)

    def provide_wheels(self, wheels: Sequence[WheelFile]) -> None:
        """WHEELS: put ``wheels`` (checked against their sha256 here) into /mnt/wheels; PackageError when one
        does not match or does not fit."""
        raise self.refusal(Capability.WHEELS)

    def change_egress(self, allow: Sequence[str], deny: Sequence[str]) -> None:
        """EGRESS: change the egress rules of a running sandbox (network="allowlist"): ``allow`` then ``deny``
        appended, the newest match deciding; every new request is judged by them, the open connections they no
        longer allow are closed, and the change is in the next `take_connections` (see `nbexec.egress`). The
        caller checked the change against its policy (`nbexec.egress.check_change`); ConfigError for a bad
        entry, nothing changed."""
        raise self.refusal(Capability.EGRESS)

    def sleep(self) -> None:
        """SLEEP: stop every process of the sandbox (no memory or CPU used), keeping /mnt/data and every limit
        as they are, for `awake`; SandboxError when this sandbox cannot."""
        raise self.refusal(Capability.SLEEP)

    def awake(self) -> None:
        """SLEEP: start a fresh kernel in a slept sandbox, over its kept /mnt/data (its memory is not kept: the
        engine replays); SandboxError when it cannot."""
        raise self.refusal(Capability.SLEEP)

    def describe(self) -> dict[str, Any]:
        """DURABLE: a JSON-able record that finds this sandbox again from another process
        (`SandboxSource.adopt`); it may hold the kernel's key: kept private (see `nbexec.files.statefolder`)."""
        raise self.refusal(Capability.DURABLE)


class SandboxSource(abc.ABC):
    """Gives ready sandboxes, takes them back, sweeps what dead processes left (see the module docstring).
    ``acquire`` and ``release`` are the required core; the rest have defaults (see `SandboxHandle`)."""

    backend: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    mounts_host_folders: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = offered(cls, SandboxSource, 1)

    def offers(self, capability: Capability) -> bool:
        """Whether this source defines ``capability`` (its handles say what they offer themselves)."""
        return capability in self.capabilities

    def refusal(self, capability: Capability) -> NotOfferedError:
        """The error for asking this backend for a capability it does not offer (it names both)."""
        return not_offered(self.backend or type(self).__name__, capability)

    @abc.abstractmethod
    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        """A ready sandbox for ``purpose`` ("oneshot" or "session"); NbexecError when none can be had. A
        ``claim`` (a state folder's, see `nbexec.files.statefolder`) keeps it past this process's death."""

    @abc.abstractmethod
    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        """Remove the sandbox: before returning with ``wait``, else in the background (a one-shot's caller
        does not wait for the teardown)."""

    def sweep(self) -> None:
        """Remove sandboxes and folders left by processes of this host that died (nothing by default)."""
        return  # nothing to do: a plain default, not an abstract method

    def capacity(self, config: SandboxConfig) -> Capacity:
        """Sandboxes ready now for ``config``, of how many kept ready (no I/O); none kept by default."""
        return Capacity(ready=0, size=0)

    def readiness(self, config: SandboxConfig) -> Readiness:
        """Whether sandboxes for ``config`` can be had now (may ask the engine or the nodes)."""
        return Readiness(True, {})

    def warm_up(self, config: SandboxConfig) -> None:
        """Start readying sandboxes for ``config`` in the background (nothing by default)."""
        return  # nothing to do: a plain default, not an abstract method

    def close(self) -> None:
        """Remove every sandbox this source holds ready (at shutdown; nothing by default)."""
        return  # nothing to do: a plain default, not an abstract method

    def adopt(self, config: SandboxConfig, record: dict[str, Any]) -> SandboxHandle:
        """DURABLE: the running sandbox a ``describe`` record names, from another (maybe dead) process;
        SandboxError when it is gone or the record does not name one of this source's."""
        raise self.refusal(Capability.DURABLE)

    def abandon(self, config: SandboxConfig, record: dict[str, Any]) -> None:
        """DURABLE: remove the sandbox a ``describe`` record names without waiting on its kernel (its adoption
        failed or ran past its deadline); nothing when the record names none of this source's."""
        raise self.refusal(Capability.DURABLE)

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        """CHECKPOINT: stop ``handle``'s sandbox keeping its memory in ``folder`` (0700, yours); a JSON-able
        record to wake it from, or None when it cannot for this sandbox (the engine then replays). The sandbox
        is gone after a record is returned; on None it is untouched."""
        raise self.refusal(Capability.CHECKPOINT)

    def wake(self, config: SandboxConfig, record: dict[str, Any], folder: Path, *,
             check: Callable[[], None] = lambda: None, deadline: float | None = None) -> SandboxHandle:
        """CHECKPOINT: a running sandbox from a record ``hibernate`` returned (raises SandboxError when it
        cannot). Its waits call ``check`` between polls: it raises (SandboxError) to end the wake, leaving
        nothing behind. ``deadline`` (time.monotonic()) is the caller's limit, for a wake that cannot poll (one
        call to a node): WakeStoppedError past it, the sandbox still asleep."""
        raise self.refusal(Capability.CHECKPOINT)

    def discard(self, record: dict[str, Any], folder: Path) -> None:
        """CHECKPOINT: remove what a ``hibernate`` record keeps, without waking it (its session is closed): the
        sandbox's files, and its memory wherever the source kept it (``folder`` itself is the caller's)."""
        raise self.refusal(Capability.CHECKPOINT)
