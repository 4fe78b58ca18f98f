"""/mnt/data has a hard limit the kernel enforces, and what the host keeps of it is bounded and a snapshot.

Each test attacks from inside the sandbox and judges from outside: bytes the host holds for the sandbox, the
result, the files handed over on the host, mounts and loop devices left behind.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

import nbexec
from nbexec.files import mounts
from nbexec.files.folders import work_root
from nbexec.files.workdir import remove_stale_workdirs
from nbexec.sandbox.docker import datafs, pool

from ..conftest import IMAGE

MiB = 1024**2


@pytest.fixture
def small(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """One pooled sandbox with a 32 MiB /mnt/data (quick to fill)."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=30, interrupt_grace=3,
                                max_data="32m")


def _host_tree(root: str) -> list[tuple[str, os.stat_result]]:
    """Everything under ``root`` on the host's own filesystem (a data filesystem mounted there is its image)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(folder, d))]
        for name in dirs + files:
            path = os.path.join(folder, name)
            found.append((path, os.lstat(path)))
    return found


def _host_bytes(root: str) -> int:
    return sum(st.st_blocks * 512 for _, st in _host_tree(root))


def test_quick_cells_cannot_write_past_the_cap(small: nbexec.SandboxConfig) -> None:
    # Quick writes, no pauses for a sampler to notice; the cell counts what the kernel accepted.
    code = ("written = 0\nf = open('/mnt/data/fill', 'wb', buffering=0)\n"
            "try:\n    while True:\n        written += f.write(b'x' * (4 << 20))\n"
            "except OSError as exc:\n    print('stopped', exc.errno, written)\n")
    result = nbexec.execute_notebook(code, config=small)
    assert result.ok, result.error
    _, errno_seen, written = result.stdout.split()
    assert errno_seen == "28" and int(written) <= 32 * MiB  # overshoot: zero
    assert any("reached its 32m cap" in note for note in result.notes), result.notes
    assert sum(f.size for f in result.files) <= 32 * MiB
    assert _host_bytes(result.output_dir + "/data") <= 32 * MiB


def test_uncaught_enospc_is_a_limit_error(small: nbexec.SandboxConfig) -> None:
    code = "f = open('/mnt/data/big', 'wb')\nwhile True: f.write(b'x' * (1 << 20)); f.flush()"
    result = nbexec.execute_notebook(code, config=small)
    assert result.error is not None and result.error.kind == "limit" and "32m" in result.error.evalue


def test_background_writer_between_cells_is_capped(small: nbexec.SandboxConfig) -> None:
    with nbexec.Session(small) as session:
        first = session.run(
            "import threading\nstate = {'written': 0, 'error': None}\n"
            "def fill():\n    with open('/mnt/data/bg', 'wb', buffering=0) as f:\n        try:\n"
            "            while True:\n                state['written'] += f.write(b'y' * (1 << 20))\n"
            "        except OSError as exc:\n            state['error'] = exc.errno\n"
            "threading.Thread(target=fill, daemon=True).start()")
        assert first.ok, first.error
        sandbox = session._sandbox
        assert sandbox is not None
        deadline = time.monotonic() + 30  # the writer runs on its own, between cells
        while time.monotonic() < deadline:
            use = datafs.usage(sandbox.data_dir)
            if use is None or use.full:
                break
            time.sleep(0.1)
        second = session.run("print(state['written'], state['error'])")
        written, error = second.stdout.split()
        assert error == "28" and int(written) <= 32 * MiB
        assert _host_bytes(str(sandbox.workdir)) <= 32 * MiB + MiB  # the image never holds more than its size
        assert any("32m cap" in note for note in second.notes), second.notes


def test_deep_paths_and_long_names_neither_crash_nor_hide(small: nbexec.SandboxConfig) -> None:
    code = ("import os\nopen('x' * 255, 'w').write('long')\nos.makedirs('shallow/a', exist_ok=True)\n"
            "open('shallow/a/kept.txt', 'w').write('kept')\nlevels = 0\n"
            "try:\n    for _ in range(5000):\n        os.mkdir('d'); os.chdir('d'); levels += 1\n"
            "    open('bottom.txt', 'w').write('deep')\nexcept OSError as exc:\n    print('stopped', exc.errno)\n"
            "os.chdir('/mnt/data')\nprint('levels', levels)")
    started = time.monotonic()
    result = nbexec.execute_notebook(code, config=small)
    assert result.ok, result.error
    assert time.monotonic() - started < 20
    names = {f.name for f in result.files}
    assert {"x" * 255, "shallow/a/kept.txt"} <= names
    deep = [s for s in result.skipped_files if s.name.startswith("d/d/d")]
    assert deep and "nested deeper" in deep[0].reason, result.skipped_files  # not hidden: reported
    assert len(result.skipped_files) <= 200


def test_two_hundred_thousand_files_hit_the_inode_cap(config: nbexec.SandboxConfig) -> None:
    code = ("import os\nmade = 0\ntry:\n    for i in range(200_000):\n"
            "        os.close(os.open(f'/mnt/data/f{i}', os.O_CREAT | os.O_WRONLY)); made += 1\n"
            "except OSError as exc:\n    print('stopped', exc.errno)\nprint('made', made)")
    result = nbexec.execute_notebook(code, config=config)
    assert result.ok, result.error
    made = int(result.stdout.split()[-1])
    assert made < 2 * config.max_files, result.stdout  # the filesystem's inode count stopped it
    assert len(result.files) == config.max_files
    assert any(f"{made - config.max_files:,} more files" in note for note in result.notes), result.notes
    collect_s = result.timings["total_s"] - result.timings["run_s"] - result.timings["sandbox_s"]
    print(f"\ncollected {made} files ({len(result.files)} kept) in {collect_s * 1000:.0f} ms")
    assert collect_s < 5
    assert len(os.listdir(Path(result.output_dir) / "data")) == config.max_files


def test_sparse_files_cost_milliseconds(config: nbexec.SandboxConfig) -> None:
    # ext4 refuses exactly 16 TiB (EFBIG); 16 TiB - 4 KiB is its largest file
    code = ("import os\nfor name, size in [('eight', 8 << 30), ('huge', 16 << 40), ('huge', (16 << 40) - 4096)]:\n"
            "    try:\n        with open(name, 'wb') as f:\n            f.truncate(size)\n"
            "    except OSError as exc:\n        print(name, 'refused', exc.errno)\n"
            "print({n: os.stat(n).st_size for n in os.listdir('.')})")
    started = time.monotonic()
    result = nbexec.execute_notebook(code, config=config)  # 1 GiB: 4 KiB blocks, files up to 16 TiB
    elapsed = time.monotonic() - started
    assert result.ok, result.error
    skipped = {s.name: s.reason for s in result.skipped_files}
    assert "apparent size" in skipped["eight"] and "apparent size" in skipped["huge"], skipped
    assert not result.files and elapsed < 10
    assert result.timings["total_s"] - result.timings["run_s"] - result.timings["sandbox_s"] < 1
    assert _host_bytes(result.output_dir + "/data") < MiB


def test_a_growing_file_is_handed_over_as_listed(small: nbexec.SandboxConfig) -> None:
    code = ("import os, threading\n"
            "def grow():\n    with open('/mnt/data/grow.log', 'ab', buffering=0) as f:\n"
            "        while True:\n            try:\n                f.write(os.urandom(65536))\n"
            "            except OSError:\n                f.seek(0); f.truncate()\n"
            "def churn():\n    while True:\n        with open('/mnt/data/churn.bin', 'wb') as f:\n"
            "            f.write(os.urandom(1 << 20))\n"
            "for target in (grow, churn):\n    threading.Thread(target=target, daemon=True).start()\n"
            "import time; time.sleep(0.5)")
    for _ in range(3):
        result = nbexec.execute_notebook(code, config=small)
        assert result.ok, result.error
        assert {f.name for f in result.files} <= {"grow.log", "churn.bin"} and result.files
        time.sleep(1)  # whatever still runs in the sandbox must not change what was handed over
        for item in result.files:
            content = Path(item.path).read_bytes()
            assert len(content) == item.size and hashlib.sha256(content).hexdigest() == item.sha256, item.name


def test_the_manifest_is_one_moment_across_files(small: nbexec.SandboxConfig) -> None:
    """A writer that outlives the cell bumps a counter in a.txt, then in z.txt; a 20 MiB file sorts between them,
    so collection takes a while between the two. Frozen, the copies show one moment (z lags a by at most one
    step); sampled while the writer runs, they drift apart by however far it got meanwhile."""
    code = ("import os, threading\n"
            "open('/mnt/data/m.bin', 'wb').write(os.urandom(20 << 20))\n"
            "def bump():\n    i = 0\n    while True:\n        i += 1\n"
            "        for name in ('a.txt', 'z.txt'):\n"
            "            with open('/mnt/data/' + name, 'w') as f:\n                f.write(str(i))\n"
            "threading.Thread(target=bump, daemon=True).start()\n"
            "import time; time.sleep(0.3)")
    for _ in range(3):
        result = nbexec.execute_notebook(code, config=small)
        assert result.ok, result.error
        copies = {f.name: Path(f.path).read_text() for f in result.files if f.name.endswith(".txt")}
        assert set(copies) == {"a.txt", "z.txt"}, copies
        if copies["a.txt"] and copies["z.txt"]:  # a file caught between open and write is empty: also a moment
            assert 0 <= int(copies["a.txt"]) - int(copies["z.txt"]) <= 1, copies


def test_planted_setid_executables_are_inert_on_the_host(small: nbexec.SandboxConfig) -> None:
    code = ("import os, shutil\nfor name, mode in [('suid', 0o4755), ('sgid', 0o2755), ('plain', 0o755)]:\n"
            "    shutil.copy('/bin/true', name); os.chmod(name, mode)\n"
            "os.makedirs('sub', exist_ok=True); shutil.copy('/bin/true', 'sub/suid2'); os.chmod('sub/suid2', 0o6777)")
    result = nbexec.execute_notebook(code, config=small)
    assert result.ok, result.error
    tree = _host_tree(result.output_dir)
    assert tree
    for path, st in tree:
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), (path, oct(st.st_mode))
        if stat.S_ISREG(st.st_mode):
            assert not st.st_mode & (stat.S_IXOTH | stat.S_IXGRP | stat.S_IWOTH), (path, oct(st.st_mode))
    assert "plain" in {f.name for f in result.files}


def test_an_upload_that_does_not_fit_fails_clearly(small: nbexec.SandboxConfig, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as handle:
        handle.truncate(31 * MiB)
    with nbexec.Session(small) as session:
        session.upload(b"x" * (20 * MiB), "first.bin")
        with pytest.raises(nbexec.FileTransferError, match="does not fit in /mnt/data"):
            session.upload(big)
        result = session.run("import os\nprint(sorted(os.listdir('.')))")
        assert result.stdout.strip() == "['first.bin']"


def test_no_mount_or_loop_device_is_left(small: nbexec.SandboxConfig) -> None:
    nbexec.execute_notebook("open('/mnt/data/a', 'w').write('a')", config=small)
    with nbexec.Session(small) as session:
        session.run("open('/mnt/data/b', 'w').write('b')")
        workdir = session._sandbox.workdir if session._sandbox else None
        assert workdir is not None and mounts.is_mounted(workdir / "data")
    pool.shutdown()
    pool.wait_for_teardown()
    prefix = f"/tmp/nbexec/nbexec-{os.getpid()}-"
    assert prefix not in Path("/proc/self/mountinfo").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    assert prefix not in loops, loops
    assert not workdir.exists()


def test_without_mounts_the_sampled_fallback_still_stops_the_writer(
        cleanup_ledger: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a non-root nbexec gets: a plain folder and a check once a second (datafs's documented fallback).
    monkeypatch.setattr(datafs, "can_mount", lambda: False)
    assert datafs.fallback_reason() is not None
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, max_data="16m")
    code = ("import time\nf = open('/mnt/data/big', 'wb')\n"
            "while True: f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.01)")
    result = nbexec.execute_notebook(code, config=config)
    assert result.error is not None and result.error.kind == "limit", result.error
    assert any("sampled check" in note for note in result.notes), result.notes


def test_the_orphan_sweep_unmounts_before_deleting() -> None:
    assert datafs.can_mount(), "this test needs root, mkfs.ext4 and /dev/loop-control (as nbexec's default)"
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    workdir = work_root() / f"nbexec-{dead}-sweeptest"
    (workdir / "data").mkdir(parents=True)
    datafs.create(workdir / "data", workdir / "data.img", size=8 * MiB, inodes=64, owner=(os.getuid(), os.getgid()))
    (workdir / "data" / "left.txt").write_text("left by a process that died")
    assert mounts.is_mounted(workdir / "data")
    assert workdir in remove_stale_workdirs()
    assert not workdir.exists() and str(workdir) not in Path("/proc/self/mountinfo").read_text()
    assert str(workdir) not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
