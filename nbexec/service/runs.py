"""Who a request is, and where its work runs: the owner the gateway authenticated, per-token execution slots, the
token's own worker threads, and nbexec errors mapped to HTTP ones."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Annotated, Any

import pydantic_core
from fastapi import Depends, HTTPException, Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import Receive

from nbexec import egress, notebook
from nbexec.config import SandboxConfig
from nbexec.engine.session import Session
from nbexec.errors import (
    CellTooLargeError,
    ClusterFullError,
    ConfigError,
    DiskSpaceError,
    DockerError,
    FileTooLargeError,
    FileTransferError,
    NbexecError,
    NodeUnavailableError,
    NotOfferedError,
    SessionError,
    ShuttingDownError,
)
from nbexec.notebook import verbatim
from nbexec.result import ExecutionResult

from . import streaming
from .gateway import FOR_KEY, OWNER_KEY
from .identity import View
from .schemas import SessionExecuteBody
from .settings import ServerSettings
from .tenants import Tenants

log = logging.getLogger(__name__)
Render = Callable[[Any], Any]  # runs in a worker thread: (on_output or None) -> the answer (a public result)

# Declares the scheme in the OpenAPI document only: the gateway has checked the token before any body was read.
bearer = HTTPBearer(auto_error=False, description="One of the server's API tokens (--token-file, NBEXEC_API_TOKENS).")


def owner(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> str:
    """Who sent the request, as the gateway authenticated it."""
    who = request.scope.get("state", {}).get(OWNER_KEY)
    if not who:  # unreachable behind the gateway: refuse rather than serve anonymously
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
    return str(who)


def view(request: Request) -> View:
    """How this call's caller sees ids: as a router's client (a signed call) or as the node's own."""
    return View(request.scope.get("state", {}).get(FOR_KEY), request.app.state.instance)


Shown = Annotated[View, Depends(view)]  # a route's parameter: how its caller sees ids


def too_many(message: str) -> HTTPException:
    return HTTPException(429, message, headers={"Retry-After": "5"})


def http_error(exc: NbexecError) -> HTTPException:
    if isinstance(exc, (FileTooLargeError, CellTooLargeError)):
        return HTTPException(413, str(exc))
    if isinstance(exc, DiskSpaceError):  # the reason without host paths; the log has the rest
        return HTTPException(503, exc.reason, headers={"Retry-After": "30"})
    if isinstance(exc, (FileTransferError, NotOfferedError)):  # the request asked for what this run cannot do
        return HTTPException(400, str(exc))
    if isinstance(exc, ShuttingDownError):  # not this request's fault: another node, or this one later, takes it
        return HTTPException(503, str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, SessionError):
        return HTTPException(409, str(exc))
    if isinstance(exc, DockerError):
        return HTTPException(503, "the sandbox engine failed; try again later")
    if isinstance(exc, ClusterFullError):  # nothing ran; a retry may succeed (its text names nodes alone)
        return HTTPException(503, str(exc), headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
    if isinstance(exc, NodeUnavailableError):  # nothing ran; its text may hold the nodes' addresses: the log has it
        log.warning("no node could take a call: %s", exc)
        return HTTPException(503, "no node of this server's cluster can take the call now; try again later",
                             headers={"Retry-After": "5"})
    return HTTPException(500, "nbexec failed to run this; see the server's log")


class Runs:
    """Per-token execution slots and worker threads."""

    def __init__(self, folders: Tenants, settings: ServerSettings) -> None:
        self.folders = folders
        self.settings = settings
        self.running: dict[str, int] = {}

    def take_slot(self, who: str) -> None:
        if self.running.get(who, 0) >= self.settings.max_running_per_token:
            raise too_many(f"{self.settings.max_running_per_token} executions already running for this token")
        self.running[who] = self.running.get(who, 0) + 1

    def free_slot(self, who: str) -> None:
        self.running[who] -= 1

    async def run(self, who: str, render: Render, on_output: Any = None, *, slot_taken: bool = False,
                  frees_slot: bool = True) -> Any:
        """Run ``render`` on the token's own run threads inside its slot, mapping nbexec errors to HTTP ones.

        The slot is held until the thread is done, even when the client leaves earlier. ``frees_slot`` False: the
        caller holds it on after (a batch's worker, for the sandbox it keeps)."""
        if not slot_taken:
            self.take_slot(who)
        loop = asyncio.get_running_loop()
        try:
            future = self.folders.lanes(who).runs.submit(render, on_output)
        except RuntimeError:
            if frees_slot:
                self.free_slot(who)
            raise HTTPException(503, "the server is shutting down") from None
        if frees_slot:
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self.free_slot, who))
        try:
            return await asyncio.wrap_future(future)
        except NbexecError as exc:
            log.warning("execution failed: %s", exc)
            raise http_error(exc) from exc
        except Exception as exc:  # a bug or a broken store: the client gets a plain 500, the log the details
            log.exception("execution failed unexpectedly")
            raise HTTPException(500, "nbexec failed to run this; see the server's log") from exc

    async def respond(self, who: str, render: Render, interrupt: Callable[[], None], stream: bool,
                      receive: Receive, headers: dict[str, str] | None = None) -> Any:
        """The result, or with ``stream`` a server-sent event stream of the run (with ``headers``, sent before the
        first event). A client that hangs up before the result interrupts the run either way (its answer then
        goes nowhere)."""
        if not stream:
            work = asyncio.ensure_future(self.run(who, render))
            if not await streaming.first_or_gone(work, receive):
                await streaming.interrupt_until_done(work, interrupt)
            return answered(await work)
        self.take_slot(who)  # before the response starts, so a refusal is a real 429
        return streaming.respond(lambda on_output: self.run(who, render, on_output, slot_taken=True), interrupt,
                                 self.settings.keepalive, self.folders.background, headers)

    async def io(self, who: str, func: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file or session work on the token's own I/O threads."""
        try:
            return await asyncio.wrap_future(self.folders.lanes(who).io.submit(func, *args))
        except FileTooLargeError as exc:
            raise HTTPException(413, str(exc)) from exc
        except FileTransferError as exc:
            raise HTTPException(404, str(exc)) from exc
        except NbexecError as exc:
            raise http_error(exc) from exc


def answered(body: Any) -> Any:
    """A result's JSON answer with its display values written as they came (`verbatim`): encoding a deep value
    again cost as much host CPU as parsing it. When it holds what JSON has not (NaN, an infinity), encoded in
    Rust with those as null (the stdlib encoder refuses them: the answer was a 500 and the result lost)."""
    if not isinstance(body, dict):
        return body
    try:
        # Four levels: the outputs, an output, its data, a value.
        text = verbatim.encode(body, levels=4, ensure_ascii=True, finite=True).encode("utf-8")
    except (TypeError, ValueError):
        text = pydantic_core.to_json(body, inf_nan_mode="null")
    return Response(text, media_type="application/json")


def execute(session: Session, body: SessionExecuteBody, timeout: float, on_output: Any = None) -> ExecutionResult:
    """Run a request's ``code`` (one cell) or ``cells`` in ``session``; with ``allow_errors`` every cell runs and
    each error is kept, and the result still fails (`Session.run_notebook`)."""
    nb = notebook.build_cells(body.sources(), session.config.language)
    return session.run_notebook(nb, timeout=timeout, on_output=on_output, packages=body.packages,
                                allow_errors=body.allow_errors)


def chosen(config: SandboxConfig, asked: str | None, language: str | None = None) -> SandboxConfig:
    """The policy with the image and language a body asked for; 400 for one the operator does not allow
    (NBEXEC_IMAGES, NBEXEC_LANGUAGES)."""
    try:
        return config.choose_image(asked).offer_language(language)
    except ConfigError as exc:
        raise HTTPException(400, str(exc)) from None


def same_language(config: SandboxConfig, asked: str | None) -> None:
    """400 when a session's request names a language other than the session's (it keeps the one it started with)."""
    if asked is not None and chosen(config, None, asked).language != config.language:
        raise HTTPException(400, f"this session runs {config.language} code, the language it started with; omit "
                                 "language, or start another session")


def plain_restore(image: str | None, language: str | None) -> None:
    """400 when a restore from a snapshot also names an image or a language (it runs in the snapshot's own)."""
    if image is not None or language is not None:
        raise HTTPException(400, "from_snapshot restores in the snapshot's own image and language: omit image and "
                                 "language")


async def apply_egress(runs: Runs, who: str, change: Callable[[], None]) -> None:
    """Make a checked change on the client's I/O threads; 400 when the sandbox refuses it (too many rules)."""
    def applied() -> str | None:
        try:
            change()
        except ConfigError as exc:
            return str(exc)
        return None
    problem = await runs.io(who, applied)
    if problem is not None:
        raise HTTPException(400, problem)


def egress_change(config: SandboxConfig, allow: list[str], deny: list[str], *, widen: bool) -> None:
    """400 for a change of a running allowlist the policy refuses (`nbexec.egress.check_change`), before it is made."""
    try:
        egress.check_change(config.network, config.allowed_hosts, allow, deny, widen=widen)
    except ConfigError as exc:
        raise HTTPException(400, str(exc)) from None
