"""The E2B door's data plane (/e2b/sandbox/..., E2B_SANDBOX_URL).

Every in-sandbox call names its sandbox in ``E2b-Sandbox-Id`` and its port in ``E2b-Sandbox-Port``. It carries
that sandbox's access token (``X-Access-Token``, or ``E2B-Traffic-Access-Token`` for the context routes).

Anyone holding one of a sandbox's two tokens can reach it. Tokens leak into logs and agents more easily than an
API key, so a token opens its own sandbox only. An unknown or ended sandbox is 502 "The sandbox was not found",
which the SDKs read as not running. Another sandbox's token is 401. A paused sandbox is 409 until resumed, or is
resumed here when it was made with auto-resume. Other ports than the interpreter's and envd's go to a server the
code started (`ports`); unless the operator turned the relay on, that is 502 "port is not open". The owner's
budgets, slots and threads apply to every call."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import envd, envfiles, interpreter, ports, wire
from .boxes import INTERPRETER_PORT, SANDBOX_PORT, Box
from .control import Control
from .wire import NOT_FOUND, E2bError

ROUTE = "/e2b/sandbox/{path:path}"


def _header(request: Request, name: str) -> str | None:
    value = request.headers.get(name)
    return value if value is None or len(value) <= 512 else None


async def resolve(control: Control, request: Request) -> tuple[Box, int]:
    """The sandbox and port a request names, once its token is that sandbox's own."""
    sandbox_id, port = _header(request, "e2b-sandbox-id") or "", _header(request, "e2b-sandbox-port") or ""
    token = _header(request, "x-access-token") or _header(request, "e2b-traffic-access-token")
    if not wire.digits(port, 5):
        raise E2bError(400, "E2b-Sandbox-Port must name a port")
    box = control.boxes.by_token(sandbox_id, token)
    if box is None:
        if not any(b.id == sandbox_id for b in control.boxes.all()):
            raise E2bError(502, NOT_FOUND)
        raise E2bError(401, "missing or wrong access token for this sandbox")
    if box.paused:
        if not box.auto_resume:
            raise E2bError(409, "the sandbox is paused: connect to it to resume it")

        def resume() -> None:
            with box.lock:
                if box.paused:
                    box.session.start()
                    box.resumed()
        await control.io(box.owner, resume)
    return box, int(port)


def add_routes(app: FastAPI, control: Control) -> None:
    @app.api_route(ROUTE, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def data(path: str, request: Request) -> Response:
        box, port = await resolve(control, request)
        if port == INTERPRETER_PORT:
            return await interpreter.route(control, box, request, path)
        if port == SANDBOX_PORT:
            if path == "health":
                return Response(status_code=204)
            if path.startswith(envd.PACKAGE) and request.method == "POST":
                return await envd.route(control, box, request, path[len(envd.PACKAGE):])
            if path.startswith(envfiles.PACKAGE) and request.method == "POST":
                return await envfiles.route(control, box, request, path[len(envfiles.PACKAGE):])
            if path == "files":
                return await envfiles.files(control, box, request)
            raise E2bError(404, f"no route {request.method} /{path[:64]} in this sandbox")
        return await ports.route(control, box, request, port)  # a server the code started: off by default
