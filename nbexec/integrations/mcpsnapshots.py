"""`nbexec mcp`'s snapshot tools.

They keep a client's session as a snapshot, list and delete its snapshots, and replace its session with one
started from a snapshot id. `nbexec.engine.snapshots` signs ids for their owner, checks every file before use and
expires snapshots after NBEXEC_SNAPSHOT_TTL.

A snapshot's owner is the bearer token of the connection that made it (`principal_of`). Another token's id is
"no snapshot of yours"; its snapshots are not listed and do not count against the caller's cap. Without tokens
(stdio, or HTTP on loopback) every client is the one owner `MCP_OWNER`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent

from nbexec.engine import snapshotblobs
from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.errors import NbexecError

MCP_OWNER = "mcp"  # the owner of the snapshots of a server without tokens: its clients share them


def principal_of(request: ServerRequestContext[Any, Any]) -> str:
    """The owner of a call's session and snapshots: the token `mcp.BearerGate` accepted, else `MCP_OWNER`."""
    user = getattr(request.request, "scope", {}).get("user")
    return user.access_token.client_id if isinstance(user, AuthenticatedUser) else MCP_OWNER


def _failed(exc: NbexecError) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)


def register(server: MCPServer, manager: SessionManager, client_of: Callable[[Context], Any],
             session_of: Callable[[Any], Session]) -> None:
    """Add the snapshot tools to ``server``, for sessions of ``manager``.

    A client is what ``client_of`` makes of a call's context: its ``owner``, ``session`` and ``files``."""
    def store() -> Any:
        return snapshotblobs.store_for(manager.state_dir)

    @server.tool(name="snapshot_session", structured_output=False,
                 description="Keep this conversation's session (its files and the cells run so far) as a "
                             "snapshot; returns its id, for restore_session.")
    async def snapshot_session(ctx: Context) -> CallToolResult:
        client = client_of(ctx)
        try:
            made = await asyncio.to_thread(session_of(client).snapshot)
        except NbexecError as exc:
            return _failed(exc)
        return CallToolResult(content=[TextContent(text=made)])

    @server.tool(name="list_snapshots", structured_output=False,
                 description="List this conversation's snapshots: id, and when each was made and expires (Unix s).")
    async def list_snapshots(ctx: Context) -> CallToolResult:
        owner = client_of(ctx).owner
        try:
            found = await asyncio.to_thread(lambda: store().listing(owner))
        except NbexecError as exc:
            return _failed(exc)
        listed = [{"id": s.id, "created": round(s.created), "expires": round(s.expires)} for s in found]
        return CallToolResult(content=[TextContent(text=json.dumps(listed))])

    @server.tool(name="delete_snapshot", structured_output=False,
                 description="Delete a snapshot of this conversation's by id (its files are removed).")
    async def delete_snapshot(snapshot_id: str, ctx: Context) -> CallToolResult:
        owner = client_of(ctx).owner
        try:
            await asyncio.to_thread(lambda: store().delete(owner, snapshot_id))
        except NbexecError as exc:
            return _failed(exc)
        return CallToolResult(content=[TextContent(text="deleted")])

    @server.tool(name="restore_session", structured_output=False,
                 description="Replace this conversation's session with one started from a snapshot id "
                             "snapshot_session returned (its files, and its variables by re-running its cells).")
    async def restore_session(snapshot_id: str, ctx: Context) -> CallToolResult:
        client = client_of(ctx)
        try:
            restored = await asyncio.to_thread(functools.partial(manager.restore, snapshot_id, owner=client.owner,
                                                                 policy=manager.config))
        except NbexecError as exc:
            return _failed(exc)
        old, client.session, client.files = client.session, restored, {}
        if old is not None:
            await asyncio.to_thread(old.close)
        return CallToolResult(content=[TextContent(text=f"restored: {len(restored.notebook.cells)} cells replayed; "
                                                         f"the session runs {restored.config.language} code")])
