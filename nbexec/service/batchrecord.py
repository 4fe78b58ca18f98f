"""One batch of `nbexec serve`: its items and results on disk, its counts in memory.

A batch's folder (``batch-<id>`` under the node's result root: gone with it, or kept in the state folder across
restarts) holds ``batch.json`` (who made it), ``items.jsonl`` (the request's items, read back one at a time as
they start) and ``results.jsonl`` (one line per finished item, appended in the order they end). A cursor is a
byte offset into the results that ends a line, so a page or a stream reads only what it sends, and a half-written
line is never read (``written`` moves after the line is whole).

The folder is read back at a restart as hostile: no link is followed (the folder, its files), no line is read past
its cap (an item past ITEM_LINE is that item's error, a result past RESULT_LINE ends what is kept), and a record
whose id, owner or count is not one this node writes is dropped.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbexec.engine.session import Session
from nbexec.files.workdir import remove_tree

from .identity import View

PAGE_BYTES = 4 * 1024**2  # a page of results stops once it holds this much (one result more at most)
FINAL = ("done", "cancelled", "failed")  # failed: nbexec stopped it (its log says why)
META = "batch.json"  # who made the batch, and how many items: what a restarted node finds it by
ITEM_LINE = 17 * 1024**2  # bytes of one item's line at most (the body cap and its defaults); past it, its error
RESULT_LINE = 128 * 1024**2  # bytes of one result's line at most (capped outputs, JSON-escaped); past it, cut
_ID = re.compile(r"[0-9a-f]{16}")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class TooLong(ValueError):
    """A line past its cap (skipped: ``next`` is the offset after it)."""

    def __init__(self, next_offset: int) -> None:
        super().__init__("the line is over its cap")
        self.next = next_offset


def _open(path: Path, flags: int, mode: str) -> Any:
    """``path`` opened without following a link (OSError for one)."""
    return os.fdopen(os.open(path, flags | _NOFOLLOW, 0o600), mode)


@dataclass(eq=False)
class Batch:
    """A batch's state. Counts and status change on the event loop; the files on worker threads."""

    id: str
    owner: str
    total: int
    folder: Path
    shown: View
    status: str = "running"  # running, done or cancelled
    done: int = 0
    ok: int = 0
    failed: int = 0  # the code failed (the result says how)
    errors: int = 0  # nbexec could not run it (the item's error says why)
    written: int = 0  # bytes of results.jsonl that are whole lines
    expires: float = math.inf  # time.monotonic() after which the batch and its folder go
    created: float = field(default_factory=time.time)
    sessions: dict[str, Session] = field(default_factory=dict)  # running items, by execution id
    executions: list[str] = field(default_factory=list)  # every item's execution id (its files' folder)
    task: asyncio.Task[None] | None = None
    finished: set[int] = field(default_factory=set)  # indices with a result before a restart (not run again)
    reuse: str | None = None  # "batch": its judge items share a few sandboxes (batchreuse); kept in the record
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def queued(self) -> int:
        """Items not yet finished (none once the batch has ended)."""
        return 0 if self.status in FINAL else self.total - self.done

    def summary(self) -> dict[str, Any]:
        return {"id": self.shown.id(self.id), "status": self.status, "total": self.total, "done": self.done,
                "ok": self.ok, "failed": self.failed, "errors": self.errors,
                "created": round(self.created, 3), "reuse": self.reuse}

    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it before looking at the state)."""
        return self._changed

    def notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def interrupt(self) -> None:
        for session in list(self.sessions.values()):
            try:
                session.interrupt()
            except Exception:  # it may be closing under us; the next round tries again
                continue

    # -- files (worker threads) -------------------------------------------------------------------------

    def write_items(self, lines: list[bytes]) -> None:
        os.mkdir(self.folder, 0o700)
        meta = {"id": self.id, "owner": self.owner, "total": self.total, "created": self.created,
                "reuse": self.reuse}
        with _open(self.folder / META, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "w") as out:
            json.dump(meta, out)
        with _open(self.folder / "items.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, "wb") as out:
            for line in lines:
                out.write(line + b"\n")

    def item(self, offset: int) -> tuple[bytes | None, int]:
        """The request's item at byte ``offset`` of items.jsonl and the offset of the next (None after the last);
        TooLong for a line past ITEM_LINE (read past in chunks, never held)."""
        with _open(self.folder / "items.jsonl", os.O_RDONLY, "rb") as source:
            source.seek(offset)
            line = source.readline(ITEM_LINE + 1)
            if len(line) <= ITEM_LINE:
                return (line.rstrip(b"\n") or None), offset + len(line)
            skipped = len(line)
            while not line.endswith(b"\n") and line:
                line = source.readline(1 << 20)
                skipped += len(line)
        raise TooLong(offset + skipped)

    def append(self, line: dict[str, Any]) -> None:
        """Add one finished item's line and count it."""
        data = json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        with self._lock, _open(self.folder / "results.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, "ab") as out:
            out.write(data)
            self.recount(line, len(data))

    def recount(self, line: dict[str, Any], size: int) -> None:
        """Count one result line of ``size`` bytes."""
        self.written += size
        self.done += 1
        self.finished.add(int(line["index"]))
        result = line.get("result")
        if result is None:
            self.errors += 1
        elif result.get("ok"):
            self.ok += 1
        else:
            self.failed += 1

    def page(self, cursor: int, limit: int) -> tuple[list[bytes], int]:
        """Up to ``limit`` result lines from ``cursor`` (and within PAGE_BYTES), and the cursor after them."""
        end = self.written
        lines: list[bytes] = []
        size = 0
        if cursor > end or cursor < 0:
            raise ValueError("not a cursor of this batch")
        if cursor == end:
            return lines, cursor
        with _open(self.folder / "results.jsonl", os.O_RDONLY, "rb") as source:
            if cursor > 0:  # a cursor ends a line: any other offset is not one this batch gave
                source.seek(cursor - 1)
                if source.read(1) != b"\n":
                    raise ValueError("not a cursor of this batch")
            source.seek(cursor)
            while cursor < end and len(lines) < limit and size < PAGE_BYTES:
                line = source.readline()
                cursor += len(line)
                size += len(line)
                lines.append(line.rstrip(b"\n"))
        return lines, cursor


def load(folder: Path, shown: View, most: int) -> Batch | None:
    """A batch a node's last life left in ``folder`` (with a state folder), its results counted again; a result
    line cut by a crash (or past RESULT_LINE) is dropped with all after it, so those items run again. None for a
    folder that is not a whole batch of this node's: a link, a record whose id is not its folder's, a count not
    in 1..``most``."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        with _open(folder / META, os.O_RDONLY, "rb") as source:
            meta = json.loads(source.read(4096))
        batch = Batch(str(meta["id"]), str(meta["owner"]), int(meta["total"]), folder, shown,
                      created=float(meta["created"]), reuse="batch" if meta.get("reuse") == "batch" else None)
        if folder.name != f"batch-{batch.id}" or not _ID.fullmatch(batch.id) or not 1 <= batch.total <= most \
                or not batch.owner or not math.isfinite(batch.created):
            return None
        if not stat.S_ISREG(os.lstat(folder / "items.jsonl").st_mode):
            return None
        with _open(folder / "results.jsonl", os.O_RDWR | os.O_CREAT, "r+b") as results:
            while True:
                line = results.readline(RESULT_LINE + 1)
                if not line.endswith(b"\n") or len(line) > RESULT_LINE:
                    break
                found = json.loads(line)
                if not isinstance(found, dict) or not isinstance(found.get("index"), int) \
                        or not 0 <= found["index"] < batch.total or found["index"] in batch.finished:
                    break
                batch.recount(found, len(line))
            results.truncate(batch.written)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        return None
    batch.status = "done" if batch.done >= batch.total else "running"
    return batch


def remove(path: Path) -> None:
    """Remove a batch's folder; a link planted in its place goes, never what it points to."""
    if path.is_symlink():
        path.unlink()
    else:
        remove_tree(path)
