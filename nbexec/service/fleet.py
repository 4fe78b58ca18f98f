"""The router's view of its nodes: health checks with backoff, placement, and ids that name their node.

A session or result id handed to a client is ``<node>.<instance>.<node's id>.<signature>``. The signature (an
HMAC keyed from NBEXEC_NODE_TOKEN, which every router replica holds) binds the id to the client's token, so any
replica routes it without shared state and no other token can use it (404, as on a single node). ``instance``
tells a restarted node from the one that made the session: its sessions are lost (410), never silently new.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
from typing import Any

from nbexec.sandbox.remote.nodes import CONNECT_TIMEOUT, PROBE_TIMEOUT, READ_TIMEOUT, Capacity, Health, rank

log = logging.getLogger(__name__)
CHECK_INTERVAL = 1.0  # seconds between health checks of a node that is up
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


class Fleet:
    """Nodes by URL: their last capacity, their health, calls in flight from this router."""

    def __init__(self, urls: tuple[str, ...], token: str) -> None:
        self.urls = urls
        self.token = token
        self.health = {url: Health() for url in urls}
        self.inflight = {url: 0 for url in urls}
        self.checked = asyncio.Event()  # set once every node was checked once
        self._key = hashlib.sha256(b"nbexec-router-ids\0" + token.encode()).digest()
        self._tasks: list[asyncio.Task[None]] = []
        self.http: Any = None

    async def start(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT, pool=CONNECT_TIMEOUT),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        await asyncio.gather(*(self.probe(url) for url in self.urls))
        self.checked.set()
        self._tasks = [asyncio.create_task(self._watch(url)) for url in self.urls]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.http is not None:
            await self.http.aclose()

    async def probe(self, url: str) -> None:
        """Read the node's capacity; a failure starts (or lengthens) its backoff."""
        try:
            response = await self.http.get(f"{url}/v1/capacity", timeout=PROBE_TIMEOUT)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            capacity = Capacity.from_json(response.json())
        except Exception as exc:  # any failure means: not usable now
            self.failed(url, f"{type(exc).__name__}: {exc}")
            return
        was_down = not self.health[url].up
        self.health[url].ok(capacity)
        if was_down:
            log.info("node %s (%s) is up, instance %s", capacity.node, url, capacity.instance)

    def failed(self, url: str, reason: str) -> None:
        health = self.health[url]
        if health.up:
            log.warning("node %s is down: %s", url, reason)
        health.failed(reason)

    async def _watch(self, url: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            health = self.health[url]
            wait = CHECK_INTERVAL if health.up else max(0.05, health.down_until - loop.time())
            await asyncio.sleep(min(wait, CHECK_INTERVAL * 5))
            await self.probe(url)

    def order(self) -> list[str]:
        """Up nodes, most free first."""
        up = {url: h.capacity for url, h in self.health.items() if h.up and h.capacity is not None}
        return rank(up, self.inflight)

    def find(self, name: str) -> tuple[str, Health] | None:
        """The URL and health of the node last seen with this name."""
        for url, health in self.health.items():
            if health.capacity is not None and health.capacity.node == name:
                return url, health
        return None

    def name(self, url: str) -> str:
        capacity = self.health[url].capacity
        return capacity.node if capacity is not None else url

    # -- ids ------------------------------------------------------------------------------------------------

    def _sign(self, who: str, node: str, instance: str, raw: str) -> str:
        message = "\0".join((who, node, instance, raw)).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:24]

    def public_id(self, who: str, url: str, raw: str) -> str:
        capacity = self.health[url].capacity
        assert capacity is not None
        return f"{capacity.node}.{capacity.instance}.{raw}.{self._sign(who, capacity.node, capacity.instance, raw)}"

    def parse_id(self, who: str, public: str) -> tuple[str, str, str] | None:
        """(node, instance, the node's id) of an id this router family issued to ``who``; None otherwise."""
        parts = public.rsplit(".", 3)
        if len(parts) != 4 or not all(_HEX.match(p) for p in parts[1:]):
            return None
        node, instance, raw, signature = parts
        if not hmac.compare_digest(signature, self._sign(who, node, instance, raw)):
            return None
        return node, instance, raw

    def snapshot(self) -> list[dict[str, Any]]:
        """Every node as /readyz shows it."""
        return [{"url": url, "node": self.name(url), "up": h.up,
                 **({"error": h.last_error} if not h.up and h.last_error else {}),
                 **(h.capacity.to_dict() if h.up and h.capacity is not None else {})}
                for url, h in self.health.items()]
