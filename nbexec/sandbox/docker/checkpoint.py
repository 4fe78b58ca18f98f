"""Memory kept across a stop: gVisor checkpoint/restore of a local sandbox (`LocalSource.hibernate` / ``wake``).

What blocks a plain ``docker checkpoint``: gVisor cannot save a socket backed by the host, and the kernel's five
ZeroMQ sockets are exactly that (ipc:// files made through runsc's ``--host-uds=create`` in /run/nbexec), and it
cannot save a listening TCP socket of its own netstack either (ipykernel's IOPub pipe for forked children binds
tcp://127.0.0.1). Both fail the checkpoint *and kill the container*. So the host first asks the kernel to let go:
`agent` (run silently in the kernel) starts a thread that, once the host says it has read the reply, unbinds the
IOPub pipe and then the five ipc sockets, and waits for a wake file; the host drops its connections, says so,
waits until the five socket files are gone, and checkpoints. Restored in a NEW container (a restored container
cannot be checkpointed again: containerd's task gets stuck), the same thread sees the wake file and binds the same
addresses again; the host reconnects with the key it kept. The agent runs on the sandbox's side, so it is trusted
with nothing: a kernel that does not let go is not checkpointed (hibernate raises), and the host only ever waits,
within a deadline, for socket files in a folder the sandbox cannot write once it is locked.

Before anything changes, the agent looks for sockets of the code's that gVisor could not save (any TCP or UDP
socket but the IOPub pipe's, a unix socket bound on a host mount such as /mnt/data): with one, it refuses and
``hibernate`` returns None with the sandbox running on (the engine replays instead). Every restore hands the
kernel a fresh HMAC key and session id and reseeds ``random`` (and numpy's global generator), so the sandboxes
made from one image by `from_template` (a template, a fork) never share them.

A checkpoint is hostile data on its way back (`checkpointfiles`): copied into ``folder`` private (0700/0600), each
file's sha256 and size kept in the record, capped at ``memory_bytes + CHECKPOINT_SLACK`` in all (past it the copy
stops, is removed and the checkpoint refused); ``wake`` copies only regular files (no links, nothing added nor
missing) through descriptors, hashing them, within the same cap, and hands them to runsc alone. While a restored
kernel binds its sockets its runtime folder is open to the sandbox's code, so it is a 64 KiB tmpfs (a file opened
and unlinked there writes no further); locked, it must hold only the sockets and the wake file (anything else
refuses the wake).
`supported` probes whether a runtime can (under runc CRIU fails on this kernel's vDSO: ``hibernate`` returns None)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors

from nbexec.config import SandboxConfig
from nbexec.errors import DockerError, SandboxError
from nbexec.files import space
from nbexec.files.workdir import claim_of

from . import agent, checkpointfiles, daemon, datafs, leftovers, pool
from .container import Sandbox
from .options import KERNEL_PORTS, RUNTIME_BYTES, RUNTIME_INODES, Place, connection_info, container_options

log = logging.getLogger(__name__)

NAME = "nbexec"  # the checkpoint's name in Docker's data root
CHECKPOINT_SLACK = 64 * 1024**2  # a checkpoint may be this much larger than the sandbox's memory limit
RECORD_VERSION = 1
_restoring = threading.Lock()  # two restores of one template in this process never share containerd's copy
_unfinished: dict[str, threading.Thread] = {}  # sandbox id -> its restore's engine call, until it returned
_SOCKETS = tuple(f"kernel-{n}" for n in KERNEL_PORTS.values())
_probed: dict[str, tuple[bool, float, str]] = {}  # runtime -> (the answer, when it was found, why not)
_probe_lock = threading.Lock()
PROBE_AGAIN = 900.0  # seconds after which a "no" is asked again (it may have met an engine restarting)

class Blocked(SandboxError):
    """The kernel holds sockets gVisor cannot save (a server of the code's on localhost...): nothing was done."""


def supported(config: SandboxConfig) -> bool:
    """Whether sandboxes of ``runtime`` keep their memory through hibernate/wake here: found out once per runtime
    per process by doing it to a tiny sandbox and reading a variable back (never assumed from the runtime's name).
    A "no" is asked once more at once (a loaded or restarting engine can fail a probe) and after PROBE_AGAIN s."""
    key = config.runtime or ""
    with _probe_lock:
        known, when, why = _probed.get(key, (False, -PROBE_AGAIN, ""))
        if not known and time.monotonic() - when >= PROBE_AGAIN:  # a "yes" is kept for good
            small = config.replace(memory="256m", max_data="16m", network=False, input_dir=None, warm_imports=(),
                                   pool_size=0)
            if why := daemon.checkpoint_refusal() or (_probe(small) and _probe(small)):
                log.warning("sandboxes of runtime %s cannot keep memory through a stop: %s", key or "default", why)
            known = not why
            _probed[key] = (known, time.monotonic(), why)
        return known


def why_not(config: SandboxConfig) -> str:
    """Why the last probe of ``config``'s runtime said no ("" if it said yes or was never asked)."""
    return _probed.get(config.runtime or "", (False, 0.0, ""))[2]


def _probe(config: SandboxConfig) -> str:
    """"" when a sandbox of ``config`` kept a variable through checkpoint and restore, else why not."""
    with tempfile.TemporaryDirectory(prefix="nbexec-probe-") as folder:
        sandbox = pool.start_sandbox(config, role="probe", warm_up=False)
        woken: Sandbox | None = None
        try:
            marker = secrets.token_hex(8)
            sandbox.run_hidden(f"__nbexec_probe = {marker!r}", config.startup_timeout)
            record = checkpoint(sandbox, Path(folder))
            woken = restore(config, record, Path(folder))
            reply = woken.run_hidden("pass", config.startup_timeout, expressions={"m": "__nbexec_probe"})
            value = ((reply or {}).get("user_expressions", {}).get("m") or {}).get("data", {}).get("text/plain")
            return "" if value == repr(marker) else f"the restored sandbox read back {str(value)[:80]!r}"
        except Exception as exc:  # the runtime cannot: hibernate returns None
            return f"{type(exc).__name__}: {exc}"[:500]
        finally:
            (woken or sandbox).destroy()  # one working folder: the woken sandbox's, when there is one


def hibernate(sandbox: Sandbox, folder: Path) -> dict[str, Any] | None:
    """Checkpoint ``sandbox`` into ``folder`` and remove its container; its record, or None (untouched) when its
    runtime cannot keep memory, it reaches the host's egress proxy, or it holds a socket gVisor cannot save."""
    if sandbox.config.network == "allowlist" or not sandbox.language.is_python or not supported(sandbox.config):
        return None
    image = sandbox.config.memory_bytes + CHECKPOINT_SLACK  # DiskSpaceError before the kernel is asked anything
    held = space.reserve([space.Need(folder, image, "its memory image (memory)"),
                          space.Need(Path(daemon.root_dir()), image, "the engine's copy of its memory image")],
                         sandbox.config.disk_margin_bytes, action="keep a sandbox's memory")
    try:
        return checkpoint(sandbox, folder)
    except Blocked as exc:  # the kernel was asked before anything changed: the sandbox runs on, untouched
        log.info("sandbox %s is not checkpointed: %s", sandbox.id, exc)
        return None
    finally:
        held.release()  # what was written is gone from the free space; nothing more is held


def checkpoint(sandbox: Sandbox, folder: Path) -> dict[str, Any]:
    """Quiesce the kernel, checkpoint the container, copy it into ``folder`` privately, remove the container."""
    config = sandbox.config
    wake, go = agent.names(secrets.token_hex(8))
    code = agent.code(wake, go, patience=config.startup_timeout + 10)  # it outwaits the host's wait for its reply
    reply = sandbox.run_hidden(code, config.startup_timeout)
    if reply is not None and str(reply.get("evalue", "")).startswith("nbexec-checkpoint-blocked"):
        raise Blocked(f"the sandbox holds sockets gVisor cannot save ({str(reply['evalue'])[27:200]})")
    if reply is None or reply.get("status") != "ok":
        raise SandboxError("the sandbox's kernel did not prepare for a checkpoint")
    if sandbox.client is not None:
        sandbox.client.close()
        sandbox.client = None
    try:
        _say(sandbox.runtime_dir, go)  # the reply was read: the kernel may let go of its sockets
    except OSError as exc:  # a name already there: only a sandbox that could write the folder put it there
        raise SandboxError(f"could not tell the kernel to let go in its runtime folder: {exc.strerror}") from exc
    _wait(lambda: not any(_answers(sandbox.runtime_dir / name) for name in _SOCKETS), config.startup_timeout,
          "the sandbox's kernel did not let go of its sockets")
    if sandbox.freezer is not None:
        sandbox.freezer.thaw()
    api = daemon.connect().api
    started = time.monotonic()
    with daemon.translated("checkpoint a sandbox"):
        response = api._post_json(api._url("/containers/{0}/checkpoints", sandbox.container.id),
                                  data={"CheckpointID": NAME, "Exit": True})
        api._raise_for_status(response)
    copied = Path(daemon.root_dir()) / "containers" / sandbox.container.id / "checkpoints" / NAME
    files = checkpointfiles.copy_out(copied, folder / "checkpoint", config.memory_bytes + CHECKPOINT_SLACK)
    log.debug("sandbox %s checkpointed in %.3f s", sandbox.id, time.monotonic() - started)
    with contextlib.suppress(DockerError), daemon.translated("remove a checkpointed sandbox"):
        sandbox.container.remove(force=True, v=True)
    leftovers.stop_shim(sandbox.container.id)  # a re-checkpointed restored container's would stay
    sandbox.container = None
    if sandbox.disk is not None:  # no container now: the woken one is admitted again (restore)
        sandbox.disk.release()
    return {"version": RECORD_VERSION, "runtime": config.runtime, "sandbox_id": sandbox.id,
            "workdir": str(sandbox.workdir), "uid": sandbox.uid, "gid": sandbox.gid, "wake": wake,
            "files": files}  # no key: every restore sets a fresh one


def restore(config: SandboxConfig, record: dict[str, Any], folder: Path,
            check: Callable[[], None] = lambda: None) -> Sandbox:
    """The hibernated sandbox of ``record`` running again: same id and working folder, in a new container started
    from the checked checkpoint, its kernel reconnected (``check`` polled); SandboxError (nothing left) otherwise."""
    files = _checked_record(record, config)
    sandbox = Sandbox(config, record["sandbox_id"], Path(record["workdir"]))
    sandbox.uid, sandbox.gid = int(record["uid"]), int(record["gid"])
    sandbox.data_fs = True  # the engine keeps the working folder, its data filesystem mounted
    sandbox.disk = space.reserve(space.sandbox_needs(config, sandbox.workdir), config.disk_margin_bytes)
    try:
        return _start_from(sandbox, record, files, folder, check)
    except BaseException:
        sandbox.disk.release()
        raise


def from_template(config: SandboxConfig, record: dict[str, Any], folder: Path) -> Sandbox:
    """A NEW sandbox (own id and folders) whose kernel is ``record``'s checkpoint (a template, a fork; its uid)."""
    files = _checked_record(record, config)
    sandbox = Sandbox.prepare(config, ids=(int(record["uid"]), int(record["gid"])))
    try:
        return _start_from(sandbox, record, files, folder)
    except BaseException:
        sandbox.destroy()
        raise


def _start_from(sandbox: Sandbox, record: dict[str, Any], files: dict[str, tuple[int, str]], folder: Path,
                check: Callable[[], None] = lambda: None) -> Sandbox:
    """Start a new container from the checkpoint with a fresh key and session id; reconnect."""
    config, client, container = sandbox.config, daemon.connect(), None
    copies = space.reserve([space.Need(Path(daemon.root_dir()), sum(size for size, _ in files.values()) * 2,
                                       "the engine's copies of the memory image it restores")],
                           config.disk_margin_bytes, action="restore a sandbox's memory")
    sandbox.connection = connection_info(config)
    kept = [copies]  # an abandoned restore's thread takes it: the engine writes its copies until it returns
    try:
        if (last := _unfinished.get(sandbox.id)) is not None:  # a stopped wake's: it binds in the same folder
            _wait(lambda: not last.is_alive(), config.startup_timeout, "the last restore of this sandbox", check)
        with daemon.translated("create a sandbox to restore"):
            container = client.containers.create(**container_options(config, "session", Place(
                sandbox.id, sandbox.uid, sandbox.gid, sandbox.workdir, claim=claim_of(sandbox.workdir))))
        target = Path(daemon.root_dir()) / "containers" / container.id / "checkpoints" / NAME
        checkpointfiles.copy_in(folder / "checkpoint", target, files)
        fresh = {"key": sandbox.connection["key"], "session": secrets.token_hex(16)}
        _open_runtime(sandbox.runtime_dir, str(record["wake"]), json.dumps(fresh).encode())
        # One at a time (a copy is removed once used); another's long restore never holds this wake past its check.
        _wait(lambda: _restoring.acquire(timeout=0.05), config.startup_timeout, "another restore held on", check)
        try:
            _started(client, container, sandbox.id, files, check, kept)
        except BaseException:
            container = None  # removed by `_started` (or by its thread once the engine lets go of it)
            raise
        sandbox.attach(container)
        with daemon.translated("remove a restored checkpoint"):  # read; the next hibernate writes its own
            client.api._raise_for_status(client.api._delete(
                client.api._url("/containers/{0}/checkpoints/{1}", container.id, NAME)))
        _wait(lambda: all((sandbox.runtime_dir / name).exists() for name in _SOCKETS), config.startup_timeout,
              "the restored kernel did not bind its sockets again", check)
        _lock_sockets(sandbox.runtime_dir, str(record["wake"]))
        sandbox.connect_kernel(check)
        (sandbox.runtime_dir / str(record["wake"])).unlink(missing_ok=True)
    except BaseException:
        if container is not None:
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True, v=True)
        sandbox.container = None
        raise
    finally:
        for hold in kept:
            hold.release()
    return sandbox


def _started(client: Any, container: Any, sandbox_id: str, files: dict[str, tuple[int, str]],
             check: Callable[[], None], kept: list[Any]) -> Any:
    """The engine's answer to starting ``container`` from its checkpoint: one blocking call (the engine unpacks the
    checkpoint, then runsc restores it), made on a thread of its own while ``check`` is polled. When anything
    raises here, the container is removed: at once when the call is over, else by that thread as soon as the
    engine lets go of it (it holds the container until then), so a stopped wake never waits for the engine."""
    answer: list[Any] = []
    orphan: list[Any] = []  # ``kept`` (the disk held for the engine's copies) once the waiting wake is gone
    handoff, abandoned = threading.Lock(), threading.Event()

    def start() -> None:
        try:
            with daemon.translated("restore a sandbox"):
                outcome: Any = client.api.post(client.api._url("/containers/{0}/start", container.id),
                                               params={"checkpoint": NAME})
        except BaseException as exc:
            outcome = exc
        try:
            with handoff:
                answer.append(outcome)
            if abandoned.is_set():  # the waiting wake is gone: nothing of this restore may stay
                _remove(container)
        finally:
            leftovers.remove_copies(files)  # containerd's copy of what it restored from
            for hold in orphan:
                hold.release()
            _restoring.release()
            _unfinished.pop(sandbox_id, None)

    thread = _unfinished[sandbox_id] = threading.Thread(target=start, name="nbexec-restore", daemon=True)
    thread.start()
    try:
        while not answer:
            check()
            thread.join(0.05)
        if isinstance(answer[0], BaseException):
            raise answer[0]
        client.api._raise_for_status(answer[0])
    except BaseException:
        with handoff:
            abandoned.set()
            over = bool(answer)
            if not over:
                orphan.extend(kept)
                kept.clear()
        if over:
            _remove(container)
        raise
    return answer[0]


def _remove(container: Any) -> None:
    with contextlib.suppress(docker.errors.APIError, DockerError):
        container.remove(force=True, v=True)


def _checked_record(record: dict[str, Any], config: SandboxConfig) -> dict[str, tuple[int, str]]:
    """The record's files as {name: (size, sha256)}, every field's type checked; SandboxError otherwise."""
    try:
        assert record["version"] == RECORD_VERSION and record["runtime"] == config.runtime
        assert isinstance(record["sandbox_id"], str) and record["sandbox_id"].isalnum()
        assert isinstance(record["wake"], str) and record["wake"].replace("-", "").isalnum()
        assert isinstance(record["workdir"], str) and "connection" not in record
        files = {str(name): (int(size), str(digest)) for name, (size, digest) in record["files"].items()}
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SandboxError("the hibernated sandbox's record is not one nbexec wrote") from exc
    if not files or any("/" in name or name.startswith(".") for name in files):
        raise SandboxError("the hibernated sandbox's record names no checkpoint files, or unsafe ones")
    if sum(size for size, _ in files.values()) > config.memory_bytes + CHECKPOINT_SLACK:
        raise SandboxError("the hibernated sandbox's checkpoint is larger than its memory limit allows")
    return files


def _open_runtime(runtime_dir: Path, wake: str, content: bytes) -> None:
    """Let the restored kernel bind its sockets again: the folder a small tmpfs (what the restored code writes there
    while it is open stays within RUNTIME_BYTES, named or not), the old socket files removed, the folder writable
    until it is up (`Sandbox.connect_kernel` locks it), and the wake file its agent waits for."""
    if not os.path.ismount(runtime_dir):  # the first restore into this working folder
        try:
            datafs.mount_small(runtime_dir, size=RUNTIME_BYTES, inodes=RUNTIME_INODES)
        except OSError as exc:
            raise SandboxError(f"could not cap the restored sandbox's runtime folder: {exc}") from exc
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in os.listdir(fd):
            if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):  # left by code a refused wake ran
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    _say(runtime_dir, wake, content)
    os.chmod(runtime_dir, 0o777)


def _say(runtime_dir: Path, name: str, content: bytes = b"") -> None:
    """Write the new file ``name`` (read-only) into the runtime folder, which the sandbox cannot write."""
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444, dir_fd=fd)
        with os.fdopen(out, "wb") as written:
            written.write(content)
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    """Whether something listens on the unix socket at ``path`` (in the locked runtime folder: host-made)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _lock_sockets(runtime_dir: Path, wake: str) -> None:
    """Lock the runtime folder again (the sandbox's code ran while it was open), then check that each name the
    host will connect to is a socket, never a link or anything else the sandbox could have left there, and that
    nothing else is there (a file the code opened while it could would let it write to the host's disk)."""
    os.chmod(runtime_dir, 0o555)
    for name in _SOCKETS:
        if not stat.S_ISSOCK(os.lstat(runtime_dir / name).st_mode):
            raise SandboxError(f"the restored sandbox left {name!r} in its runtime folder that is not its socket")
    extra = sorted(set(os.listdir(runtime_dir)) - {*_SOCKETS, wake})
    if extra:
        raise SandboxError(f"the restored sandbox made {extra[0][:80]!r} in its runtime folder while it was open "
                           "for its kernel's sockets: not woken")


def _wait(done: Any, timeout: float, message: str, check: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        check()
        if time.monotonic() > deadline:
            raise SandboxError(f"{message} within {timeout:g} s")
        time.sleep(0.005)

