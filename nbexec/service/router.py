"""`nbexec serve --nodes name=URL,...`: the same HTTP API as one node, in front of many (stateless; run replicas).

Clients authenticate to the router with its API tokens; the router calls nodes with NBEXEC_NODE_TOKEN and signs,
for each call, which client it is for (`identity`), so every node keeps each client's sessions, results and caps
apart. The router answers its own routes (/healthz, /readyz, /metrics, /v1/capacity, /v1/nodes, the playground)
and forwards every other /v1 call through one path (`relay`), whatever the route:

- ``/v1/<collection>/<id>/...`` names a session or a result: the id must be one issued to this client (its HMAC,
  see `identity`), it names the node (by the router's configured name) and that node's life (410 when the node
  restarted or is gone); the rest of the path is checked segment by segment and re-encoded.
- any other ``/v1/...`` call is placed (``/v1/snapshots/<id>`` too: snapshots live in the nodes' shared store):
  on the most free node (a new session: the node with the fewest sessions), and on the next only when the call
  never reached one (502 ``node_lost`` when it was lost after; never re-run).

E2B's API (/e2b, /e2b/sandbox) goes through the same relay, its sandbox ids naming their node (`router_e2b`).

/readyz says whether any node is up, nothing more; the nodes' detail is at /v1/nodes for NBEXEC_NODE_TOKEN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from nbexec import __version__
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError
from nbexec.sandbox.remote.paths import bad_segment

from . import identity, playground, router_e2b
from .fleet import Fleet, Member, members
from .gateway import OWNER_KEY, PUBLIC_PATHS, Gateway
from .relay import NOT_REACHED, Call, CutOff, Relay, lost_answer

try:
    import httpx  # noqa: F401  (the relay's client)
    from fastapi import FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("the router needs the server extra: pip install 'nbexec-sandbox[server]'") from exc

__all__ = ["RouterSettings", "create_router"]
MiB = 1024 * 1024
_TRUE = {"1", "true", "yes", "on"}  # what FastAPI reads as true for ?stream=


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """The router's nodes (``name=URL`` or ``URL``), its clients' tokens, NBEXEC_NODE_TOKEN, and its caps."""

    nodes: tuple[str, ...]
    node_token: str = field(repr=False)
    tokens: tuple[str, ...] = field(default=(), repr=False)
    max_body: int = 16 * MiB  # bytes of a client's request body
    max_event: int = 67 * MiB  # bytes of one event from a node: 2 x (max_output + max_display) + 1 MiB by default
    max_download: int = 1024 * MiB  # bytes of any other answer from a node (a file): max_data by default; 0: none
    max_calls_per_token: int = 64  # calls of one client in flight through this router (429 past it)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("the router needs at least one node URL (--nodes)")
        if not self.tokens or any(len(t) < 16 for t in self.tokens):
            raise ConfigError("the router needs API tokens of 16+ characters (--token-file or NBEXEC_API_TOKENS)")
        if len(self.node_token) < 16:
            raise ConfigError("the router needs NBEXEC_NODE_TOKEN (16 characters or more), one of the nodes' tokens")
        if self.node_token in self.tokens:
            raise ConfigError("NBEXEC_NODE_TOKEN must not be one of the router's client tokens")
        if min(self.max_body, self.max_event, self.max_calls_per_token) < 1 or self.max_download < 0:
            raise ConfigError("the router's caps must be positive")
        members(self.nodes)  # names and URLs checked now, not at the first call

    @property
    def members(self) -> tuple[Member, ...]:
        return members(self.nodes)

    @classmethod
    def for_policy(cls, config: SandboxConfig, **values: Any) -> RouterSettings:
        """Settings whose caps follow the sandbox policy the nodes were given (max_output, max_display, max_data)."""
        event = 2 * (config.max_output_bytes + config.max_display_bytes) + MiB
        return cls(max_event=event, max_download=config.max_data_bytes, **values)


def create_router(settings: RouterSettings) -> Any:
    """The router's ASGI application, behind the same gateway as a node."""
    fleet = Fleet(settings.members, settings.node_token)
    relay = Relay(fleet, max_event=settings.max_event, max_download=settings.max_download,
                  max_calls=settings.max_calls_per_token)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        try:
            yield
        finally:
            await fleet.close()

    app = FastAPI(title="nbexec router", version=__version__, lifespan=lifespan,
                  description="One endpoint for many nbexec nodes.")
    app.state.fleet = fleet
    _ops_routes(app, fleet)
    playground.add_routes(app)
    _forward_route(app, fleet, relay)
    router_e2b.add_routes(app, fleet, relay)  # E2B's API and SDKs (/e2b), through the same relay
    app.add_middleware(Gateway, tokens=settings.tokens, auth=True, max_body=settings.max_body,
                       public=PUBLIC_PATHS | {"/v1/nodes"})  # /v1/nodes checks the node token itself
    return app


def _who(request: Request) -> str:
    who = request.scope.get("state", {}).get(OWNER_KEY)
    if not who:
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
    return str(who)


def _ops_routes(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Whether any node is up: no names, addresses, loads or errors (those are at /v1/nodes)."""
        ready = bool(fleet.up())
        return JSONResponse({"ready": ready}, 200 if ready else 503)

    @app.get("/v1/nodes")
    async def nodes(request: Request) -> dict[str, Any]:
        """Every node's name, URL, health, load and last error: for the operator (NBEXEC_NODE_TOKEN) only."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), fleet.token):
            raise HTTPException(401, "the node detail needs NBEXEC_NODE_TOKEN", headers={"WWW-Authenticate": "Bearer"})
        return {"nodes": fleet.snapshot()}

    @app.get("/metrics")
    async def metrics() -> Response:
        up = sum(1 for h in fleet.health.values() if h.up)
        lines = ["# TYPE nbexec_router_nodes gauge", f"nbexec_router_nodes {len(fleet.health)}",
                 "# TYPE nbexec_router_nodes_up gauge", f"nbexec_router_nodes_up {up}",
                 "# TYPE nbexec_router_in_flight gauge", f"nbexec_router_in_flight {sum(fleet.inflight.values())}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/capacity")
    async def capacity(request: Request) -> dict[str, Any]:
        """The sum over the nodes that are up (so NBEXEC_NODES may name a router)."""
        _who(request)
        up = list(fleet.up().values())
        return {"node": "router", "instance": "-", "nodes": len(up),
                **{k: sum(getattr(c, k) for c in up) for k in ("sessions", "pool_free", "pool_size", "running")}}


def _forward_route(app: FastAPI, fleet: Fleet, relay: Relay) -> None:
    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def forward(path: str, request: Request) -> Response:
        """Every node route: a call on a session or result goes to its node, any other is placed."""
        who = _who(request)
        segments = path.split("/")
        for segment in segments:
            why = bad_segment(segment)
            if why:
                raise HTTPException(400, f"the path has {why}; name files with plain segments")
        stream, query = _query(request)
        call = Call(who=who, method=request.method, path="", query=query, stream=stream,
                    session=segments[0] == "sessions" and len(segments) > 1,
                    content_type=request.headers.get("content-type"))
        # A snapshot id is the node's own: snapshots shared by the nodes live in their common store (any node).
        if len(segments) > 1 and segments[0] != "snapshots":
            return await _on_its_node(fleet, relay, request, segments, call)
        return await _placed(fleet, relay, request, segments, call)


def _query(request: Request) -> tuple[bool, str]:
    """Whether the client asked for a stream, and the query sent on (with stream=true)."""
    pairs = parse_qsl(request.url.query, keep_blank_values=True)
    stream = any(k == "stream" and v.lower() in _TRUE for k, v in pairs)
    return stream, urlencode([*((k, v) for k, v in pairs if k != "stream"), ("stream", "true")])


def _encoded(segments: list[str]) -> str:
    return "/v1/" + "/".join(quote(s, safe="") for s in segments)


async def _on_its_node(fleet: Fleet, relay: Relay, request: Request, segments: list[str], call: Call) -> Response:
    """A call on a session or result: to the node its id names, with the node's own id."""
    collection, public = segments[0], segments[1]
    parsed = identity.parse_id(fleet.key, call.who, public)
    if parsed is None:
        raise HTTPException(404, f"no such {collection.rstrip('s') or 'thing'}")
    name, instance, raw = parsed
    health = fleet.health.get(name)
    if health is None or not health.up or health.capacity is None:
        return _gone(name, "is down or unknown to this router")
    if health.capacity.instance != instance:
        return _gone(name, "restarted since")
    call = dataclasses.replace(call, path=_encoded([collection, raw, *segments[2:]]))
    body = request.stream() if request.method in ("POST", "PUT", "PATCH") else None  # uploads are streamed
    try:
        upstream = await relay.open(name, call, body)
    except NOT_REACHED as exc:
        fleet.failed(name, str(exc))
        return lost_answer(name, "cannot be reached", True)
    except CutOff:
        return lost_answer(name, "was lost during the call", True)
    return await relay.answer(upstream, request.receive)


async def _placed(fleet: Fleet, relay: Relay, request: Request, segments: list[str], call: Call) -> Response:
    """A call on no session or result: the most free node (fewest sessions for a new session); the next only
    when it never reached one."""
    call = dataclasses.replace(call, path=_encoded(segments))
    body = await request.body()  # within --max-body: kept, so the call can go to another node
    order = fleet.by_sessions() if segments == ["sessions"] else fleet.order()
    tried = []
    for name in order:
        try:
            upstream = await relay.open(name, call, body)
        except NOT_REACHED as exc:
            fleet.failed(name, str(exc))
            tried.append(name)
            continue
        except CutOff:
            return lost_answer(name, "was lost while it took the call", call.session)
        return await relay.answer(upstream, request.receive)
    raise HTTPException(503, "no node is up" + (f" (tried {', '.join(tried)})" if tried else ""),
                        headers={"Retry-After": "2"})


def _gone(name: str, what: str) -> JSONResponse:
    return JSONResponse({"detail": f"session lost: node {name} {what}; its state is gone, files already downloaded "
                         "stay. Start a new session.", "error": "session_lost", "node": name}, 410)
