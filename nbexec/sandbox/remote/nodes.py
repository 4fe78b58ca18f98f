"""Remote nodes (`nbexec serve` agents): their capacity, their health, where a call goes, and the one HTTP hop.

The pure parts (``Capacity``, ``rank``, ``Health``) are shared by the library's remote source (`source`, blocking)
and the router (`service.fleet`, asyncio); ``NodeClient`` is the library's hop. Every hop has timeouts: connect,
write, and a read timeout that the node's keep-alive frames reset on long runs. Every answer is read within a cap
while it arrives (an error's body too), never whole and then judged.

A failure is sorted by whether the request reached the node: not reached (connect refused or timed out) is a
``NodeUnavailableError`` and safe to send elsewhere; reached and then lost is a ``NodeLostError``, never retried,
because the code may have run.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbexec.errors import (
    ConfigError,
    FileTooLargeError,
    FileTransferError,
    NodeError,
    NodeLostError,
    NodeUnavailableError,
    ProtocolError,
    SessionError,
    SessionLimitError,
)
from nbexec.sandbox.messages import parse

CONNECT_TIMEOUT = 3.0  # seconds to open a connection to a node
PROBE_TIMEOUT = 3.0  # seconds for a capacity probe, end to end
READ_TIMEOUT = 60.0  # seconds without a byte from a node (keep-alive comments arrive every 15 s on a run)
ERROR_BODY = 64 * 1024  # bytes of an error answer read at most
MAX_PROBE = 64 * 1024  # bytes of a /v1/capacity answer
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 5.0  # seconds a failed node is left alone, doubling per failure


@dataclass(frozen=True)
class Capacity:
    """What a node reports at /v1/capacity."""

    node: str
    instance: str  # changes when the node restarts: its sessions from before are lost
    sessions: int
    pool_free: int
    pool_size: int
    running: int

    @classmethod
    def from_json(cls, data: Any) -> Capacity:
        try:
            return cls(str(data["node"]), str(data["instance"]), int(data["sessions"]), int(data["pool_free"]),
                       int(data["pool_size"]), int(data["running"]))
        except (TypeError, KeyError, ValueError) as exc:
            raise NodeError(f"a node answered /v1/capacity with something else: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "instance": self.instance, "sessions": self.sessions,
                "pool_free": self.pool_free, "pool_size": self.pool_size, "running": self.running}


def rank(capacities: Mapping[str, Capacity], inflight: Mapping[str, int] | None = None) -> list[str]:
    """Node keys, most free first: warm sandboxes not yet claimed, then fewest running, then fewest sessions.

    ``inflight`` counts calls this client has sent since the capacity was read. Ties are broken at random, so
    equal nodes share the load."""
    inflight = inflight or {}

    def key(name: str) -> tuple[int, int, int, float]:
        cap, extra = capacities[name], inflight.get(name, 0)
        return (-(cap.pool_free - extra), cap.running + extra, cap.sessions, random.random())

    return sorted(capacities, key=key)


@dataclass
class Health:
    """One node's health as its callers saw it: a failed node is skipped for a backoff that doubles."""

    failures: int = 0
    down_until: float = 0.0
    last_error: str = ""
    capacity: Capacity | None = None
    seen: float = field(default=0.0)

    @property
    def up(self) -> bool:
        return self.failures == 0 and self.capacity is not None

    def due(self, now: float | None = None) -> bool:
        """Whether the node may be tried now (up, or its backoff is over)."""
        return (time.monotonic() if now is None else now) >= self.down_until

    def ok(self, capacity: Capacity) -> None:
        self.failures, self.down_until, self.last_error = 0, 0.0, ""
        self.capacity, self.seen = capacity, time.monotonic()

    def failed(self, reason: str) -> None:
        self.failures += 1
        self.last_error = reason
        self.down_until = time.monotonic() + min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self.failures - 1))


def http_error(status: int, detail: str, node: str) -> Exception:
    """The nbexec error for a node's HTTP error answer."""
    where = f"node {node}"
    if status == 401:
        return ConfigError(f"{where} refused NBEXEC_NODE_TOKEN; use one of the node's API tokens")
    if status == 400:
        return FileTransferError(detail)
    if status == 413:
        return FileTooLargeError(detail)
    if status == 429:
        return SessionLimitError(f"{where} is at its limit: {detail}")
    if status in (404, 409, 410):
        return SessionError(f"{where}: {detail}")
    return NodeError(f"{where} failed (HTTP {status}): {detail}")


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ConfigError("NBEXEC_NODES needs the cluster extra: pip install 'nbexec-sandbox[cluster]'") from exc
    return httpx


class NodeClient:
    """The blocking HTTP hop to one node, with the node's token and timeouts on every request."""

    def __init__(self, url: str, token: str) -> None:
        httpx = _httpx()
        self.url = url
        self.name = url  # until the node says its name
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT, pool=CONNECT_TIMEOUT))

    def __repr__(self) -> str:
        return f"<NodeClient {self.name} {self.url}>"

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Translate httpx's failures inside into NodeUnavailableError (never reached) or NodeLostError."""
        httpx = _httpx()
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NodeUnavailableError(f"node {self.name} ({self.url}) cannot be reached to {what}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise NodeLostError(
                f"node {self.name} ({self.url}) was lost while it was asked to {what} "
                f"({type(exc).__name__}); not retried, since the code may have run") from exc

    @contextlib.contextmanager
    def stream(self, method: str, path: str, what: str, **options: Any) -> Iterator[Any]:
        """The node's answer to one request, its error (if any) raised after reading at most ERROR_BODY bytes."""
        with self.call(what), self.http.stream(method, path, **options) as response:
            self.check(response)
            yield response

    def capacity(self) -> Capacity:
        capacity = Capacity.from_json(self.json("GET", "/v1/capacity", "report its capacity", MAX_PROBE,
                                                timeout=PROBE_TIMEOUT))
        self.name = capacity.node
        return capacity

    def check(self, response: Any) -> None:
        """Raise the nbexec error for an HTTP error answer (at most ERROR_BODY bytes of its body are read)."""
        if response.status_code < 400:
            return
        body = b""
        with contextlib.suppress(Exception):
            body = read(response, ERROR_BODY, what="an error", node=self.name, truncate=True)
        try:
            detail = str(json.loads(body).get("detail", ""))[:2000]
        except (ValueError, AttributeError, RecursionError):
            detail = body[:300].decode("utf-8", "replace")
        raise http_error(response.status_code, detail, self.name)

    def json(self, method: str, path: str, what: str, max_bytes: int, *, deadline: float | None = None,
             **options: Any) -> Any:
        """The JSON answer to one request, read within ``max_bytes`` (FileTooLargeError past them, nothing
        parsed; NodeError when it is not JSON) and, with ``deadline``, by that time.monotonic() (NodeLostError
        after it: a node that trickles its answer keeps each read under the read timeout)."""
        with self.stream(method, path, what, **options) as response:
            body = read(response, max_bytes, what=what, node=self.name, deadline=deadline)
        try:
            return parse(body, f"answer to {what}")
        except ProtocolError as exc:
            raise NodeError(f"node {self.name} sent a malformed answer when asked to {what}") from exc

    def send(self, method: str, path: str, what: str, **options: Any) -> None:
        """A request whose answer carries nothing (its body, if any, is read within ERROR_BODY bytes)."""
        with self.stream(method, path, what, **options) as response:
            read(response, ERROR_BODY, what=what, node=self.name, truncate=True)

    def close(self) -> None:
        self.http.close()


def read(response: Any, max_bytes: int, *, what: str, node: str, truncate: bool = False,
         deadline: float | None = None) -> bytes:
    """At most ``max_bytes`` of ``response``'s body, read as it arrives: past them the rest is left unread and
    FileTooLargeError raised (with ``truncate``, the first ``max_bytes`` returned instead); past ``deadline``,
    NodeLostError."""
    chunks, total = [], 0
    # With a deadline, each chunk as it arrives: a chunk size would wait for that many bytes of a trickle.
    for chunk in response.iter_bytes() if deadline is not None else response.iter_bytes(1 << 16):
        if deadline is not None and time.monotonic() > deadline:
            raise NodeLostError(f"node {node} did not finish its answer to {what} in time")
        total += len(chunk)
        if total > max_bytes:
            if truncate:
                chunks.append(chunk[:len(chunk) - (total - max_bytes)])
                break
            raise FileTooLargeError(f"what node {node} sent to {what} is larger than {max_bytes:,} bytes; the rest "
                                    "was not read")
        chunks.append(chunk)
    return b"".join(chunks)
