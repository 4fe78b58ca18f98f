"""The front door of `nbexec serve`: a pure ASGI middleware that judges a request by its headers alone.

In order: the Host header (only with authentication off: loopback names, against DNS rebinding), the bearer
token (compared as bytes, so any odd header is a 401, never a 500), on a node the router's signed
``X-Nbexec-For`` header (see `identity`: the call is then the named client's, apart from every other's), the
declared length, and then, while the application reads, every body byte counted (chunked bodies too). Nothing of
the body is read before the token is accepted, and no more than ``max_body`` bytes of it are ever read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .identity import FOR_HEADER, For, SignatureError, Verifier

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                          "/redoc", "/", "/playground.js", "/playground.css"})  # the playground asks for a token
LOOPBACK_NAMES = (b"localhost", b"127.0.0.1", b"[::1]")
E2B_CONTROL, E2B_DATA = "/e2b/", "/e2b/sandbox/"  # E2B's API: the key in X-API-KEY; the data plane's own tokens
OWNER_KEY = "nbexec_owner"  # in scope["state"]: who sent the request (a token id, or "anonymous")
FOR_KEY = "nbexec_for"  # in scope["state"]: the identity.For of a signed call through a router


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


async def _answer(send: Send, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = (),
                  path: str = "") -> None:
    # E2B's SDKs read {"code", "message"}; every other client nbexec's {"detail"}.
    shape = {"code": status, "message": detail} if path.startswith(E2B_CONTROL) else {"detail": detail}
    body = json.dumps(shape).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class Gateway:
    """Check Host, token, a router's signature and body size before the application sees a request.

    ``public`` are the paths answered without a token; ``signed`` (nodes) honours X-Nbexec-For."""

    def __init__(self, app: ASGIApp, *, tokens: tuple[str, ...], auth: bool, max_body: int, signed: bool = False,
                 public: frozenset[str] = PUBLIC_PATHS, larger: Mapping[re.Pattern[str], int] | None = None) -> None:
        self.app = app
        self.tokens = tuple(t.encode() for t in tokens)
        self.auth = auth
        self.max_body = max_body
        self.larger = dict(larger or {})  # paths (matched whole) whose bodies may be this large instead
        self.public = public
        self.verifier = Verifier() if signed else None

    def token(self, scope: Scope) -> bytes | None:
        """The request's bearer token (under /e2b/: its X-API-KEY) when it is one of the accepted ones, else None."""
        if scope["path"].startswith(E2B_CONTROL):
            scheme, token = b"bearer", _header(scope, b"x-api-key") or b""
        else:
            scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        found = False
        for accepted in self.tokens:  # every token compared, in constant time each
            found |= hmac.compare_digest(token, accepted)
        return token if found else None

    def owner(self, scope: Scope) -> str | None:
        """The token id of the request's valid bearer token ("anonymous" without authentication), or None."""
        if not self.auth:
            return "anonymous"
        token = self.token(scope)
        return token_id(token) if token is not None else None

    def signed_for(self, scope: Scope, owner: str) -> tuple[str, For | None]:
        """The owner of a call, made a client's own when a router signed it for that client; SignatureError."""
        header = _header(scope, FOR_HEADER.encode())
        if self.verifier is None or header is None:
            return owner, None
        token = self.token(scope) if self.auth else None
        if token is None:
            raise SignatureError("a signed call needs the node token (authentication is off or the token is wrong)")
        target = bytes(scope.get("raw_path") or scope["path"].encode())
        if scope.get("query_string"):
            target += b"?" + bytes(scope["query_string"])
        signed = self.verifier.verify(token, scope["method"], target.decode("latin-1"), header)
        return f"{owner}~{signed.client}", signed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.auth and not loopback_host(_header(scope, b"host"), (scope.get("server") or (None, None))[1]):
            await _answer(send, 400, "the Host header must name this loopback server (authentication is off)",
                          path=scope["path"])
            return
        path = scope["path"]
        # The E2B data plane takes a sandbox's own token, never an API key: that door judges it (nbexec.service.e2b).
        owner = None if path.startswith(E2B_DATA) else self.owner(scope)
        if owner is None and path not in self.public and not path.startswith(E2B_DATA):
            await _answer(send, 401, "missing or wrong API token (X-API-KEY)" if path.startswith(E2B_CONTROL)
                          else "missing or wrong bearer token", [(b"www-authenticate", b"Bearer")], path)
            return
        signed: For | None = None
        if owner is not None:
            try:
                owner, signed = self.signed_for(scope, owner)
            except SignatureError as exc:
                await _answer(send, 401, f"the X-Nbexec-For header was refused: {exc}", path=path)
                return
        limit = next((n for p, n in self.larger.items() if owner and p.fullmatch(scope["path"])), self.max_body)
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _answer(send, 413, f"request body over {limit} bytes", path=path)
            return
        state = scope.setdefault("state", {})
        state[OWNER_KEY], state[FOR_KEY] = owner, signed
        await self.app(scope, self._counted(receive, limit), send)

    def _counted(self, receive: Receive, limit: int) -> Receive:
        seen = 0

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
