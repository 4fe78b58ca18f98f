"""`nbexec serve`: an authenticated JSON-over-HTTP service for clients in any language (the server extra).

Every request but /healthz, /readyz and /metrics needs `Authorization: Bearer <token>`. A session belongs to the
token that created it: any other token gets 404 for it. Per-token caps on live sessions and on executions in
flight are answered with 429 and Retry-After. Tokens never appear in logs or responses (a token is known by
the first 12 hex digits of its sha256).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from . import __version__, daemon, pool
from .config import SandboxConfig
from .errors import ConfigError, DockerError, FileTransferError, NbexecError, SessionError
from .execute import execute_notebook
from .result import ExecutionResult
from .session import Session, SessionManager
from .storage import ArtifactStore

try:
    from fastapi import Depends, FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, Field
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("`nbexec serve` needs the server extra: pip install 'nbexec[server]'") from exc

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The service's policy. ``tokens`` are the accepted bearer tokens (empty only with ``auth=False``)."""

    config: SandboxConfig
    tokens: tuple[str, ...] = field(default=(), repr=False)
    auth: bool = True
    store: ArtifactStore | None = None
    max_body: int = 16 * 1024**2
    max_sessions_per_token: int = 8
    max_running_per_token: int = 4
    session_ttl: float = 20 * 60.0

    def __post_init__(self) -> None:
        if self.auth and not self.tokens:
            raise ConfigError("no API token: give --token-file or NBEXEC_API_TOKENS (or --no-auth on loopback)")
        if any(len(t) < 16 for t in self.tokens):
            raise ConfigError("API tokens must be at least 16 characters long")


def token_id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


class ExecuteBody(BaseModel):
    code: str = Field(min_length=1, max_length=1_000_000, description="Python source to run.")
    timeout: float | None = Field(default=None, gt=0, le=3600, description="Seconds (default: the server's).")
    files: dict[str, str] | None = Field(
        default=None, description="Files to put in /mnt/data first: name -> base64 content (one-shot only).")


class SessionExecuteBody(BaseModel):
    code: str = Field(min_length=1, max_length=1_000_000)
    timeout: float | None = Field(default=None, gt=0, le=3600)


class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executions: dict[str, int] = defaultdict(int)
        self.failures: dict[str, int] = defaultdict(int)
        self.duration_sum = 0.0
        self.duration_count = 0

    def record(self, kind: str, result: ExecutionResult) -> None:
        with self.lock:
            self.executions[kind] += 1
            self.duration_sum += result.duration_s
            self.duration_count += 1
            if result.error is not None:
                self.failures[result.error.kind] += 1

    def render(self, live_sessions: int, pool_ready: int) -> str:
        with self.lock:
            lines = ["# TYPE nbexec_executions_total counter"]
            lines += [f'nbexec_executions_total{{kind="{k}"}} {v}' for k, v in sorted(self.executions.items())]
            lines += ["# TYPE nbexec_failures_total counter"]
            lines += [f'nbexec_failures_total{{kind="{k}"}} {v}' for k, v in sorted(self.failures.items())]
            lines += ["# TYPE nbexec_execution_seconds summary",
                      f"nbexec_execution_seconds_sum {self.duration_sum:.6f}",
                      f"nbexec_execution_seconds_count {self.duration_count}",
                      "# TYPE nbexec_live_sessions gauge", f"nbexec_live_sessions {live_sessions}",
                      "# TYPE nbexec_pool_ready gauge", f"nbexec_pool_ready {pool_ready}"]
        return "\n".join(lines) + "\n"


class _State:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.sessions = SessionManager(settings.config, max_sessions=1024, ttl=settings.session_ttl)
        self.owners: dict[str, str] = {}
        self.running: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.metrics = Metrics()

    def owned(self, owner: str, session_id: str) -> Session:
        with self.lock:
            if self.owners.get(session_id) != owner:
                raise HTTPException(404, "no such session")
        try:
            return self.sessions.get(session_id)
        except SessionError:
            raise HTTPException(404, "no such session") from None

    def live_for(self, owner: str) -> int:
        ids = set(self.sessions.ids())
        with self.lock:
            for gone in [s for s in self.owners if s not in ids]:
                del self.owners[gone]
            return sum(1 for o in self.owners.values() if o == owner)


def _too_many(message: str) -> HTTPException:
    return HTTPException(429, message, headers={"Retry-After": "5"})


class _Gate:
    """Authentication and per-token execution slots."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.settings = state.settings

    def owner(self, request: Request) -> str:
        if not self.settings.auth:
            return "anonymous"
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, t) for t in self.settings.tokens):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        return token_id(token)

    def take_slot(self, who: str) -> None:
        with self.state.lock:
            if self.state.running[who] >= self.settings.max_running_per_token:
                raise _too_many(f"{self.settings.max_running_per_token} executions already running for this token")
            self.state.running[who] += 1

    async def run(self, who: str, func: Callable[[], ExecutionResult], *, slot_taken: bool = False) -> ExecutionResult:
        """Run ``func`` in a worker thread inside the token's slot, mapping nbexec errors to HTTP ones."""
        if not slot_taken:
            self.take_slot(who)
        try:
            return await asyncio.to_thread(func)
        except FileTransferError as exc:
            raise HTTPException(400, str(exc)) from exc
        except SessionError as exc:
            raise HTTPException(409, str(exc)) from exc
        except DockerError as exc:
            raise HTTPException(503, str(exc)) from exc
        except NbexecError as exc:
            raise HTTPException(500, str(exc)) from exc
        finally:
            with self.state.lock:
                self.state.running[who] -= 1

    async def respond(self, who: str, run: Callable[..., ExecutionResult], stream: bool) -> Any:
        if stream:
            self.take_slot(who)  # before the response starts, so a refusal is a real 429
            return _stream(lambda on_output: self.run(who, lambda: run(on_output), slot_taken=True))
        return (await self.run(who, run)).to_dict()


def _decode_files(files: dict[str, str] | None) -> dict[str, bytes]:
    try:
        return {name: base64.b64decode(data, validate=True) for name, data in (files or {}).items()}
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(422, "files must map names to base64 content") from exc


def create_app(settings: ServerSettings) -> FastAPI:
    """The ASGI application."""
    state = _State(settings)
    gate = _Gate(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.warm_up(settings.config)
        yield
        await asyncio.to_thread(state.sessions.close_all)

    app = FastAPI(title="nbexec", version=__version__, lifespan=lifespan,
                  description="Run untrusted Python in throwaway, locked-down sandboxes.")
    app.state.nbexec = state

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Callable[[Request], Any]) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body):
            return JSONResponse({"detail": f"request body over {settings.max_body} bytes"}, status_code=413)
        response: Response = await call_next(request)
        return response

    _ops_routes(app, state)
    _execute_routes(app, state, gate)
    _session_routes(app, state, gate)
    _file_routes(app, state, gate)
    return app


def _ops_routes(app: FastAPI, state: _State) -> None:
    config = state.settings.config

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        checks: dict[str, Any] = {"docker": "ok", "image": "ok"}
        try:
            daemon.require_image(daemon.connect(), config.image)
        except NbexecError as exc:
            checks["error"] = str(exc)
        checks["pool_ready"] = pool.ready_count(config)
        checks["pool_filled"] = pool.has_filled(config)  # full once since start: later dips are load, not illness
        ok = "error" not in checks and checks["pool_filled"]
        if "error" not in checks:
            pool.warm_up(config)
        return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return state.metrics.render(len(state.sessions), pool.ready_count(config))


def _execute_routes(app: FastAPI, state: _State, gate: _Gate) -> None:
    settings = state.settings

    @app.post("/v1/execute")
    async def execute(body: ExecuteBody, stream: bool = False, who: str = Depends(gate.owner)) -> Any:
        """One-shot execution in a fresh sandbox from the warm pool; ?stream=true for server-sent events."""
        files = _decode_files(body.files)
        config = settings.config.replace(timeout=body.timeout)

        def run(on_output: Any = None) -> ExecutionResult:
            result = execute_notebook(body.code, config=config, store=settings.store, files=files,
                                      on_output=on_output)
            state.metrics.record("oneshot", result)
            return result

        return await gate.respond(who, run, stream)


def _session_routes(app: FastAPI, state: _State, gate: _Gate) -> None:
    settings = state.settings

    @app.post("/v1/sessions", status_code=201)
    def create_session(who: str = Depends(gate.owner)) -> dict[str, Any]:
        if state.live_for(who) >= settings.max_sessions_per_token:
            raise _too_many(f"{settings.max_sessions_per_token} sessions are live for this token; delete one")
        session = state.sessions.create(store=settings.store)
        with state.lock:
            state.owners[session.id] = who
        return _describe(session)

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, who: str = Depends(gate.owner)) -> dict[str, Any]:
        return _describe(state.owned(who, session_id))

    @app.post("/v1/sessions/{session_id}/execute")
    async def execute_in_session(session_id: str, body: SessionExecuteBody, stream: bool = False,
                                 who: str = Depends(gate.owner)) -> Any:
        """Run a cell in the session (state kept); ?stream=true for server-sent events."""
        session = state.owned(who, session_id)

        def run(on_output: Any = None) -> ExecutionResult:
            result = session.run(body.code, timeout=body.timeout, on_output=on_output)
            state.metrics.record("session", result)
            return result

        return await gate.respond(who, run, stream)



def _file_routes(app: FastAPI, state: _State, gate: _Gate) -> None:
    settings = state.settings

    @app.get("/v1/sessions/{session_id}/files")
    def list_files(session_id: str, who: str = Depends(gate.owner)) -> dict[str, Any]:
        session = state.owned(who, session_id)
        return {"files": [{"name": f.name, "size": f.size, "mime": f.mime, "sha256": f.sha256}
                          for f in session.files()]}

    @app.put("/v1/sessions/{session_id}/files/{name:path}", status_code=201)
    async def put_file(session_id: str, name: str, request: Request,
                       who: str = Depends(gate.owner)) -> dict[str, Any]:
        session = state.owned(who, session_id)
        content = await _read_body(request, settings.max_body)
        try:
            path = await asyncio.to_thread(session.upload, content, name)
        except FileTransferError as exc:
            raise HTTPException(400, str(exc)) from exc
        except SessionError as exc:
            raise HTTPException(409, str(exc)) from exc
        return {"path": path, "size": len(content)}

    @app.get("/v1/sessions/{session_id}/files/{name:path}")
    def get_file(session_id: str, name: str, who: str = Depends(gate.owner)) -> Response:
        session = state.owned(who, session_id)
        try:
            content = session.download(name)
        except FileTransferError as exc:
            raise HTTPException(404, str(exc)) from exc
        except SessionError as exc:
            raise HTTPException(409, str(exc)) from exc
        return Response(content, media_type="application/octet-stream")

    @app.delete("/v1/sessions/{session_id}", status_code=204, response_class=Response)
    def delete_session(session_id: str, who: str = Depends(gate.owner)) -> Response:
        session = state.owned(who, session_id)
        with state.lock:
            state.owners.pop(session_id, None)
        state.sessions.close(session.id)
        return Response(status_code=204)


def _describe(session: Session) -> dict[str, Any]:
    idle = time.monotonic() - session.last_activity
    return {"id": session.id, "status": session.status, "idle_s": round(idle, 3),
            "cells": len(session.notebook.cells)}


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _stream(start: Callable[[Callable[[int, Any], None]], Any]) -> StreamingResponse:
    """Server-sent events: one `output` event per output as the cell runs, then `result` (or `error`)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_output(cell_index: int, output: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("output", {"cell_index": cell_index, **dict(output)}))

    async def produce() -> None:
        try:
            result = await start(on_output)
            await queue.put(("result", result.to_dict()))
        except HTTPException as exc:
            await queue.put(("error", {"status": exc.status_code, "detail": exc.detail}))

    async def events() -> AsyncIterator[bytes]:
        task = asyncio.create_task(produce())
        while True:
            kind, data = await queue.get()
            yield f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
            if kind in ("result", "error"):
                break
        await task

    return StreamingResponse(events(), media_type="text/event-stream")
