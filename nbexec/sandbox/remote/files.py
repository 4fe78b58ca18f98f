"""A remote sandbox's /mnt/data seen from this host.

The node's listing is checked and held to this host's limits. The files stream into a private local folder
through directory descriptors: never past a cap, never through a link or out of the folder. A session's unchanged
files are fetched once."""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
from collections.abc import Iterator
from typing import Any

from nbexec.errors import FileTooLargeError, FileTransferError, NodeError
from nbexec.files import artifacts, transfer
from nbexec.files.artifacts import MAX_SKIPPED, Collection
from nbexec.files.folders import OutputFolder
from nbexec.result import File, SkippedFile
from nbexec.sandbox.source import SandboxHandle

LISTED_ENTRY = 8192  # bytes one entry of a file listing may take (a 1,024-byte name escaped, its URL, its hash)
REMOTE = -1  # the "inode" of a Known entry made here: the node's sha256 is what says a file is unchanged


def listing_cap(limits: artifacts.Limits) -> int:
    """The most bytes a listing within ``limits`` takes (a larger one is refused unread)."""
    return (limits.max_files + MAX_SKIPPED) * LISTED_ENTRY + 65536


def parse_listing(data: Any, max_files: int, node: str) -> Collection:
    """A node's listing, already capped in bytes and parsed, checked entry by entry; else NodeError.

    At most ``max_files`` files and MAX_SKIPPED skipped entries are kept, each a `nbexec.result` File."""
    try:
        listed, skipped, notes = data["files"], data.get("skipped_files", []), data.get("notes", [])
        files = [File.from_dict(entry) for entry in listed[:max_files]]
        left_out = [SkippedFile.from_dict(entry) for entry in skipped[:MAX_SKIPPED]]
        remarks = [str(n) for n in notes[:MAX_SKIPPED] if isinstance(n, str)]
        more = len(listed) - len(files)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise NodeError(f"node {node} sent a malformed file listing ({str(exc)[:200]})") from exc
    if any(f.size < 0 for f in files):
        raise NodeError(f"node {node} sent a file listing with a negative size")
    if more > 0:
        remarks.append(f"{more:,} more files were listed by node {node}; at most {max_files:,} are kept (max_files)")
    return Collection([File(f.name, "", f.size, f.mime, f.sha256, f.url) for f in files], left_out, remarks)


def within(found: Collection, limits: artifacts.Limits) -> Collection:
    """``found`` held to this host's ``limits``: files past max_files, over max_file or past max_total skipped."""
    kept: list[File] = []
    skipped, total = list(found.skipped), 0
    for item in found.files:
        if limits.max_files and len(kept) >= limits.max_files:
            skipped.append(SkippedFile(item.name, f"over the cap of {limits.max_files} files (max_files)"))
        elif limits.max_file and item.size > limits.max_file:
            skipped.append(SkippedFile(item.name, f"larger than the {limits.max_file:,}-byte cap (max_data)"))
        elif limits.max_total and total + item.size > limits.max_total:
            skipped.append(SkippedFile(item.name, "over the cap on a run's files (max_data), spent by the files "
                                                  "before it"))
        else:
            total += item.size
            kept.append(item)
    return Collection(kept, skipped[:MAX_SKIPPED], list(found.notes))


def unchanged(known: artifacts.Known, item: File) -> bool:
    return known.get(item.name) == ((REMOTE, item.size, 0, 0), item.sha256)


def remember(known: artifacts.Known, item: File) -> None:
    known[item.name] = ((REMOTE, item.size, 0, 0), item.sha256)


def forget_gone(folder: OutputFolder, known: artifacts.Known, present: set[str]) -> None:
    """Remove the copies of files that are no longer in the sandbox (through descriptors, links not followed)."""
    for name in [n for n in known if n not in present]:
        del known[name]
        with contextlib.suppress(OSError, FileTransferError):
            parts = transfer.relative_parts(name)
            parent = transfer.open_parent(folder.fd, parts)
            try:
                os.unlink(parts[-1], dir_fd=parent)
            finally:
                os.close(parent)


def _parts(name: str) -> list[str]:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or "\0" in p or len(p.encode()) > 255 for p in parts):
        raise FileTransferError(f"{name!r} is not a plain relative name")
    return parts


def save(folder: OutputFolder, name: str, chunks: Iterator[bytes], cap: int) -> File:
    """Write ``chunks`` to ``folder``/``name`` (folders made privately, nothing followed), stopping past ``cap``
    bytes (0: none) with nothing left behind."""
    parts = _parts(name)
    opened: list[OutputFolder] = []
    try:
        here = folder
        for part in parts[:-1]:
            here = here.child(part)
            opened.append(here)
        return _write(here, parts[-1], name, chunks, cap)
    except (OSError, ValueError) as exc:
        raise FileTransferError(f"cannot keep {name!r} here: {exc}") from exc
    finally:
        for item in opened:
            item.close()


def _write(folder: OutputFolder, leaf: str, name: str, chunks: Iterator[bytes], cap: int) -> File:
    """Write into a new private file, then rename it over ``leaf`` (a session's file may change between runs)."""
    temp = f".nbexec-download-{os.urandom(6).hex()}"
    fd = os.open(temp, transfer.WRITE_FLAGS, folder.file_mode, dir_fd=folder.fd)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if cap and size > cap:
                    raise FileTransferError(f"larger than the /mnt/data cap ({cap} bytes)")
                digest.update(chunk)
                handle.write(chunk)
        os.replace(temp, leaf, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder.fd)
        raise
    mime = mimetypes.guess_type(leaf)[0] or "application/octet-stream"
    return File(name, str(folder.path / leaf), size, mime, digest.hexdigest())




def fetch_into(handle: SandboxHandle, target: OutputFolder, limits: artifacts.Limits,
               known: artifacts.Known | None = None) -> Collection:
    """A far sandbox's snapshot: its listing (``handle.list_files``, checked and capped), then each file streamed
    (``handle.open_file``) into ``target`` within what is left of ``limits``; ``known`` spares unchanged ones."""
    known = {} if known is None else known
    found = handle.list_files(limits)
    kept: list[File] = []
    total = 0
    for item in found.files:
        if unchanged(known, item) and _exists(target, item.name):
            copy = File(item.name, str(target.path / item.name), item.size, item.mime, item.sha256)
        else:
            try:  # a file that changed since the listing is kept as it arrives, within what is left
                size, chunks = handle.open_file(item.name, max_bytes=_room(limits, total))
                copy = save(target, item.name, chunks, size)
            except FileTransferError as exc:
                found.skipped.append(SkippedFile(item.name, str(exc)))
                continue
            remember(known, copy)
        total += copy.size
        kept.append(copy)
    forget_gone(target, known, {f.name for f in kept})
    return Collection(kept, found.skipped, found.notes)


def _room(limits: artifacts.Limits, total: int) -> int:
    """The most bytes the next file may take (0: no cap); FileTooLargeError when max_data is spent (a spent
    budget is never "no cap")."""
    caps = [c for c, on in ((limits.max_file, limits.max_file), (limits.max_total - total, limits.max_total)) if on]
    if caps and min(caps) <= 0:
        raise FileTooLargeError("over the cap on a run's files (max_data), spent by the files before it")
    return min(caps) if caps else 0


def _exists(target: OutputFolder, name: str) -> bool:
    """Whether the copy of ``name`` is still in ``target`` (through descriptors, links not followed)."""
    with contextlib.suppress(OSError, FileTransferError):
        parts = transfer.relative_parts(name)
        parent = transfer.open_parent(target.fd, parts)
        try:
            os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            return True
        finally:
            os.close(parent)
    return False
