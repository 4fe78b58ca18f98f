"""One throwaway container with a ready IPython kernel, driven from the host over ZMQ ipc:// sockets.

The container has no network interface but loopback (by default); the kernel's sockets live in a host folder
bind-mounted at /run/nbexec, and the sandbox's data filesystem (see `datafs`) is bind-mounted at /mnt/data. Once
the kernel is up, the socket folder is made read-only to the sandbox (the code cannot swap the sockets for links).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import docker
import docker.errors
import docker.types

from nbexec import languages
from nbexec.config import SandboxConfig, running_as_root
from nbexec.egress import describe_change
from nbexec.errors import ConfigError, DockerError, SandboxError
from nbexec.files import artifacts, mounts, space, transfer
from nbexec.files.folders import OutputFolder, mark, work_root
from nbexec.files.workdir import CLAIM_FILE, CLAIMED_PREFIX, WORKDIR_PREFIX, remove_tree
from nbexec.result import Connection
from nbexec.sandbox import hidden, kernel
from nbexec.sandbox.source import ContainerState, SandboxHandle, WheelFile

from . import daemon, datafs, egress, inputcopy, users, workdir
from .options import KERNEL_PORTS, RUNTIME_BYTES, RUNTIME_INODES, Place, connection_info, container_options
from .sleep import Sleeper

if TYPE_CHECKING:
    from nbexec.egress.proxy import Proxy

__all__ = ["Sandbox"]

log = logging.getLogger(__name__)


class Sandbox(Sleeper, SandboxHandle):
    """A started container and a connected kernel client. Made by `Sandbox.start`; used for one owner at a time."""
    hidden_code = True  # run_hidden runs any code in the kernel (judging needs it)

    def __init__(self, config: SandboxConfig, sandbox_id: str, workdir: Path) -> None:
        self.config = config
        self.language = languages.get(config.language)
        # Who the code runs as (the one place that decides it per sandbox): as root, a fresh uid with no account.
        self.uid, self.gid = users.uid_gid(config)
        self.id = sandbox_id
        self.node: str | None = None  # on this host
        self.workdir = workdir
        self.data_dir = workdir / "data"  # mounted at /mnt/data; gone with the sandbox (results copy files out)
        self.data_fs = False  # a filesystem of its own (fixed size and inode count) is mounted at data_dir
        self.input_links: frozenset[str] = frozenset()  # names of the links nbexec made in data_dir (see inputcopy)
        self.input_copies: dict[str, inputcopy.Key] = {}  # name -> identity of the input copy as nbexec made it
        self._input_masks: list[docker.types.Mount] = []  # empty stand-ins over nbexec's settings files in it
        self._input_notes: list[str] = []
        self.data_watch: datafs.Watch | None = None  # the sampled fallback when nbexec cannot mount
        self.freezer: datafs.Freezer | None = None
        self.container: Any = None
        self.client: kernel.KernelClient | None = None
        self.started_at = time.monotonic()
        self.connection: dict[str, Any] = {}
        self.language_info: dict[str, Any] = {}
        self.init_process: tuple[int, str] | None = None  # (host pid, start time) of the container's init
        self.egress: Proxy | None = None  # network="allowlist": the host proxy it reaches (nbexec.egress)
        self.disk: space.Reservation | None = None  # its share of the host's disk, held until destroy

    def file_owner(self) -> tuple[int, int] | None:
        """Who the files the host makes for the sandbox must belong to (the one place that decides it): the
        sandbox user when nbexec runs as root (it can chown), else None (the host user is the sandbox user)."""
        return (self.uid, self.gid) if running_as_root() else None

    @property
    def runtime_dir(self) -> Path:
        return self.workdir / "run"

    @classmethod
    def prepare(cls, config: SandboxConfig, *, ids: tuple[int, int] | None = None, claim: str = "") -> Sandbox:
        """A new sandbox's disk share, working folders and data filesystem (owned by ``ids``, else by its own
        user), and its egress proxy; no container yet. ``claim``: the state folder that keeps it past this process
        (see `nbexec.files.statefolder`)."""
        prefix = CLAIMED_PREFIX if claim else f"{WORKDIR_PREFIX}{os.getpid()}-"  # a claimed one outlives this pid
        workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=work_root()))
        sandbox = cls(config, uuid.uuid4().hex[:16], workdir)
        sandbox.uid, sandbox.gid = ids or (sandbox.uid, sandbox.gid)
        try:
            # Its share of the host's disk is admitted before anything is written (DiskSpaceError otherwise).
            sandbox.disk = space.reserve(space.sandbox_needs(config, workdir), config.disk_margin_bytes)
            sandbox.data_dir.mkdir(mode=0o700)
            sandbox._prepare_folders()
            if claim:  # read by the sweep (workdir.remove_stale_workdirs): kept while the state folder wants it
                (workdir / CLAIM_FILE).write_text(claim)
            if config.network == "allowlist":  # before the container, which mounts the proxy's folder
                sandbox.egress = egress.open_proxy(workdir, config)
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox

    @classmethod
    def start(cls, config: SandboxConfig, *, role: str, claim: str = "") -> Sandbox:
        """Create the working folders, the data filesystem and the container; wait until the kernel answers."""
        docker_client = daemon.connect()
        sandbox = cls.prepare(config, claim=claim)
        try:
            sandbox._create_container(docker_client, role, claim)
            sandbox._watch_data()
            sandbox.connect_kernel()
            if sandbox.egress is not None:
                assert sandbox.client is not None
                egress.start_forwarder(sandbox.client, config)
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox

    def _prepare_folders(self) -> None:
        mark(self.workdir)  # /mnt/data lives below: never a place nbexec loads a .env from
        self.runtime_dir.mkdir(mode=0o700)
        owner = self.file_owner()
        if owner is not None and datafs.can_mount():  # the sandbox writes there (contexts): never the host's disk
            datafs.mount_small(self.runtime_dir, size=RUNTIME_BYTES, inodes=RUNTIME_INODES)
        self.connection = connection_info(self.config)
        conn = self.runtime_dir / "kernel.json"
        conn.write_text(json.dumps(self.connection))
        if owner is not None:
            os.chown(conn, *owner)
            os.chmod(self.runtime_dir, 0o777)  # the kernel binds its sockets here; read-only once up (_lock_runtime)
        os.chmod(conn, 0o400)
        (self.workdir / "wheels").mkdir(mode=0o755)  # packages: empty until the host links wheels in
        self._make_data_fs()
        if self.config.input_dir:  # settings files withheld (inputmount); the code's own copy of the rest (inputcopy)
            self._input_masks, self._input_notes, self.input_links, self.input_copies = inputcopy.prepare(
                self.config, self.workdir, self.data_dir, (self.uid, self.gid), self.file_owner())

    def _make_data_fs(self) -> None:
        """Mount a filesystem of max_data bytes and max_files (+ headroom) inodes at data_dir, owned by the
        sandbox user; without root, leave a plain folder (the sampled fallback, see `datafs`)."""
        limit = self.config.max_data_bytes
        if limit and datafs.can_mount():
            datafs.create(self.data_dir, self.workdir / "data.img", size=limit,
                          inodes=datafs.inode_count(self.config.max_files), owner=(self.uid, self.gid))
            self.data_fs = True
            return
        if limit:
            log.warning("%s", datafs.fallback_reason())
        owner = self.file_owner()
        if owner is not None:
            os.chown(self.data_dir, *owner)
        os.chmod(self.data_dir, 0o755)

    def _watch_data(self) -> None:
        limit = self.config.max_data_bytes
        if limit and not self.data_fs:
            self.data_watch = datafs.Watch(self.data_dir, limit, self.kill)
            self.data_watch.start()

    def freeze(self) -> None:
        """Stop every process of the sandbox where it is, so its files can be collected as a snapshot
        (cgroup freezer: no Docker call; Docker's pause API, then kill, when there is no freezer here)."""
        if self.freezer is not None and self.freezer.freeze():
            return
        try:
            with daemon.translated("pause a sandbox"):
                self.container.pause()
        except DockerError:
            self.kill()

    def _create_container(self, docker_client: docker.DockerClient, role: str, claim: str) -> None:
        options = container_options(self.config, role, Place(self.id, self.uid, self.gid, self.workdir,
                                                             tuple(self._input_masks), claim))
        with daemon.translated("start a sandbox container"):
            self.container = docker_client.containers.create(**options)
            self.container.start()
            self.attach(self.container)

    def attach(self, container: Any) -> None:
        """Take ``container`` (started) as this sandbox's: its init process and its cgroup freezer."""
        self.container = container
        container.reload()
        self.init_process = daemon.process_identity(container.attrs.get("State", {}).get("Pid"))
        self.freezer = datafs.Freezer.of_process(self.init_process[0]) if self.init_process else None

    def connect_kernel(self, check: Callable[[], None] = lambda: None) -> None:
        """Wait for the kernel's sockets, its kernel_info reply and a first iopub message; ``check`` between polls."""
        deadline = time.monotonic() + self.config.startup_timeout
        shell = self.runtime_dir / f"kernel-{KERNEL_PORTS['shell_port']}"
        iopub = self.runtime_dir / f"kernel-{KERNEL_PORTS['iopub_port']}"
        delay, next_check = 0.002, time.monotonic() + 0.25
        while not (shell.exists() and iopub.exists()):
            if time.monotonic() > next_check:  # asking Docker costs a few ms: not on every poll
                self._check_startup(deadline, check)
                next_check = time.monotonic() + 0.25
            time.sleep(delay)
            delay = min(delay * 1.5, 0.02)
        self.client = self.open_client()
        self.language_info = self.client.wait_ready(lambda: self._check_startup(deadline, check))
        # The kernel is fully up (it rewrites its connection file late in start-up): now lock the folder.
        self._lock_runtime()
        self.client.wait_subscribed(lambda: self._check_startup(deadline, check))
        log.debug("sandbox %s ready in %.3f s", self.id, time.monotonic() - self.started_at)

    def open_client(self) -> kernel.KernelClient:
        """Connect a kernel client to the sockets of the kernel, told how this language's kernel behaves."""
        # A message may hold at most the whole output allowance (plus headers); larger ones are read past.
        frame_limit = self.config.max_output_bytes + self.config.max_display_bytes + kernel.MAX_HEADER
        client = kernel.KernelClient.connect(self.runtime_dir / "kernel", self.connection, max_message=frame_limit)
        client.asks_last_error, client.settle = self.language.is_python, self.language.settle
        return client

    def _lock_runtime(self) -> None:
        # The kernel read the connection file before it bound its sockets; the key need not stay on disk.
        (self.runtime_dir / "kernel.json").unlink(missing_ok=True)
        if running_as_root():
            os.chmod(self.runtime_dir, 0o555)

    def _check_startup(self, deadline: float, check: Callable[[], None]) -> None:
        check()  # a wake's: it raises past the run's limit, or once interrupted
        state = self.state()
        if not state.running:
            logs = self._logs()
            raise SandboxError(f"The sandbox's kernel exited while starting (exit code {state.exit_code}).{logs}")
        if time.monotonic() > deadline:
            raise SandboxError(f"The sandbox's kernel did not start within {self.config.startup_timeout:g} s. Is "
                               "the machine overloaded? Raise startup_timeout (NBEXEC_STARTUP_TIMEOUT) if it is "
                               "just slow.")

    def _logs(self) -> str:
        with contextlib.suppress(Exception):
            text = self.container.logs(tail=20).decode("utf-8", "replace").strip()
            return f" Its last lines:\n{text}" if text else ""
        return ""

    def describe(self) -> dict[str, Any]:
        """What finds this sandbox again once this process is gone (see `adopt`); holds the kernel's key."""
        return {"kind": "local", "id": self.id, "container": self.container.id, "workdir": str(self.workdir),
                "uid": self.uid, "gid": self.gid, "data_fs": self.data_fs, "connection": self.connection,
                "language_info": self.language_info, "asleep": self.client is None}

    # -- the kernel ---------------------------------------------------------------------------------

    def run(self, code: str, *, deadline: float, on_output: Callable[[kernel.Message], None]) -> kernel.Execution:
        """Run ``code`` on the kernel (see kernel.KernelClient.run): interrupted at ``deadline``, the sandbox
        killed interrupt_grace seconds later; status "gone" when the container stopped under it."""
        assert self.client is not None
        return self.client.run(code, deadline=deadline, grace=self.config.interrupt_grace, on_output=on_output,
                               alive=lambda: self.state().running, kill=self.kill, interrupt=self.interrupt)

    def warm(self) -> None:
        """Import the configured modules in the kernel, binding no name in the user's namespace (Python only)."""
        assert self.client is not None
        if not self.language.is_python:
            return
        modules = list(self.config.warm_imports)
        code = (f"for __nbexec_m in {modules!r}:\n"
                f"    __import__('importlib').import_module(__nbexec_m)\n"
                f"del __nbexec_m\n") if modules else "pass"
        reply = self.client.run_silent(code, self.config.startup_timeout)
        if reply is None:
            raise SandboxError(f"the sandbox's kernel did not finish its warm imports within "
                               f"{self.config.startup_timeout:g} s")
        if reply.get("status") != "ok":
            log.warning("warm imports failed in the sandbox: %.200r", reply.get("evalue"))

    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: hidden.Named | None = None) -> dict[str, Any] | None:
        """Run ``code`` outside the notebook (silent, no history): its execute_reply content, or None after
        ``timeout`` seconds (the cell is then interrupted). ``named`` tells a node what to build; here code runs."""
        assert self.client is not None
        reply = self.client.run_silent(code, timeout, expressions=expressions)
        if reply is None:
            self.interrupt()
        return reply

    @property
    def kernel_lost(self) -> bool:
        """Whether the kernel closed a connection (it went away, or crashed its messaging)."""
        return self.client is None or bool(self.client.lost)

    # -- /mnt/data ----------------------------------------------------------------------------------

    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        """Write ``content`` (bytes or a binary file, streamed) to /mnt/data/``name``, owned by the sandbox user."""
        transfer.put(self.data_dir, name, content, owner=self.file_owner())

    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        """Copy the regular files of /mnt/data into ``target`` (see artifacts.snapshot)."""
        return inputcopy.snapshot(self.data_dir, target, limits, known, self.input_copies)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        """/mnt/data/``name`` as it is now, for streaming: (its size, its chunks); links are refused."""
        return transfer.open_stream(self.data_dir, name, max_bytes=max_bytes)

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        """/mnt/data as it is now, within ``limits`` (hashed where they lie; see artifacts.snapshot)."""
        return inputcopy.snapshot(self.data_dir, None, limits, known, self.input_copies)

    def data_notes(self) -> tuple[list[str], bool]:
        """nbexec's notes on /mnt/data running out of space or inodes, and whether that stopped the sandbox
        (the sampled fallback, when nbexec cannot mount a filesystem of fixed size)."""
        return datafs.report(self.data_dir, mounted=self.data_fs, watch=self.data_watch, cap=self.config.max_data)

    def input_notes(self) -> list[str]:
        """nbexec's notes on what of the input folder it withheld from the sandbox (its own settings files)."""
        return list(self._input_notes)

    def provide_wheels(self, wheels: Sequence[WheelFile]) -> None:
        """Link (or copy) each wheel into /mnt/wheels under its own file name."""
        workdir.provide_wheels(self.workdir / "wheels", wheels)

    def take_connections(self) -> tuple[tuple[Connection, ...], list[str]]:
        """The egress connections since the last call and notes on what was capped; none without a proxy."""
        return self.egress.take() if self.egress is not None else ((), [])

    def change_egress(self, allow: Sequence[str], deny: Sequence[str]) -> None:
        """Judge by the proxy's rules with ``allow`` then ``deny`` appended from now on (see `nbexec.egress`)."""
        if self.egress is None:
            raise ConfigError("this sandbox has no allowlist proxy (network='allowlist')")
        changed = self.egress.allowlist.changed(allow, deny)
        egress.keep_rules(self.workdir, changed)  # first: a proxy opened again (a wake, a new owner) judges by it
        self.egress.change(changed, describe_change(allow, deny))

    # -- the container ------------------------------------------------------------------------------

    def seems_alive(self) -> bool:
        """A cheap check (no Docker call) that the container's init still runs: False once it is gone.

        Uses the host's /proc when the engine is local; assumes alive when that cannot be known."""
        if self.init_process is None:
            return self.container is not None
        return daemon.process_identity(self.init_process[0]) == self.init_process

    def state(self) -> ContainerState:
        """Ask Docker whether the container still runs and how it ended."""
        try:
            with daemon.translated("inspect a sandbox"):
                self.container.reload()
        except DockerError as exc:
            if isinstance(exc.__cause__, docker.errors.NotFound):
                return ContainerState(running=False, exit_code=None, oom_killed=False)
            raise
        status = self.container.attrs.get("State", {})
        if status.get("Status") == "removing":  # `docker rm -f` from outside: it kills first, then removes
            return ContainerState(running=False, exit_code=None, oom_killed=False)
        running, code = bool(status.get("Running")), status.get("ExitCode")  # OOMKilled misses late news: ask events
        return ContainerState(running, code, bool(status.get("OOMKilled")) or (
            not running and code == 137 and daemon.oom_reported(self.container)))

    def interrupt(self) -> None:
        """Interrupt the running cell: ask the kernel (it sends itself SIGINT), or for a kernel that ignores the
        request (IRkernel) send SIGINT to the container's init, which passes it to the kernel."""
        if self.language.interrupt == "signal":
            if self.container is not None:
                with contextlib.suppress(DockerError), daemon.translated("interrupt a sandbox"):
                    self.container.kill(signal="SIGINT")
        elif self.client is not None:
            self.client.interrupt()

    def kill(self) -> None:
        """Stop every process of the sandbox at once; its folders stay."""
        with contextlib.suppress(DockerError), daemon.translated("kill a sandbox"):
            self.container.kill()

    def destroy(self) -> None:
        """Remove the container, unmount and delete its data filesystem, and remove the working folder."""
        if self.egress is not None:
            self.egress.close()
        if self.data_watch is not None:
            self.data_watch.close()
        if self.freezer is not None:
            self.freezer.thaw()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self.container is not None:
            try:
                with daemon.translated("remove a sandbox"):
                    self.container.remove(force=True, v=True)
            except DockerError as exc:
                if not isinstance(exc.__cause__, docker.errors.NotFound):
                    log.warning("could not remove container %s: %s (run `nbexec cleanup`)", self.id, exc)
            self.container = None
        if self.data_fs:
            mounts.unmount(self.data_dir)
            self.data_fs = False
        # remove_tree unmounts first what is still mounted there: it never deletes through a mount
        remove_tree(self.workdir)
        if self.disk is not None:
            self.disk.release()
