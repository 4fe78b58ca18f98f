"""Files the code left in /mnt/data, read on the host side without ever following a link.

Every host-side access under a run's folders goes through directory file descriptors with O_NOFOLLOW, and
each file is checked with fstat after it is opened, so links, FIFOs, sockets and devices planted by the code
(or swapped in while we look) are reported and never read. The size that counts is the apparent size seen at
fstat: nothing past it is read, files are hashed and copied in chunks, and a sparse file over the cap is
skipped unread. Copies on the host are 0600, so no set-id or exec bit carries over.
"""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nbexec.errors import FileTransferError
from nbexec.result import File, SkippedFile

from . import transfer
from .folders import OutputFolder

# One file at a time (put, get, open_stream, FileChunks, write_new, replace, save_images) lives in `transfer`;
# these names stay importable from here, where callers have always found them.
from .transfer import FileChunks, get, open_stream, put, replace, save_images, write_new

__all__ = ["MAX_DEPTH", "MAX_SKIPPED", "Collection", "FileChunks", "Known", "Limits", "collect", "display_name", "get",
           "open_stream", "put", "replace", "save_images", "snapshot", "write_new"]

_KINDS = [(stat.S_ISLNK, "symbolic link (not followed)"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
MAX_DEPTH = 64  # deeper folders are listed as skipped, not walked
MAX_SKIPPED = 200  # entries listed in skipped_files; the rest are counted in a note


def display_name(raw: bytes) -> str:
    """A name safe to print and to put in JSON: undecodable bytes and control characters escaped."""
    text = raw.decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)



@dataclass(frozen=True, kw_only=True)
class Limits:
    """Caps on what one collection keeps (0: no cap). Sizes are apparent sizes (``st_size``)."""

    max_file: int = 0
    max_total: int = 0
    max_files: int = 0


@dataclass
class Collection:
    """What a collection kept, what it left out (at most MAX_SKIPPED listed) and nbexec's notes on it."""

    files: list[File] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# name -> (identity of the source file when copied: inode, size, mtime, ctime; sha256 of the copy)
Known = dict[str, tuple[tuple[int, int, int, int], str]]


@dataclass
class _Folder:
    fd: int
    parts: tuple[bytes, ...]
    names: list[str]
    parent: _Folder | None
    target: int | None = None  # the matching host folder, opened when a file in it is copied


class _Collector:
    """One walk of a data folder with directory descriptors (no recursion), copying kept files to ``target``."""

    def __init__(self, source: Path, target: Path | None, limits: Limits, known: Known | None,
                 unchanged: Mapping[str, tuple[int, int, int, int]] | None = None) -> None:
        self.source, self.target, self.limits, self.unchanged = source, target, limits, unchanged or {}
        self.known, self.now_known = known, Known()
        self.out = Collection()
        self.more_skipped = self.not_kept = self.total = self.examined = 0
        self.seen: dict[int, int] = {}  # inode -> entries seen that name it (hard links)
        self.kept: dict[int, tuple[int, list[File]]] = {}  # inode -> (its link count, files kept for it)

    def skip(self, parts: tuple[bytes, ...], reason: str) -> None:
        if len(self.out.skipped) < MAX_SKIPPED:
            self.out.skipped.append(SkippedFile(display_name(b"/".join(parts))[:300] or ".", reason))
        else:
            self.more_skipped += 1

    def run(self, root: _Folder) -> None:
        stack = [root]
        budget = max(self.limits.max_files, 1000) * 10
        try:
            while stack:
                folder = stack[-1]
                if not folder.names:
                    _close(folder)
                    stack.pop()
                    continue
                self.examined += 1
                if self.examined > budget:
                    self.out.notes.append(f"the walk of /mnt/data stopped after {budget:,} entries")
                    break
                child = self._visit(folder, os.fsencode(folder.names.pop()))
                if child is not None:
                    stack.append(child)
        finally:
            for folder in stack:
                _close(folder)

    def _visit(self, folder: _Folder, raw: bytes) -> _Folder | None:
        parts = (*folder.parts, raw)
        try:
            st = os.stat(raw, dir_fd=folder.fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return self._enter(folder, parts, st)
        if stat.S_ISREG(st.st_mode):
            key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if self.unchanged and self.unchanged.get(display_name(b"/".join(parts))) == key:
                return None  # a copy nbexec made of an input, as it made it: not the code's file
            self.seen[st.st_ino] = self.seen.get(st.st_ino, 0) + 1
        reason = _why_skip(st.st_mode, transfer.valid_name(b"/".join(parts)))
        if reason is None and self.limits.max_file and st.st_size > self.limits.max_file:
            reason = f"larger than the {self.limits.max_file:,}-byte per-file cap (apparent size, not read)"
        if reason is not None:
            self.skip(parts, reason)
        elif self.limits.max_files and len(self.out.files) >= self.limits.max_files:
            self.not_kept += 1
        else:
            self._take(folder, parts, st)
        return None

    def _enter(self, folder: _Folder, parts: tuple[bytes, ...], st: os.stat_result) -> _Folder | None:
        if len(parts) > MAX_DEPTH:
            self.skip(parts, f"folder nested deeper than {MAX_DEPTH} levels (not walked)")
            return None
        try:
            fd = os.open(parts[-1], transfer.DIR_FLAGS, dir_fd=folder.fd)
        except OSError as exc:
            self.skip(parts, f"unreadable folder: {exc.strerror}")
            return None
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                raise OSError(0, "changed while being read")
            return _Folder(fd, parts, sorted(os.listdir(fd), reverse=True), folder)
        except OSError as exc:
            os.close(fd)
            self.skip(parts, f"unreadable folder: {exc.strerror}")
            return None

    def _take(self, folder: _Folder, parts: tuple[bytes, ...], st: os.stat_result) -> None:
        name = display_name(b"/".join(parts))
        try:
            fd = os.open(parts[-1], transfer.READ_FLAGS, dir_fd=folder.fd)
        except OSError as exc:
            self.skip(parts, f"could not be opened: {exc.strerror}")
            return
        try:
            now = os.fstat(fd)
            size = now.st_size  # the size that counts, and the most that is ever read
            reason = _why_skip(now.st_mode, None) or ("changed while being read" if now.st_ino != st.st_ino else None)
            if reason is None and self.limits.max_file and size > self.limits.max_file:
                reason = f"larger than the {self.limits.max_file:,}-byte per-file cap (apparent size, not read)"
            if reason is None and self.limits.max_total and self.total + size > self.limits.max_total:
                reason = f"over the {self.limits.max_total:,}-byte total cap"
            if reason is not None:
                self.skip(parts, reason)
                return
            key = (now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns)
            previous = (self.known or {}).get(name)
            if previous is not None and previous[0] == key:
                digest = previous[1]  # unchanged since the host copy was made
            else:
                digest, size = self._copy(fd, size, folder, parts[-1])
        except OSError as exc:
            self.skip(parts, f"could not be copied: {exc.strerror}")
            return
        finally:
            os.close(fd)
        self.total += size
        self.now_known[name] = (key, digest)
        base = self.source if self.target is None else self.target
        item = File(name, str(base / name), size, mimetypes.guess_type(name)[0] or "application/octet-stream",
                    digest)
        self.out.files.append(item)
        self.kept.setdefault(st.st_ino, (st.st_nlink, []))[1].append(item)

    def _copy(self, fd: int, size: int, folder: _Folder, leaf: bytes) -> tuple[str, int]:
        """Hash (and copy to the host, 0600, never through a link) at most ``size`` bytes, in chunks."""
        sha, done = hashlib.sha256(), 0
        target = _target_dir(folder) if self.target is not None else None
        temp = b".nbexec-copy-" + os.urandom(6).hex().encode()
        out = os.open(temp, transfer.WRITE_FLAGS, 0o600, dir_fd=target) if target is not None else None
        try:
            while done < size:
                chunk = os.read(fd, min(transfer.CHUNK, size - done))
                if not chunk:
                    break  # it shrank: what was read is what is handed over
                sha.update(chunk)
                if out is not None:
                    transfer.write_all(out, chunk)
                done += len(chunk)
            if out is not None:
                os.rename(temp, leaf, src_dir_fd=target, dst_dir_fd=target)
        except OSError:
            if out is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=target)
            raise
        finally:
            if out is not None:
                os.close(out)
        return sha.hexdigest(), done

    def finish(self) -> Collection:
        """Drop hard links to files outside the walk, remove stale host copies, write the notes."""
        for ino, (nlink, items) in self.kept.items():
            if nlink > self.seen.get(ino, 0):
                for item in items:
                    self.out.files.remove(item)
                    self.now_known.pop(item.name, None)
                    self.skip((os.fsencode(item.name),), "hard link to a file outside /mnt/data")
                    if self.target is not None:
                        _unlink(self.target, item.name)
        if self.target is not None:
            for name in set(self.known or {}) - set(self.now_known):
                _unlink(self.target, name)
        if self.known is not None:
            self.known.clear()
            self.known.update(self.now_known)
        self.out.files.sort(key=lambda f: f.name)
        if self.not_kept:
            self.out.notes.append(f"{self.not_kept:,} more files in /mnt/data were not kept: a result lists at "
                                  f"most {self.limits.max_files:,} files (max_files)")
        if self.more_skipped:
            self.out.notes.append(f"{self.more_skipped:,} more entries of /mnt/data were not collected (only the "
                                  f"first {MAX_SKIPPED} are listed in skipped_files)")
        return self.out

def _close(folder: _Folder) -> None:
    for fd in (folder.fd, folder.target):
        if fd is not None and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    folder.fd, folder.target = -1, None


def _target_dir(folder: _Folder) -> int:
    """The host folder matching ``folder``, made (0700) and opened along the way, never through a link."""
    chain = []
    walk: _Folder | None = folder
    while walk is not None and walk.target is None:
        chain.append(walk)
        walk = walk.parent
    assert walk is not None and walk.target is not None, "the root folder has its target open"
    parent_fd = walk.target
    for item in reversed(chain):
        with contextlib.suppress(FileExistsError):
            os.mkdir(item.parts[-1], 0o700, dir_fd=parent_fd)
        item.target = os.open(item.parts[-1], transfer.DIR_FLAGS, dir_fd=parent_fd)
        parent_fd = item.target
    return parent_fd


def _unlink(root_path: Path, name: str) -> None:
    with contextlib.suppress(OSError, FileTransferError):
        parts = transfer.relative_parts(name)
        root = os.open(root_path, transfer.DIR_FLAGS)
        try:
            parent = transfer.open_parent(root, parts)
        finally:
            os.close(root)
        try:
            os.unlink(parts[-1], dir_fd=parent)
        finally:
            os.close(parent)


def snapshot(source: Path, target: OutputFolder | None, limits: Limits = Limits(), *,
             known: Known | None = None, unchanged: Mapping[str, tuple[int, int, int, int]] | None = None,
             ) -> Collection:
    """Collect the regular files under ``source``: sha256, apparent size, MIME type; everything else is listed
    as skipped with a reason. With ``target`` (a host folder made by nbexec), each kept file is copied there
    (0600, hashed in the same pass) and ``File.path`` points at the copy. ``known`` (a session's memory of the
    last copy) spares copying unchanged files and removes copies of files that are gone. A file whose name and
    identity (inode, size, mtime, ctime) are in ``unchanged`` is left out (the input copies, see inputcopy)."""
    out = Collection()
    try:
        root_fd = os.open(source, transfer.DIR_FLAGS)
    except OSError as exc:
        out.skipped.append(SkippedFile(".", f"the data folder is unreadable: {exc.strerror}"))
        return out
    try:
        names = sorted(os.listdir(root_fd), reverse=True)
        target_fd = os.dup(target.fd) if target is not None else None  # the folder held open, never re-resolved
    except OSError as exc:
        os.close(root_fd)
        out.skipped.append(SkippedFile(".", f"the data folder is unreadable: {exc.strerror}"))
        return out
    collector = _Collector(source, target.path if target is not None else None, limits, known, unchanged)
    collector.run(_Folder(root_fd, (), names, None, target_fd))
    return collector.finish()


def collect(data_dir: Path, *, max_file: int = 0, max_total: int = 0) -> tuple[list[File], list[SkippedFile]]:
    """The regular files under ``data_dir`` (hashed where they lie, nothing copied) and what was skipped."""
    found = snapshot(data_dir, None, Limits(max_file=max_file, max_total=max_total))
    return found.files, found.skipped


def _why_skip(mode: int, bad_name: str | None) -> str | None:
    for check, kind in _KINDS:
        if check(mode):
            return kind
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if mode & (stat.S_ISUID | stat.S_ISGID):
        return "setuid or setgid file"
    return bad_name
