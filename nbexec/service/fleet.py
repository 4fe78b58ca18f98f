"""The router's nodes: who they are (by configuration), their health checks with backoff, and where calls go.

A node is named by the operator (``--nodes name=URL,...``) or, without a name, after its URL's host and port.
What a node reports about itself at /v1/capacity is its load and its ``instance`` (new at each start), never its
identity: a node that claims another's name is still only the node at its own URL. Every answer a node gives
the router here is read within a small cap before it is parsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nbexec.errors import ConfigError
from nbexec.sandbox.remote.nodes import CONNECT_TIMEOUT, PROBE_TIMEOUT, READ_TIMEOUT, Capacity, Health, rank

from . import identity

log = logging.getLogger(__name__)
CHECK_INTERVAL = 1.0  # seconds between health checks of a node that is up
MAX_PROBE = 64 * 1024  # bytes of a /v1/capacity answer read at most
_URL = re.compile(r"https?://[^\s/?#@]+")


@dataclass(frozen=True)
class Member:
    """One node of the router's configuration: its name (used in ids and messages) and its base URL."""

    name: str
    url: str


def members(entries: tuple[str, ...]) -> tuple[Member, ...]:
    """The nodes of ``--nodes``: ``name=URL`` or ``URL`` (then named ``host-port``); names are unique."""
    found: list[Member] = []
    for entry in entries:
        name, _, url = entry.strip().partition("=") if "=" in entry else ("", "", entry.strip())
        url = url.strip().rstrip("/")
        if not _URL.fullmatch(url):
            raise ConfigError(f"--nodes: {url!r} is not a base URL like http://host:8080")
        name = name.strip() or re.sub(r"[^A-Za-z0-9_.-]", "-", urlsplit(url).netloc).strip("-.")
        if not identity.NAME.fullmatch(name):
            raise ConfigError(f"--nodes: {name!r} is not a node name (letters, digits, '_', '.', '-'); "
                              "give one as name=URL")
        found.append(Member(name, url))
    names = [m.name for m in found]
    if len(set(names)) != len(names) or len({m.url for m in found}) != len(found):
        raise ConfigError("--nodes: each node needs its own name and URL; give names as name=URL")
    return tuple(found)


class Fleet:
    """Nodes by name: their URL, last capacity and health, and the calls in flight to each from this router."""

    def __init__(self, nodes: tuple[Member, ...], token: str) -> None:
        self.urls = {m.name: m.url for m in nodes}
        self.token = token.encode()
        self.health = {m.name: Health() for m in nodes}
        self.inflight = {m.name: 0 for m in nodes}
        self.key = identity.id_key(self.token)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.http: Any = None

    async def start(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {self.token.decode()}"}, follow_redirects=False,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT, pool=CONNECT_TIMEOUT),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        await asyncio.gather(*(self.probe(name) for name in self.urls))
        self._tasks = [asyncio.create_task(self._watch(name)) for name in self.urls]

    async def close(self) -> None:
        """End the health checks, then the client.

        A cancellation can be lost: on Python 3.11, ``asyncio.wait_for`` returns its inner result when that
        completes just as the caller is cancelled (a refused connection to a lost node completes within
        microseconds), and a check that lived on kept the router from ever exiting. So a check also ends at its
        next turn once the fleet is closing: within one probe (PROBE_TIMEOUT) of a lost cancellation.
        """
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self.http is not None:
            await self.http.aclose()

    async def probe(self, name: str) -> None:
        """Read the node's capacity (at most MAX_PROBE bytes); a failure starts (or lengthens) its backoff."""
        try:
            body = await asyncio.wait_for(self._read_capacity(name), PROBE_TIMEOUT)
            capacity = Capacity.from_json(json.loads(body))
        except Exception as exc:  # any failure means: not usable now
            self.failed(name, f"{type(exc).__name__}: {exc}"[:300])
            return
        was_down = not self.health[name].up
        self.health[name].ok(capacity)
        if was_down:
            log.info("node %s (%s) is up, instance %s", name, self.urls[name], capacity.instance)
        if capacity.node != name:
            log.debug("node %s calls itself %r; it is known by its configured name", name, capacity.node[:64])

    async def _read_capacity(self, name: str) -> bytes:
        async with self.http.stream("GET", f"{self.urls[name]}/v1/capacity") as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > MAX_PROBE:
                    raise RuntimeError(f"its /v1/capacity answer is over {MAX_PROBE} bytes")
            return bytes(body)

    def failed(self, name: str, reason: str) -> None:
        health = self.health[name]
        if health.up:
            log.warning("node %s is down: %s", name, reason)
        health.failed(reason)

    async def _watch(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            health = self.health[name]
            wait = CHECK_INTERVAL if health.up else max(0.05, health.down_until - loop.time())
            await asyncio.sleep(min(wait, CHECK_INTERVAL * 5))
            await self.probe(name)

    def up(self) -> dict[str, Capacity]:
        return {name: h.capacity for name, h in self.health.items() if h.up and h.capacity is not None}

    def order(self) -> list[str]:
        """Names of the nodes that are up, most free first."""
        return rank(self.up(), self.inflight)

    def by_sessions(self) -> list[str]:
        """Names of the nodes that are up, fewest sessions first."""
        up = self.up()
        return sorted(self.order(), key=lambda name: up[name].sessions)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every node as the operator's /v1/nodes shows it."""
        return [{"node": name, "url": self.urls[name], "up": h.up,
                 **({"error": h.last_error} if not h.up and h.last_error else {}),
                 **({k: v for k, v in h.capacity.to_dict().items() if k != "node"}
                    if h.up and h.capacity is not None else {})}
                for name, h in self.health.items()]
