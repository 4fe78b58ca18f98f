"""containerd's leftover checkpoint copies: only a folder holding exactly a checkpoint's files (names, sizes,
sha256) is removed; anything else in its scratch folder stays (the real engine's leak: tests/security/
test_checkpoint.py::test_hibernate_and_wake_leave_no_copy_nor_process_on_the_host)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from nbexec.sandbox.docker import leftovers

IMAGE = b"memory image " * 1000


def files(data: bytes = IMAGE) -> dict[str, list[object]]:
    return {"checkpoint.img": [len(data), hashlib.sha256(data).hexdigest()]}


def copy(folder: Path, name: str, data: bytes = IMAGE) -> Path:
    made = folder / name
    made.mkdir()
    (made / "checkpoint.img").write_bytes(data)
    return made


def test_only_an_exact_copy_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leftovers, "scratch_folders", lambda: [tmp_path])
    exact = copy(tmp_path, "ctrd-checkpoint1")
    same_size = copy(tmp_path, "ctrd-checkpoint2", IMAGE[:-1] + b"!")  # another sandbox's, still being written
    shorter = copy(tmp_path, "ctrd-checkpoint3", IMAGE[:-1])
    extra = copy(tmp_path, "ctrd-checkpoint4")
    (extra / "more").write_bytes(b"x")
    linked = tmp_path / "ctrd-checkpoint5"
    linked.mkdir()
    (linked / "checkpoint.img").symlink_to(exact / "checkpoint.img")
    folder_link = tmp_path / "ctrd-checkpoint6"
    folder_link.symlink_to(same_size)
    not_ours = copy(tmp_path, "other-folder")
    assert leftovers.remove_copies(files()) == 1
    assert not exact.exists()
    assert all(p.exists() for p in (same_size, shorter, extra, linked, folder_link, not_ours))
    assert (same_size / "checkpoint.img").read_bytes().endswith(b"!")


def test_a_shim_is_found_by_its_exact_id_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Matched on the argument after -id: a longer id, an id elsewhere on the line, another program: not it."""
    table = {
        101: [b"/usr/bin/containerd-shim-runc-v2", b"-namespace", b"moby", b"-id", b"abc", b"-address", b"/x"],
        102: [b"/usr/bin/containerd-shim-runc-v2", b"-namespace", b"moby", b"-id", b"abcd"],
        103: [b"/usr/bin/containerd-shim-runc-v2", b"-namespace", b"abc", b"-id", b"zzz"],
        104: [b"/usr/bin/sleep", b"-id", b"abc"],
    }
    monkeypatch.setattr(leftovers, "_pids", lambda: iter(table))
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: b"\0".join(table[int(self.parts[2])]) + b"\0"
                        if self.parts[1] == "proc" else real(self))
    assert leftovers.shims_of("abc") == [101]
    assert os.getpid() not in leftovers.shims_of(str(os.getpid()))
