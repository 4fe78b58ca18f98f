"""Run on remote nodes (NBEXEC_NODES): the same ExecutionResult as a local run, its files on this host.

A one-shot call goes to the node with the most free capacity (asked at /v1/capacity); a call that never reached
its node goes to the next one; a call lost on its node fails with a NodeLostError naming it (never retried: the
code may have run). A notebook with one code cell runs as one `/v1/execute`; one with several runs cell by cell
in a throwaway session on one node, so each cell keeps its own outputs as it would locally. Files and images are
streamed into the local output folder (0700, written through its descriptor, within max_data and max_files),
then handed to the local artifact store like a local run's; files a node uploaded to its own store travel as links.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nbexec import notebook
from nbexec.config import SandboxConfig, from_env, host_from_env
from nbexec.engine.budget import OutputCallback
from nbexec.errors import ConfigError, NodeUnavailableError, NotebookError
from nbexec.files import folders
from nbexec.result import ExecutionResult
from nbexec.stores import uploads
from nbexec.stores.storage import ArtifactStore, LocalStore

from . import noderun
from .nodes import Health, NodeClient, rank

log = logging.getLogger(__name__)
INLINE_FILES = 8 * 1024**2  # input files up to this total travel inside the request; larger ones are streamed


def enabled() -> bool:
    """Whether NBEXEC_NODES names nodes to run on."""
    return bool(host_from_env().nodes)


class Cluster:
    """The nodes of NBEXEC_NODES, their health, and the order to try them in. Thread-safe; no I/O until used."""

    def __init__(self, urls: tuple[str, ...], token: str) -> None:
        self.clients = {url: NodeClient(url, token) for url in urls}
        self.health = {url: Health() for url in urls}
        self.inflight = {url: 0 for url in urls}
        self._lock = threading.Lock()
        self._probes = ThreadPoolExecutor(min(16, len(urls)), thread_name_prefix="nbexec-probe")

    def _probe(self, url: str) -> None:
        try:
            capacity = self.clients[url].capacity()
        except Exception as exc:  # any failure: the node is skipped for its backoff
            with self._lock:
                self.health[url].failed(str(exc))
            log.info("node %s is down: %s", url, exc)
            return
        with self._lock:
            self.health[url].ok(capacity)

    def candidates(self) -> list[NodeClient]:
        """Nodes to try, most free first; those in backoff are left out (all of them, when every node is)."""
        due = [url for url, health in self.health.items() if health.due()]
        list(self._probes.map(self._probe, due or list(self.health)))
        with self._lock:
            up = {url: h.capacity for url, h in self.health.items() if h.up and h.capacity is not None}
            order = rank(up, self.inflight)
        if not order:
            raise NodeUnavailableError("no node of NBEXEC_NODES answers: " + "; ".join(
                f"{url}: {h.last_error or 'not probed'}" for url, h in self.health.items()))
        return [self.clients[url] for url in order]

    @contextlib.contextmanager
    def using(self, client: NodeClient) -> Any:
        with self._lock:
            self.inflight[client.url] += 1
        try:
            yield client
        except NodeUnavailableError as exc:
            with self._lock:
                self.health[client.url].failed(str(exc))
            raise
        finally:
            with self._lock:
                self.inflight[client.url] -= 1

    def client_for(self, url: str) -> NodeClient:
        return self.clients[url]


_clusters: dict[tuple[tuple[str, ...], str], Cluster] = {}
_clusters_lock = threading.Lock()


def cluster() -> Cluster:
    """The Cluster of NBEXEC_NODES / NBEXEC_NODE_TOKEN (one per process and setting)."""
    host = host_from_env()
    key = (host.nodes, host.node_token)
    with _clusters_lock:
        if key not in _clusters:
            _clusters[key] = Cluster(host.nodes, host.node_token)
        return _clusters[key]


def _code_cells(nb: Any) -> list[int]:
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.source.strip()]


def execute(source: Any, *, config: SandboxConfig | None = None, output_dir: str | os.PathLike[str] | None = None,
            on_output: OutputCallback | None = None, store: ArtifactStore | None = None,
            files: Mapping[str, bytes] | None = None, packages: Sequence[str] = (),
            **overrides: Any) -> ExecutionResult:
    """execute_notebook() on a node: the same arguments and result (``node`` names where it ran).

    The node's own policy (memory, network, image, ...) applies; ``config.timeout`` is sent (the node caps it),
    and ``max_data`` / ``max_files`` cap what is downloaded here."""
    started = time.monotonic()
    nb = notebook.coerce(source)
    config = (config or from_env()).replace(**overrides)
    if config.input_dir:
        raise ConfigError("input_dir (--mount-input) is a folder of this host, which nodes cannot mount: pass the "
                          "files with files={name: bytes} instead, or unset NBEXEC_NODES")
    cells = _code_cells(nb)
    if not cells:
        raise NotebookError("There is no code to run: the notebook has no code cell.")
    for index in cells:
        nb.cells[index].outputs = []
    execution_id = uuid.uuid4().hex[:16]
    out = _output_dir(output_dir, execution_id)
    try:
        with folders.OutputFolder.open(out) as folder:
            result = _on_some_node(noderun.Run(nb, cells, config, on_output, tuple(packages)), dict(files or {}),
                                   folder,
                                   execution_id, out, started)
    except BaseException:
        if output_dir is None:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when nothing was written
        raise
    target: ArtifactStore = store if store is not None else LocalStore()
    return noderun.published(uploads.publish(result[0], target), result[1])


def _on_some_node(run: noderun.Run, files: dict[str, bytes], folder: folders.OutputFolder, execution_id: str,
                  out: Path, started: float) -> tuple[ExecutionResult, noderun.Run]:
    """Run on the most free node; on the next one only when the call never reached a node."""
    inline = sum(len(v) for v in files.values()) <= INLINE_FILES
    nodes = cluster()
    last: NodeUnavailableError | None = None
    for client in nodes.candidates():
        attempt = noderun.Run(run.nb, run.cells, run.config, run.on_output, run.packages)
        try:
            with nodes.using(client):
                if len(run.cells) == 1 and inline:
                    noderun.one_shot(client, attempt, files, folder)
                else:
                    noderun.cell_by_cell(client, attempt, files, folder)
        except NodeUnavailableError as exc:  # never reached: nothing ran there, so another node may run it
            log.info("%s; trying another node", exc)
            last = exc
            continue
        return noderun.finish(attempt, execution_id, out, folder, started), attempt
    assert last is not None
    raise last


def _output_dir(output_dir: str | os.PathLike[str] | None, execution_id: str) -> Path:
    if output_dir is None:
        return folders.make_output_dir(folders.output_root() / execution_id, may_exist=False)
    return folders.make_output_dir(Path(output_dir).absolute(), may_exist=True)
