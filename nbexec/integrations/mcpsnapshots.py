"""`nbexec mcp`'s snapshot tools: keep a client's session as a snapshot, and replace it with one started from a
snapshot id (see `nbexec.engine.snapshots`: ids signed for their owner, every file checked before use)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent

from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.errors import NbexecError


def register(server: MCPServer, manager: SessionManager, client_of: Callable[[Context], Any],
             session_of: Callable[[Any], Session], owner: str) -> None:
    """Add the snapshot_session and restore_session tools to ``server`` (sessions of ``manager``, snapshots of
    ``owner``; a client is what ``client_of`` makes of a call's context, with ``session`` and ``files``)."""

    @server.tool(name="snapshot_session", structured_output=False,
                 description="Keep this conversation's session (its files and the cells run so far) as a "
                             "snapshot; returns its id, for restore_session.")
    async def snapshot_session(ctx: Context) -> CallToolResult:
        client = client_of(ctx)
        try:
            made = await asyncio.to_thread(session_of(client).snapshot)
        except NbexecError as exc:
            return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)
        return CallToolResult(content=[TextContent(text=made)])

    @server.tool(name="restore_session", structured_output=False,
                 description="Replace this conversation's session with one started from a snapshot id "
                             "snapshot_session returned (its files, and its variables by re-running its cells).")
    async def restore_session(snapshot_id: str, ctx: Context) -> CallToolResult:
        client = client_of(ctx)
        try:
            restored = await asyncio.to_thread(functools.partial(manager.restore, snapshot_id, owner=owner,
                                                                 policy=manager.config))
        except NbexecError as exc:
            return CallToolResult(content=[TextContent(text=f"Tool error: {exc}")], is_error=True)
        old, client.session, client.files = client.session, restored, {}
        if old is not None:
            await asyncio.to_thread(old.close)
        return CallToolResult(content=[TextContent(text=f"restored: {len(restored.notebook.cells)} cells replayed; "
                                                         f"the session runs {restored.config.language} code")])
