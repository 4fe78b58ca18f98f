"""Collecting /mnt/data safely: links, special files and hostile names are reported, never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nbexec
from nbexec import execute_notebook
from nbexec.files import artifacts

HOSTILE = r"""
import os, socket
os.symlink('/etc/passwd', 'passwd-link')
os.symlink('/mnt/data', 'loop')
os.mkfifo('pipe')
s = socket.socket(socket.AF_UNIX); s.bind('/mnt/data/sock')
open('real.txt', 'w').write('real')
os.link('real.txt', 'real-hardlink.txt')
open('bad\nname.txt', 'w').write('x')
open(b'latin-\xe9.txt', 'wb').write(b'x')
open('x' * 200, 'w').write('long')
os.makedirs('deep/er', exist_ok=True); open('deep/er/ok.csv', 'w').write('a')
print('planted')
"""


def test_hostile_entries_are_skipped_and_reported(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook(HOSTILE, config=config)
    assert result.ok, result.error
    files = {f.name for f in result.files}
    skipped = {s.name: s.reason for s in result.skipped_files}
    assert files == {"real.txt", "real-hardlink.txt", "deep/er/ok.csv", "x" * 200}
    assert "symbolic link" in skipped["passwd-link"] and "symbolic link" in skipped["loop"]
    assert skipped["pipe"] == "FIFO" and skipped["sock"] == "socket"
    assert skipped["bad\\nname.txt"] == "name contains control characters"
    assert skipped["latin-\\xe9.txt"] == "name is not UTF-8"
    assert all(Path(f.path).resolve().is_relative_to(Path(result.output_dir).resolve()) for f in result.files)


def test_hard_link_to_outside_is_skipped(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    os.link(outside, data / "inside.txt")
    files, skipped = artifacts.collect(data)
    assert files == []
    assert skipped[0].reason == "hard link to a file outside /mnt/data"


def test_caps_are_reported(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "b.bin").write_bytes(b"x" * 10)
    (tmp_path / "c.bin").write_bytes(b"x" * 10)
    files, skipped = artifacts.collect(tmp_path, max_file=50, max_total=15)
    assert [f.name for f in files] == ["b.bin"]
    assert {s.name: s.reason.split()[0] for s in skipped} == {"a.bin": "larger", "c.bin": "over"}


def test_put_replaces_a_planted_link_without_following_it(tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    target.write_text("host")
    data = tmp_path / "data"
    data.mkdir()
    (data / "upload.txt").symlink_to(target)
    artifacts.put(data, "upload.txt", b"new")
    assert target.read_text() == "host"
    assert (data / "upload.txt").read_bytes() == b"new" and not (data / "upload.txt").is_symlink()
    (data / "dirlink").symlink_to(tmp_path)
    with pytest.raises(nbexec.FileTransferError):
        artifacts.put(data, "dirlink/escape.txt", b"x")
    with pytest.raises(nbexec.FileTransferError):
        artifacts.get(data, "dirlink/host-file")
    assert not (tmp_path / "escape.txt").exists()
