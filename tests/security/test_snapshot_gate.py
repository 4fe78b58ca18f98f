"""The local snapshot store's gate under attack: another writer in the store (an operator's clean-up, a second
process sharing it) may delete or plant files there. The gate must never be followed, and a sweep must never
remove a live take.

Judged from outside: what is left in the store and outside it, and the take's own outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbexec.engine import snapshots

# A take in another process that stops in the window between making its folder and locking it (under the gate),
# says its folder's name, and finishes (``filled``) once told to on stdin.
WINDOW_TAKE = """
import sys
from pathlib import Path
import nbexec
from nbexec.engine import snapshots
store = snapshots.SnapshotStore(Path(sys.argv[1]))
opened = snapshots.folders.OutputFolder.open
def pause(path, *args, **kwargs):
    if str(path).endswith(snapshots.MAKING):
        print(Path(path).name, flush=True)
        sys.stdin.readline()
    return opened(path, *args, **kwargs)
snapshots.folders.OutputFolder.open = pause
def fill(target, raw, *_):
    with target.child("files"):
        pass
    print("filled", flush=True)
    raise SystemExit(0)
store._fill = fill
store.take("alice", nbexec.SandboxConfig(), None, None)
"""


def _store(tmp_path: Path) -> Path:
    store = tmp_path / "snaps"
    snapshots.SnapshotStore(store).listing("bob")  # made: private, with its key
    return store


@pytest.mark.parametrize("plant", ["deleted", "link", "folder"])
def test_a_take_in_its_window_survives_a_sweep_whatever_is_done_to_the_gate(plant: str, tmp_path: Path) -> None:
    """Before: the gate was a file ``.gate`` in the store; deleted (or replaced) while a take held it shared, between
    making its folder and locking it, a sweep made a new gate, held it at once and removed the live take's folder
    (the take then failed writing into a removed folder). After: the gate is the store's folder itself, which no
    file in it can replace; the sweep waits for the take and leaves its folder."""
    store = _store(tmp_path)
    maker = subprocess.Popen([sys.executable, "-c", WINDOW_TAKE, str(store)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None and maker.stdin is not None
        name = maker.stdout.readline().strip()
        assert name.endswith(snapshots.MAKING), "the take never reached its window"
        for leftover in (".gate",):
            if os.path.lexists(store / leftover):
                os.unlink(store / leftover)
        if plant == "link":
            os.symlink(tmp_path, store / ".gate")
        elif plant == "folder":
            os.mkdir(store / ".gate")
        snapshots.SnapshotStore(store).sweep()
        assert (store / name).is_dir(), "a sweep removed the folder of a take under way"
        maker.stdin.write("\n")
        maker.stdin.flush()
        assert maker.stdout.readline().strip() == "filled", "the take could not fill its folder"
    finally:
        maker.kill()
        maker.communicate(timeout=10)


@pytest.mark.parametrize("plant", ["link", "fifo", "folder"])
def test_a_planted_gate_is_never_followed_nor_wedges_the_store(plant: str, tmp_path: Path) -> None:
    """Before: ``.gate`` planted as a link or a folder made every listing, take and sweep of the store raise a bare
    OSError (ELOOP, EISDIR): the store was unusable until someone found the file. The link was not followed (held).
    After: a file named .gate is nothing to the store; listing and sweeping go on, the link's target untouched."""
    store, outside = _store(tmp_path), tmp_path / "outside"
    outside.write_text("keep")
    if os.path.lexists(store / ".gate"):
        os.unlink(store / ".gate")
    {"link": lambda p: os.symlink(outside, p), "fifo": lambda p: os.mkfifo(p, 0o600),
     "folder": lambda p: os.mkdir(p)}[plant](store / ".gate")
    snapshots.SnapshotStore(store).sweep()
    assert snapshots.SnapshotStore(store).listing("bob") == []
    assert outside.read_text() == "keep"


def test_a_planted_making_folder_of_links_is_swept_without_following_them(tmp_path: Path) -> None:
    """A dead take's folder holding links (to a folder and a file outside the store), and a ``.making`` name that
    is itself a link to a folder outside: the sweep removes the real folder and its links, and never what they
    name (held)."""
    store, outside = _store(tmp_path), tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "file").write_text("keep")
    planted = store / f"{'a' * 32}{snapshots.MAKING}"
    (planted / "files").mkdir(parents=True)
    os.symlink(outside, planted / "files" / "up")
    os.symlink(outside / "deep" / "file", planted / "notebook.ipynb")
    os.symlink(outside, store / f"{'b' * 32}{snapshots.MAKING}")
    snapshots.SnapshotStore(store).sweep()
    assert not os.path.lexists(planted)
    assert (outside / "deep" / "file").read_text() == "keep"
