"""The E2B control plane through a router (``/e2b/...``, the client's key in ``X-API-KEY``): see `router_e2b`.

A call naming a sandbox goes to the node its id names, with the node's own id. A create goes to the node with the
fewest sessions, anything else to the most free node; the next node is tried only when the call never reached
one. The list asks every node that is up and merges their answers (`listing`). Every answer is read within a cap,
and every sandbox id in it is made the client's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from nbexec.sandbox.remote.paths import bad_segment

from . import e2b_ids
from .e2b import wire
from .fleet import Fleet
from .gateway import E2B_CONTROL, OWNER_KEY
from .relay import ERROR_BODY, NOT_REACHED, Call, CutOff, Relay, Upstream

log = logging.getLogger(__name__)
MiB = 1024 * 1024
CONTROL_ANSWER = 8 * MiB  # bytes of a node's control-plane answer read (a page of 100 sandboxes with metadata)
ID_KEYS = ("sandboxID", "sandboxId")  # where E2B's answers carry a sandbox id
MAX_IDS = 1000  # sandbox ids in one node answer (a page holds at most 100)
ANSWER_HEADERS = ("retry-after", "should-retry")  # a control answer is asked for without encoding
# A node's list is read in pages of LIST_PAGE sandboxes, each at most PAGE_BYTES (10 with the most metadata a node
# takes). At most LIST_BYTES come from one node. That is far above a token's cap of sandboxes on a node, and it
# bounds what a hostile node can make the router parse and keep.
LIST_PAGE, PAGE_BYTES, LIST_BYTES, LIST_PAGES = 10, 256 * 1024, 2 * MiB, 80
LISTED = ("metadata", "state")  # the list's filters, passed to every node as the client sent them


def error(status: int, message: str, headers: dict[str, str] | None = None, **more: Any) -> JSONResponse:
    """An answer in E2B's error shape."""
    return JSONResponse({"code": status, "message": message, **more}, status, headers=headers)


def lost(node: str, what: str) -> JSONResponse:
    return error(502, f"node {node} {what}; the call was not retried, since it may have run",
                 {"Should-Retry": "false", "X-Nbexec-Node": node})


def segments_of(path: str) -> list[str]:
    segments = path.split("/")
    for segment in segments:
        why = bad_segment(segment)
        if why:
            raise HTTPException(400, f"the path has {why}")
    return segments


def encoded(prefix: str, segments: list[str]) -> str:
    return prefix + "/".join(quote(s, safe="") for s in segments)


def gone(fleet: Fleet, named: e2b_ids.Named) -> str | None:
    """Why the node an id names cannot have its sandbox (down, unknown, restarted), or None."""
    health = fleet.health.get(named.node)
    if health is None or not health.up or health.capacity is None:
        return f"its node {named.node} is down or unknown to this router"
    if health.capacity.instance != named.instance:
        return f"its node {named.node} restarted since"
    return None


async def send(relay: Relay, node: str, call: Call, body: Any) -> Upstream | Response:
    """``call`` opened on ``node``, or the E2B-shaped answer when it could not be."""
    try:
        return await relay.open(node, call, body)
    except NOT_REACHED as exc:
        relay.fleet.failed(node, str(exc))
        return error(502, f"node {node} cannot be reached", {"X-Nbexec-Node": node})
    except CutOff:
        return lost(node, "was lost during the call")
    except HTTPException as exc:  # 429 (the client's calls in flight) or 413 (a streamed body over the cap)
        return error(exc.status_code, str(exc.detail), dict(exc.headers or {}))


# -- the control plane ------------------------------------------------------------------------------------------

def control_call(fleet: Fleet, who: str, method: str, segments: list[str], query: str,
                 content_type: str | None = None) -> Call:
    """A control-plane call to a node: as the router's client, with the node token where E2B's door reads it."""
    headers = (("X-API-KEY", fleet.token.decode()), ("Accept-Encoding", "identity"))
    return Call(who=who, method=method, path=encoded(E2B_CONTROL, segments), query=query, stream=False,
                session=False, content_type=content_type, headers=headers)


async def route(fleet: Fleet, relay: Relay, request: Request, path: str) -> Response:
    who = request.scope.get("state", {}).get(OWNER_KEY)
    if not who:  # unreachable behind the gateway
        return error(401, "missing or wrong API key (X-API-KEY)")
    segments = segments_of(path)
    at = 2 if segments[:1] == ["v2"] else 1  # where a sandbox id sits: /sandboxes/<id>, /v2/sandboxes/<id>
    if segments[at - 1:at] == ["sandboxes"] and len(segments) > at:
        return await _on_its_node(fleet, relay, request, str(who), segments, at)
    if segments[at - 1:] == ["sandboxes"] and request.method == "GET":
        return await listing(fleet, relay, request, str(who))
    return await _placed(fleet, relay, request, str(who), segments)


async def _on_its_node(fleet: Fleet, relay: Relay, request: Request, who: str, segments: list[str],
                       at: int) -> Response:
    """A call naming a sandbox: to its node, with the node's own id, if the id is this client's."""
    given = segments[at]
    named = e2b_ids.parse(fleet.key, given, who)
    if named is None:
        return error(404, f"sandbox {given[:64]!r} not found")
    why = gone(fleet, named)
    if why:
        return error(404, f"sandbox {given[:64]!r} not found: {why}")
    segments = [*segments[:at], named.raw, *segments[at + 1:]]
    call = control_call(fleet, who, request.method, segments, request.url.query, request.headers.get("content-type"))
    upstream = await send(relay, named.node, call, await request.body())
    if isinstance(upstream, Response):
        return upstream
    return await control_answer(fleet, upstream, {named.raw: given})


async def _placed(fleet: Fleet, relay: Relay, request: Request, who: str, segments: list[str]) -> Response:
    """A create (to the node with the fewest sessions) or a call on no sandbox (to the most free node).

    The next node is tried only when the call never reached one."""
    creating = request.method == "POST" and segments in (["sandboxes"], ["v2", "sandboxes"])
    call = control_call(fleet, who, request.method, segments, request.url.query, request.headers.get("content-type"))
    body = await request.body()  # within --max-body: kept, so the call can go to another node
    tried = []
    for node in fleet.by_sessions() if creating else fleet.order():
        try:
            upstream = await relay.open(node, call, body)
        except NOT_REACHED as exc:
            fleet.failed(node, str(exc))
            tried.append(node)
            continue
        except CutOff:
            return lost(node, "was lost while it took the call")
        return await control_answer(fleet, upstream, {})
    return error(503, "no node is up" + (f" (tried {', '.join(tried)})" if tried else ""), {"Retry-After": "2"})


async def read(response: Any, limit: int) -> bytes:
    """At most ``limit`` bytes of an answer; CutOff past them."""
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise CutOff(f"the answer is over {limit} bytes")
    return bytes(body)


async def control_answer(fleet: Fleet, upstream: Upstream, known: dict[str, str]) -> Response:
    """A node's control-plane answer with every sandbox id made the client's.

    ``known`` maps the node's ids in the call's path to the client's, for error messages."""
    found = await control_data(fleet, upstream, known)
    if isinstance(found, Response):
        return found
    data, headers, _ = found
    return JSONResponse(data, upstream.response.status_code, headers=headers)


async def control_data(fleet: Fleet, upstream: Upstream, known: dict[str, str],
                       limit: int = CONTROL_ANSWER) -> tuple[Any, dict[str, str], int] | Response:
    """A node's 2xx JSON answer (at most ``limit`` bytes), its sandbox ids made the client's, with headers and size.

    Any other answer goes to the client as it is, its body within ERROR_BODY."""
    response, node = upstream.response, upstream.name
    status, where = response.status_code, {"X-Nbexec-Node": node}
    try:
        body = await read(response, ERROR_BODY if status >= 300 else limit)
    except (httpx.HTTPError, CutOff) as exc:
        log.warning("node %s: %s", node, exc)
        return lost(node, "broke its answer off or sent one over the router's cap")
    finally:
        await upstream.close()
    headers = {**where, **passed(response.headers)}
    if status == 401:
        return error(502, "a node refused the router's NBEXEC_NODE_TOKEN", where)
    if status >= 300 or status == 204 or not body:
        for raw, given in known.items():  # the node names its own id; the client knows another
            body = body.replace(raw.encode(), given.encode())
        return Response(body, status, headers=headers, media_type="application/json")
    try:
        return outward(fleet, upstream.call.who, node, json.loads(body)), headers, len(body)
    except (ValueError, RecursionError) as exc:
        log.warning("node %s: %s", node, exc)
        return error(502, f"node {node} sent an answer the router cannot read", where)


def passed(headers: Any) -> dict[str, str]:
    """The headers of a node's answer that E2B's clients read, when they are plain."""
    found = {}
    for name in ANSWER_HEADERS:
        value = headers.get(name, "")
        if value and len(value) <= 64 and value.isascii() and value.isprintable():
            found[name] = value
    return found


def outward(fleet: Fleet, who: str, node: str, data: Any, depth: int = 0, signed: list[int] | None = None) -> Any:
    """``data`` with each sandbox id (``sandboxID``, in an object, a list, or a fork's ``sandbox``) made the client's.

    ValueError for an id the router does not pass on, and past MAX_IDS ids. The cap exists because each id is
    signed on the event loop: 8 MiB of ids took 2.5 s of it."""
    signed = [0] if signed is None else signed
    if depth > 3:
        return data
    if isinstance(data, list):
        return [outward(fleet, who, node, item, depth + 1, signed) for item in data]
    if isinstance(data, dict):
        capacity = fleet.health[node].capacity
        for key, value in data.items():
            if key in ID_KEYS and isinstance(value, str):
                if capacity is None:
                    raise ValueError(f"node {node} is down")
                signed[0] += 1
                if signed[0] > MAX_IDS:
                    raise ValueError(f"node {node} named over {MAX_IDS} sandboxes in one answer")
                data[key] = e2b_ids.public(fleet.key, who, node, capacity.instance, value)
            elif key == "sandbox":
                data[key] = outward(fleet, who, node, value, depth + 1, signed)
    return data


# -- the list, merged from every node ---------------------------------------------------------------------------

async def listing(fleet: Fleet, relay: Relay, request: Request, who: str) -> Response:
    """``GET /v2/sandboxes``: the client's sandboxes on every node that is up, merged, one page at a time.

    Each node is asked for all that pass the filters, within LIST_PAGES and LIST_BYTES. The answers are merged in
    start order (then id), and the page after the ``nextToken`` given is returned. The token is the router's own,
    bound to the client: the start time and id of the last sandbox given. So a page is right whatever was made or
    killed since, on any node."""
    query = request.query_params
    try:
        count = wire.limit(query.get("limit"))
        after = e2b_ids.read_page(fleet.key, who, query["nextToken"]) if query.get("nextToken") else None
    except wire.E2bError as exc:
        return error(exc.status, exc.message)
    except ValueError as exc:
        return error(400, str(exc))
    newest_first = query.get("order") == "desc"
    filters = [(k, v) for k, v in parse_qsl(request.url.query, keep_blank_values=True) if k in LISTED]
    answers = await asyncio.gather(*(_node_listing(fleet, relay, who, node, filters) for node in fleet.up()))
    refused = next((a for a in answers if isinstance(a, Response)), None)
    if refused is not None:
        return refused
    found = sorted((item for listed in answers if isinstance(listed, list) for item in listed),
                   key=_position, reverse=newest_first)
    if after is not None:
        found = [i for i in found if (_position(i) < after if newest_first else _position(i) > after)]
    page = found[:count]
    headers = {"X-Next-Token": e2b_ids.page_token(fleet.key, who, _position(page[-1]))} \
        if len(found) > count else {}
    return JSONResponse(page, headers=headers)


def _position(item: dict[str, Any]) -> tuple[str, str]:
    return str(item["startedAt"]), str(item["sandboxID"])


async def _node_listing(fleet: Fleet, relay: Relay, who: str, node: str,
                        filters: list[tuple[str, str]]) -> list[dict[str, Any]] | Response:
    """The client's sandboxes on ``node`` that pass ``filters``, their ids made the client's.

    A node's refusal (a bad filter) is the answer. A node lost meanwhile gives nothing: its sandboxes are gone."""
    found: list[dict[str, Any]] = []
    token, budget = "", LIST_BYTES
    for _ in range(LIST_PAGES):
        query = urlencode([*filters, ("limit", str(LIST_PAGE)), *([("nextToken", token)] if token else [])])
        upstream = await send(relay, node, control_call(fleet, who, "GET", ["v2", "sandboxes"], query), None)
        if isinstance(upstream, Response):
            return [] if upstream.status_code == 502 else upstream
        answer = await control_data(fleet, upstream, {}, min(PAGE_BYTES, budget))
        if isinstance(answer, Response):
            return [] if answer.status_code == 502 else answer
        listed, _, size = answer
        found += [i for i in listed if isinstance(i, dict) and isinstance(i.get("startedAt"), str)
                  and isinstance(i.get("sandboxID"), str)] if isinstance(listed, list) else []
        budget -= size
        token = upstream.response.headers.get("x-next-token", "")
        if not token or len(token) > e2b_ids.MAX_PAGE_TOKEN or budget <= 0:
            break
    return found
