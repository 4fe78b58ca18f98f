"""`nbexec serve`: an authenticated JSON-over-HTTP service for clients in any language (the server extra).

Every request but /, /healthz, /readyz, /metrics and the API documents needs `Authorization: Bearer <token>`,
checked from the headers before any body byte is read (see `gateway`; the OpenAPI document declares the scheme).
A session or a one-shot result belongs to the token that made it: any other token gets 404 for it. Each token
runs on its own worker threads, so one token's long runs never delay another's requests; per-token caps on live
sessions and executions in flight are answered with 429 and Retry-After. Responses carry relative names and URLs,
never host paths. Tokens never appear in logs or responses (a token is known by the first 12 hex digits of its
sha256). `/` is the playground page (see `playground`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from nbexec import __version__
from nbexec.config import parse_size
from nbexec.engine import durable
from nbexec.engine.session import Session
from nbexec.errors import SessionError

from . import node
from .gateway import Gateway, token_id
from .settings import ServerSettings
from .tenants import Tenants, public

try:
    from fastapi import Depends, FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse

    from . import batches, e2b, files, playground, sandboxes, snapshots
    from .identity import View
    from .metrics import CONTENT_TYPE, Metrics
    from .runs import Runs, Shown, apply_egress, chosen, egress_change, owner, plain_restore, same_language, too_many
    from .runs import execute as run_body
    from .schemas import (
        RESULT,
        EgressBody,
        ExecuteBody,
        HealthModel,
        ReadyModel,
        SessionBody,
        SessionExecuteBody,
        SessionModel,
    )
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("`nbexec serve` needs the server extra: pip install 'nbexec-sandbox[server]'") from exc

__all__ = ["create_app", "token_id"]

log = logging.getLogger(__name__)
EXECUTION_HEADER = "X-Nbexec-Execution-Id"  # a streamed one-shot run's id, known before its first event


def _decode_files(files: dict[str, str] | None) -> dict[str, bytes]:
    try:
        return {name: base64.b64decode(data, validate=True) for name, data in (files or {}).items()}
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(422, "files must map names to base64 content") from exc


def create_app(settings: ServerSettings) -> Any:
    """The ASGI application: the FastAPI routes behind the gateway (Host, token and body checks)."""
    folders = Tenants(settings.config, max_sessions=1024, session_ttl=settings.session_ttl,
                      result_ttl=settings.result_ttl, runs_per_token=settings.max_running_per_token,
                      state_dir=settings.state_dir, hibernate_after=settings.hibernate_after)
    runs = Runs(folders, settings)
    metrics = Metrics(lambda: len(folders.sessions), lambda: folders.source.capacity(settings.config).ready)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        folders.open()
        folders.source.warm_up(settings.config)
        janitor = asyncio.create_task(folders.sweep_forever())
        try:
            yield
        finally:
            janitor.cancel()
            await asyncio.to_thread(folders.close)

    app = FastAPI(title="nbexec", version=__version__, lifespan=lifespan,
                  description="Run untrusted Python in throwaway, locked-down sandboxes.")
    app.state.nbexec = folders
    app.state.gate = runs  # per-token slots, read by operators' tooling and the tests
    app.state.metrics = metrics
    # New at every start (callers tell a restarted node by it), unless a state folder keeps it with the sessions.
    app.state.instance = _instance(settings)
    _ops_routes(app, folders, metrics)
    _execute_routes(app, folders, runs, metrics)
    _session_routes(app, folders, runs, metrics)
    files.add_routes(app, folders, runs)
    playground.add_routes(app)
    node.add_routes(app, folders, runs, lambda: len(folders.held), owner)  # /v1/capacity: this server as a node
    sandboxes.add_routes(app, folders, runs, settings)
    snapshots.add_routes(app, folders, runs, _describe)  # the seam over HTTP, for library clients (NBEXEC_NODES)
    e2b.add_routes(app, folders, runs, settings)  # E2B's API and SDKs (/e2b)
    batches.add_routes(app, folders, runs)  # many one-shot executions in one call (/v1/batches)
    app.add_middleware(Gateway, tokens=settings.tokens, auth=settings.auth, max_body=settings.max_body, signed=True,
                       larger={sandboxes.WHEEL_ROUTE: parse_size(settings.config.max_package_download)})
    return app


def _instance(settings: ServerSettings) -> str:
    if settings.state_dir is None:
        return uuid.uuid4().hex[:12]
    folder = durable.hold(settings.state_dir)
    kept = folder.read("instance", limit=64)
    if kept is not None and re.fullmatch(rb"[0-9a-f]{12}", kept):
        return kept.decode()
    instance = uuid.uuid4().hex[:12]
    folder.write("instance", instance.encode())
    return instance


def _ops_routes(app: FastAPI, folders: Tenants, metrics: Metrics) -> None:
    config = folders.config

    @app.get("/healthz")
    async def healthz() -> HealthModel:
        return HealthModel(status="ok")

    @app.get("/readyz", response_model=ReadyModel, responses={503: {"model": ReadyModel}})
    def readyz() -> JSONResponse:
        """Whether this node's sandbox source can give sandboxes (locally: Docker, the image, a pool full once)."""
        ready = folders.source.readiness(config)
        return JSONResponse({"ready": ready.ready, **ready.checks}, status_code=200 if ready.ready else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format.", "content": {CONTENT_TYPE: {}}}})
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _execute_routes(app: FastAPI, folders: Tenants, runs: Runs, metrics: Metrics) -> None:
    settings = runs.settings

    @app.post("/v1/execute", responses={200: RESULT})
    async def execute(body: ExecuteBody, request: Request, shown: Shown, stream: bool = False,
                      who: str = Depends(owner)) -> Any:
        """One-shot execution in a fresh sandbox from the warm pool; ?stream=true for server-sent events.

        Its files and images are served from /v1/executions/{execution_id}/... for ``result_ttl`` seconds."""
        uploads = _decode_files(body.files)
        config = chosen(settings.config, body.image, body.language)
        execution_id = uuid.uuid4().hex[:16]
        session = folders.one_shot(execution_id, settings.store, shown.id, config)

        def render(on_output: Any = None) -> dict[str, Any]:
            folders.keep(who, execution_id, session)
            try:
                for name, content in uploads.items():
                    session.upload(content, name)
                result = run_body(session, body, folders.capped(body.timeout), on_output)
            finally:
                folders.finish_one_shot(execution_id)
            metrics.record("oneshot", result)
            return shown.outward(public(result, execution_id), execution_id)

        return await runs.respond(who, render, session.interrupt, stream, request.receive,
                                  {EXECUTION_HEADER: shown.id(execution_id)})

    @app.post("/v1/executions/{execution_id}/interrupt", status_code=202, responses={404: {}, 409: {}})
    async def interrupt_execution(execution_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        """Interrupt a running one-shot execution (a streamed run's id is its X-Nbexec-Execution-Id header, sent
        before the first event). 404 for an id that is not this token's running or kept run; 409 once it ended.
        The result then says what happened (error.kind "exception", KeyboardInterrupt; never ok)."""
        state = await runs.io(who, folders.interrupt_run, who, execution_id)
        if state == "unknown":
            raise HTTPException(404, "no such execution")
        if state == "finished":
            raise HTTPException(409, "the execution has ended: there is nothing to interrupt")
        return {"interrupted": True}


def _session_routes(app: FastAPI, folders: Tenants, runs: Runs, metrics: Metrics) -> None:
    settings = runs.settings

    @app.post("/v1/sessions", status_code=201)
    async def create_session(shown: Shown, body: SessionBody | None = None,
                             who: str = Depends(owner)) -> SessionModel:
        config = chosen(settings.config, *((body.image, body.language) if body is not None else (None, None)))
        if body is not None and body.from_snapshot:
            plain_restore(body.image, body.language)
            return _describe(await runs.io(who, snapshots.restore, folders, runs, who, body.from_snapshot, shown),
                             shown)
        try:  # the place is taken with the check: concurrent creates cannot all pass a check made before
            with folders.making(who, settings.max_sessions_per_token) as place:
                return _describe(folders.new_session(who, settings.store, shown.id, config, place), shown)
        except SessionError as exc:
            raise too_many(str(exc)) from exc

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, shown: Shown, who: str = Depends(owner)) -> SessionModel:
        return _describe(files.owned(folders, who, session_id), shown)

    @app.post("/v1/sessions/{session_id}/execute", responses={200: RESULT})
    async def execute_in_session(session_id: str, body: SessionExecuteBody, request: Request, shown: Shown,
                                 stream: bool = False, who: str = Depends(owner)) -> Any:
        """Run a cell in the session (state kept); ?stream=true for server-sent events."""
        session = files.owned(folders, who, session_id)
        same_language(session.config, body.language)

        def render(on_output: Any = None) -> dict[str, Any]:
            result = run_body(session, body, folders.capped(body.timeout), on_output)
            metrics.record("session", result)
            return shown.outward(public(result), session.id)

        return await runs.respond(who, render, session.interrupt, stream, request.receive)

    @app.post("/v1/sessions/{session_id}/egress", status_code=204, response_class=Response)
    async def change_egress(session_id: str, body: EgressBody, who: str = Depends(owner)) -> Response:
        """Change the session's allowlist now: ``allow`` then ``deny`` appended (the newest match decides); open
        connections no longer allowed are closed; the next result's connections log it (method RULES)."""
        session = files.owned(folders, who, session_id)
        egress_change(session.config, body.allow, body.deny, widen=session.config.egress_widen)
        await apply_egress(runs, who, lambda: session.change_hosts(allow=body.allow, deny=body.deny))
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/interrupt", status_code=202, responses={404: {}, 409: {}})
    async def interrupt_session(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        """Interrupt the session's running call (a cell or a shell command): 202, and that call's result says it
        was interrupted. 409 when nothing is running (an idle session is left as it is)."""
        session = files.owned(folders, who, session_id)
        if not session.busy:
            raise HTTPException(409, f"session is {session.status}: nothing is running to interrupt")
        await runs.io(who, session.interrupt)
        return {"interrupted": True}

    @app.delete("/v1/sessions/{session_id}", status_code=204, response_class=Response)
    async def delete_session(session_id: str, who: str = Depends(owner)) -> Response:
        files.deletable(folders, who, session_id)
        await runs.io(who, folders.delete_session, session_id)
        return Response(status_code=204)


def _describe(session: Session, shown: View) -> SessionModel:
    return SessionModel(id=shown.id(session.id), status=session.status,
                        idle_s=round(time.monotonic() - session.last_activity, 3), cells=len(session.notebook.cells),
                        language=session.config.language)
