"""Remote nodes (`nbexec serve` agents): their capacity, their health, where a call goes, and the one HTTP hop.

The pure parts (``Capacity``, ``rank``, ``Health``, ``EventReader``) are shared by the library's remote client
(`remote`, blocking) and the router (`service.router`, asyncio); ``NodeClient`` is the library's hop. Every hop
has timeouts: connect, write, and a read timeout that the node's keep-alive comments reset on long runs.

A failure is sorted by whether the request reached the node: not reached (connect refused or timed out) is a
``NodeUnavailableError`` and safe to send elsewhere; reached and then lost is a ``NodeLostError``, never retried,
because the code may have run.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbexec.errors import (
    ConfigError,
    FileTooLargeError,
    FileTransferError,
    NodeError,
    NodeLostError,
    NodeUnavailableError,
    SessionError,
    SessionLimitError,
)
from nbexec.files.artifacts import MAX_SKIPPED, Collection
from nbexec.result import File, SkippedFile

CONNECT_TIMEOUT = 3.0  # seconds to open a connection to a node
PROBE_TIMEOUT = 3.0  # seconds for a capacity probe, end to end
READ_TIMEOUT = 60.0  # seconds without a byte from a node (keep-alive comments arrive every 15 s on a run)
MAX_EVENT = 128 * 1024**2  # bytes of one streamed event (a result carries at most max_output + max_display)
LISTED_ENTRY = 8192  # bytes one entry of a file listing may take (a 1,024-byte name escaped, its URL, its hash)
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


class EventReader:
    """Server-sent events, one line at a time: returns ``(event, data)`` at each blank line; comments (keep-alive)
    return ``("comment", None)``. Events past MAX_EVENT bytes are refused."""

    def __init__(self) -> None:
        self.kind = "message"
        self.data: list[str] = []
        self.size = 0

    def feed(self, line: str) -> tuple[str, Any] | None:
        if line.startswith(":"):
            return ("comment", None)
        if line == "":
            if not self.data:
                return None
            text, kind = "\n".join(self.data), self.kind
            self.kind, self.data, self.size = "message", [], 0
            try:
                return (kind, json.loads(text))
            except json.JSONDecodeError as exc:
                raise NodeError(f"a node sent a malformed {kind} event") from exc
        self.size += len(line)
        if self.size > MAX_EVENT:
            raise NodeError(f"a node sent an event over {MAX_EVENT} bytes")
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.kind = value
        elif name == "data":
            self.data.append(value)
        return None


def parse_listing(raw: bytes, max_files: int, node: str) -> Collection:
    """A node's answer to GET /v1/sessions/{id}/files (already capped in bytes): at most ``max_files`` files and
    MAX_SKIPPED skipped entries kept, each field checked; anything else is a NodeError."""
    try:
        data = json.loads(raw)
        files = [File(_text(f["name"]), "", _count(f["size"]), _text(f["mime"]), _text(f["sha256"]),
                      None if f.get("url") is None else _text(f["url"])) for f in data["files"][:max_files]]
        skipped = [SkippedFile(_text(s["name"]), _text(s["reason"]))
                   for s in data.get("skipped_files", [])[:MAX_SKIPPED]]
        notes = [_text(n) for n in data.get("notes", [])[:MAX_SKIPPED]]
        more = len(data["files"]) - len(files)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise NodeError(f"node {node} sent a malformed file listing ({type(exc).__name__})") from exc
    if more > 0:
        notes.append(f"{more:,} more files were listed by node {node}; at most {max_files:,} are kept (max_files)")
    return Collection(files, skipped, notes)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError("not a count")
    return value


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


class Interrupted(Exception):
    """The caller closed a run's stream on purpose (``NodeClient.interrupt``)."""


class NodeClient:
    """The blocking HTTP hop to one node, with the node's token and timeouts on every request."""

    def __init__(self, url: str, token: str) -> None:
        httpx = _httpx()
        self.url = url
        self.name = url  # until the node says its name
        self._streams: set[Any] = set()  # runs being streamed, closed by interrupt()
        self._interrupted: set[int] = set()
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

    def capacity(self) -> Capacity:
        with self.call("report its capacity"):
            response = self.http.get("/v1/capacity", timeout=PROBE_TIMEOUT)
        self.check(response)
        capacity = Capacity.from_json(response.json())
        self.name = capacity.node
        return capacity

    def check(self, response: Any) -> None:
        """Raise the nbexec error for an HTTP error answer (the body is read, at most 64 KiB of it)."""
        if response.status_code < 400:
            return
        with contextlib.suppress(Exception):
            response.read()
        try:
            detail = str(json.loads(response.content[:65536]).get("detail", ""))
        except (ValueError, AttributeError):
            detail = response.text[:300]
        raise http_error(response.status_code, detail, self.name)

    def request(self, method: str, path: str, what: str, **options: Any) -> Any:
        with self.call(what):
            response = self.http.request(method, path, **options)
        self.check(response)
        return response

    def fetch(self, path: str, what: str, max_bytes: int) -> bytes:
        """GET ``path`` and return its body, refused (FileTooLargeError) once it passes ``max_bytes`` (0: no cap):
        by its Content-Length before a byte is read, else as soon as what arrived passes the cap."""
        with self.call(what), self.http.stream("GET", path) as response:
            self.check(response)
            with contextlib.suppress(ValueError):
                if max_bytes and int(response.headers.get("content-length", "0")) > max_bytes:
                    raise FileTooLargeError(f"what node {self.name} sent to {what} is larger than {max_bytes:,} "
                                            "bytes by its Content-Length; nothing was read")
            chunks, total = [], 0
            for chunk in response.iter_bytes(1 << 20):
                total += len(chunk)
                if max_bytes and total > max_bytes:
                    raise FileTooLargeError(f"what node {self.name} sent to {what} is larger than {max_bytes:,} "
                                            "bytes; the rest was not read")
                chunks.append(chunk)
        return b"".join(chunks)

    def run(self, path: str, body: dict[str, Any], on_event: Callable[[str, Any], None]) -> dict[str, Any]:
        """POST ``body`` to ``path`` as a stream: each ``output`` event goes to ``on_event``; return the result.

        Raises Interrupted when ``interrupt()`` closed the stream (the node then interrupts the run)."""
        with self.call("run code"), self.http.stream("POST", path, params={"stream": "true"}, json=body) as response:
            self._streams.add(response)
            try:
                return self._result(response, on_event)
            except Exception:
                if id(response) in self._interrupted:
                    raise Interrupted() from None
                raise
            finally:
                self._streams.discard(response)
                self._interrupted.discard(id(response))

    def _result(self, response: Any, on_event: Callable[[str, Any], None]) -> dict[str, Any]:
        self.check(response)
        reader = EventReader()
        for line in response.iter_lines():
            event = reader.feed(line)
            if event is None or event[0] == "comment":
                continue
            kind, data = event
            if kind == "result":
                return dict(data)
            if kind == "error":
                raise http_error(int(data.get("status", 500)), str(data.get("detail", "")), self.name)
            on_event(kind, data)
        raise NodeLostError(f"node {self.name} ({self.url}) ended the stream without a result; not retried, "
                            "since the code may have run")

    def interrupt(self) -> None:
        """Close every run being streamed: the node sees its client go and interrupts the run."""
        import socket

        for response in list(self._streams):
            self._interrupted.add(id(response))
            stream = response.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            with contextlib.suppress(Exception):  # wakes the reading thread at once; closing alone would not
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
                response.close()

    def close(self) -> None:
        self.http.close()
