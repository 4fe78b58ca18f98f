"""The host's file operations in a sandbox, run by its supervisor as the sandbox user (never on the host through
paths): the sandbox's view and permissions decide. Every answer is checked (types, sizes, counts) before use; a
lie closes the supervisor (`SupervisorLostError`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from . import wire
from .events import Subscription, SupervisorError, SupervisorLostError, TooLargeError, Violation, entry, number


class Link(Protocol):
    """What the file operations use of a `Supervisor`."""

    @property
    def lost(self) -> bool: ...

    def request(self, head: dict[str, Any], data: bytes = b"") -> tuple[dict[str, Any], bytes]: ...

    def broken(self, reason: str) -> SupervisorLostError: ...

    def notify(self, head: dict[str, Any]) -> None: ...

    def watch(self, path: str, recursive: bool) -> Subscription: ...


class Files:
    """``supervisor.files``: stat, list, make, move, remove, read and write, as the sandbox user."""

    def __init__(self, supervisor: Link) -> None:
        self._supervisor = supervisor

    def _entry_call(self, head: dict[str, Any]) -> dict[str, Any]:
        answer, _ = self._supervisor.request(head)
        try:
            return entry(answer.get("entry"))
        except Violation as exc:
            raise self._supervisor.broken(str(exc)) from None

    def stat(self, path: str) -> dict[str, Any]:
        """name, type (file, dir, symlink, other), path, size, mode, permissions, owner, group, mtime,
        symlink_target of ``path`` (a last link is not followed)."""
        return self._entry_call({"op": "stat", "path": path})

    def list_dir(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        head, _ = self._supervisor.request({"op": "list_dir", "path": path, "depth": max(1, depth)})
        raw = head.get("entries")
        if not isinstance(raw, list) or len(raw) > wire.MAX_ENTRIES:
            raise self._supervisor.broken("an entry list over the cap")
        try:
            return [entry(item) for item in raw]
        except Violation as exc:
            raise self._supervisor.broken(str(exc)) from None

    def make_dir(self, path: str) -> bool:
        """Make ``path`` and its parents; False when it existed."""
        head, _ = self._supervisor.request({"op": "make_dir", "path": path})
        return head.get("created") is True

    def move(self, source: str, destination: str) -> dict[str, Any]:
        return self._entry_call({"op": "move", "source": source, "destination": destination})

    def remove(self, path: str) -> None:
        self._supervisor.request({"op": "remove", "path": path})

    def read_file(self, path: str, *, max_bytes: int) -> Iterator[bytes]:
        """The file's content in chunks, never more than the size seen when it was opened; TooLargeError when
        that size is over ``max_bytes``, IsDirectoryError for a folder."""
        head, _ = self._supervisor.request({"op": "read_open", "path": path, "max": max_bytes})
        handle, size, got, done = head.get("handle"), number(head.get("size")), 0, False
        if size > max_bytes:
            raise self._supervisor.broken("a file over the cap it was asked to refuse")
        try:
            while not done:
                head, data = self._supervisor.request({"op": "read_chunk", "handle": handle})
                got, done = got + len(data), head.get("eof") is True
                if got > size:
                    raise self._supervisor.broken("more file content than its size")
                if data:
                    yield data
        finally:
            if not done and not self._supervisor.lost:
                self._supervisor.notify({"op": "close", "handle": handle})

    def write_file(self, path: str, chunks: Iterable[bytes], *, max_bytes: int) -> dict[str, Any]:
        """Create or overwrite ``path`` (parents made) with ``chunks``; TooLargeError past ``max_bytes``, and then
        nothing of it stays."""
        head, _ = self._supervisor.request({"op": "write_open", "path": path})
        handle, total, ok = head.get("handle"), 0, False
        try:
            for chunk in chunks:
                total += len(chunk)
                if total > max_bytes:
                    raise TooLargeError(f"the file is over the cap of {max_bytes} bytes")
                for start in range(0, len(chunk), wire.FILE_CHUNK):
                    part = chunk[start:start + wire.FILE_CHUNK]
                    self._supervisor.request({"op": "write_chunk", "handle": handle}, part)
            ok = True
            return self._entry_call({"op": "close", "handle": handle})
        finally:
            if not ok and not self._supervisor.lost:
                with contextlib.suppress(SupervisorError):
                    self._supervisor.request({"op": "close", "handle": handle, "discard": True})

    def watch_dir(self, path: str, *, recursive: bool = False) -> Subscription:
        """Changes below the folder ``path`` from now on, as `FsEvent`s (name relative to it; type create, write,
        remove, rename, chmod, or overflow when the sandbox's kernel dropped some); ``close()`` ends the watch.
        At most MAX_WATCHERS watches, MAX_WATCH_DIRS folders each; a reader that falls behind loses events
        (counted in ``lost``)."""
        return self._supervisor.watch(path, recursive)
