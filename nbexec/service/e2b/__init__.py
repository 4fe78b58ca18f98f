"""`nbexec serve` as an E2B-compatible server: E2B's SDKs, unmodified, with ``E2B_API_URL=<server>/e2b``,
``E2B_SANDBOX_URL=<server>/e2b/sandbox`` and ``E2B_API_KEY=<an nbexec API token>``.

Two doors. The control plane (/e2b/..., `control`) takes the API token from ``X-API-KEY`` (the gateway checks it
as it checks a bearer token). The data plane (/e2b/sandbox/..., `dataplane`) names its sandbox and port in the
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers and takes that sandbox's own access token, never the API key:
the gateway lets it through unauthenticated and the door judges the token against the sandbox the request names.
Every answer is in E2B's shapes (docs/design/e2b-server.md), and the differences are in docs/e2b.md."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runs import Runs
from ..schemas import refused
from ..settings import ServerSettings
from ..tenants import Tenants
from . import control, dataplane
from .boxes import Boxes
from .connect import ConnectError
from .wire import E2bError

__all__ = ["add_routes"]
PREFIX = "/e2b/"


def _answer(exc: E2bError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers())


def add_routes(app: FastAPI, folders: Tenants, runs: Runs, settings: ServerSettings) -> control.Control:
    """The door's routes and its error shapes (only under /e2b: every other route keeps nbexec's own)."""
    doors = control.Control(folders, runs, settings, Boxes())
    control.add_routes(app, doors)
    dataplane.add_routes(app, doors)

    async def e2b_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, E2bError)
        return _answer(exc)

    async def http_error(request: Request, exc: Exception) -> Any:
        if request.url.path.startswith(PREFIX) and isinstance(exc, StarletteHTTPException):
            return _answer(E2bError(exc.status_code, str(exc.detail)))
        return await http_exception_handler(request, exc)  # type: ignore[arg-type]

    async def invalid(request: Request, exc: Exception) -> Any:
        if request.url.path.startswith(PREFIX):
            return _answer(E2bError(400, "the request does not match the API"))
        assert isinstance(exc, RequestValidationError)
        return JSONResponse(refused(exc.errors()), status_code=422)  # never the value sent back (a NaN: a 500)

    async def connect_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ConnectError)
        return exc.unary()

    app.add_exception_handler(E2bError, e2b_error)
    app.add_exception_handler(ConnectError, connect_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    return doors
