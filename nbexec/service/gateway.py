"""The front door of `nbexec serve`: a pure ASGI middleware that judges a request by its headers alone.

In order: the Host header (only with authentication off: loopback names, against DNS rebinding), the bearer
token (compared as bytes, so any odd header is a 401, never a 500), the declared length, and then, while the
application reads, every body byte counted (chunked bodies too). Nothing of the body is read before the token
is accepted, and no more than ``max_body`` bytes of it are ever read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                          "/redoc", "/", "/playground.js", "/playground.css"})  # the playground asks for a token
LOOPBACK_NAMES = (b"localhost", b"127.0.0.1", b"[::1]")
OWNER_KEY = "nbexec_owner"  # in scope["state"]: who sent the request (a token id, or "anonymous")


def token_id(token: bytes) -> str:
    """How a token is known in logs and state: the first 12 hex digits of its sha256."""
    return hashlib.sha256(token).hexdigest()[:12]


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def loopback_host(host: bytes | None, port: int | None) -> bool:
    """Whether a Host header names this loopback server (``localhost``, ``127.0.0.1``, ``[::1]``, any with
    the server's port)."""
    if not host:
        return False
    host = host.lower()
    return any(host == name or (port is not None and host == name + b":%d" % port) for name in LOOPBACK_NAMES)


async def _answer(send: Send, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class Gateway:
    """Check Host, token and body size before the application sees a request."""

    def __init__(self, app: ASGIApp, *, tokens: tuple[str, ...], auth: bool, max_body: int) -> None:
        self.app = app
        self.tokens = tuple(t.encode() for t in tokens)
        self.auth = auth
        self.max_body = max_body

    def owner(self, scope: Scope) -> str | None:
        """The token id of the request's valid bearer token, or None."""
        if not self.auth:
            return "anonymous"
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        found = False
        for accepted in self.tokens:  # every token compared, in constant time each
            found |= hmac.compare_digest(token, accepted)
        return token_id(token) if found else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.auth and not loopback_host(_header(scope, b"host"), (scope.get("server") or (None, None))[1]):
            await _answer(send, 400, "the Host header must name this loopback server (authentication is off)")
            return
        owner = self.owner(scope)
        if owner is None and scope["path"] not in PUBLIC_PATHS:
            await _answer(send, 401, "missing or wrong bearer token", [(b"www-authenticate", b"Bearer")])
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _answer(send, 413, f"request body over {self.max_body} bytes")
            return
        scope.setdefault("state", {})[OWNER_KEY] = owner
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body

        async def counted() -> Message:
            nonlocal seen
            if seen > limit:
                raise HTTPException(413, f"request body over {limit} bytes")
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body over {limit} bytes")
            return message

        return counted
