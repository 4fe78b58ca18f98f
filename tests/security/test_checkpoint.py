"""Durable sessions, the runtime side: a local sandbox hibernated to a folder by gVisor's checkpoint and woken in a
new container keeps its memory (a variable, an imported module, a running thread) and its /mnt/data, cycle after
cycle, and every limit a fresh sandbox has; under runc the probe says no and nothing is touched; a checkpoint
changed on disk (a byte, a file added or removed, a link planted) is refused and leaves nothing behind.

Judged from outside: what the woken kernel prints, the containers Docker lists, the files on the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker.errors
import pytest

import nbexec
from nbexec.errors import SandboxError
from nbexec.sandbox.docker import checkpoint, daemon, pool
from nbexec.sandbox.docker.container import Sandbox
from nbexec.sandbox.docker.local import LocalSource
from nbexec.sandbox.kernel import KernelClient
from nbexec.sandbox.messages import Message

from ..conftest import IMAGE, own_containers, settle
from ..test_runtimes import UNDER_RUNSC
from . import test_hostile as hostile

STATE = """
import threading, time, json as kept_module
x = 41
ticks = [0]
def tick():
    while True:
        ticks[0] += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
open('/mnt/data/kept.txt', 'w').write('on disk')
"""


def run(sandbox: Sandbox, code: str) -> str:
    """What ``code`` printed on the sandbox's kernel (an error's name and value appended)."""
    out: list[str] = []

    def take(message: nbexec.sandbox.messages.Message) -> None:
        content = message.content()
        if message.msg_type == "stream":
            out.append(content["text"])
        elif message.msg_type == "error":
            out.append(f"{content['ename']}: {content['evalue']}")

    execution = sandbox.run(code, deadline=time.monotonic() + 30, on_output=take)
    assert execution.status != "gone", f"the sandbox went away running {code!r}: {''.join(out)}"
    return "".join(out)


def private_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hibernated"
    folder.mkdir(mode=0o700, parents=True)
    return folder


@pytest.fixture
def runsc(cleanup_ledger: None) -> nbexec.SandboxConfig:
    config = nbexec.SandboxConfig(image=IMAGE, runtime="runsc", pool_size=0, warm_imports=(), timeout=30)
    if "runsc" not in (daemon.connect().info().get("Runtimes") or {}):
        pytest.fail("gVisor (runsc) is not registered with Docker: run `sudo scripts/setup-gvisor.sh`",
                    pytrace=False)
    return config


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    """Every sandbox a test made or woke, destroyed at its end."""
    made: list[Sandbox] = []
    yield made
    for index, sandbox in enumerate(made):  # a hibernated one shares its working folder with the one woken
        if sandbox.container is not None or not any(s.workdir == sandbox.workdir for s in made[index + 1:]):
            sandbox.destroy()


def hibernated(config: nbexec.SandboxConfig, tmp_path: Path, made: list[Sandbox]) -> tuple[dict, Path, Sandbox]:
    sandbox = pool.start_sandbox(config, role="session", warm_up=False)
    made.append(sandbox)
    run(sandbox, STATE)
    folder = private_folder(tmp_path)
    record = LocalSource().hibernate(sandbox, folder)
    assert record is not None, f"runsc's probe said it cannot keep memory: {checkpoint.why_not(config)}"
    return record, folder, sandbox


def test_state_survives_several_hibernate_wake_cycles(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                      sandboxes: list[Sandbox]) -> None:
    source = LocalSource()
    record, folder, first = hibernated(runsc, tmp_path, sandboxes)
    assert own_containers() == [], "the hibernated sandbox's container is still there"
    last = -1
    for cycle in range(3):
        woken = source.wake(runsc, record, folder)
        sandboxes.append(woken)
        assert woken.id == first.id
        seen = json.loads(run(woken, "import json; print(json.dumps([x, kept_module.__name__, ticks[0], "
                                      "open('/mnt/data/kept.txt').read()]))"))
        assert seen[:2] == [41 + cycle, "json"] and seen[3] == "on disk"
        assert seen[2] > last, "the background thread did not run on after the wake"
        later = json.loads(run(woken, "time.sleep(0.3); print(ticks[0]); x += 1"))
        assert later > seen[2], "the background thread stopped after the wake"
        last = later
        folder = private_folder(tmp_path / f"cycle{cycle}")
        record = source.hibernate(woken, folder)
        assert record is not None


def test_a_host_that_reads_the_agents_reply_late_still_checkpoints(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                     sandboxes: list[Sandbox],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded host reads the kernel's answer to "prepare" late (here 1 s): it checkpoints all the same, and the
    sandbox wakes with its state (CI saw "the kernel closed its SUB connection" when the kernel let go of its
    sockets on a timer and the host read on after the answer)."""
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, STATE)
    recv, late = KernelClient.recv, []

    def read_late(self: KernelClient, channel: str, timeout: float, *, parent: str | None = None,
                  budget: int | None = None) -> Message | None:
        message = recv(self, channel, timeout, parent=parent, budget=budget)
        if channel == "shell" and message is not None and parent is not None:
            late.append(parent)
            time.sleep(1)
        return message

    monkeypatch.setattr(KernelClient, "recv", read_late)
    record = LocalSource().hibernate(sandbox, folder := private_folder(tmp_path))
    monkeypatch.undo()
    assert late, "the host never read a reply late: the test proves nothing"
    assert record is not None, f"not checkpointed: {checkpoint.why_not(runsc)}"
    woken = LocalSource().wake(runsc, record, folder)
    sandboxes.append(woken)
    assert run(woken, "print(x)") == "41\n"


def test_a_kernel_whose_checkpoint_the_host_gave_up_on_runs_on_with_its_state(runsc: nbexec.SandboxConfig,
                                                                              tmp_path: Path,
                                                                              sandboxes: list[Sandbox],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel lets go of its sockets only when the host says it has read its answer to "prepare". A host that
    never read it (it gave up waiting) refuses the checkpoint, and the kernel keeps answering with its state: at
    once, and after the agent's own patience has run out."""
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, STATE)
    sandbox.config = runsc.replace(startup_timeout=5)  # the agent's patience: 15 s
    run_hidden, asked = Sandbox.run_hidden, []

    def gave_up(self: Sandbox, code: str, timeout: float, **options: object) -> dict | None:
        reply = run_hidden(self, code, timeout, **options)  # type: ignore[arg-type]
        if "__nbexec_agent" in code:
            asked.append(reply)
            return None  # as if it came after the host's deadline
        return reply

    monkeypatch.setattr(Sandbox, "run_hidden", gave_up)
    with pytest.raises(SandboxError, match="did not prepare"):
        checkpoint.checkpoint(sandbox, private_folder(tmp_path))
    monkeypatch.undo()
    assert asked and (asked[0] or {}).get("status") == "ok", f"the agent did not run: {asked}"
    time.sleep(1)  # longer than any timer the kernel could have let go on
    assert run(sandbox, "print(x)") == "41\n", "the kernel let go of its sockets though the host gave up"
    time.sleep(5 + 10 + 2)
    assert run(sandbox, "x += 1; print(x)") == "42\n", "the kernel let go of its sockets after its patience"


@pytest.mark.parametrize("planted", ["file", "link", "dangling"])
def test_a_name_planted_where_the_host_says_go_refuses_the_checkpoint(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                      sandboxes: list[Sandbox], planted: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox that can write its runtime folder (nbexec not running as root) and learned the checkpoint's names
    could plant the host's "go" first: a file, a link to a file, a link to nothing. The host neither follows it
    (nothing made or changed where it points) nor fails with a bare OSError: the checkpoint is refused with
    SandboxError, and the session then sleeps by replay."""
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    kept, absent = tmp_path / "kept", tmp_path / "absent"
    kept.write_text("kept")
    names = checkpoint.agent.names
    monkeypatch.setattr(checkpoint.agent, "names", lambda token: names("0" * 16))  # the names it learned
    name = sandbox.runtime_dir / names("0" * 16)[1]
    if planted == "file":
        name.write_text("planted")
    else:
        name.symlink_to(kept if planted == "link" else absent)
    with pytest.raises(SandboxError):  # a name that exists may make the kernel let go before it answers
        checkpoint.checkpoint(sandbox, private_folder(tmp_path))
    assert kept.read_text() == "kept" and not absent.exists()


def containerd_copies() -> set[Path]:
    """containerd's ctrd-checkpoint* scratch folders, found on our own (its environment, seen through its root)."""
    found: set[Path] = set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "containerd":
                env = dict(i.split("=", 1) for i in (proc / "environ").read_text().split("\0") if "=" in i)
                base = proc / "root" / (env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp").lstrip("/")
                found |= set(base.glob("ctrd-checkpoint*"))
    return found


def engine_processes_of(container_ids: set[str]) -> list[str]:
    """Command lines of live processes naming one of ``container_ids`` (a containerd shim, a runsc)."""
    lines = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit():
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                lines += [line] if any(cid in line for cid in container_ids) else []
    return lines


def test_hibernate_and_wake_leave_no_copy_nor_process_on_the_host(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                    sandboxes: list[Sandbox]) -> None:
    """Two engine bugs would make every cycle a leak: containerd keeps a copy of each checkpoint it restores from
    (the sandbox's memory image, in its scratch folder) and a restored container checkpointed again keeps its shim
    running after removal. Three cycles: no new copy, no process naming any of the containers."""
    source = LocalSource()
    checkpoint.supported(runsc)  # the probe's own sandbox is judged by the same rule, but before we count
    copies = containerd_copies()
    first = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(first)
    ids = {first.container.id}
    folder = private_folder(tmp_path)
    record = source.hibernate(first, folder)
    assert record is not None, f"runsc's probe said it cannot keep memory: {checkpoint.why_not(runsc)}"
    for cycle in range(3):
        woken = source.wake(runsc, record, folder)
        sandboxes.append(woken)
        ids.add(woken.container.id)
        folder = private_folder(tmp_path / f"cycle{cycle}")
        record = source.hibernate(woken, folder)
        assert record is not None
    # What the engine reaps after a removal it reaps within a second; a restore another test abandoned (run beside
    # this one) keeps its copy until the engine lets go of it: a minute at most, under load.
    settle(lambda: not containerd_copies() - copies, 120)
    assert containerd_copies() - copies == set(), "containerd kept a copy of a checkpoint on the host"
    settle(lambda: not engine_processes_of(ids), 30)  # a shim ends a moment after its container, later under load
    assert engine_processes_of(ids) == [], "an engine process of a removed container is still running"


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_the_kernel_is_touched(
        runsc: nbexec.SandboxConfig, tmp_path: Path, sandboxes: list[Sandbox]) -> None:
    """The memory image (up to the memory limit) and the engine's copy of it are admitted like a sandbox's disk:
    a host that cannot hold them refuses the hibernate with DiskSpaceError before anything changes; the sandbox
    runs on with its state and nothing is written (the engine then replays, tests/security/test_durable_sleep.py)."""
    checkpoint.supported(runsc)  # the probe's own sandbox fits: this one is judged on its own
    free = shutil.disk_usage(tmp_path).free
    config = runsc.replace(memory=f"{free // 1024**2}m", disk_margin=f"{max(0, free - 8 * 1024**3) // 1024**2}m",
                           max_data="16m")  # starts (it may write ~100 MiB), cannot keep 2 x its memory limit
    sandbox = pool.start_sandbox(config, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, "x = 6")
    folder = private_folder(tmp_path)
    with pytest.raises(nbexec.DiskSpaceError, match="keep a sandbox's memory"):
        LocalSource().hibernate(sandbox, folder)
    assert run(sandbox, "print(x * 7)") == "42\n", "the kernel was asked to let go before the disk was admitted"
    assert list(folder.iterdir()) == []
    engines = Path(daemon.root_dir()) / "containers" / sandbox.container.id / "checkpoints"
    assert not engines.exists() or list(engines.iterdir()) == []


def test_a_hibernated_folder_is_private(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                        sandboxes: list[Sandbox]) -> None:
    record, folder, sandbox = hibernated(runsc, tmp_path, sandboxes)
    assert sandbox.connection["key"] not in json.dumps(record), "the record holds the kernel's key"
    kept = folder / "checkpoint"
    assert kept.stat().st_mode & 0o777 == 0o700
    assert [p.stat().st_mode & 0o777 for p in kept.iterdir()] == [0o600 for _ in kept.iterdir()]


LIMITS = """
import os, socket, subprocess
found = []
try:
    open('/usr/escaped', 'w')
except OSError as e:
    found.append('ro:' + type(e).__name__)
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2)
except OSError as e:
    found.append('net:' + type(e).__name__)
found.append('uid:%d' % os.getuid())
found.append('mem:' + open('/proc/meminfo').readline().split()[1])
print(' '.join(found))
"""


def test_a_woken_sandbox_keeps_every_limit(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                           sandboxes: list[Sandbox]) -> None:
    config = runsc.replace(memory="256m", pids=128)
    record, folder, first = hibernated(config, tmp_path, sandboxes)
    woken = LocalSource().wake(config, record, folder)
    sandboxes.append(woken)
    seen = run(woken, LIMITS)
    assert "ro:" in seen and "net:OSError" in seen and f"uid:{first.uid}" in seen and "mem:262144" in seen, seen
    host = woken.container.attrs["HostConfig"]
    assert (host["Memory"], host["PidsLimit"], host["ReadonlyRootfs"], host["NetworkMode"]) == (
        256 * 1024**2, 128, True, "none")
    # The memory limit is enforced by the woken container: a 400 MiB allocation ends the sandbox.
    held: list[str] = []
    with contextlib.suppress(nbexec.NbexecError):
        held.append(run(woken, "b = bytearray(400 * 1024**2)\nb[::4096] = b'x' * len(b[::4096])\nprint('held')"))
    assert "held" not in "".join(held), "the woken sandbox held 400 MiB under a 256 MiB limit"


def test_a_woken_sandbox_keeps_its_pid_limit(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                             sandboxes: list[Sandbox]) -> None:
    """200 processes under pids=128: refused, or (gVisor's way, as for a fresh sandbox) the sandbox ends."""
    config = runsc.replace(pids=128)
    record, folder, _ = hibernated(config, tmp_path, sandboxes)
    woken = LocalSource().wake(config, record, folder)
    sandboxes.append(woken)
    out: list[str] = []
    with contextlib.suppress(nbexec.NbexecError):  # the kernel may be lost to the limit (under load)
        out.append(run(woken, "import subprocess\nps=[]\ntry:\n    [ps.append(subprocess.Popen(['sleep','60'])) "
                              "for _ in range(200)]\nexcept OSError:\n    pass\nprint(len(ps))"))
    if out:
        assert not woken.state().running or int(out[0]) < 128, out
    elif woken.state().running:  # the kernel was lost to the limit: judged by Docker's list of its processes
        assert woken.container is not None
        try:
            processes = woken.container.top()["Processes"]
        except docker.errors.APIError:  # it stopped meanwhile: the limit ended it
            processes = []
        assert len(processes) <= 128


def test_under_runc_the_probe_says_no_and_the_sandbox_is_untouched(cleanup_ledger: None, tmp_path: Path,
                                                                  sandboxes: list[Sandbox]) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, runtime=None, pool_size=0, warm_imports=())
    sandbox = pool.start_sandbox(config, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, "x = 7")
    folder = private_folder(tmp_path)
    assert LocalSource().hibernate(sandbox, folder) is None
    assert run(sandbox, "print(x * 6)") == "42\n"
    assert list(folder.iterdir()) == []


def tamper_byte(kept: Path) -> None:
    image = kept / "checkpoint.img"
    with open(image, "r+b") as blob:
        blob.seek(os.path.getsize(image) // 2)
        byte = blob.read(1)
        blob.seek(-1, os.SEEK_CUR)
        blob.write(bytes([byte[0] ^ 1]))


def tamper_add(kept: Path) -> None:
    (kept / "extra.img").write_bytes(b"planted")


def tamper_remove(kept: Path) -> None:
    next(kept.iterdir()).unlink()


def tamper_link(kept: Path) -> None:
    image = kept / "checkpoint.img"
    os.replace(image, kept.parent / "elsewhere.img")
    image.symlink_to(kept.parent / "elsewhere.img")


def tamper_grow(kept: Path) -> None:
    with open(kept / "checkpoint.img", "ab") as blob:
        blob.write(b"\0" * 4096)


TAMPERING: dict[str, Callable[[Path], None]] = {
    "byte": tamper_byte, "added": tamper_add, "removed": tamper_remove, "symlink": tamper_link, "grown": tamper_grow}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_tampered_checkpoint_is_refused_and_leaves_nothing(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                             sandboxes: list[Sandbox], how: str) -> None:
    record, folder, _ = hibernated(runsc, tmp_path, sandboxes)
    before = set((daemon.root_dir() / "containers").iterdir())
    TAMPERING[how](folder / "checkpoint")
    with pytest.raises(SandboxError, match="checkpoint"):
        LocalSource().wake(runsc, record, folder)
    assert own_containers() == [], "a refused wake left a container"
    assert left_in_docker(before) == [], "a refused wake left a folder in Docker's data root"


def left_in_docker(before: set[Path]) -> list[str]:
    """Folders in Docker's data root made since ``before`` that are ours or of no container.

    The engine is shared: other processes' new containers are not leaks. Docker makes a container's folder before
    it registers the container, so another process's container being created looks, for a moment, like a folder
    of no container. Such a folder is judged again until it is registered or gone (30 s at most); a folder whose
    saved configuration names another owner is never ours."""
    deadline = time.monotonic() + 30
    while True:
        left = [folder.name for folder in set((daemon.root_dir() / "containers").iterdir()) - before
                if _ours_or_orphaned(folder)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _ours_or_orphaned(folder: Path) -> bool:
    try:
        return daemon.connect().containers.get(folder.name).labels.get(daemon.LABEL_OWNER) == daemon.owner()
    except docker.errors.NotFound:
        pass
    try:
        saved = json.loads((folder / "config.v2.json").read_text())
    except (FileNotFoundError, ValueError):
        return folder.exists()  # gone, or its configuration not yet (wholly) saved
    return (saved.get("Config", {}).get("Labels") or {}).get(daemon.LABEL_OWNER) == daemon.owner()


@pytest.mark.parametrize("field,value", [("files", {}), ("files", {"../x": [1, "0" * 64]}),
                                         ("runtime", None), ("sandbox_id", "../../etc"), ("version", 2),
                                         ("connection", {"shell_port": "../../../../var/run/docker.sock"})])
def test_a_forged_record_is_refused(runsc: nbexec.SandboxConfig, tmp_path: Path, sandboxes: list[Sandbox],
                                    field: str, value: object) -> None:
    record, folder, _ = hibernated(runsc, tmp_path, sandboxes)
    with pytest.raises(SandboxError):
        LocalSource().wake(runsc, {**record, field: value}, folder)
    assert own_containers() == []


def test_a_checkpoint_past_its_cap_is_refused_before_a_byte_is_copied(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                      sandboxes: list[Sandbox]) -> None:
    """The image grown (sparse) past memory + 64 MiB, and the record forged to match it: refused by its size."""
    record, folder, _ = hibernated(runsc, tmp_path, sandboxes)
    image = folder / "checkpoint" / "checkpoint.img"
    os.truncate(image, 330 * 1024**2)
    digest = hashlib.sha256()
    with open(image, "rb") as blob:
        while chunk := blob.read(1 << 20):
            digest.update(chunk)
    forged = {**record, "files": {**record["files"], "checkpoint.img": [330 * 1024**2, digest.hexdigest()]}}
    with pytest.raises(SandboxError, match="larger than its memory limit"):
        LocalSource().wake(runsc.replace(memory="256m"), forged, folder)
    assert own_containers() == []


def test_the_probe_is_asked_once_per_runtime(runsc: nbexec.SandboxConfig) -> None:
    assert checkpoint.supported(runsc) is True
    assert checkpoint.supported(runsc.replace(memory="1g")) is True  # cached: no second probe container


def test_a_no_is_asked_again_later_and_a_yes_is_kept(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A probe that met a loaded or restarting engine says no: it is asked once more at once, a second no is kept
    (and said, with why) for PROBE_AGAIN, then asked again; a yes is never asked again."""
    answers, asked = ["no: first", "", "no: once", "no: twice", ""], []
    monkeypatch.setattr(checkpoint, "_probed", {})
    monkeypatch.setattr(checkpoint.daemon, "checkpoint_refusal", lambda: "")  # the engine's route is there
    monkeypatch.setattr(checkpoint, "_probe", lambda config: asked.append(config.runtime) or answers[len(asked) - 1])
    assert checkpoint.supported(nbexec.SandboxConfig(runtime="flaky")) is True and len(asked) == 2  # retried
    assert checkpoint.why_not(nbexec.SandboxConfig(runtime="flaky")) == ""
    config = nbexec.SandboxConfig(runtime="slow")
    assert checkpoint.supported(config) is False and len(asked) == 4
    assert checkpoint.why_not(config) == "no: twice" and "no: twice" in caplog.text
    assert checkpoint.supported(config) is False and len(asked) == 4  # within PROBE_AGAIN: the answer kept
    monkeypatch.setattr(checkpoint, "PROBE_AGAIN", 0.0)
    assert checkpoint.supported(config) is True and len(asked) == 5
    assert checkpoint.supported(config) is True and len(asked) == 5  # a yes is never asked again


PLANT = """
import os, zmq
_bind = zmq.Socket.bind
def bind(self, address):
    if address.endswith('/kernel-1') and any(f.startswith('wake-') for f in os.listdir('/run/nbexec')):
        @PLANT@('/run/nbexec/kernel-1')  # restored: the host is about to connect here
        return None
    return _bind(self, address)
zmq.Socket.bind = bind
"""
PLANTS = {"link": "(lambda at: os.symlink(@BAIT@, at))", "directory": "os.mkdir", "fifo": "os.mkfifo"}
# How each is refused: gVisor keeps a fifo made in the host's folder to itself (the host never sees one there), so
# the host waits for the socket until the startup time runs out.
REFUSED = {"link": "not its socket", "directory": "not its socket", "fifo": "did not bind its sockets again"}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_anything_but_a_socket_planted_for_the_host_refuses_the_wake(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                     sandboxes: list[Sandbox], plant: str) -> None:
    """The woken kernel's code runs while its socket folder is open: it plants a link where the shell socket
    goes, to a socket of the host (or a folder, or a fifo). The host never connects to it, and the wake is
    refused."""
    bait_path = Path(tempfile.mkdtemp(prefix="nbexec-bait-")) / "bait.sock"  # short: a unix socket's path limit
    bait = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bait.bind(str(bait_path))
    bait.listen(8)
    bait.setblocking(False)
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, PLANT.replace("@PLANT@", PLANTS[plant]).replace("@BAIT@", repr(str(bait_path))))
    folder = private_folder(tmp_path)
    record = LocalSource().hibernate(sandbox, folder)
    assert record is not None
    with pytest.raises(SandboxError, match=REFUSED[plant]):
        sandboxes.append(LocalSource().wake(runsc.replace(startup_timeout=15), record, folder))
    with pytest.raises(BlockingIOError):
        bait.accept()  # nobody connected to the host's socket
    bait.close()
    shutil.rmtree(bait_path.parent)
    assert own_containers() == [], "a refused wake left a container"


IDENTITY = ("import random\nk = get_ipython().kernel.session\n"
            "print(json.dumps([k.key.decode(), k.session, random.random(), x, sorted(os.listdir('/mnt/data'))]))")


def test_sandboxes_from_one_template_get_their_own_key_ids_and_files(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                     sandboxes: list[Sandbox]) -> None:
    """Every sandbox restored from one memory image (a template, a fork) must not share its HMAC key, its
    kernel session id, its random state or its /mnt/data with the others."""
    template = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(template)
    run(template, "import json, os, random\nx = 41\nrandom.seed(7)\nopen('/mnt/data/template.txt', 'w').write('t')")
    folder = private_folder(tmp_path)
    record = checkpoint.checkpoint(template, folder)
    made = [checkpoint.from_template(runsc, record, folder) for _ in range(2)]
    sandboxes.extend(made)
    seen = [json.loads(run(sandbox, IDENTITY)) for sandbox in made]
    assert [s[0] for s in seen] == [sandbox.connection["key"] for sandbox in made], "the kernel's key is not the host's"
    assert seen[0][0] != seen[1][0] and seen[0][0] != template.connection["key"], "two sandboxes share a key"
    assert seen[0][1] != seen[1][1], "two sandboxes share the kernel's session id"
    assert seen[0][2] != seen[1][2], "two sandboxes draw the same random numbers"
    assert [s[3] for s in seen] == [41, 41] and [s[4] for s in seen] == [[], []]
    assert len({sandbox.id for sandbox in made} | {template.id}) == 3
    assert len({sandbox.workdir for sandbox in made} | {template.workdir}) == 3


@pytest.mark.parametrize("holds", [
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()",  # a server of the code's on localhost
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 0))",
    "s = socket.socket(socket.AF_UNIX); s.bind('/mnt/data/own.sock'); s.listen()",  # a socket on a host mount
])
def test_a_sandbox_holding_sockets_gvisor_cannot_save_is_left_running(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                                      sandboxes: list[Sandbox], holds: str) -> None:
    """A checkpoint that fails kills the container: such a sandbox is never checkpointed (None, the engine
    replays), and it runs on with its state and its socket."""
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, "import socket\nx = 6\n" + holds)
    folder = private_folder(tmp_path)
    assert LocalSource().hibernate(sandbox, folder) is None
    assert run(sandbox, "print(x * 7, s.fileno() > 0)") == "42 True\n"
    assert list(folder.iterdir()) == []


def test_a_kernel_that_keeps_its_sockets_is_not_checkpointed(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                              sandboxes: list[Sandbox]) -> None:
    """The code disables the agent's unbinding: the host waits only up to startup_timeout, never checkpoints a
    container whose host sockets are still bound (that would kill it), and writes nothing into the folder."""
    config = runsc.replace(startup_timeout=5)
    sandbox = pool.start_sandbox(config, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, "import zmq\nzmq.Socket.unbind = lambda self, endpoint: None")
    folder = private_folder(tmp_path)
    with pytest.raises(SandboxError, match="did not let go"):
        LocalSource().hibernate(sandbox, folder)
    assert sandbox.state().running, "a checkpoint was tried on a kernel that kept its sockets"
    assert list(folder.iterdir()) == []


CORE = ("fork-bomb", "memory-bomb", "write-rootfs", "http-exfiltration", "docker-bridge-host", "docker-socket",
        "host-files", "capabilities", "symlink-to-host")


@pytest.mark.parametrize("case", [c for c in hostile.CASES if c.id in CORE], ids=lambda c: c.id)
def test_a_woken_sandbox_contains_the_hostile_suites_core_escapes(
        case: hostile.Case, canary: Path, listener: hostile.Listener, cleanup_ledger: None,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The hostile suite's core cases, run by the engine on a sandbox that was hibernated and woken (the pool
    hands out only such sandboxes here), judged by the suite's own checks (gVisor's, where test_runtimes has one:
    a fork bomb ends a runsc sandbox rather than failing its fork)."""
    run_ = hostile.prepare(case, listener)
    config = hostile.contained_config(case, canary).replace(runtime="runsc")
    woken: list[Sandbox] = []

    def acquire(wanted: nbexec.SandboxConfig) -> Sandbox:
        sandbox = pool.start_sandbox(wanted, role="session", warm_up=False)
        folder = private_folder(tmp_path / f"h{len(woken)}")
        record = checkpoint.hibernate(sandbox, folder)
        if record is None:
            sandbox.destroy()
            pytest.fail(f"runsc's probe said it cannot keep memory: {checkpoint.why_not(sandbox.config)}")
        woken.append(checkpoint.restore(wanted, record, folder))
        return woken[-1]

    monkeypatch.setattr(pool, "acquire", acquire)
    before = hashlib.sha256(canary.read_bytes()).hexdigest()
    result = nbexec.execute_notebook(run_.code, config=config)
    assert len(woken) == 1, "the run's sandbox was not a woken one"
    (UNDER_RUNSC[case.id][0] if case.id in UNDER_RUNSC else case.check)(result)  # as for a fresh runsc sandbox
    assert hashlib.sha256(canary.read_bytes()).hexdigest() == before
    assert listener.got(run_.token) == b"", "the host listener received data from the sandbox"


def test_a_checkpoint_past_its_cap_is_not_copied_out(runsc: nbexec.SandboxConfig, tmp_path: Path,
                                                     sandboxes: list[Sandbox], monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy out of Docker's data root is capped like the copy back in (memory + CHECKPOINT_SLACK): the cap
    shrunk to 16 MiB in this process (the copy runs here), a sandbox holding 48 MiB of random bytes is refused
    and nothing partial is left in the folder."""
    assert checkpoint.supported(runsc)  # probed at the real cap first
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, "import os\nheld = os.urandom(48 * 1024**2)")
    monkeypatch.setattr(checkpoint, "CHECKPOINT_SLACK", 16 * 1024**2 - runsc.memory_bytes)
    folder = private_folder(tmp_path)
    try:
        record = LocalSource().hibernate(sandbox, folder)
    except SandboxError as exc:
        assert "larger than" in str(exc), str(exc)
    else:
        copied = sum(size for size, _ in record["files"].values()) if record else 0
        pytest.fail(f"a {copied / 1024**2:.0f} MiB checkpoint was copied out past the 16 MiB cap")
    assert list(folder.iterdir()) == [], "a partial copy was left in the folder"


WRITER = """
import os, threading, time
def __write():
    while not any(n.startswith('wake-') for n in os.listdir('/run/nbexec')):
        time.sleep(0.001)
    while True:  # restored: the folder is open until the kernel binds its sockets
        try:
            out = open('/run/nbexec/filler', 'wb')
            break
        except OSError:
            time.sleep(0.0005)
    while True:
        out.write(b'x' * 65536)
        out.flush()
        time.sleep(0.01)
threading.Thread(target=__write, daemon=True).start()
"""


def test_what_the_sandbox_writes_in_its_open_runtime_folder_refuses_the_wake(
        runsc: nbexec.SandboxConfig, tmp_path: Path, sandboxes: list[Sandbox]) -> None:
    """The woken kernel's code runs while its runtime folder (a host folder) is open to it for the kernel's
    sockets: it opens a file there and keeps writing to the host's disk through it. The wake is refused, the
    container (the writer) removed, and nothing but the kernel's own names is in the folder afterwards."""
    sandbox = pool.start_sandbox(runsc, role="session", warm_up=False)
    sandboxes.append(sandbox)
    run(sandbox, WRITER)
    folder = private_folder(tmp_path)
    record = LocalSource().hibernate(sandbox, folder)
    assert record is not None
    try:
        sandboxes.append(LocalSource().wake(runsc, record, folder))
    except SandboxError as exc:
        assert "runtime folder" in str(exc), str(exc)
    else:
        time.sleep(1)
        grown = (sandbox.runtime_dir / "filler").stat().st_size
        pytest.fail(f"woken with the code writing to the host through its runtime folder ({grown:,} bytes in 1 s)")
    assert own_containers() == [], "a refused wake left a container"
