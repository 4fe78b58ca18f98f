"""Snapshot routes of a node: POST /v1/sessions/{id}/snapshot (201 {"snapshot": id}), POST /v1/sessions/{id}/fork
(201, a new session), POST /v1/sessions with ``from_snapshot`` (in `server`), GET /v1/snapshots (the token's own,
with when each expires) and DELETE /v1/snapshots/{id} (204; its files removed). A snapshot belongs to the token
that made it: any other token, like a tampered, unknown, deleted or expired id, gets 404; past the per-owner cap
(counted per token), 429. Expiry: NBEXEC_SNAPSHOT_TTL (see `nbexec.engine.snapshots`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Response

from nbexec.engine import snapshotblobs
from nbexec.engine.session import Session
from nbexec.errors import SessionLimitError, SnapshotError

from . import files
from .runs import Runs, Shown, owner, too_many
from .schemas import SessionModel
from .tenants import Tenants


def guarded(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except SnapshotError as exc:
        raise HTTPException(404, str(exc)) from None
    except SessionLimitError as exc:
        raise too_many(str(exc)) from None


def restore(folders: Tenants, runs: Runs, who: str, snapshot_id: str, shown: Shown) -> Session:
    """A new session of ``who`` from their snapshot; its place under the token's cap is held from the check on."""
    def made() -> Session:
        with folders.making(who, runs.settings.max_sessions_per_token) as place:
            return folders.restore_session(who, snapshot_id, runs.settings.store, shown.id, place=place)
    session: Session = guarded(made)
    return session


def add_routes(app: FastAPI, folders: Tenants, runs: Runs, describe: Callable[[Session, Any], SessionModel]) -> None:
    @app.post("/v1/sessions/{session_id}/snapshot", status_code=201)
    async def snapshot(session_id: str, who: str = Depends(owner)) -> dict[str, str]:
        """Keep the session's files and notebook as a snapshot only this token can restore."""
        session = files.owned(folders, who, session_id)
        return {"snapshot": await runs.io(who, lambda: guarded(session.snapshot))}

    @app.post("/v1/sessions/{session_id}/fork", status_code=201)
    async def fork(session_id: str, shown: Shown, who: str = Depends(owner)) -> SessionModel:
        """A new session from a snapshot of this one: its files, and its memory by replay."""
        session = files.owned(folders, who, session_id)
        made = await runs.io(who, lambda: guarded(session.snapshot))
        restored = await runs.io(who, restore, folders, runs, who, made, shown)
        return describe(restored, shown)

    @app.get("/v1/snapshots")
    async def listing(who: str = Depends(owner)) -> dict[str, list[dict[str, Any]]]:
        """This token's snapshots, oldest first (expired ones are removed on the way)."""
        found = await runs.io(who, lambda: guarded(lambda: store(folders).listing(who)))
        return {"snapshots": [{"id": s.id, "created": s.created, "expires": s.expires} for s in found]}

    @app.delete("/v1/snapshots/{snapshot_id}", status_code=204)
    async def delete(snapshot_id: str, who: str = Depends(owner)) -> Response:
        """Delete one of this token's snapshots and its files (404 for any other id)."""
        await runs.io(who, lambda: guarded(lambda: store(folders).delete(who, snapshot_id)))
        return Response(status_code=204)


def store(folders: Tenants) -> Any:
    """The node's snapshot store, as its sessions use it (a shared blob store, or a folder)."""
    return snapshotblobs.store_for(folders.sessions.state_dir)
