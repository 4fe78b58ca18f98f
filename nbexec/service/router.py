"""`nbexec serve --nodes URL,...`: the same HTTP API as one node, in front of many (stateless; run replicas).

Clients authenticate to the router with its API tokens; the router calls nodes with NBEXEC_NODE_TOKEN. A
one-shot goes to the most free node, and to the next only when it never reached one; a session goes to the
node with the fewest sessions and stays there (its id names the node, see `fleet`). Runs are streamed from the
node whatever the client asked (the node's keep-alive comments bound every wait); a client that leaves closes
the node's stream, which interrupts the run there. A node lost during a call is an explicit error naming it:
502 for a one-shot (never re-run elsewhere), 410 with ``"error": "session_lost"`` for a session.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from nbexec import __version__
from nbexec.errors import ConfigError
from nbexec.sandbox.remote.nodes import EventReader

from .fleet import Fleet
from .gateway import OWNER_KEY, Gateway

try:
    import httpx
    from fastapi import FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("the router needs the server extra: pip install 'nbexec-sandbox[server]'") from exc

__all__ = ["RouterSettings", "create_router"]
log = logging.getLogger(__name__)
Rewrite = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """The router's nodes, its clients' tokens, and NBEXEC_NODE_TOKEN for the nodes."""

    nodes: tuple[str, ...]
    node_token: str = field(repr=False)
    tokens: tuple[str, ...] = field(default=(), repr=False)
    max_body: int = 16 * 1024**2

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("the router needs at least one node URL (--nodes)")
        if not self.tokens or any(len(t) < 16 for t in self.tokens):
            raise ConfigError("the router needs API tokens of 16+ characters (--token-file or NBEXEC_API_TOKENS)")
        if len(self.node_token) < 16:
            raise ConfigError("the router needs NBEXEC_NODE_TOKEN (16 characters or more), one of the nodes' tokens")


def _who(request: Request) -> str:
    who = request.scope.get("state", {}).get(OWNER_KEY)
    if not who:
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
    return str(who)


def _lost(fleet: Fleet, url: str, what: str, session: bool) -> JSONResponse:
    name = fleet.name(url)
    if session:
        return JSONResponse({"detail": f"session lost: node {name} {what}; its kernel state is gone, files already "
                             "downloaded stay. Start a new session.", "error": "session_lost", "node": name}, 410)
    return JSONResponse({"detail": f"node {name} {what}; the execution was not retried, since it may have run",
                         "error": "node_lost", "node": name}, 502)


def _frame(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _relink(data: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """Node routes and ids in a result or listing, as the router's (``old`` and ``new`` are route prefixes)."""
    for key in ("files", "images", "uploads"):
        for item in data.get(key) or []:
            url = item.get("url")
            if isinstance(url, str) and url.startswith(old):
                item["url"] = new + url[len(old):]
    return data


def create_router(settings: RouterSettings) -> Any:
    """The router's ASGI application, behind the same gateway as a node."""
    fleet = Fleet(settings.nodes, settings.node_token)

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
    proxy = _Proxy(fleet)
    _ops_routes(app, fleet)
    _run_routes(app, fleet, proxy)
    _session_routes(app, fleet, proxy)
    app.add_exception_handler(_Gone, lambda _, exc: JSONResponse(exc.body, 410))
    app.add_middleware(Gateway, tokens=settings.tokens, auth=True, max_body=settings.max_body)
    return app


class _Proxy:
    """Forward one request to one node and translate what comes back."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def run(self, url: str, path: str, body: bytes, stream: bool, rewrite: Rewrite,
                  session: bool) -> Response:
        """POST a run to the node as a stream; relay it (stream) or answer with its result. A connect failure
        raises httpx.ConnectError (the caller may try elsewhere); later failures are answered here."""
        request = self.fleet.http.build_request("POST", f"{url}{path}", params={"stream": "true"}, content=body,
                                                headers={"Content-Type": "application/json"})
        self.fleet.inflight[url] += 1
        try:
            response = await self.fleet.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
            self.fleet.inflight[url] -= 1
            raise
        except httpx.HTTPError:
            self.fleet.inflight[url] -= 1
            return _lost(self.fleet, url, "was lost while starting the run", session)
        if response.status_code >= 400:
            self.fleet.inflight[url] -= 1
            return await self._answer(response)
        events = self._events(url, response, rewrite, session)
        where = {"X-Nbexec-Node": self.fleet.name(url)}  # known before the first event: a streaming client sees it
        if stream:
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store", **where})
        answer = await self._collect(events)
        answer.headers.update(where)
        return answer

    async def _events(self, url: str, response: Any, rewrite: Rewrite, session: bool) -> AsyncIterator[bytes]:
        reader = EventReader()
        try:
            async for line in response.aiter_lines():
                event = reader.feed(line)
                if event is None:
                    continue
                kind, data = event
                if kind == "comment":
                    yield b": keep-alive\n\n"
                    continue
                yield _frame(kind, rewrite(data) if kind == "result" else data)
                if kind in ("result", "error"):
                    return
            raise httpx.RemoteProtocolError("the stream ended without a result")
        except httpx.HTTPError as exc:
            log.warning("node %s lost during a run: %s", url, exc)
            lost = _lost(self.fleet, url, "was lost during the run", session)
            yield _frame("error", {"status": lost.status_code, **json.loads(bytes(lost.body))})
        finally:
            self.fleet.inflight[url] -= 1
            await response.aclose()

    @staticmethod
    async def _collect(events: AsyncIterator[bytes]) -> Response:
        final = b""
        async for frame in events:
            if not frame.startswith(b":"):
                final = frame
        kind, _, data = final.partition(b"\ndata: ")
        body = json.loads(data)
        if kind == b"event: result":
            return JSONResponse(body)
        status = int(body.pop("status", 500))
        return JSONResponse(body, status)

    @staticmethod
    async def _answer(response: Any) -> Response:
        """A node's error answer, passed on (a refused node token is the router's fault: 502)."""
        content = await response.aread()
        await response.aclose()
        if response.status_code == 401:
            return JSONResponse({"detail": "a node refused the router's NBEXEC_NODE_TOKEN"}, 502)
        headers = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "content-type")}
        return Response(content[:65536], response.status_code, headers=headers)

    async def forward(self, url: str, method: str, path: str, *, content: Any = None,
                      rewrite: Rewrite | None = None, raw: bool = False) -> Response:
        """Any other call to a session's node: JSON rewritten, or bytes streamed (downloads)."""
        request = self.fleet.http.build_request(method, f"{url}{path}", content=content)
        try:
            response = await self.fleet.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            self.fleet.failed(url, str(exc))
            return _lost(self.fleet, url, "cannot be reached", True)
        except httpx.HTTPError:
            return _lost(self.fleet, url, "was lost during the call", True)
        if response.status_code >= 400:
            return await self._answer(response)
        if raw:
            return StreamingResponse(self._bytes(response), status_code=response.status_code,
                                     media_type="application/octet-stream",
                                     headers={"Content-Disposition": "attachment", "X-Content-Type-Options": "nosniff"})
        content = await response.aread()
        await response.aclose()
        if response.status_code == 204 or not content:
            return Response(status_code=response.status_code)
        data = json.loads(content)
        return JSONResponse(rewrite(data) if rewrite else data, response.status_code)

    @staticmethod
    async def _bytes(response: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()


def _ops_routes(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        nodes = fleet.snapshot()
        ready = any(n["up"] for n in nodes)
        return JSONResponse({"ready": ready, "nodes": nodes}, 200 if ready else 503)

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
        up = [h.capacity for h in fleet.health.values() if h.up and h.capacity is not None]
        return {"node": "router", "instance": "-", "nodes": len(up),
                **{k: sum(getattr(c, k) for c in up) for k in ("sessions", "pool_free", "pool_size", "running")}}


def _run_routes(app: FastAPI, fleet: Fleet, proxy: _Proxy) -> None:
    @app.post("/v1/execute")
    async def execute(request: Request, stream: bool = False) -> Response:
        """A one-shot on the most free node; on another only when the call never reached a node."""
        who = _who(request)
        body = await request.body()
        tried = []
        for url in fleet.order():
            def rewrite(data: dict[str, Any], url: str = url) -> dict[str, Any]:
                raw = str(data.get("execution_id", ""))
                public = fleet.public_id(who, url, raw)
                data["execution_id"] = public
                return _relink(data, f"/v1/executions/{raw}/", f"/v1/executions/{public}/")

            try:
                return await proxy.run(url, "/v1/execute", body, stream, rewrite, session=False)
            except httpx.HTTPError as exc:
                fleet.failed(url, str(exc))
                tried.append(fleet.name(url))
        raise HTTPException(503, "no node is up" + (f" (tried {', '.join(tried)})" if tried else ""),
                            headers={"Retry-After": "2"})

    @app.get("/v1/executions/{execution_id}/{kind}/{name:path}")
    async def result_file(execution_id: str, kind: str, name: str, request: Request) -> Response:
        if kind not in ("files", "images"):
            raise HTTPException(404, "no such route")
        url, raw = _node_of(fleet, _who(request), execution_id, "execution")
        return await proxy.forward(url, "GET", f"/v1/executions/{raw}/{kind}/{quote(name)}", raw=True)


def _node_of(fleet: Fleet, who: str, public: str, what: str) -> tuple[str, str]:
    """The URL of the node that holds ``public`` and the node's own id; 404 or 410 when it cannot be reached."""
    parsed = fleet.parse_id(who, public)
    if parsed is None:
        raise HTTPException(404, f"no such {what}")
    node, instance, raw = parsed
    found = fleet.find(node)
    if found is None or not found[1].up:
        raise _gone(node, "is down or unknown to this router")
    url, health = found
    if health.capacity is None or health.capacity.instance != instance:
        raise _gone(node, "restarted since")
    return url, raw


class _Gone(Exception):
    """A session (or result) whose node is down or restarted: answered 410 with a JSON body."""

    def __init__(self, node: str, what: str) -> None:
        super().__init__(node)
        self.body = {"detail": f"session lost: node {node} {what}; its state is gone, files already downloaded "
                     "stay. Start a new session.", "error": "session_lost", "node": node}


def _gone(node: str, what: str) -> _Gone:
    return _Gone(node, what)


async def _make_session(fleet: Fleet, proxy: _Proxy, url: str) -> dict[str, Any] | Response | None:
    """The node's new session (its JSON), an answer to pass on, or None when the node was not reached."""
    try:
        response = await fleet.http.post(f"{url}/v1/sessions")
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        fleet.failed(url, str(exc))
        return None
    except httpx.HTTPError:
        return _lost(fleet, url, "was lost while making the session", True)
    if response.status_code != 201:
        return await proxy._answer(response)
    return dict(response.json())


def _session_routes(app: FastAPI, fleet: Fleet, proxy: _Proxy) -> None:
    def ids(who: str, url: str, raw: str) -> tuple[str, Rewrite]:
        public = fleet.public_id(who, url, raw)

        def rewrite(data: dict[str, Any]) -> dict[str, Any]:
            if str(data.get("id", "")) == raw:
                data["id"] = public
            execution = str(data.get("execution_id", ""))
            if execution.startswith(raw):
                data["execution_id"] = public + execution[len(raw):]
            return _relink(data, f"/v1/sessions/{raw}/", f"/v1/sessions/{public}/")

        return public, rewrite

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request) -> Response:
        """A session on the node with the fewest; it stays there (its id names the node)."""
        who = _who(request)
        order = sorted(fleet.order(), key=lambda u: fleet.health[u].capacity.sessions)  # type: ignore[union-attr]
        for url in order:
            made = await _make_session(fleet, proxy, url)
            if isinstance(made, dict):
                return JSONResponse(ids(who, url, str(made["id"]))[1](made), 201)
            if made is not None:
                return made
        raise HTTPException(503, "no node is up", headers={"Retry-After": "2"})

    @app.api_route("/v1/sessions/{session_id}", methods=["GET", "DELETE"])
    async def session(session_id: str, request: Request) -> Response:
        who = _who(request)
        url, raw = _node_of(fleet, who, session_id, "session")
        return await proxy.forward(url, request.method, f"/v1/sessions/{raw}", rewrite=ids(who, url, raw)[1])

    @app.post("/v1/sessions/{session_id}/execute")
    async def execute_in_session(session_id: str, request: Request, stream: bool = False) -> Response:
        who = _who(request)
        url, raw = _node_of(fleet, who, session_id, "session")
        try:
            return await proxy.run(url, f"/v1/sessions/{raw}/execute", await request.body(), stream,
                                   ids(who, url, raw)[1], session=True)
        except httpx.HTTPError as exc:
            fleet.failed(url, str(exc))
            return _lost(fleet, url, "cannot be reached", True)

    _session_file_routes(app, fleet, proxy, ids)


def _session_file_routes(app: FastAPI, fleet: Fleet, proxy: _Proxy, ids: Callable[..., tuple[str, Rewrite]]) -> None:
    @app.get("/v1/sessions/{session_id}/files")
    async def list_files(session_id: str, request: Request) -> Response:
        who = _who(request)
        url, raw = _node_of(fleet, who, session_id, "session")
        return await proxy.forward(url, "GET", f"/v1/sessions/{raw}/files", rewrite=ids(who, url, raw)[1])

    @app.api_route("/v1/sessions/{session_id}/{kind}/{name:path}", methods=["GET", "PUT"])
    async def session_file(session_id: str, kind: str, name: str, request: Request) -> Response:
        who = _who(request)
        if kind not in ("files", "images") or (request.method == "PUT" and kind != "files"):
            raise HTTPException(404, "no such route")
        url, raw = _node_of(fleet, who, session_id, "session")
        path = f"/v1/sessions/{raw}/{kind}/{quote(name)}"
        if request.method == "PUT":
            return await proxy.forward(url, "PUT", path, content=request.stream())
        return await proxy.forward(url, "GET", path, raw=True)
