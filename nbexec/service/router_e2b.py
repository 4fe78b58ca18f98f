"""E2B's API through a router: the SDKs pointed at the router (``E2B_API_URL=<router>/e2b``,
``E2B_SANDBOX_URL=<router>/e2b/sandbox``, ``E2B_API_KEY=<a router token>``) reach sandboxes on its nodes.

Every call goes through the router's one relay, signed for its client (`identity`), so each node keeps each
client's sandboxes apart. The router keeps no table: the sandbox ids its clients hold name the node (`e2b_ids`),
and it rewrites them both ways (in paths and ``E2b-Sandbox-Id``; ``sandboxID`` in answers).

- Control plane (``/e2b/...``, ``X-API-KEY``): a create goes to the node with the fewest sessions, a call naming
  a sandbox to its node. The list asks every node that is up and merges. Anything else goes to the most free
  node, since the nodes share snapshots. See `router_e2b_control`.
- Data plane (``/e2b/sandbox/...``): routed by ``E2b-Sandbox-Id``. The sandbox's access token goes to the node,
  which judges it; the router neither checks nor keeps it. Only the E2B headers the node reads go with it.
  Answers stream through as they come, capped (`e2b_frames`).

A sandbox whose node is down, unknown or restarted answers as E2B answers a gone sandbox, without calling a node:
control 404, data plane 502 "The sandbox was not found". A node lost during a call is 502 with ``Should-Retry:
false``, because the SDKs would otherwise send it again; it is never sent to another node.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from . import e2b_frames, e2b_ids
from .e2b.wire import NOT_FOUND
from .fleet import Fleet
from .gateway import E2B_CONTROL, E2B_DATA
from .relay import ERROR_BODY, Call, CutOff, Relay, Upstream
from .router_e2b_control import encoded, error, gone, passed, read, route, segments_of, send

__all__ = ["add_routes"]
log = logging.getLogger(__name__)
DATA_HEADERS = ("e2b-sandbox-port", "x-access-token", "e2b-traffic-access-token", "content-type", "content-encoding",
                "connect-protocol-version", "connect-timeout-ms", "connect-accept-encoding", "connect-content-encoding",
                "keepalive-ping-interval")
ENCODINGS = ("gzip", "deflate", "identity")
MAX_METADATA_HEADERS = 64  # X-Metadata-* headers of a file upload passed on
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def add_routes(app: FastAPI, fleet: Fleet, relay: Relay) -> None:
    """The data plane's route, then the control plane's (the first is under the second), and E2B-shaped errors."""

    @app.api_route(E2B_DATA + "{path:path}", methods=METHODS, include_in_schema=False)
    async def data(path: str, request: Request) -> Response:
        return await _data(fleet, relay, request, path)

    @app.api_route(E2B_CONTROL + "{path:path}", methods=METHODS, include_in_schema=False)
    async def control(path: str, request: Request) -> Response:
        return await route(fleet, relay, request, path)

    async def http_error(request: Request, exc: Exception) -> Any:
        if request.url.path.startswith(E2B_CONTROL) and isinstance(exc, HTTPException):
            return error(exc.status_code, str(exc.detail), dict(exc.headers or {}))
        return await http_exception_handler(request, exc)  # type: ignore[arg-type]

    app.add_exception_handler(HTTPException, http_error)


# -- the data plane -------------------------------------------------------------------------------------------

def _not_running(given: str, why: str = "") -> JSONResponse:
    """E2B's answer for a sandbox that is not there (the SDKs read "was not found" as not running)."""
    return JSONResponse({"sandboxId": given[:e2b_ids.MAX_ID], "message": NOT_FOUND + (f": {why}" if why else ""),
                         "code": 502}, 502)


def _data_headers(request: Request, raw: str) -> tuple[tuple[str, str], ...]:
    """What the node's data plane reads of the client's headers, with the node's own sandbox id."""
    found = [("E2b-Sandbox-Id", raw), ("Accept-Encoding", request.headers.get("accept-encoding", "identity"))]
    found += [(name, request.headers[name]) for name in DATA_HEADERS if name in request.headers]
    user = request.headers.get("authorization", "")
    if user[:6].lower() == "basic ":  # the Unix user to run as; any other scheme is a credential, kept here
        found.append(("Authorization", user))
    metadata = [(k, v) for k, v in request.headers.items() if k.startswith("x-metadata-")]
    if len(metadata) > MAX_METADATA_HEADERS:
        raise HTTPException(400, f"more than {MAX_METADATA_HEADERS} X-Metadata headers")
    return tuple(found + metadata)


async def _data(fleet: Fleet, relay: Relay, request: Request, path: str) -> Response:
    """An in-sandbox call: to the node the ``E2b-Sandbox-Id`` names, which judges the access token."""
    given = request.headers.get("e2b-sandbox-id", "")
    named = e2b_ids.parse(fleet.key, given, None)
    if named is None:
        return _not_running(given)
    why = gone(fleet, named)
    if why:
        return _not_running(given, why)
    try:
        headers = _data_headers(request, named.raw)
        segments = segments_of(path)
    except HTTPException as exc:
        return error(exc.status_code, str(exc.detail))
    # Counted as the id's client's calls in flight (the tag: a caller cannot dodge the cap with made-up tokens).
    call = Call(who=f"e2b-{named.tag}", method=request.method, path=encoded(E2B_DATA, segments),
                query=request.url.query, stream=False, session=False, headers=headers, node_auth=False)
    body = request.stream() if request.method in ("POST", "PUT", "PATCH") else None  # streamed both ways
    upstream = await send(relay, named.node, call, body)
    if isinstance(upstream, Response):
        if upstream.status_code == 502:  # not reached or lost: gone, as far as the client can tell
            return _not_running(given, f"node {named.node} cannot be reached or was lost during the call")
        return upstream
    return await _data_answer(relay, upstream)


async def _data_answer(relay: Relay, upstream: Upstream) -> Response:
    """A node's data-plane answer, streamed as it comes within the caps (errors: at most ERROR_BODY bytes)."""
    response = upstream.response
    kind = response.headers.get("content-type", "application/octet-stream")[:128]
    headers = {"X-Nbexec-Node": upstream.name, "X-Content-Type-Options": "nosniff", **passed(response.headers)}
    encoding = response.headers.get("content-encoding", "").lower()
    if encoding in ENCODINGS:  # a file read with gzip asked for: passed on encoded, as the node sent it
        headers["Content-Encoding"] = encoding
    if not 200 <= response.status_code < 300 or response.status_code == 204:
        try:
            body = await read(response, ERROR_BODY) if response.status_code != 204 else b""
        except (httpx.HTTPError, CutOff):
            body = b""
        finally:
            await upstream.close()
        return Response(body[:ERROR_BODY], response.status_code, headers=headers, media_type=kind)
    framer = e2b_frames.Framer(kind.split(";")[0].strip().lower(), max_frame=relay.max_event,
                               max_total=relay.max_download)
    return upstream.streamed(_relayed(upstream, framer), response.status_code, headers=headers, media_type=kind)


async def _relayed(upstream: Upstream, framer: e2b_frames.Framer) -> AsyncIterator[bytes]:
    """The node's answer as it comes.

    A broken cap or a lost node ends a Connect stream with an error at an envelope's boundary. Any other answer is
    cut off, with nothing invented."""
    try:
        async for chunk in upstream.response.aiter_raw():
            for piece in framer.feed(chunk):
                yield piece
            if framer.done:
                return
    except (e2b_frames.Cut, httpx.HTTPError) as exc:
        message = f"node {upstream.name}: {exc or type(exc).__name__}"
        log.warning("%s", message)
        boundary = exc.boundary if isinstance(exc, e2b_frames.Cut) else not framer.midway
        if framer.kind != e2b_frames.CONNECT_STREAM or not boundary:
            raise CutOff(message) from exc
        code = "resource_exhausted" if isinstance(exc, e2b_frames.Cut) else "unavailable"
        yield e2b_frames.end_of_stream(code, message)
    finally:
        await upstream.close()
