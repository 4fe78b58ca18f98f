"""`nbexec mcp`: an MCP server (the official `mcp` package, the mcp extra) with the tools `execute_python`, `shell`
(a command in the same sandbox; Python sessions only) and `upload_file` (into /mnt/data; see `mcpcalls`). A
client's ``notifications/cancelled`` for a running call interrupts it (`mcpcalls.interruptible`).

State is kept per MCP connection, the SDK's own per-client object: the stdio peer, each streamable-HTTP session
whose id the server issued, or each single-exchange (2026-07-28) request. Nothing a client sends (a header, an
argument) chooses the state it gets. When the connection ends (DELETE, the SDK's idle timeout, shutdown) its nbexec
Session is closed and its folder deleted. Produced files are resources only of the client that made them
(``nbexec://files/<name>``, answered from that client's own listing), read through the link-safe path with a size
cap. Images come back as image content. Over HTTP, bearer tokens are checked (as bytes) before the MCP app sees a
request, and each token is the principal the SDK binds its sessions to and the owner of its snapshots (without
tokens, on loopback or stdio, every client is one owner: see `mcpsnapshots`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from nbexec.config import MIN_TOKEN_CHARS, SandboxConfig
from nbexec.engine import reaper, sources
from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.errors import ConfigError, NbexecError
from nbexec.files import artifacts
from nbexec.result import ExecutionResult

from . import tools

log = logging.getLogger(__name__)

try:
    import anyio
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken
    from mcp.server.connection import Connection
    from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
    from mcp.server.mcpserver import Context, Image, MCPServer
    from mcp.shared.exceptions import MCPError
    from mcp_types import (
        INVALID_PARAMS,
        BlobResourceContents,
        CallToolResult,
        ListResourcesResult,
        ReadResourceResult,
        Resource,
        TextContent,
    )
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

    from . import mcpargs, mcpcalls, mcpsnapshots, sessionview
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("`nbexec mcp` needs the mcp extra: pip install 'nbexec-sandbox[mcp]'") from exc

# A resource is read whole into one message; its base64 form must fit the official client's default 1 MiB
# SSE event limit, and a file the sandbox made must never be loaded whole whatever its size.
MAX_RESOURCE = 512 * 1024
URI_PREFIX = "nbexec://files/"
_STATE_KEY = "nbexec.client"
UPLOAD_NAME = "upload_file"


def connection_of(request: ServerRequestContext[Any, Any]) -> Connection:
    """The SDK's per-client connection behind a request.

    mcp 2.3 hands handlers this server-made object only through ``ServerSession``; a change there must fail
    loudly rather than let clients share state.
    """
    found = getattr(request.session, "_connection", None)
    if not isinstance(found, Connection):
        raise RuntimeError("this mcp version does not expose the client connection; nbexec needs mcp>=2.3,<3")
    return found


@dataclass(eq=False)
class _Client:
    """One MCP client: its nbexec Session (made on first use) and the files it may read, by resource URI."""

    session: Session | None = None
    files: dict[str, tuple[str, str]] = field(default_factory=dict)  # uri -> (name in /mnt/data, mime)
    chose: SandboxConfig | None = None  # the image and language a call chose: a reaped session comes back in them
    owner: str = mcpsnapshots.MCP_OWNER  # its token: the SDK binds a connection to the token that opened it


class Clients:
    """The nbexec Session of every connected MCP client. Thread-safe."""

    def __init__(self, config: SandboxConfig, max_sessions: int, max_resource: int = MAX_RESOURCE) -> None:
        self.config = config
        self.manager = SessionManager(config, max_sessions=max_sessions, keep_files=False)
        self.max_resource = max_resource
        self._live: set[_Client] = set()
        self._lock = threading.Lock()

    def client(self, request: ServerRequestContext[Any, Any]) -> _Client:
        """The record of the request's connection, made on first use with its release pushed onto the
        connection's end."""
        connection = connection_of(request)
        found = connection.state.get(_STATE_KEY)
        if isinstance(found, _Client):
            return found
        client = _Client(owner=mcpsnapshots.principal_of(request))
        connection.state[_STATE_KEY] = client
        with self._lock:
            self._live.add(client)
        connection.exit_stack.push_async_callback(anyio.to_thread.run_sync, self.release, client)
        return client

    def session_for(self, client: _Client, *, image: str | None = None, language: str | None = None) -> Session:
        """The client's session, made on first use in the image and language a call chose (only names the
        operator allows: config.images, config.languages; never a Docker tag the model made up). A call naming
        another than its session's is a ConfigError; one naming none keeps it."""
        self.prune(client)
        asked = self.config.choose_image(image).offer_language(language) \
            if image is not None or language is not None else None
        if client.session is None:
            client.chose = asked or client.chose
            client.session = self.manager.create(config=client.chose, owner=client.owner)
        elif asked is not None and image is not None and client.session.config.image != asked.image:
            raise ConfigError(f"this conversation's session runs in image {client.session.config.image}, the one its "
                              "first call chose; omit image to keep using it")
        elif asked is not None and language is not None and client.session.config.language != asked.language:
            raise ConfigError(f"this conversation's session runs {client.session.config.language} code, the "
                              "language its first call chose; omit language to keep using it")
        return client.session

    def prune(self, client: _Client) -> None:
        """Forget the files of a session the reaper closed (its folder went with it)."""
        gone = client.session
        if gone is not None and gone.status == "closed":
            client.session, client.files = None, {}

    def publish(self, client: _Client, result: ExecutionResult) -> ExecutionResult:
        """List the result's files as the client's resources; the model sees resource URIs, not host paths."""
        client.files = {URI_PREFIX + quote(f.name): (f.name, f.mime) for f in result.files}
        files = tuple(dataclasses.replace(f, url=URI_PREFIX + quote(f.name), path=f.name) for f in result.files)
        images = tuple(dataclasses.replace(i, url="sent as image content") for i in result.images)
        return dataclasses.replace(result, files=files, images=images)

    def resources(self, client: _Client) -> list[Resource]:
        self.prune(client)
        return [Resource(uri=uri, name=name, mime_type=mime, description=f"/mnt/data/{name}")
                for uri, (name, mime) in client.files.items()]

    def read(self, client: _Client, uri: str) -> bytes:
        self.prune(client)
        entry = client.files.get(uri)
        if entry is None or client.session is None or client.session.output_dir is None:
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown resource: {uri}")
        try:
            return artifacts.get(client.session.output_dir / "data", entry[0], max_bytes=self.max_resource)
        except NbexecError as exc:
            raise MCPError(code=INVALID_PARAMS, message=str(exc)) from None

    def release(self, client: _Client) -> None:
        """Close the client's session (interrupting a running cell first) and delete its folder."""
        with self._lock:
            self._live.discard(client)
        gone, client.session, client.files = client.session, None, {}
        if gone is None:
            return
        with contextlib.suppress(Exception):
            gone.interrupt()
        with contextlib.suppress(Exception):
            gone.close()  # keep_files=False: its folder goes with it

    def close_all(self) -> None:
        with self._lock:
            clients = list(self._live)
        for client in clients:
            self.release(client)
        self.manager.close_all()


def build(config: SandboxConfig, *, max_sessions: int = 16, budget: int = tools.DEFAULT_BUDGET,
          max_resource: int = MAX_RESOURCE, max_upload: int = mcpcalls.MAX_UPLOAD_CHARS) -> tuple[MCPServer, Clients]:
    """The MCP server object and its clients' sessions (close them with ``Clients.close_all`` when it stops)."""
    # State is kept per client connection: the tool has no session_id, so its description names none.
    text = tools.description(config, stateful=True, by_session_id=False)
    server: MCPServer = MCPServer("nbexec", instructions=text)
    clients = Clients(config, max_sessions, max_resource)

    @server.tool(name=tools.DEFAULT_NAME, description=text, structured_output=False)
    async def execute_python(code: str, ctx: Context, image: str | None = None,
                             language: str | None = None) -> CallToolResult:
        client = clients.client(ctx.request_context)
        try:
            session = clients.session_for(client, image=image, language=language)
            result = await mcpcalls.interruptible(session, functools.partial(
                sessionview.revived, session, functools.partial(session.run, code)))
        except NbexecError as exc:
            return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)
        return answer(result, client)

    async def shell(command: str, ctx: Context) -> CallToolResult:
        client = clients.client(ctx.request_context)
        try:
            session = clients.session_for(client)
            result = await mcpcalls.interruptible(session, functools.partial(
                sessionview.revived, session, functools.partial(session.shell, command)))
        except NbexecError as exc:
            return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)
        return answer(result, client)

    if config.language == "python":  # its runner is Python code: another language's session refuses it
        server.tool(name=tools.SHELL_NAME, description=tools.shell_description(config, stateful=True,
                                                                               by_session_id=False),
                    structured_output=False)(shell)

    @server.tool(name=UPLOAD_NAME, description=mcpcalls.UPLOAD_DESCRIPTION, structured_output=False)
    async def upload_file(name: str, content_base64: str, ctx: Context) -> CallToolResult:
        client = clients.client(ctx.request_context)
        try:
            session = clients.session_for(client)
            path = await anyio.to_thread.run_sync(
                functools.partial(mcpcalls.upload_checked, session, config, name, content_base64,
                                  max_chars=max_upload))
        except NbexecError as exc:
            return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)
        return CallToolResult(content=[TextContent(text=f"Saved {path}; code and shell commands can read it.")])

    def answer(result: ExecutionResult, client: _Client) -> CallToolResult:
        shown = sessionview.only_changed(client.session, clients.publish(client, result)) if client.session else \
            clients.publish(client, result)
        content: list[Any] = [TextContent(text=tools.render_for_llm(shown, budget=budget))]
        content += [Image(path=image.path).to_image_content() for image in result.images
                    if image.mime != "image/svg+xml"]
        return CallToolResult(content=content, is_error=not result.ok)  # the code raised: the model is told

    mcpsnapshots.register(server, clients.manager, lambda ctx: clients.client(ctx.request_context),
                          lambda client: clients.session_for(client))

    server.middleware.append(functools.partial(own_resources, clients=clients))
    server.middleware.append(functools.partial(mcpargs.declared, images=config.images,
                                               languages=tools.offered(config)))
    server.middleware.append(functools.partial(mcpargs.friendly, server=server, images=config.images,
                                               languages=tools.offered(config)))
    return server, clients


async def own_resources(ctx: ServerRequestContext[Any, Any], call_next: CallNext, *,
                        clients: Clients) -> HandlerResult:
    """Answer resources/list and resources/read from the requesting client's own files only."""
    if ctx.method not in ("resources/list", "resources/read"):
        return await call_next(ctx)
    client = clients.client(ctx)
    if ctx.method == "resources/list":
        return ListResourcesResult(resources=await anyio.to_thread.run_sync(clients.resources, client))
    params = ctx.params if isinstance(ctx.params, Mapping) else {}
    uri = params.get("uri")
    if not isinstance(uri, str):
        raise MCPError(code=INVALID_PARAMS, message="resources/read needs a uri")
    content = await anyio.to_thread.run_sync(clients.read, client, uri)
    mime = client.files.get(uri, ("", "application/octet-stream"))[1]
    return ReadResourceResult(contents=[BlobResourceContents(
        uri=uri, blob=base64.b64encode(content).decode("ascii"), mime_type=mime)])


# -- serving ------------------------------------------------------------------------------------------------------

class BearerGate:
    """ASGI: answer 401 before the MCP app sees a request whose bearer token is not one of ``tokens``.

    Tokens are compared as bytes, each in constant time; the request body is never read. The accepted token's
    digest becomes the principal the SDK binds its sessions to, so one token cannot use another's session id.
    """

    def __init__(self, app: Any, tokens: tuple[bytes, ...]) -> None:
        short = [t for t in tokens if len(t.decode("utf-8", "replace")) < MIN_TOKEN_CHARS]
        if short:
            raise ConfigError(f"{len(short)} of the bearer tokens are shorter than {MIN_TOKEN_CHARS} characters; "
                              "give only long random ones (python -c 'import secrets; print(secrets.token_urlsafe(32)"
                              ")')")
        self.app = app
        self.tokens = tokens

    def principal(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        values = [value for name, value in headers if name.lower() == b"authorization"]
        offered = values[0] if len(values) == 1 else b""
        offered = offered[7:] if offered[:7].lower() == b"bearer " else b""
        found = None
        for token in self.tokens:  # no early exit: every token is compared
            if hmac.compare_digest(offered, token) and offered:
                found = "token-" + hashlib.sha256(token).hexdigest()[:16]
        return found

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        principal = self.principal(list(scope.get("headers", [])))
        if principal is None:
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="nbexec"')]})
            await send({"type": "http.response.body",
                        "body": b'{"error": "a valid bearer token is required (Authorization: Bearer <token>)"}'})
            return None
        user = AuthenticatedUser(AccessToken(token="", client_id=principal, scopes=[]))
        return await self.app({**scope, "user": user}, receive, send)


class HandshakeOnly:
    """ASGI: refuse single-exchange (2026-07-28) requests, which carry no session, so clients fall back to the
    initialize handshake and keep their state between calls (the SDK's probe treats -32022 naming only handshake
    versions as a legacy server)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            versions = [v for k, v in scope.get("headers", []) if k.lower() == b"mcp-protocol-version"]
            requested = versions[0].decode("latin-1") if versions else None
            if requested is not None and requested not in HANDSHAKE_PROTOCOL_VERSIONS:
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32022, "message": "this server keeps state per session: use the initialize handshake",
                    "data": {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": requested[:40]}}})
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body.encode()})
                return None
        return await self.app(scope, receive, send)


class _Stopper:
    """On SIGTERM or SIGINT, free every session, pool sandbox and folder, then exit (128 + signal).

    The work runs in its own thread: the main thread may be parked in the event loop while a worker thread
    blocks on stdin or on a running cell, and a graceful loop shutdown would wait for those forever.
    """

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.thread: threading.Thread | None = None

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, _frame: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.stop, args=(signum,), name="nbexec-mcp-stop", daemon=True)
            self.thread.start()

    def stop(self, signum: int) -> None:
        with contextlib.suppress(Exception):
            self.clients.close_all()
        with contextlib.suppress(Exception):
            reaper.close_all()
        with contextlib.suppress(Exception):
            sources.for_config(self.clients.config).close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)


def serve(server: MCPServer, clients: Clients, *, transport: str, host: str = "127.0.0.1", port: int = 8765,
          tokens: tuple[bytes, ...] = (), max_sessions: int = 16) -> None:
    """Run until stdin closes (stdio) or a signal comes; every session is closed and its folder deleted."""
    stopper = _Stopper(clients)
    stopper.install()
    try:
        if transport == "stdio":
            server.run("stdio")
            return
        import uvicorn

        app: Any = HandshakeOnly(server.streamable_http_app(host=host, max_sessions=4 * max_sessions))
        if tokens:
            app = BearerGate(app, tokens)
        # uvicorn takes SIGTERM/SIGINT while it runs: a graceful stop bounded so open SSE streams cannot hold
        # it, then it raises the signal again, which lands in the handler above.
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      timeout_graceful_shutdown=3)).run()
    finally:
        clients.close_all()
        if stopper.thread is not None:
            stopper.thread.join()  # it ends the process with the signal's exit code
