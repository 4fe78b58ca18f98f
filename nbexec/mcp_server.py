"""`nbexec mcp`: an MCP server (the official `mcp` package, the mcp extra) with one tool, `execute_python`.

State is kept per connected client session: two calls from one client share variables and /mnt/data.
Produced files are listed as resources (``nbexec://<session>/<path>``, read through the same link-safe path as
everything else on the host) and images come back as image content.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from pathlib import Path
from typing import Any

from . import artifacts, tools
from .config import SandboxConfig
from .errors import NbexecError, SessionError
from .session import Session, SessionManager

log = logging.getLogger(__name__)

try:
    from mcp.server.mcpserver import Context, Image, MCPServer
    from mcp.server.mcpserver.resources import FunctionResource
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("`nbexec mcp` needs the mcp extra: pip install 'nbexec[mcp]'") from exc


class _Clients:
    """One nbexec Session per MCP client: the stdio peer, or each streamable-HTTP `mcp-session-id`."""

    def __init__(self, config: SandboxConfig, max_sessions: int) -> None:
        self.manager = SessionManager(config, max_sessions=max_sessions)
        self._sessions: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(ctx: Context) -> str:
        headers = ctx.headers or {}
        return str(headers.get("mcp-session-id") or "stdio")

    def session_for(self, key: str) -> Session:
        with self._lock:
            session_id = self._sessions.get(key)
            if session_id is not None:
                try:
                    return self.manager.get(session_id)
                except SessionError:  # reaped after its idle TTL: start afresh
                    pass
            session = self.manager.create()
            self._sessions[key] = session.id
            return session


def build(config: SandboxConfig, *, max_sessions: int = 16, budget: int = tools.DEFAULT_BUDGET) -> MCPServer:
    """The MCP server object (run it with ``.run("stdio")`` or ``.run("streamable-http", host=..., port=...)``)."""
    server: MCPServer = MCPServer("nbexec", instructions=tools.description(config, stateful=True))
    clients = _Clients(config, max_sessions)
    listed: set[str] = set()

    def publish_files(session: Session, result: Any) -> None:
        for item in result.files:
            uri = f"nbexec://{session.id}/{item.name}"
            if uri in listed:
                continue
            listed.add(uri)
            server.add_resource(FunctionResource(
                uri=uri, name=item.name, mime_type=item.mime, description=f"/mnt/data/{item.name}",
                fn=functools.partial(artifacts.get, Path(result.output_dir) / "data", item.name)))

    @server.tool(name=tools.DEFAULT_NAME, description=tools.description(config, stateful=True),
                 structured_output=False)
    async def execute_python(code: str, ctx: Context) -> list[Any]:
        try:
            session = clients.session_for(clients.key(ctx))
            result = await asyncio.to_thread(session.run, code)
        except NbexecError as exc:
            return [f"Tool error: {exc}"]
        publish_files(session, result)
        content: list[Any] = [tools.render_for_llm(result, budget=budget)]
        content += [Image(path=image.path) for image in result.images if image.mime != "image/svg+xml"]
        return content

    return server
