"""Host disk is admitted before it is used: a sandbox is not started when its share of the host's disk (its data
filesystem, the copy of its files, images, notebook) plus a margin is not free on the working and output folders,
counting what sandboxes admitted earlier may still write.

The attacks run on a small filesystem of their own: a 200 MiB ext4 image loop-mounted on a temporary folder that
becomes TMPDIR (working and output folders), with max_data chosen so that two sandboxes fit and a third does not.
Judged from outside: which starts are refused and with what error (library, CLI exit code, HTTP status), that
admitted sandboxes keep working and filling their /mnt/data, what is left on the small filesystem and in Docker,
and the free space that remains. Everything the tests mount is unmounted by them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import httpx
import pytest

import nbexec
from nbexec.errors import SandboxError
from nbexec.files import mounts
from nbexec.sandbox.docker import daemon, datafs, pool

from ..conftest import IMAGE, own_containers, wait_until
from .test_service import TOKEN_A, start_serve, stop

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
MARGIN = 16 * MiB


@dataclass
class SmallDisk:
    """A loop-mounted ext4 filesystem of ``size`` bytes at ``path``, used as TMPDIR."""

    path: Path
    image: Path

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def entries(self) -> list[str]:
        """What nbexec left in its folders on the small disk (the private roots themselves excepted)."""
        found = []
        for root in self.path.iterdir():
            if root.is_dir() and root.name.startswith("nbexec"):
                found += [f"{root.name}/{entry.name}" for entry in root.iterdir()]
        return sorted(found)


def share(max_data: int, max_display: int, max_output: int) -> int:
    """The host disk one sandbox may use, as the docs state it (packages off): its data filesystem, the copy
    of its files, its images, and its notebook (twice the output allowances: JSON and the copy being replaced)."""
    return 2 * max_data + max_display + 2 * (max_output + max_display)


def sized_for(disk: SmallDisk, fit: int) -> dict[str, str]:
    """NBEXEC_* values with which ``fit`` sandboxes fit in the disk's free space and one more does not (nor the
    data filesystem of one more), with a quarter of a share to spare."""
    target = (disk.free() - MARGIN) / (fit + 0.25)
    max_data = int((target - 5 * MiB) / 2) // MiB
    each = share(max_data * MiB, MiB, MiB)
    assert fit * each + MARGIN < disk.free() < fit * each + max_data * MiB + MARGIN
    return {"NBEXEC_MAX_DATA": f"{max_data}m", "NBEXEC_MAX_DISPLAY": "1m", "NBEXEC_MAX_OUTPUT": "1m",
            "NBEXEC_DISK_MARGIN": f"{MARGIN // MiB}m", "NBEXEC_PACKAGES": "off", "NBEXEC_IMAGE": IMAGE,
            "NBEXEC_WARM_IMPORTS": "", "NBEXEC_TIMEOUT": "60", "NBEXEC_INTERRUPT_GRACE": "3"}


@pytest.fixture
def small_disk(cleanup_ledger: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    if not datafs.can_mount():
        pytest.fail("these tests mount a small filesystem: run them as root with mkfs.ext4 and loop devices",
                    pytrace=False)
    image, path = tmp_path / "disk.img", tmp_path / "disk"
    path.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(200 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True, capture_output=True)
    path.chmod(0o755)  # the sandbox user reaches its bind mounts through it
    disk = SmallDisk(path, image)
    before = set(own_containers(include_pool=True))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    try:
        yield disk
    finally:
        pool.shutdown()  # pools of the small disk's configs hold sandboxes whose folders live there
        nbexec.engine.reaper.close_all()
        pool.wait_for_teardown()
        left = [name for name in own_containers(include_pool=True) if name not in before]
        entries = [e for e in disk.entries() if not e.startswith("nbexec-output")]  # outputs are handed back
        for name in left:
            with contextlib.suppress(docker.errors.NotFound):
                daemon.connect().containers.get(name).remove(force=True)
        mounts.unmount_all(path)
        monkeypatch.undo()
        assert not mounts.mounts_under(path), "the small disk is still mounted"
        image.unlink()
    assert (left, entries) == ([], []), "containers or working folders were left on the small disk"


def config_for(disk: SmallDisk, fit: int = 2, **extra: str) -> nbexec.SandboxConfig:
    environ = {**sized_for(disk, fit), "NBEXEC_POOL_SIZE": "0", **extra}
    return nbexec.from_env(environ)


def refused_start(config: nbexec.SandboxConfig, match: str) -> None:
    """Starting a session of ``config`` must be refused (and the session is closed whatever happens)."""
    session = nbexec.Session(config, keep_files=False)
    try:
        with pytest.raises(SandboxError, match=match):
            session.start()
    finally:
        session.close()


def test_a_sandbox_past_the_free_disk_is_refused_and_the_others_keep_working(small_disk: SmallDisk) -> None:
    config = config_for(small_disk)
    first, second = (nbexec.Session(config, keep_files=False).start() for _ in range(2))
    try:
        before = (small_disk.entries(), set(own_containers(include_pool=True)))
        third = nbexec.Session(config, keep_files=False)
        with pytest.raises(SandboxError, match="disk") as refused:
            third.start()
        message = str(refused.value)
        assert "max_data" in message and "disk_margin" in message.lower(), message
        assert (small_disk.entries(), set(own_containers(include_pool=True))) == before, "the refusal left something"
        # the admitted ones fill their /mnt/data to the brim and still finish, with their files collected
        fill = ("written = 0\nf = open('/mnt/data/fill', 'wb', buffering=0)\ntry:\n    while True:\n"
                "        written += f.write(b'x' * (1 << 20))\nexcept OSError:\n    pass\nprint(written)")
        for session in (first, second):
            result = session.run(fill)
            assert result.ok and int(result.stdout) > 0, result.error
            assert session.run("print(6 * 7)").stdout == "42\n"
        assert small_disk.free() >= MARGIN, small_disk.free()  # both filled: the margin is still free
        refused_start(config, "disk")
        assert second.run("import os\nos.remove('/mnt/data/fill')").ok  # its copy goes with the file
    finally:
        first.close()
    third.start()  # the first one's share came back when it ended
    assert third.run("print(1)").stdout == "1\n"
    third.close()
    second.close()


def test_the_margin_stays_free(small_disk: SmallDisk) -> None:
    """A sandbox whose share fits in the free space is still refused when it would eat into disk_margin."""
    base = {**sized_for(small_disk, 2), "NBEXEC_POOL_SIZE": "0"}
    each = share(int(base["NBEXEC_MAX_DATA"].rstrip("m")) * MiB, MiB, MiB)
    spare = small_disk.free() - each  # what one sandbox leaves free
    tight = nbexec.from_env({**base, "NBEXEC_DISK_MARGIN": str(spare + 8 * MiB)})
    refused_start(tight, "disk_margin")
    roomy = nbexec.from_env({**base, "NBEXEC_DISK_MARGIN": str(spare - 8 * MiB)})
    with nbexec.Session(roomy, keep_files=False) as session:
        assert session.run("print(5)").stdout == "5\n"


def test_concurrent_starts_cannot_all_pass_on_the_same_free_space(small_disk: SmallDisk) -> None:
    config = config_for(small_disk)
    started: list[nbexec.Session] = []
    refused: list[str] = []
    lock = threading.Lock()

    def start() -> None:
        session = nbexec.Session(config, keep_files=False)
        try:
            session.start()
        except SandboxError as exc:
            with lock:
                refused.append(str(exc))
            return
        with lock:
            started.append(session)

    threads = [threading.Thread(target=start) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert (len(started), len(refused)) == (2, 8), (len(started), refused)
        assert all("disk" in message for message in refused)
    finally:
        for session in started:
            session.close()


def test_one_shots_and_the_pool_are_refused_too(small_disk: SmallDisk) -> None:
    config = config_for(small_disk, fit=1)
    holder = nbexec.Session(config, keep_files=False).start()
    try:
        with pytest.raises(SandboxError, match="disk"):
            nbexec.execute_notebook("print(1)", config=config)
        pooled = config.replace(pool_size=2)
        pool.warm_up(pooled)
        wait_until(lambda: pool._pool_for(pooled).idle(), 120, "the pool kept trying to start sandboxes")
        with pytest.raises(SandboxError, match="disk"):
            nbexec.execute_notebook("print(1)", config=pooled)
        assert holder.run("print(2)").stdout == "2\n"
    finally:
        holder.close()
    assert nbexec.execute_notebook("print(3)", config=config).stdout == "3\n"


def test_admissions_in_two_processes_share_the_ledger(small_disk: SmallDisk) -> None:
    """What this process holds counts for another nbexec process on the same folders (parallel CLI runs)."""
    env = {**sized_for(small_disk, 1), "NBEXEC_POOL_SIZE": "0"}
    with nbexec.Session(nbexec.from_env(env), keep_files=False) as holder:
        holder.start()
        done = _cli(small_disk, "run", "-", env=env)
        assert done.returncode == 3 and "disk" in done.stderr, (done.returncode, done.stdout, done.stderr)
    done = _cli(small_disk, "run", "-", env=env)  # its share was released when it closed
    assert done.returncode == 0, done.stderr


def test_a_dead_processs_record_holds_nothing(small_disk: SmallDisk) -> None:
    """A process killed while it held disk (no release) does not keep the host's disk held."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger = small_disk.path / f"nbexec-disk-{os.getuid()}"
    ledger.mkdir(mode=0o700, exist_ok=True)
    record = ledger / f"{gone.pid}-12345-deadbeef0000"
    record.write_text(f"[[{os.stat(small_disk.path).st_dev}, {1 << 50}, null]]")
    with nbexec.Session(config_for(small_disk, fit=1), keep_files=False) as session:
        assert session.run("print(4)").stdout == "4\n"
    assert not record.exists()


def _cli(disk: SmallDisk, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env, "TMPDIR": str(disk.path), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nbexec.cli", *args], cwd=disk.path, env=environ, input="print(1)\n",
                          capture_output=True, text=True, timeout=300)


def test_the_cli_exits_3_with_the_reason(small_disk: SmallDisk) -> None:
    env = {**sized_for(small_disk, 0), "NBEXEC_POOL_SIZE": "0"}  # not even one fits
    done = _cli(small_disk, "run", "-", env=env)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert "disk" in done.stderr and "max_data" in done.stderr, done.stderr
    assert not (small_disk.path / "nbexec-output").exists() or not any((small_disk.path / "nbexec-output").iterdir())


def test_serve_answers_503_with_the_reason_and_keeps_serving(small_disk: SmallDisk, tmp_path: Path) -> None:
    env = {**sized_for(small_disk, 0), "TMPDIR": str(small_disk.path)}
    server = start_serve(tmp_path, env=env)
    try:
        with server.client(TOKEN_A) as http:
            answer = http.post("/v1/execute", json={"code": "print(1)"})
            assert answer.status_code == 503, (answer.status_code, answer.text[:500])
            assert "disk" in answer.json()["detail"] and answer.headers.get("retry-after"), answer.text
            session = http.post("/v1/sessions").json()["id"]
            answer = http.post(f"/v1/sessions/{session}/execute", json={"code": "print(1)"})
            assert answer.status_code == 503 and "disk" in answer.json()["detail"], answer.text
            streamed = http.post("/v1/execute?stream=true", json={"code": "print(1)"})
            assert "503" in streamed.text and "disk" in streamed.text, streamed.text[:500]
            assert httpx.get(f"{server.url}/healthz").status_code == 200
    finally:
        stop(server)
    assert server.containers() == []


def test_doctor_states_each_sandboxs_share_of_the_disk(small_disk: SmallDisk) -> None:
    env = sized_for(small_disk, 2)
    max_data = int(env["NBEXEC_MAX_DATA"].rstrip("m")) * MiB
    done = _cli(small_disk, "doctor", env=env)
    line = next((x for x in done.stdout.splitlines() if "host disk" in x), "")
    total = share(max_data, MiB, MiB)
    assert f"{total / MiB:.1f} MiB" in line and "room for 2 " in line, done.stdout
    too_big = _cli(small_disk, "doctor", env=sized_for(small_disk, 0))
    assert too_big.returncode == 3 and any(x.startswith("FAIL") and "host disk" in x
                                           for x in too_big.stdout.splitlines()), too_big.stdout


# -- what a sandbox may write elsewhere on the host --------------------------------------------------------------

def test_the_container_log_is_capped(cleanup_ledger: None) -> None:
    """The kernel's own stdout and stderr (fd 1 and 2, not the notebook's streams) land in Docker's log file on
    the host's disk; code that writes there must not fill it."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    code = "import os\nfor _ in range(64):\n    os.write(1, b'x' * (1 << 20))\n    os.write(2, b'y' * (1 << 20))\n"
    with nbexec.Session(config) as session:
        assert session.run(code).ok
        container = session._sandbox.container  # type: ignore[union-attr]
        container.reload()
        log = Path(container.attrs["LogPath"])
        held = sum(p.stat().st_size for p in log.parent.glob(log.name + "*"))
        print(f"\nthe container's log after 128 MiB written to fd 1 and 2: {held:,} bytes")
        assert held <= 4 * MiB, f"the container's log holds {held:,} bytes after 128 MiB written to fd 1 and 2"
