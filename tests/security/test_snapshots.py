"""Snapshots (issue #26): a session's files and notebook kept private, restored (files checked, memory by replay)
only for their owner, and every tampered shape refused before a byte reaches a sandbox.

Judged by the effect: the variables and files of the restored session, the refusal (SnapshotError) and that no
container or folder is left after it, the modes of the snapshot's files on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import Session
from nbexec.engine import snapshots

from .. import cluster
from ..conftest import IMAGE, unaccounted_containers, wait_until
from . import hostile_cases


def cfg(**changes: Any) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3,
                                **changes)


@pytest.fixture
def snap(tmp_path: Path, cleanup_ledger: None) -> tuple[Path, str]:
    """A snapshot of a session that made ``x`` and two files, in a store at tmp_path/snaps; (store, id)."""
    store = tmp_path / "snaps"
    with Session(cfg(), owner="alice") as session:
        session.upload(b"a" * 1000, "sub/data.bin")
        assert session.run("x = 41\nopen('note.txt', 'w').write('hello')").ok
        return store, session.snapshot(snapshot_dir=store)


def raw_folder(store: Path, snapshot_id: str) -> Path:
    return store / snapshot_id.split(".")[0]


def test_snapshot_restores_files_and_memory(snap: tuple[Path, str]) -> None:
    store, snapshot_id = snap
    with Session.from_snapshot(snapshot_id, owner="alice", snapshot_dir=store) as restored:
        result = restored.run("print(x + 1, open('note.txt').read(), len(open('sub/data.bin', 'rb').read()))")
        assert result.ok and result.stdout == "42 hello 1000\n"
        assert result.restored == "replay"
        forked = restored.fork(snapshot_dir=store)
        try:
            assert forked.run("x = 0").ok
            assert restored.run("print(x)").stdout == "41\n"  # a fork is its own session
            assert forked.run("print(x)").stdout == "0\n"
        finally:
            forked.close()


def test_snapshot_is_private(snap: tuple[Path, str]) -> None:
    store, _ = snap
    for path in [store, *store.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode & 0o077 == 0, (path, oct(mode))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


TAMPER: dict[str, Callable[[Path, str], str]] = {
    "data-byte": lambda s, i: (_flip(raw_folder(s, i) / "files" / "note.txt"), i)[1],
    "data-size": lambda s, i: ((raw_folder(s, i) / "files" / "note.txt").write_bytes(b"hello!"), i)[1],
    "data-link": lambda s, i: ((raw_folder(s, i) / "files" / "note.txt").unlink(),
                               (raw_folder(s, i) / "files" / "note.txt").symlink_to("/etc/passwd"), i)[2],
    "data-missing": lambda s, i: ((raw_folder(s, i) / "files" / "sub" / "data.bin").unlink(), i)[1],
    "notebook-byte": lambda s, i: (_flip(raw_folder(s, i) / "notebook.ipynb"), i)[1],
    "manifest-byte": lambda s, i: (_flip(raw_folder(s, i) / "manifest.json"), i)[1],
    "manifest-sig": lambda s, i: ((raw_folder(s, i) / "manifest.sig").write_bytes(b"0" * 64), i)[1],
    "manifest-owner": lambda s, i: (_rewrite(raw_folder(s, i) / "manifest.json", owner="mallory"), i)[1],
    "manifest-oversized": lambda s, i: ((raw_folder(s, i) / "manifest.json").write_bytes(b" " * (5 * 2**20)), i)[1],
    "id-one-char": lambda s, i: i[:-1] + ("0" if i[-1] != "0" else "1"),
    "id-truncated": lambda s, i: i[:20],
    "id-empty": lambda s, i: "",
    "id-path": lambda s, i: "../" + i,
    "key-swapped": lambda s, i: ((s / "key").unlink(), (s / "key").write_bytes(os.urandom(32)), i)[2],
}


def _rewrite(path: Path, **changes: Any) -> None:
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body, sort_keys=True))


@pytest.mark.parametrize("shape", list(TAMPER))
def test_tampered_snapshot_is_refused(snap: tuple[Path, str], shape: str) -> None:
    store, snapshot_id = snap
    asked = TAMPER[shape](store, snapshot_id)
    before = unaccounted_containers()
    with pytest.raises(nbexec.SnapshotError):
        Session.from_snapshot(asked, owner="alice", snapshot_dir=store)
    assert unaccounted_containers() == before  # refused before any sandbox was started


def test_another_owners_snapshot_is_refused(snap: tuple[Path, str]) -> None:
    store, snapshot_id = snap
    with pytest.raises(nbexec.SnapshotError, match="no snapshot"):
        Session.from_snapshot(snapshot_id, owner="mallory", snapshot_dir=store)
    with pytest.raises(nbexec.SnapshotError, match="no snapshot"):
        Session.from_snapshot(snapshot_id, snapshot_dir=store)  # no owner is another owner


def test_renamed_snapshot_folder_is_refused(tmp_path: Path, cleanup_ledger: None) -> None:
    """Two snapshots of the same owner: swapping their folders (each manifest still validly signed) is refused."""
    store = tmp_path / "snaps"
    with Session(cfg(), owner="alice") as session:
        assert session.run("x = 1").ok
        first = session.snapshot(snapshot_dir=store)
        assert session.run("x = 2").ok
        second = session.snapshot(snapshot_dir=store)
    a, b = raw_folder(store, first), raw_folder(store, second)
    shutil.rmtree(a)
    shutil.copytree(b, a)
    with pytest.raises(nbexec.SnapshotError, match="another snapshot"):
        Session.from_snapshot(first, owner="alice", snapshot_dir=store)
    with Session.from_snapshot(second, owner="alice", snapshot_dir=store) as ok:
        assert ok.run("print(x)").stdout == "2\n"


def test_snapshot_count_is_capped_per_owner(tmp_path: Path, cleanup_ledger: None) -> None:
    store = tmp_path / "snaps"
    with Session(cfg(), owner="alice") as session:
        assert session.run("x = 1").ok
        made = [session.snapshot(snapshot_dir=store) for _ in range(snapshots.MAX_SNAPSHOTS)]
        with pytest.raises(nbexec.SessionLimitError, match="snapshots are kept"):
            session.snapshot(snapshot_dir=store)
        assert len([p for p in store.iterdir() if p.is_dir()]) == snapshots.MAX_SNAPSHOTS
        snapshots.SnapshotStore(store).delete("alice", made[0])
        session.snapshot(snapshot_dir=store)


def test_snapshot_of_a_link_in_data_is_refused(tmp_path: Path, cleanup_ledger: None) -> None:
    store = tmp_path / "snaps"
    with Session(cfg(), owner="alice") as session:
        assert session.run("import os\nos.symlink('/etc/passwd', 'link')").ok
        with pytest.raises(nbexec.SnapshotError, match="link"):
            session.snapshot(snapshot_dir=store)
    assert [p for p in store.iterdir() if p.is_dir()] == []


@pytest.mark.parametrize("case", [c for c in hostile_cases.CASES if c.id in ("write-rootfs", "fork-bomb")],
                         ids=lambda c: c.id)
def test_restored_sandbox_keeps_every_limit(snap: tuple[Path, str], case: hostile_cases.Case) -> None:
    store, snapshot_id = snap
    with Session.from_snapshot(snapshot_id, owner="alice", snapshot_dir=store) as restored:
        case.check(restored.run(case.code))


def test_snapshot_is_admitted_before_it_writes(tmp_path: Path, cleanup_ledger: None) -> None:
    """Less free disk than the snapshot may need (past disk_margin): refused before a byte is written."""
    store = tmp_path / "snaps"
    with Session(cfg(), owner="alice") as session:
        assert session.run("x = 1").ok
        session._config = session.config.replace(disk_margin="1000t")  # the host as if it had no room left
        with pytest.raises(nbexec.DiskSpaceError):
            session.snapshot(snapshot_dir=store)
    assert [p for p in store.iterdir() if p.is_dir()] == []


# -- a take whose process died is swept at once; a live one is kept ---------------------------------------------

STALLED_TAKE = """
import sys, time
from pathlib import Path
import nbexec
from nbexec.engine import snapshots
store = snapshots.SnapshotStore(Path(sys.argv[1]))
def stall(target, raw, *_):  # the take is under way: its folder made and being filled
    print(raw, flush=True)
    time.sleep(600)
store._fill = stall
store.take("alice", nbexec.SandboxConfig(), None, None)
"""


def _taking(store: Path) -> tuple[subprocess.Popen[str], str]:
    """A real process in the middle of a take into ``store``: (the process, the raw id of its folder)."""
    maker = subprocess.Popen([sys.executable, "-c", STALLED_TAKE, str(store)], stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None
    raw = maker.stdout.readline().strip()
    assert raw, "the take never started"
    return maker, raw


def _making(store: Path) -> set[str]:
    return {name.removesuffix(snapshots.MAKING) for name in os.listdir(store) if name.endswith(snapshots.MAKING)}


def test_a_take_killed_midway_is_swept_at_the_next_use_and_a_live_one_is_kept(tmp_path: Path) -> None:
    """Before: the folder of a take whose process was killed (SIGKILL) stayed for the snapshot TTL (7 days), on
    the owner's disk. After: the next use of the store removes it; a take under way in another process is kept."""
    store = tmp_path / "snaps"
    dead, dead_raw = _taking(store)
    live, live_raw = _taking(store)
    try:
        dead.kill()
        dead.wait(10)  # SIGKILL: nothing of the take's own cleanup runs
        assert _making(store) == {dead_raw, live_raw}
        snapshots.SnapshotStore(store).listing("bob")
        assert _making(store) == {live_raw}, "a dead take's folder was kept, or a live one's removed"
        snapshots.SnapshotStore(store).sweep()  # what a node runs at start and in its janitor
        assert _making(store) == {live_raw}
    finally:
        for maker in (dead, live):
            maker.kill()
            maker.communicate(timeout=10)
    snapshots.SnapshotStore(store).sweep()
    assert _making(store) == set()


def test_a_node_sweeps_a_dead_take_when_it_starts(tmp_path: Path, docker_ready: None) -> None:
    """A node killed mid-take leaves the take's folder in its state folder; the next start of the node removes it
    (before: it stayed for the snapshot TTL)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    dead, raw = _taking(state / "snapshots")
    dead.kill()
    dead.communicate(timeout=10)
    assert _making(state / "snapshots") == {raw}
    with cluster.running_node("sw", {"NBEXEC_STATE_DIR": str(state), "NBEXEC_POOL_SIZE": "0"}):
        wait_until(lambda: not _making(state / "snapshots"), 30, "the dead take's folder outlived the node's start")
