"""The code interpreter of the E2B door (port 49999): POST /execute answers JSON lines as the cell runs (stdout,
stderr, results, the error, the execution count, the end), and /contexts lists the sandbox's one context.

A run here is a cell of the sandbox's session, so every budget of a session run holds (the output allowance, the
operator's time limit, the token's slots). The SDKs have no interrupt call: a client that hangs up (its own time
limit) interrupts the cell, as E2B's server does. A keepalive line goes out every few seconds of silence, so a
client that is gone is noticed while the cell is quiet."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nbexec.errors import SessionError
from nbexec.result import ExecutionResult

from .. import streaming
from . import wire
from .boxes import Box
from .control import Control
from .wire import E2bError

KEEPALIVE = 5.0  # seconds of silence before a keepalive line
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript", "e2b/data": "data"}
CWD = "/mnt/data"  # the kernel's working folder: the sandbox's capped data filesystem


def _text(value: Any) -> Any:
    return "".join(value) if isinstance(value, list) else value


def lines_of(output: Any) -> list[dict[str, Any]]:
    """The E2B lines of one notebook output (a stream, a result, a display, an error)."""
    kind, now = output.get("output_type"), wire.rfc3339(time.time())
    if kind == "stream":
        return [{"type": "stderr" if output.get("name") == "stderr" else "stdout",
                 "text": _text(output.get("text", "")), "timestamp": now}]
    if kind in ("execute_result", "display_data"):
        found: dict[str, Any] = {"type": "result", "is_main_result": kind == "execute_result"}
        extra: dict[str, Any] = {}
        for mime, value in dict(output.get("data") or {}).items():
            if mime in MIME:
                found[MIME[mime]] = _text(value)
            else:
                extra[mime] = _text(value)
        if extra:
            found["extra"] = extra
        return [found]
    if kind == "error":
        return [_error(output.get("ename", ""), output.get("evalue", ""), output.get("traceback") or [])]
    return []


def _error(name: str, value: str, traceback: Any) -> dict[str, Any]:
    return {"type": "error", "name": str(name), "value": str(value),
            "traceback": "\n".join(str(line) for line in traceback)}


def final_lines(result: ExecutionResult, error_sent: bool) -> list[dict[str, Any]]:
    """What ends a run: its error when none was streamed (a time limit, a lost kernel: a failure is never
    silent), the execution count, the end marker."""
    found: list[dict[str, Any]] = []
    if result.error is not None and not error_sent:
        found.append(_error(result.error.ename or result.error.kind, result.error.evalue, result.error.traceback))
    cells = result.notebook.get("cells") or [{}]
    count = cells[-1].get("execution_count")
    if isinstance(count, int):
        found.append({"type": "number_of_executions", "execution_count": count})
    found.append({"type": "end_of_execution"})
    return found


def _encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def contexts(box: Box) -> list[dict[str, str]]:
    language = box.session.config.language
    return [{"id": language, "language": language, "cwd": CWD}]


async def route(control: Control, box: Box, request: Request, path: str) -> Response:
    """Dispatch a call to port 49999."""
    method = request.method
    if path == "execute" and method == "POST":
        return await execute(control, box, request)
    if path == "contexts" and method == "GET":
        return JSONResponse(contexts(box))
    if path == "contexts" and method == "POST":
        raise E2bError(501, "nbexec runs one context per sandbox (its language's default); create_code_context is "
                            "not offered: use the default context, or another sandbox for separate state")
    if path.startswith("contexts/"):
        context_id, _, action = path[len("contexts/"):].partition("/")
        if context_id not in {c["id"] for c in contexts(box)}:
            raise E2bError(404, f"context {context_id[:64]!r} not found")
        if action == "restart" and method == "POST":
            await control.io(box.owner, box.session.restart)
            return Response(status_code=204)
        if not action and method == "DELETE":
            raise E2bError(400, "the default context cannot be removed")
    if path == "health":
        return Response(status_code=204)
    raise E2bError(404, f"no route {method} /{path[:64]} on the code interpreter")


def _checked(box: Box, body: dict[str, Any]) -> str:
    code, language, context_id = body.get("code"), body.get("language"), body.get("context_id")
    if not isinstance(code, str):
        raise E2bError(400, "code must be a string")
    if language and context_id:
        raise E2bError(400, "give language or context_id, not both")
    own = box.session.config.language
    if language not in (None, own) or context_id not in (None, own):
        raise E2bError(400, f"this sandbox runs {own} code (its one context is {own!r})")
    return code


def env_vars(box: Box, body: dict[str, Any]) -> dict[str, str]:
    """A call's ``env_vars`` (Python sandboxes: set in the kernel for that call only)."""
    found = wire.strings(body.get("env_vars"), "env_vars", count=wire.MAX_ENVS, size=wire.MAX_ENV_BYTES,
                         names=wire.ENV_NAME)
    if found and box.session.config.language != "python":
        raise E2bError(400, "per-call env_vars are offered in Python sandboxes; give envs when the sandbox is "
                            "created")
    return found


SET_ENV = ("import os as _nbexec_os, json as _nbexec_json\n_nbexec_saved = {k: _nbexec_os.environ.get(k) for k in "
           "_nbexec_json.loads(%r)}\n_nbexec_os.environ.update(_nbexec_json.loads(%r))")
RESTORE_ENV = ("for _k, _v in _nbexec_saved.items():\n    _nbexec_os.environ.pop(_k, None) if _v is None else "
               "_nbexec_os.environ.__setitem__(_k, _v)\ndel _nbexec_saved, _k, _v")


def run_with_env(box: Box, code: str, envs: dict[str, str], timeout: float, callback: Any) -> ExecutionResult:
    """The cell with ``envs`` set in the kernel before it and restored after it, nothing run in between."""
    session = box.session
    if not envs:
        return session.run(code, timeout=timeout, on_output=callback)
    with session.held():
        handle = session.started_handle()
        text = json.dumps(envs)
        if handle.run_hidden(SET_ENV % (json.dumps(list(envs)), text), min(timeout, 10.0)) is None:
            raise SessionError("the kernel did not take the call's env_vars in time")
        try:
            return session.run(code, timeout=timeout, on_output=callback)
        finally:
            handle.run_hidden(RESTORE_ENV, 10.0)


async def execute(control: Control, box: Box, request: Request) -> StreamingResponse:
    body = wire.parse_json(await request.body(), limit=control.settings.max_body)
    code, envs = _checked(box, body), env_vars(box, body)
    runs, session = control.runs, box.session
    try:
        runs.take_slot(box.owner)  # before the answer starts, so a refusal is a real 429
    except HTTPException as exc:
        raise E2bError(429, str(exc.detail), after=5) from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[dict[str, Any]] | None] = asyncio.Queue()

    def on_output(_: int, output: Any) -> None:  # the run's worker thread
        loop.call_soon_threadsafe(queue.put_nowait, lines_of(output))

    def render(callback: Any) -> ExecutionResult:
        return run_with_env(box, code, envs, control.folders.capped(None), callback)

    task = asyncio.ensure_future(runs.run(box.owner, render, on_output, slot_taken=True))
    task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
    return StreamingResponse(_lines(task, queue, session.interrupt, control), media_type="application/json")


async def _lines(task: asyncio.Future[Any], queue: asyncio.Queue[list[dict[str, Any]] | None],
                 interrupt: Any, control: Control) -> AsyncIterator[bytes]:
    error_sent, done = False, False
    try:
        while True:
            try:
                found = await asyncio.wait_for(queue.get(), KEEPALIVE)
            except asyncio.TimeoutError:
                yield _encode({"type": "keepalive"})
                continue
            if found is None:
                break
            for line in found:
                error_sent |= line["type"] == "error"
                yield _encode(line)
        done = True
        try:
            result = task.result()
        except HTTPException as exc:  # refused or failed after the answer began: said as the run's error
            yield _encode(_error("NbexecError", str(exc.detail), []))
            yield _encode({"type": "end_of_execution"})
            return
        for line in final_lines(result, error_sent):
            yield _encode(line)
    finally:
        if not done:  # the client left: interrupt the cell until it ends (its slot is freed then)
            watcher = asyncio.ensure_future(streaming.interrupt_until_done(task, interrupt))
            control.folders.background.add(watcher)
            watcher.add_done_callback(control.folders.background.discard)
