"""Snapshot routes of a node: POST /v1/sessions/{id}/snapshot (201 {"snapshot": id}), POST /v1/sessions/{id}/fork
(201, a new session), and POST /v1/sessions with ``from_snapshot`` (in `server`). A snapshot belongs to the token
that made it: any other token, like a tampered or unknown id, gets 404; past the per-owner cap, 429."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException

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
    if folders.live_for(who) >= runs.settings.max_sessions_per_token:
        raise too_many(f"{runs.settings.max_sessions_per_token} sessions are live for this token; delete one")
    session: Session = guarded(lambda: folders.restore_session(who, snapshot_id, runs.settings.store, shown.id))
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
