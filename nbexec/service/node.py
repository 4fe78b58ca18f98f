"""What makes `nbexec serve` a node agent: /v1/capacity, read by routers and remote clients to place calls.

It is authenticated like every /v1 route. ``instance`` is new at every start, so a caller can tell a node that
restarted (its sessions and sandboxes are gone) from one that merely did not answer for a while. The load comes
from the node's sandbox source (its warm pool), its sessions and held sandboxes, and its execution slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI

from nbexec.hostconfig import host_from_env

from .runs import Runs
from .tenants import Tenants


def add_routes(app: FastAPI, folders: Tenants, gate: Runs, held: Callable[[], int], owner: Callable[..., str]) -> None:
    """Add GET /v1/capacity: this node's name and instance, live sessions (and sandboxes held for library
    clients), free pool slots, running executions."""
    config = folders.config

    @app.get("/v1/capacity")
    async def capacity(who: str = Depends(owner)) -> dict[str, Any]:
        """This node's load, for placing calls: the most free node gets the next one-shot."""
        supply = folders.source.capacity(config)
        return {"node": host_from_env().node_name, "instance": app.state.instance,
                "sessions": len(folders.sessions) + held(), "pool_free": supply.ready, "pool_size": supply.size,
                "running": sum(gate.running.values())}
