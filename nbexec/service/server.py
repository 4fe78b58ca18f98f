"""`nbexec serve`: an authenticated JSON-over-HTTP service for clients in any language (the server extra).

Every request but /healthz, /readyz and /metrics needs `Authorization: Bearer <token>`, checked from the headers
before any body byte is read (see `gateway`). A session or a one-shot result belongs to the token that made it:
any other token gets 404 for it. Each token runs on its own worker threads, so one token's long runs never
delay another's requests; per-token caps on live sessions and executions in flight are answered with 429 and
Retry-After. Responses carry relative names and URLs, never host paths. Tokens never appear in logs or
responses (a token is known by the first 12 hex digits of its sha256).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__, artifacts
from ..config import SandboxConfig, parse_size
from ..errors import ConfigError, DockerError, FileTransferError, NbexecError, SessionError
from ..result import ExecutionResult
from ..sandbox import daemon, pool
from ..session import Session
from ..storage import ArtifactStore
from . import node
from .gateway import OWNER_KEY, Gateway, token_id
from .tenants import RouteStore, Tenants, public

try:
    from fastapi import Depends, FastAPI, HTTPException, Request, Response
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, Field
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("`nbexec serve` needs the server extra: pip install 'nbexec-sandbox[server]'") from exc

__all__ = ["ServerSettings", "create_app", "token_id"]

log = logging.getLogger(__name__)
Render = Callable[[Any], dict[str, Any]]  # runs in a worker thread: (on_output or None) -> the public result


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
    result_ttl: float = 15 * 60.0  # seconds a one-shot result's files stay downloadable, then they are deleted
    keepalive: float = 15.0  # seconds between SSE keep-alive comments on a quiet stream

    def __post_init__(self) -> None:
        if self.auth and not self.tokens:
            raise ConfigError("no API token: give --token-file or NBEXEC_API_TOKENS (or --no-auth on loopback)")
        if any(len(t) < 16 for t in self.tokens):
            raise ConfigError("API tokens must be at least 16 characters long")
        if self.result_ttl <= 0 or self.keepalive <= 0:
            raise ConfigError("result_ttl and keepalive must be above 0 seconds")


class ExecuteBody(BaseModel):
    code: str = Field(min_length=1, max_length=1_000_000, description="Python source to run.")
    timeout: float | None = Field(default=None, gt=0, le=3600,
                                  description="Seconds; capped by the server's limit (default: that limit).")
    files: dict[str, str] | None = Field(
        default=None, description="Files to put in /mnt/data first: name -> base64 content (one-shot only).")


class SessionExecuteBody(BaseModel):
    code: str = Field(min_length=1, max_length=1_000_000)
    timeout: float | None = Field(default=None, gt=0, le=3600)


class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self) -> None:
        self.executions: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.duration_sum = 0.0
        self.duration_count = 0

    def record(self, kind: str, result: ExecutionResult) -> None:
        self.executions[kind] = self.executions.get(kind, 0) + 1
        self.duration_sum += result.duration_s
        self.duration_count += 1
        if result.error is not None:
            self.failures[result.error.kind] = self.failures.get(result.error.kind, 0) + 1

    def render(self, live_sessions: int, pool_ready: int) -> str:
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


def owner(request: Request) -> str:
    """Who sent the request, as the gateway authenticated it."""
    who = request.scope.get("state", {}).get(OWNER_KEY)
    if not who:  # unreachable behind the gateway: refuse rather than serve anonymously
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
    return str(who)


def _too_many(message: str) -> HTTPException:
    return HTTPException(429, message, headers={"Retry-After": "5"})


def _http_error(exc: NbexecError) -> HTTPException:
    if isinstance(exc, FileTransferError):
        return HTTPException(400, str(exc))
    if isinstance(exc, SessionError):
        return HTTPException(409, str(exc))
    if isinstance(exc, DockerError):
        return HTTPException(503, "the sandbox engine failed; try again later")
    return HTTPException(500, "nbexec failed to run this; see the server's log")


class _Gate:
    """Per-token execution slots and worker threads."""

    def __init__(self, folders: Tenants, settings: ServerSettings) -> None:
        self.folders = folders
        self.settings = settings
        self.running: dict[str, int] = {}

    def take_slot(self, who: str) -> None:
        if self.running.get(who, 0) >= self.settings.max_running_per_token:
            raise _too_many(f"{self.settings.max_running_per_token} executions already running for this token")
        self.running[who] = self.running.get(who, 0) + 1

    def _free_slot(self, who: str) -> None:
        self.running[who] -= 1

    async def run(self, who: str, render: Render, on_output: Any = None, *, slot_taken: bool = False) -> Any:
        """Run ``render`` on the token's own run threads inside its slot, mapping nbexec errors to HTTP ones.

        The slot is held until the thread is done, even when the client leaves earlier."""
        if not slot_taken:
            self.take_slot(who)
        loop = asyncio.get_running_loop()
        try:
            future = self.folders.lanes(who).runs.submit(render, on_output)
        except RuntimeError:
            self._free_slot(who)
            raise HTTPException(503, "the server is shutting down") from None
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._free_slot, who))
        try:
            return await asyncio.wrap_future(future)
        except NbexecError as exc:
            log.warning("execution failed: %s", exc)
            raise _http_error(exc) from exc
        except Exception as exc:  # a bug or a broken store: the client gets a plain 500, the log the details
            log.exception("execution failed unexpectedly")
            raise HTTPException(500, "nbexec failed to run this; see the server's log") from exc

    async def respond(self, who: str, render: Render, interrupt: Callable[[], None], stream: bool) -> Any:
        if not stream:
            return await self.run(who, render)
        self.take_slot(who)  # before the response starts, so a refusal is a real 429
        return _stream(lambda on_output: self.run(who, render, on_output, slot_taken=True), interrupt,
                       self.settings.keepalive, self.folders.background)

    async def io(self, who: str, func: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file or session work on the token's own I/O threads."""
        try:
            return await asyncio.wrap_future(self.folders.lanes(who).io.submit(func, *args))
        except FileTransferError as exc:
            raise HTTPException(404, str(exc)) from exc
        except NbexecError as exc:
            raise _http_error(exc) from exc


def _decode_files(files: dict[str, str] | None) -> dict[str, bytes]:
    try:
        return {name: base64.b64decode(data, validate=True) for name, data in (files or {}).items()}
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(422, "files must map names to base64 content") from exc


def create_app(settings: ServerSettings) -> Any:
    """The ASGI application: the FastAPI routes behind the gateway (Host, token and body checks)."""
    folders = Tenants(settings.config, max_sessions=1024, session_ttl=settings.session_ttl,
                      result_ttl=settings.result_ttl, runs_per_token=settings.max_running_per_token)
    gate = _Gate(folders, settings)
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        folders.open()
        pool.warm_up(settings.config)
        janitor = asyncio.create_task(folders.sweep_forever())
        try:
            yield
        finally:
            janitor.cancel()
            await asyncio.to_thread(folders.close)

    app = FastAPI(title="nbexec", version=__version__, lifespan=lifespan,
                  description="Run untrusted Python in throwaway, locked-down sandboxes.")
    app.state.nbexec = folders
    app.state.gate = gate  # per-token slots, read by operators' tooling and the tests
    _ops_routes(app, folders, metrics)
    _execute_routes(app, folders, gate, metrics)
    _session_routes(app, folders, gate, metrics)
    _file_routes(app, folders, gate)
    node.add_routes(app, folders, gate, owner)  # /v1/capacity: this server as a node of a cluster
    app.add_middleware(Gateway, tokens=settings.tokens, auth=settings.auth, max_body=settings.max_body)
    return app


def _ops_routes(app: FastAPI, folders: Tenants, metrics: Metrics) -> None:
    config = folders.config

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
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
    async def metrics_text() -> str:
        return metrics.render(len(folders.sessions), pool.ready_count(config))


def _execute_routes(app: FastAPI, folders: Tenants, gate: _Gate, metrics: Metrics) -> None:
    settings = gate.settings

    @app.post("/v1/execute")
    async def execute(body: ExecuteBody, stream: bool = False, who: str = Depends(owner)) -> Any:
        """One-shot execution in a fresh sandbox from the warm pool; ?stream=true for server-sent events.

        Its files and images are served from /v1/executions/{execution_id}/... for ``result_ttl`` seconds."""
        files = _decode_files(body.files)
        execution_id = uuid.uuid4().hex[:16]
        session = folders.one_shot(execution_id, settings.store)

        def render(on_output: Any = None) -> dict[str, Any]:
            folders.keep(who, execution_id, session)
            try:
                for name, content in files.items():
                    session.upload(content, name)
                result = session.run(body.code, timeout=folders.capped(body.timeout), on_output=on_output)
            finally:
                folders.finish_one_shot(execution_id)
            metrics.record("oneshot", result)
            return public(result, execution_id)

        return await gate.respond(who, render, session.interrupt, stream)


def _session_routes(app: FastAPI, folders: Tenants, gate: _Gate, metrics: Metrics) -> None:
    settings = gate.settings

    @app.post("/v1/sessions", status_code=201)
    async def create_session(who: str = Depends(owner)) -> dict[str, Any]:
        if folders.live_for(who) >= settings.max_sessions_per_token:
            raise _too_many(f"{settings.max_sessions_per_token} sessions are live for this token; delete one")
        try:
            return _describe(folders.new_session(who, settings.store))
        except SessionError as exc:
            raise _too_many(str(exc)) from exc

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return _describe(_owned(folders, who, session_id))

    @app.post("/v1/sessions/{session_id}/execute")
    async def execute_in_session(session_id: str, body: SessionExecuteBody, stream: bool = False,
                                 who: str = Depends(owner)) -> Any:
        """Run a cell in the session (state kept); ?stream=true for server-sent events."""
        session = _owned(folders, who, session_id)

        def render(on_output: Any = None) -> dict[str, Any]:
            result = session.run(body.code, timeout=folders.capped(body.timeout), on_output=on_output)
            metrics.record("session", result)
            return public(result)

        return await gate.respond(who, render, session.interrupt, stream)

    @app.delete("/v1/sessions/{session_id}", status_code=204, response_class=Response)
    async def delete_session(session_id: str, who: str = Depends(owner)) -> Response:
        _owned(folders, who, session_id)
        await gate.io(who, folders.delete_session, session_id)
        return Response(status_code=204)


def _owned(folders: Tenants, who: str, session_id: str) -> Session:
    session = folders.session(who, session_id)
    if session is None:
        raise HTTPException(404, "no such session")
    return session


def _file_routes(app: FastAPI, folders: Tenants, gate: _Gate) -> None:
    cap = parse_size(folders.config.max_data)

    @app.get("/v1/sessions/{session_id}/files")
    async def list_files(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        session = _owned(folders, who, session_id)
        found = await gate.io(who, session.files)
        return {"files": [{"name": f.name, "size": f.size, "mime": f.mime, "sha256": f.sha256,
                           "url": RouteStore.url(f"/v1/sessions/{session.id}", "files", f.name)} for f in found]}

    @app.put("/v1/sessions/{session_id}/files/{name:path}", status_code=201)
    async def put_file(session_id: str, name: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        session = _owned(folders, who, session_id)
        content = await request.body()  # the gateway stops it at --max-body
        try:
            path = await gate.io(who, session.upload, content, name)
        except HTTPException as exc:
            raise HTTPException(400 if exc.status_code == 404 else exc.status_code, exc.detail) from exc
        return {"path": path, "size": len(content)}

    @app.get("/v1/sessions/{session_id}/files/{name:path}")
    async def get_file(session_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        session = _owned(folders, who, session_id)  # /mnt/data as it is now, like the listing
        return await _download(gate, who, lambda: session.open_file(name, max_bytes=cap))

    @app.get("/v1/sessions/{session_id}/images/{name}")
    async def get_session_image(session_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.session_folder(_owned(folders, who, session_id))
        return await _download_from(gate, who, folder / "images" if folder else None, name, 0)

    @app.get("/v1/executions/{execution_id}/files/{name:path}")
    async def get_result_file(execution_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.result_folder(who, execution_id)
        return await _download_from(gate, who, folder / "data" if folder else None, name, cap)

    @app.get("/v1/executions/{execution_id}/images/{name}")
    async def get_result_image(execution_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.result_folder(who, execution_id)
        return await _download_from(gate, who, folder / "images" if folder else None, name, 0)


async def _download_from(gate: _Gate, who: str, folder: Path | None, name: str, cap: int) -> StreamingResponse:
    if folder is None:
        raise HTTPException(404, "no such file")
    return await _download(gate, who, lambda: artifacts.open_stream(folder, name, max_bytes=cap))


async def _download(gate: _Gate, who: str, opener: Callable[[], tuple[int, artifacts.FileChunks]]) -> StreamingResponse:
    """Stream a regular file in chunks on the token's I/O threads (never loaded whole)."""
    _, chunks = await gate.io(who, opener)

    async def body() -> AsyncIterator[bytes]:
        try:
            while (chunk := await gate.io(who, next, chunks, None)) is not None:
                yield chunk
        finally:
            _close(chunks)

    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"Content-Disposition": "attachment", "X-Content-Type-Options": "nosniff"})


def _close(chunks: Iterator[bytes]) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        close()


def _describe(session: Session) -> dict[str, Any]:
    idle = time.monotonic() - session.last_activity
    return {"id": session.id, "status": session.status, "idle_s": round(idle, 3),
            "cells": len(session.notebook.cells)}


def _frame(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _produce(start: Callable[[Any], Any], on_output: Any, queue: asyncio.Queue[tuple[str, Any]]) -> None:
    """Run the execution and put exactly one final event: ``result``, or ``error`` whatever went wrong."""
    try:
        event: tuple[str, Any] = ("result", await start(on_output))
    except HTTPException as exc:
        event = ("error", {"status": exc.status_code, "detail": exc.detail})
    except Exception:
        log.exception("a streamed execution failed")
        event = ("error", {"status": 500, "detail": "nbexec failed to run this; see the server's log"})
    await queue.put(event)


async def _interrupt_until_done(task: asyncio.Task[None], interrupt: Callable[[], None]) -> None:
    """The client left: interrupt the run (again each second, in case the cell had not started yet)."""
    while not task.done():
        with contextlib.suppress(Exception):
            interrupt()
        await asyncio.wait({task}, timeout=1.0)


def _stream(start: Callable[[Any], Any], interrupt: Callable[[], None], keepalive: float,
            background: set[asyncio.Task[None]]) -> StreamingResponse:
    """Server-sent events: one `output` event per output as the cell runs, then `result` or `error`; comments
    keep a quiet stream alive, and a client that leaves interrupts the run."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_output(cell_index: int, output: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("output", {"cell_index": cell_index, **dict(output)}))

    async def events() -> AsyncIterator[bytes]:
        task = asyncio.create_task(_produce(start, on_output, queue))
        finished = False
        try:
            while not finished:
                try:
                    kind, data = await asyncio.wait_for(queue.get(), keepalive)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                finished = kind in ("result", "error")
                yield _frame(kind, data)
        finally:
            if not finished:
                watcher = asyncio.ensure_future(_interrupt_until_done(task, interrupt))
                background.add(watcher)
                watcher.add_done_callback(background.discard)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})
