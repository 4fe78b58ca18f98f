"""The notebook's folder as the code's own copy: what it may read, overwrite and write into, as under papermill.

`nbexec run FILE` mounts FILE's folder read-only at /mnt/input. Links to it from /mnt/data let the code read
`data.csv`, but writing `figures/plot.png` or rewriting `data.csv` went through the link and failed with "Read-only
file system". So before the container starts, the host copies the folder's visible entries into /mnt/data (the
data filesystem, owned by the sandbox user): folders made anew, regular files copied, links copied as the same
link. The host's folder is never written. After a run, a copy that is still the one nbexec made (same inode, size,
modification and change time; the change time no code can set) is not a file of the result; one the code wrote
over is, and a note names it as shadowed.

What is not copied stays a read-only link to its place under /mnt/input, as before: an entry the sandbox user
could not read through the mount (never widened by a root host's copy), a settings file nbexec withholds (see
`inputmount`), a FIFO, socket or device, a file past the byte budget, a top-level entry whose tree is past the
entry budget, and nbexec's own output folders (an earlier run's files). The host reads the folder through
directory descriptors with O_NOFOLLOW, so a link in it is never followed on the host (one leading to /etc stays a
link the sandbox resolves in its own tree).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import docker.types

from nbexec.config import SandboxConfig
from nbexec.files import artifacts, transfer
from nbexec.files.folders import MARK, OutputFolder
from nbexec.sandbox.source import INPUT_MOUNT

from . import inputmount

MAX_ENTRIES = 1000  # most entries (files, folders, links) copied, whatever max_files allows
Key = tuple[int, int, int, int]  # a copy's identity as made: inode, size, mtime_ns, ctime_ns


@dataclass
class Placed:
    """What nbexec put in /mnt/data for the input folder."""

    links: set[str] = field(default_factory=set)  # names of the links it made (never the code's files)
    copies: dict[str, Key] = field(default_factory=dict)  # name -> identity of the copy as made
    linked_big: int = 0  # files left as read-only links: past the byte budget
    linked_trees: list[str] = field(default_factory=list)  # top-level entries left as links: past the entry budget
    entries: int = 0
    size: int = 0

    def notes(self) -> list[str]:
        said = []
        if self.linked_big:
            said.append(f"{self.linked_big} file(s) of the notebook's folder were too large to copy into /mnt/data: "
                        "they are read-only links to /mnt/input (read them; write a new file to change one).")
        if self.linked_trees:
            shown = ", ".join(self.linked_trees[:10]) + (" ..." if len(self.linked_trees) > 10 else "")
            said.append(f"{len(self.linked_trees)} entry(ies) of the notebook's folder held too many files to copy "
                        f"into /mnt/data and are read-only links to /mnt/input: {shown}.")
        return said


@dataclass(frozen=True)
class _Budget:
    reader: tuple[int, int]  # the sandbox's uid and gid: what it could read through the mount is what is copied
    owner: tuple[int, int] | None  # who the copies belong to (None: this process, the sandbox user)
    max_bytes: int
    max_entries: int
    withheld: frozenset[PurePosixPath]


Prepared = tuple[list[docker.types.Mount], list[str], frozenset[str], dict[str, Key]]


def prepare(config: SandboxConfig, workdir: Path, data_dir: Path, reader: tuple[int, int],
            owner: tuple[int, int] | None) -> Prepared:
    """The input folder of ``config`` made ready: the mounts that withhold its settings files (see inputmount),
    the notes on it, the names of the links nbexec made in ``data_dir`` and its copies (with link_input)."""
    assert config.input_dir is not None
    withheld = inputmount.scan(config.input_dir, INPUT_MOUNT)  # walked once, for the masks and the copy
    masks, notes = inputmount.prepare(config.input_dir, workdir, INPUT_MOUNT, withheld)
    if not config.link_input:
        return masks, notes, frozenset(), {}
    placed = place(config.input_dir, data_dir, reader=reader, owner=owner, max_data=config.max_data_bytes,
                   max_files=config.max_files, withheld=frozenset(withheld))
    return masks, notes + placed.notes(), frozenset(placed.links), placed.copies


def place(folder: str, data_dir: Path, *, reader: tuple[int, int], owner: tuple[int, int] | None,
          max_data: int, max_files: int, withheld: frozenset[PurePosixPath]) -> Placed:
    """Copy ``folder``'s visible top-level entries (at most inputmount.MAX_INPUT_LINKS) into ``data_dir``; the
    ``withheld`` ones (nbexec's settings files, see inputmount) stay links to their empty stand-ins."""
    budget = _Budget(reader, owner, max_data // 4 if max_data else 256 << 20, min(max_files // 2, MAX_ENTRIES),
                     withheld)
    placed = Placed()
    source = os.open(os.path.realpath(folder), transfer.DIR_FLAGS)
    target = os.open(data_dir, transfer.DIR_FLAGS)
    try:
        readable = _readable(os.fstat(source), reader, 5)
        names = sorted(n for n in os.listdir(source) if not n.startswith("."))[:inputmount.MAX_INPUT_LINKS]
        for name in names:
            relative = PurePosixPath(name)
            size = _tree_entries(source, name, budget.max_entries - placed.entries + 1)
            if not readable or placed.entries + size > budget.max_entries:
                if readable:
                    placed.linked_trees.append(name)
                _link(target, name, relative, placed, budget)
            else:
                _copy_entry(source, target, name, relative, placed, budget)
    finally:
        os.close(source)
        os.close(target)
    return placed


def _readable(st: os.stat_result, reader: tuple[int, int], need: int) -> bool:
    """Whether the sandbox user has ``need`` (4: read, 5: read and search) on ``st``, by its mode bits."""
    uid, gid = reader
    if uid == 0:
        return True
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return (st.st_mode >> shift) & need == need


def _tree_entries(parent: int, name: str, most: int) -> int:
    """Entries of the tree at ``name`` (itself included), counted up to ``most``."""
    counted, pending = 0, [(os.dup(parent), name)]
    while pending:
        fd, entry = pending.pop()
        try:
            counted += 1
            if counted >= most or not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                continue
            child = os.open(entry, transfer.DIR_FLAGS, dir_fd=fd)
            pending.extend((os.dup(child), sub) for sub in os.listdir(child))
            os.close(child)
        except OSError:
            continue
        finally:
            os.close(fd)
    for fd, _ in pending:
        os.close(fd)
    return counted


def _copy_entry(source: int, target: int, name: str, relative: PurePosixPath, placed: Placed,
                budget: _Budget) -> None:
    try:
        st = os.stat(name, dir_fd=source, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=source), name, dir_fd=target)
        _own(target, name, budget)
        placed.links.add(_name(relative))
    elif stat.S_ISDIR(st.st_mode) and relative not in budget.withheld and _readable(st, budget.reader, 5) \
            and not _holds_outputs(source, name):
        _copy_folder(source, target, name, relative, placed, budget)
    elif stat.S_ISREG(st.st_mode) and relative not in budget.withheld and _readable(st, budget.reader, 4) \
            and placed.size + st.st_size <= budget.max_bytes:
        try:
            _copy_file(source, target, name, relative, placed, budget)
        except OSError:  # it changed or vanished while copied: what the mount shows is what the code reads
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=target)
            _link(target, name, relative, placed, budget)
            return
    else:
        placed.linked_big += int(stat.S_ISREG(st.st_mode) and placed.size + st.st_size > budget.max_bytes)
        _link(target, name, relative, placed, budget)
        return
    placed.entries += 1


def _holds_outputs(parent: int, name: str) -> bool:
    """Whether the folder is one of nbexec's output folders (it holds MARK): an earlier run's files stay linked."""
    try:
        fd = os.open(name, transfer.DIR_FLAGS, dir_fd=parent)
    except OSError:
        return False
    try:
        os.stat(MARK, dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _copy_folder(source: int, target: int, name: str, relative: PurePosixPath, placed: Placed,
                 budget: _Budget) -> None:
    os.mkdir(name, 0o755, dir_fd=target)
    _own(target, name, budget)
    inner_source = os.open(name, transfer.DIR_FLAGS, dir_fd=source)
    try:
        inner_target = os.open(name, transfer.DIR_FLAGS, dir_fd=target)
        try:
            for child in sorted(os.listdir(inner_source)):
                _copy_entry(inner_source, inner_target, child, relative / child, placed, budget)
        finally:
            os.close(inner_target)
    finally:
        os.close(inner_source)


def _copy_file(source: int, target: int, name: str, relative: PurePosixPath, placed: Placed,
               budget: _Budget) -> None:
    """Copy one regular file (opened without following a link; nothing past the size seen at fstat)."""
    fd = os.open(name, transfer.READ_FLAGS, dir_fd=source)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "changed while being copied")
        out = os.open(name, transfer.WRITE_FLAGS, 0o644 | (st.st_mode & 0o111), dir_fd=target)
        try:
            for chunk in _chunks(fd, st.st_size):
                transfer.write_all(out, chunk)
            if budget.owner is not None:
                os.fchown(out, *budget.owner)
            os.fchmod(out, 0o644 | (st.st_mode & 0o111))  # what umask took; no set-id bit carries over
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))  # the original's time, as a copy keeps it
            made = os.fstat(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    placed.size += made.st_size
    placed.copies[_name(relative)] = (made.st_ino, made.st_size, made.st_mtime_ns, made.st_ctime_ns)


def _chunks(fd: int, size: int) -> Iterator[bytes]:
    done = 0
    while done < size:
        chunk = os.read(fd, min(transfer.CHUNK, size - done))
        if not chunk:
            return
        done += len(chunk)
        yield chunk


def _link(target: int, name: str, relative: PurePosixPath, placed: Placed, budget: _Budget) -> None:
    """A link to the entry's place under the read-only mount, as the sandbox resolves it (never the host)."""
    os.symlink(f"{INPUT_MOUNT}/{relative}", name, dir_fd=target)
    _own(target, name, budget)
    placed.links.add(_name(relative))
    placed.entries += 1


def _own(target: int, name: str, budget: _Budget) -> None:
    if budget.owner is not None:
        os.chown(name, *budget.owner, dir_fd=target, follow_symlinks=False)


def _name(relative: PurePosixPath) -> str:
    """The name the collection of /mnt/data gives the entry (see artifacts.display_name)."""
    return artifacts.display_name(os.fsencode(str(relative)))


def snapshot(data_dir: Path, target: OutputFolder | None, limits: artifacts.Limits, known: artifacts.Known | None,
             copies: Mapping[str, Key]) -> artifacts.Collection:
    """/mnt/data collected (see artifacts.snapshot) without the copies that are still as nbexec made them; a
    note names the inputs the code wrote over (the host's own files are unchanged)."""
    found = artifacts.snapshot(data_dir, target, limits, known=known, unchanged=copies)
    shadowed = [f.name for f in found.files if f.name in copies]
    if shadowed:
        shown = ", ".join(shadowed[:10]) + (f" and {len(shadowed) - 10} more" if len(shadowed) > 10 else "")
        found.notes.append(f"The code wrote over {len(shadowed)} file(s) of the notebook's folder: {shown}. The "
                           "host's files are unchanged; the new versions are this result's files.")
    return found

