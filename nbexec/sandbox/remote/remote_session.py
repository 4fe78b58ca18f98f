"""A Session whose kernel lives on a node (NBEXEC_NODES): made by ``Session(...)`` when nodes are configured.

It has Session's public surface. The session stays on the node that created it for its whole life; its notebook
and the files of each run are kept in the local output folder (0700) as with a local session. When the node dies,
restarts or cannot be reached, every later call raises SessionLostError naming the node; the files already
downloaded stay. ``interrupt()`` closes the run's stream, which interrupts the cell on the node.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from nbexec import notebook
from nbexec.config import SandboxConfig
from nbexec.engine import budget, reaper
from nbexec.engine.budget import OutputCallback
from nbexec.errors import (
    FileTooLargeError,
    FileTransferError,
    NodeError,
    SessionClosedError,
    SessionError,
    SessionLostError,
)
from nbexec.files import folders
from nbexec.files.artifacts import MAX_SKIPPED, Collection
from nbexec.result import CellError, ExecutionResult, File
from nbexec.stores import uploads
from nbexec.stores.storage import ArtifactStore, LocalStore

from . import noderun, paths
from .nodes import LISTED_ENTRY, Interrupted, NodeClient, parse_listing

DEFAULT_TTL = 20 * 60.0


class RemoteSession(reaper.SessionBase):
    """Session's surface, run on one node of NBEXEC_NODES (see the module docstring)."""

    def __init__(self, config: SandboxConfig | None = None, *, output_dir: str | Path | None = None,
                 ttl: float | None = DEFAULT_TTL, session_id: str | None = None,
                 store: ArtifactStore | None = None, keep_files: bool = True) -> None:
        self.id = session_id or uuid.uuid4().hex
        self._config = config
        self._requested_dir = output_dir
        self.ttl = ttl  # the node reaps a session idle for its own TTL
        self.keep_files = keep_files
        self.output_dir: Path | None = None
        self._folder: folders.OutputFolder | None = None
        self.notebook = notebook.empty()
        self.created_at = time.time()
        self.last_activity = time.monotonic()
        self.store: ArtifactStore = store if store is not None else LocalStore()
        self.node: str | None = None
        self._client: NodeClient | None = None
        self._remote: str | None = None
        self._instance = ""
        self._lost: str | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._uploaded: dict[str, str] = {}
        self._known: dict[str, File] = {}
        self._base = 0

    @property
    def status(self) -> str:
        """new, ready, busy, dead (its node was lost) or closed."""
        return self._status(dead=bool(self._lost), started=self._remote is not None)

    def start(self) -> RemoteSession:
        """Create the session on the most free node now (otherwise the first call does)."""
        from .remote import cluster

        with self._lock:
            self._usable()
            if self._remote is not None:
                return self
            if self.output_dir is None:
                self.output_dir = _output_dir(self._requested_dir)
                self._folder = folders.OutputFolder.open(self.output_dir)
            nodes = cluster()
            last: NodeError | None = None
            for client in nodes.candidates():
                try:
                    with nodes.using(client):
                        self._remote = str(client.request("POST", "/v1/sessions", "start a session",
                                                          json=noderun.image_body(self.config) or None).json()["id"])
                except NodeError as exc:  # never made there (or lost while making it): try the next node
                    last = exc
                    continue
                self._client, self.node = client, client.name
                self._base = len(self.notebook.cells)  # the node numbers this session's cells from 0
                self._instance = nodes.health[client.url].capacity.instance  # type: ignore[union-attr]
                reaper.register(self)
                return self
            assert last is not None
            raise last

    def _route(self) -> str:
        """This session's route on its node (the node's id travels as one encoded segment)."""
        return f"/v1/sessions/{paths.encode(str(self._remote))}"

    def _usable(self) -> None:
        if self._closed:
            raise SessionClosedError(f"Session {self.id} is closed; start a new one.")
        if self._lost:
            raise SessionLostError(self._lost)

    @contextlib.contextmanager
    def _on_node(self, what: str) -> Iterator[NodeClient]:
        """The node's client; a lost or restarted node makes this session lost, for good."""
        self.start()
        assert self._client is not None
        try:
            yield self._client
        except NodeError as exc:
            self._lost = f"Session {self.id} is lost: {exc}. Files already downloaded stay; start a new session."
            raise SessionLostError(self._lost) from exc
        except SessionError as exc:  # 404 from the node: it restarted (a new instance) or reaped the session
            if self._restarted():
                self._lost = (f"Session {self.id} is lost: node {self.node} restarted. Files already downloaded "
                              "stay; start a new session.")
                raise SessionLostError(self._lost) from exc
            raise
        finally:
            self.last_activity = time.monotonic()

    def _restarted(self) -> bool:
        try:
            return self._client is not None and self._client.capacity().instance != self._instance
        except Exception:  # no answer about its instance: not the node that made the session, as far as we know
            return True

    def run(self, code: str, *, timeout: float | None = None, on_output: OutputCallback | None = None,
            packages: Sequence[str] = ()) -> ExecutionResult:
        """Run ``code`` as a new cell on the node and return that cell's result (files fetched when changed;
        ``packages`` are installed by the node first, under its package policy)."""
        started = time.monotonic()
        with self._lock, self._on_node("run code") as client:
            index = len(self.notebook.cells)
            self.notebook.cells.append(notebook.build(code).cells[0])
            config = self.config.replace(timeout=timeout)
            run = noderun.Run(self.notebook, list(range(self._base, index + 1)), config, on_output)
            body = {"code": code, "timeout": run.remaining(), "packages": list(packages)}
            try:
                run.take(client.run(f"{self._route()}/execute", body, run.on_event))
            except Interrupted:
                run.error = CellError("KeyboardInterrupt", f"The cell was interrupted: its stream to node {self.node} "
                                      "was closed, and the node interrupted it.", (), "exception", index)
            except BaseException:
                self.notebook.cells.pop()  # the node numbers cells it ran: keep the two notebooks in step
                raise
            assert self._folder is not None and self.output_dir is not None
            noderun.download(client, run, self._folder, self._known)
            kept = budget.keep_recent(self.notebook, index, config.max_output_bytes + config.max_display_bytes, {})
            run.notes += [kept] if kept else []
            result = noderun.finish(run, f"{self.id}-{index}", self.output_dir, self._folder, started,
                                    first_cell=index, notebook_name="session.ipynb")
        published = uploads.publish(result, self.store, already=self._uploaded)
        return noderun.published(published, run)

    def interrupt(self) -> None:
        """Interrupt the running cell: its stream is closed, so the node interrupts the cell (safe from any thread)."""
        client = self._client
        if client is not None:
            client.interrupt()

    def upload(self, source: str | Path | bytes, name: str | None = None) -> str:
        """Put a host file (streamed) or bytes into /mnt/data on the node; return its path there."""
        if isinstance(source, bytes) and not name:
            raise FileTransferError("upload(bytes) needs a name")
        name = name or Path(str(source)).name
        route = paths.encode(name)  # before anything is sent: a name never leaves this session
        with self._lock, self._on_node("take a file") as client:
            if isinstance(source, bytes):
                client.request("PUT", f"{self._route()}/files/{route}", "take a file", content=source)
            else:
                with open(source, "rb") as handle:
                    client.request("PUT", f"{self._route()}/files/{route}", "take a file",
                                   content=iter(lambda: handle.read(1 << 20), b""))
        return f"/mnt/data/{name}"

    def download(self, name: str) -> bytes:
        """The bytes of /mnt/data/``name`` on the node (at most max_data: FileTooLargeError past it)."""
        _, chunks = self.open_file(name)
        return b"".join(chunks)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, Iterator[bytes]]:
        """/mnt/data/``name`` as it is now on the node: (its size, its chunks), read whole, never past
        ``max_bytes`` or max_data, whichever is smaller (FileTooLargeError)."""
        cap = min((c for c in (max_bytes, self.config.max_data_bytes) if c), default=0)
        route = paths.encode(name)
        with self._lock, self._on_node("send a file") as client:
            content = client.fetch(f"{self._route()}/files/{route}", f"send {name!r}", cap)
        return len(content), iter([content])

    def files(self) -> list[File]:
        """The regular files now in /mnt/data on the node (``path`` is empty: they are not on this host)."""
        return self.listing().files

    def listing(self) -> Collection:
        """/mnt/data on the node as a run would collect it (see Session.listing); a listing larger than
        max_files entries could take is refused unread, and at most max_files entries are kept."""
        limit = (self.config.max_files + MAX_SKIPPED) * LISTED_ENTRY + 65536
        with self._lock, self._on_node("list files") as client:
            try:
                raw = client.fetch(f"{self._route()}/files", "list files", limit)
            except FileTooLargeError as exc:
                raise NodeError(f"node {self.node} sent a file listing over {limit:,} bytes; refused") from exc
        return parse_listing(raw, self.config.max_files, str(self.node))

    def restart(self) -> None:
        """A fresh kernel on a node (variables are lost; the files downloaded so far are put back)."""
        with self._lock:
            if self._closed:
                raise SessionClosedError(f"Session {self.id} is closed; start a new one.")
            self._end_remote()
            self._remote, self._lost, self._client = None, None, None
            self.start()
            for item in list(self._known.values()):
                self.upload(Path(item.path), item.name)
            self._known.clear()

    def save(self, path: str | Path) -> Path:
        """Write the session's notebook so far to ``path`` (atomically, never through a final link)."""
        from nbexec.files import artifacts

        path = Path(path).absolute()
        with self._lock, folders.OutputFolder(path.parent, os.open(path.parent, folders.DIR_FLAGS)) as parent:
            artifacts.replace(parent, path.name, notebook.dumps(self.notebook))
        return path

    def _end_remote(self) -> None:
        if self._client is not None and self._remote is not None and not self._lost:
            with contextlib.suppress(Exception):
                self._client.request("DELETE", self._route(), "end a session")

    def close(self) -> None:
        """End the session on its node. Idempotent; local files stay unless ``keep_files`` is False."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._end_remote()
            folder, self._folder = self._folder, None
        reaper.forget(self)
        if folder is not None:
            if not self.keep_files and folder.still_at_path():
                from nbexec.sandbox.docker.container import remove_tree

                remove_tree(folder.path)
            folder.close()

    def __enter__(self) -> RemoteSession:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RemoteSession {self.id} on {self.node or '?'} {self.status}>"


def _output_dir(requested: str | Path | None) -> Path:
    if requested is None:
        return folders.make_output_dir(folders.output_root() / f"session-{uuid.uuid4().hex}", may_exist=False)
    return folders.make_output_dir(Path(requested).absolute(), may_exist=True)
