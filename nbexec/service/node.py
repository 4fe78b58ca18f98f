"""What makes `nbexec serve` a node agent: /v1/capacity, read by routers and remote clients to place calls.

It is authenticated like every /v1 route. ``instance`` is new at every start, so a caller can tell a node that
restarted (its sessions are gone) from one that merely did not answer for a while.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbexec.config import host_from_env
from nbexec.sandbox.docker import pool


def add_routes(app: Any, folders: Any, gate: Any, owner: Callable[..., str]) -> None:
    """Add GET /v1/capacity: this node's name and instance, live sessions, free pool slots, running executions."""
    from fastapi import Depends

    config = folders.config

    @app.get("/v1/capacity")
    async def capacity(who: str = Depends(owner)) -> dict[str, Any]:
        """This node's load, for placing calls: the most free node gets the next one-shot."""
        return {"node": host_from_env().node_name, "instance": app.state.instance, "sessions": len(folders.sessions),
                "pool_free": pool.ready_count(config), "pool_size": config.pool_size,
                "running": sum(gate.running.values())}
