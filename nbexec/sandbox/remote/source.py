"""The remote source: sandboxes on the nodes of NBEXEC_NODES (`nbexec serve` agents, or one router in front of
them), each driven through its `handle.RemoteHandle`.

A sandbox goes to the node with the most free capacity (asked at /v1/capacity, see `nodes.rank`); a node that
cannot be reached, or is lost while it makes the sandbox, is skipped for a backoff and the next one is asked (no
code ran yet); once a sandbox is held, its node is never swapped (the code may have run there). Nothing of this
host is mounted on a node (``mounts_host_folders`` is False: a config with ``input_dir`` is refused); the nodes'
own policy (memory, network, image) shapes the sandbox, this host's config caps what it keeps.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nbexec import languages
from nbexec.config import SandboxConfig
from nbexec.errors import (
    ConfigError,
    FileTransferError,
    NbexecError,
    NodeError,
    NodeUnavailableError,
    NotOfferedError,
    SandboxError,
    SessionLimitError,
    WakeStoppedError,
)
from nbexec.hostconfig import host_from_env
from nbexec.names import is_image_name
from nbexec.sandbox.source import Capacity, Readiness, SandboxHandle, SandboxSource

from .handle import SMALL, WAKE_TIMEOUT, RemoteHandle
from .nodes import Health, NodeClient, rank

log = logging.getLogger(__name__)
ACQUIRE_TIMEOUT = 300.0  # seconds a node may take to make a sandbox (a cold start waits for its kernel)
WAKE_FLOOR = 1.0  # seconds a node is always given to restore a kernel (an honest one is back in milliseconds)
WAKE_SLACK = 5.0  # seconds past a wake's limit a node gets to answer that it stopped, before it is given up


class Cluster:
    """The nodes of one NBEXEC_NODES list, their health, and the order to try them in. Thread-safe; no I/O until
    used."""

    def __init__(self, urls: tuple[str, ...], token: str) -> None:
        self.clients = {url: NodeClient(url, token) for url in urls}
        self.health = {url: Health() for url in urls}
        self.inflight = {url: 0 for url in urls}  # sandboxes this process holds on each node
        self._lock = threading.Lock()
        self._probes = ThreadPoolExecutor(min(16, len(urls)), thread_name_prefix="nbexec-probe")

    def _probe(self, url: str) -> None:
        try:
            capacity = self.clients[url].capacity()
        except Exception as exc:  # any failure: the node is skipped for its backoff
            self.failed(url, str(exc))
            return
        with self._lock:
            self.health[url].ok(capacity)

    def failed(self, url: str, reason: str) -> None:
        with self._lock:
            self.health[url].failed(reason)
        log.info("node %s is down: %s", url, reason)

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

    def held(self, url: str, change: int) -> None:
        with self._lock:
            self.inflight[url] += change


class RemoteSource(SandboxSource):
    """Sandboxes on remote nodes (see the module docstring)."""

    mounts_host_folders = False

    def __init__(self, urls: tuple[str, ...], token: str) -> None:
        if not urls:
            raise ConfigError("the remote source needs NBEXEC_NODES (and NBEXEC_NODE_TOKEN): the nodes to run on")
        self.cluster = Cluster(urls, token)

    @classmethod
    def from_env(cls) -> RemoteSource:
        """The source of NBEXEC_NODES and NBEXEC_NODE_TOKEN (one per process and setting)."""
        host = host_from_env()
        key = (host.nodes, host.node_token)
        with _sources_lock:
            if key not in _sources:
                _sources[key] = cls(host.nodes, host.node_token)
            return _sources[key]

    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        """A sandbox on the freest node (``claim`` is the node's business: a node with --state-dir keeps its
        sandboxes across its restarts)."""
        if config.input_dir:
            raise ConfigError("input_dir (--mount-input) is a folder of this host, which nodes cannot mount: pass "
                              "the files with files={name: bytes} or upload() instead, or unset NBEXEC_NODES")
        last: NbexecError | None = None
        for client in self.cluster.candidates():
            try:
                body = {"purpose": purpose, **image_body(config)}
                answer = client.json("POST", "/v1/sandboxes", "make a sandbox", SMALL, json=body,
                                     timeout=ACQUIRE_TIMEOUT)
                handle = _speaking(RemoteHandle(client, answer, config, purpose))
            except (SessionLimitError, NotOfferedError) as exc:  # at its cap, or not offering it: the next is asked
                last = exc
                continue
            except FileTransferError as exc:  # a 400: this node does not offer what the body asks (image, language)
                last = NotOfferedError(f"node {client.name} does not run this: {exc}")
                continue
            except NodeError as exc:  # nothing ran there: the next node is asked, this one left alone a while
                self.cluster.failed(client.url, str(exc))
                last = exc
                continue
            self.cluster.held(client.url, 1)
            return handle
        assert last is not None
        raise last

    def adopt(self, config: SandboxConfig, record: dict[str, Any]) -> SandboxHandle:
        """The sandbox a ``describe`` record names on one of NBEXEC_NODES, if its node still holds it."""
        handle = self._found(config, record)
        client = handle.client
        try:
            state = handle.state()
        except NbexecError as exc:
            raise SandboxError(f"the kept sandbox on {client.name} cannot be reached: {exc}") from exc
        if not state.running and not handle.asleep:  # one asleep on its node is woken by the engine
            raise SandboxError(f"the kept sandbox on {client.name} stopped")
        self.cluster.held(client.url, 1)
        return handle

    def abandon(self, config: SandboxConfig, record: dict[str, Any]) -> None:
        """Remove the sandbox a ``describe`` record names from its node without a call to its kernel (a DELETE: the
        node removes its container); nothing when the record names no sandbox on a node of NBEXEC_NODES."""
        with contextlib.suppress(NbexecError):  # a node that is gone took it along
            self._found(config, record).destroy()

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        """Remove the sandbox from its node (a one-shot's in the node's background either way)."""
        if not isinstance(sandbox, RemoteHandle):
            raise TypeError(f"{sandbox!r} is not a sandbox of a node")
        sandbox.destroy()
        self.cluster.held(sandbox.client.url, -1)

    def sweep(self) -> None:
        """Nothing here: each node sweeps what its own dead processes left."""

    def capacity(self, config: SandboxConfig) -> Capacity:
        """The warm sandboxes the nodes last said they had (no I/O)."""
        known = [h.capacity for h in self.cluster.health.values() if h.up and h.capacity is not None]
        return Capacity(ready=sum(c.pool_free for c in known), size=sum(c.pool_size for c in known))

    def readiness(self, config: SandboxConfig) -> Readiness:
        try:
            up = len(self.cluster.candidates())
        except NodeUnavailableError as exc:
            return Readiness(False, {"nodes_up": 0, "error": str(exc)})
        return Readiness(True, {"nodes_up": up})

    def warm_up(self, config: SandboxConfig) -> None:
        """Nothing here: each node keeps its own pool warm."""

    def close(self) -> None:
        for client in self.cluster.clients.values():
            with contextlib.suppress(Exception):
                client.close()

    def hibernate(self, handle: SandboxHandle, folder: Path) -> dict[str, Any] | None:
        """Have the sandbox's node keep its memory (a checkpoint, where the node's runtime can): the record finds
        it there; ``folder`` stays empty, since the memory never leaves the node. None when the node cannot."""
        if not isinstance(handle, RemoteHandle):
            raise TypeError(f"{handle!r} is not a sandbox of a node")
        if not handle.keep_memory():
            return None
        self.cluster.held(handle.client.url, -1)  # asleep: no kernel of this process's on the node until woken
        return {**handle.describe(), "asleep": "checkpoint"}

    def wake(self, config: SandboxConfig, record: dict[str, Any], folder: Path, *,
             check: Callable[[], None] = lambda: None, deadline: float | None = None) -> SandboxHandle:
        """The sandbox a ``hibernate`` record names, its memory restored on its node: one call, bounded by
        ``deadline`` (the node is sent the time left; ``check`` is not polled), else by the node client's own
        timeout."""
        handle = self._found(config, record)
        left = None if deadline is None else max(WAKE_FLOOR, deadline - time.monotonic())
        try:
            if left is None:
                handle.wake_memory(timeout=WAKE_TIMEOUT)
            else:  # the node's wake stops there, its sandbox asleep; a node silent WAKE_SLACK s later is given up
                handle.wake_memory(json={"timeout": left}, timeout=min(WAKE_TIMEOUT, left + WAKE_SLACK))
        except NbexecError as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise WakeStoppedError(f"the wake on {handle.client.name} ran out of the run's time limit before the "
                                       "kernel was back; nothing ran, and the sandbox sleeps on there") from exc
            raise SandboxError(f"the kept sandbox on {handle.client.name} could not be woken: {exc}") from exc
        self.cluster.held(handle.client.url, 1)
        return handle

    def discard(self, record: dict[str, Any], folder: Path) -> None:
        """Remove the sandbox a ``hibernate`` record names from its node, with the memory the node kept."""
        with contextlib.suppress(NbexecError):  # a node that is gone took it along (and its TTL would)
            self._found(SandboxConfig(), record).destroy()

    def _found(self, config: SandboxConfig, record: dict[str, Any]) -> RemoteHandle:
        url = record.get("url")
        client = self.cluster.clients.get(url) if isinstance(url, str) else None
        if record.get("kind") != "remote" or client is None:
            raise SandboxError("the sandbox record does not name a sandbox on a node of NBEXEC_NODES")
        try:
            return RemoteHandle(client, record, config, "session")
        except NbexecError as exc:
            raise SandboxError(f"the kept sandbox record for {client.name} is not one nbexec wrote: {exc}") from exc


_sources: dict[tuple[tuple[str, ...], str], RemoteSource] = {}
_sources_lock = threading.Lock()


def forget_all() -> None:
    """Close and forget every remote source of this process (its node clients and their connections)."""
    with _sources_lock:
        found = list(_sources.values())
        _sources.clear()
    for source in found:
        source.close()


def image_body(config: SandboxConfig) -> dict[str, str]:
    """What a body says of the image and language: a named image's name (the node checks it against its own
    NBEXEC_IMAGES; nothing for a Docker tag, which is this host's choice and means the node's own image), and a
    language other than Python (checked against the node's NBEXEC_LANGUAGES)."""
    return {**({"image": config.image} if is_image_name(config.image) else {}), "language": config.language}


def _speaking(handle: RemoteHandle) -> RemoteHandle:
    """``handle`` if its kernel speaks the language asked for. One that names another kernel (a node that ignores
    the field starts its own default) has its sandbox released: NotOfferedError, and the next node is asked. A
    kernel that names none is taken for Python only."""
    language = languages.get(handle.config.language)
    said = handle.language_info.get("name")
    if (said is None and language.is_python) or (isinstance(said, str) and said.lower() == language.info.lower()):
        return handle
    with contextlib.suppress(NbexecError):
        handle.destroy()
    raise NotOfferedError(f"node {handle.node} started a {str(said)[:40]!r} kernel for {language.name} code: it "
                          f"does not run {language.name} (update it, or build its kernels image)")
