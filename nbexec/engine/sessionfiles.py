"""A session's files seen from the host: /mnt/data's (upload, download, stream, list) and its notebook (save);
a base of `session.Session`.

Every call starts the session if needed, holds its lock and counts as activity; the bytes come from the sandbox
through its handle (`nbexec.sandbox.source.SandboxHandle`), within max_data and max_files.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.errors import FileTooLargeError, FileTransferError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.notebook import dumps
from nbexec.result import File
from nbexec.sandbox.source import SandboxHandle

from . import collect


class SessionFiles:
    """The file calls of a session (see the module docstring)."""

    _lock: threading.RLock
    _sandbox: SandboxHandle | None
    _hashed: artifacts.Known
    _copied: artifacts.Known
    _folder: OutputFolder | None
    last_activity: float
    notebook: NotebookNode
    output_dir: Path | None

    @property
    def config(self) -> SandboxConfig:
        raise NotImplementedError

    def start(self) -> SessionFiles:
        raise NotImplementedError

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The session for a sequence of calls no other call may come between (the E2B door's per-call envs)."""
        with self._lock:
            yield

    def _started_handle(self) -> SandboxHandle:
        """The session's running sandbox (started or woken first): for doors that reach into it beyond cells and
        /mnt/data (the E2B door's process supervisor). It changes when the session sleeps and wakes."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            return self._sandbox

    def _copy_out(self, sandbox: SandboxHandle) -> list[File]:
        assert self._folder is not None
        with self._folder.child("data") as target:
            return sandbox.snapshot(target, collect.limits(self.config), self._copied).files

    def _copy_in(self, files: list[File]) -> None:
        """Put the host copies of a previous sandbox's files into the new /mnt/data."""
        sandbox = self._sandbox
        assert sandbox is not None
        for item in files:
            with open(item.path, "rb") as handle:  # a private host folder nbexec made (0700)
                sandbox.put_file(item.name, handle)
        self._copied.clear()  # the new filesystem's files are new: copy them again after the next run
        self._hashed.clear()
    # -- files --------------------------------------------------------------------------------------

    def upload(self, source: str | Path | bytes, name: str | None = None) -> str:
        """Put a host file (streamed) or bytes into /mnt/data as ``name``; return its path inside the sandbox.

        A file that does not fit in /mnt/data (max_data, max_files) raises FileTransferError."""
        if isinstance(source, bytes) and not name:
            raise FileTransferError("upload(bytes) needs a name")
        name = name or Path(str(source)).name
        with self._lock:
            self.start()
            sandbox = self._sandbox
            assert sandbox is not None
            if isinstance(source, bytes):
                sandbox.put_file(name, source)
            else:
                try:
                    handle = open(source, "rb")  # noqa: SIM115 - closed below, after the streamed copy
                except OSError as exc:
                    raise FileTransferError(f"cannot read {source}: {exc.strerror}") from exc
                with handle:
                    limit = self.config.max_data_bytes
                    if limit and os.fstat(handle.fileno()).st_size > limit:
                        raise FileTransferError(f"{name!r} is larger than the /mnt/data cap ({self.config.max_data})")
                    sandbox.put_file(name, handle)
            self.last_activity = time.monotonic()
        return f"/mnt/data/{name}"

    def download(self, name: str) -> bytes:
        """The bytes of /mnt/data/``name`` (a regular file; links are refused). A file over max_data (by its
        apparent size) raises FileTooLargeError before a byte is read."""
        _, chunks = self.open_file(name)
        try:
            return b"".join(chunks)
        finally:
            chunks.close()

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        """/mnt/data/``name`` as it is now, for streaming: (its size, its chunks); links are refused, and so is
        a file over ``max_bytes`` or max_data, whichever is smaller (FileTooLargeError; nothing is read)."""
        cap = min((c for c in (max_bytes, self.config.max_data_bytes) if c), default=0)
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            try:
                return self._sandbox.open_file(name, max_bytes=cap)
            except FileTooLargeError as exc:
                if cap != self.config.max_data_bytes:
                    raise
                raise FileTooLargeError(f"{exc} (the /mnt/data cap, max_data, is {self.config.max_data})") from None

    def files(self) -> list[File]:
        """The regular files now in /mnt/data, as a run would keep them (see `listing`)."""
        return self.listing().files

    def save(self, path: str | Path) -> Path:
        """Write the session's notebook so far to ``path`` (atomically; never through a final link)."""
        path = Path(path).absolute()
        with self._lock:  # inside the output folder: through its descriptor
            content = dumps(self.notebook)
            if self._folder is not None and self.output_dir is not None and path.parent == self.output_dir.absolute():
                return transfer.replace(self._folder, path.name, content)
        # A place the caller chose: its links are the caller's own, so only the final name is never followed.
        with OutputFolder(path.parent, os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)) as parent:
            transfer.replace(parent, path.name, content)
        return path

    def listing(self) -> artifacts.Collection:
        """/mnt/data as it is now, read as a run's collection reads it: the regular files within max_data and
        max_files, hashed (an unchanged file only once per session), and the rest listed as skipped with why
        (a file over the caps is never read, whatever its apparent size), with notes."""
        with self._lock:
            self.start()
            assert self._sandbox is not None
            self.last_activity = time.monotonic()
            return self._sandbox.list_files(collect.limits(self.config), self._hashed)
