"""The code interpreter of the E2B door (port 49999): POST /execute answers JSON lines as the cell runs (stdout,
stderr, results, the error, the execution count, the end); /contexts makes, lists, restarts and removes contexts
(`contexts`: more kernels in the sandbox).

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
from . import contexts, wire
from .boxes import Box
from .contexts import Ended
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


def final_lines(ended: Ended, error_sent: bool) -> list[dict[str, Any]]:
    """What ends a run: its error when none was streamed (a time limit, a lost kernel: a failure is never
    silent), the execution count, the end marker."""
    found: list[dict[str, Any]] = []
    error = ended.error
    if error is not None and not error_sent:
        found.append(_error(error.ename or error.kind, error.evalue, error.traceback))
    if ended.execution_count is not None:
        found.append({"type": "number_of_executions", "execution_count": ended.execution_count})
    found.append({"type": "end_of_execution"})
    return found


def ended_of(result: ExecutionResult) -> Ended:
    count = (result.notebook.get("cells") or [{}])[-1].get("execution_count")
    return Ended(result.error, count if isinstance(count, int) else None)


def _encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


async def route(control: Control, box: Box, request: Request, path: str) -> Response:
    """Dispatch a call to port 49999."""
    method = request.method
    if path == "execute" and method == "POST":
        return await execute(control, box, request)
    if path == "contexts" and method == "GET":
        return JSONResponse(contexts.listed(box))
    if path == "contexts" and method == "POST":
        body = wire.parse_json(await request.body(), limit=control.settings.max_body)
        said = body.get("language") or box.session.config.language
        language = contexts.language_of(box, said)
        made = await control.io(box.owner, contexts.create, box, language, said, body.get("cwd"))
        return JSONResponse(made.described())
    if path.startswith("contexts/"):
        return await _context_call(control, box, method, *path[len("contexts/"):].partition("/")[::2])
    if path == "health":
        return Response(status_code=204)
    raise E2bError(404, f"no route {method} /{path[:64]} on the code interpreter")


async def _context_call(control: Control, box: Box, method: str, context_id: str, action: str) -> Response:
    """Restart or remove a context; the sandbox's own kernel restarts, and stays."""
    if context_id == contexts.own(box)["id"]:
        if action == "restart" and method == "POST":
            await control.io(box.owner, box.session.restart)
            return Response(status_code=204)
        if not action and method == "DELETE":
            raise E2bError(400, "the sandbox's own context cannot be removed")
    else:
        context = contexts.find(box, context_id)
        if context is None:
            raise E2bError(404, f"context {context_id[:64]!r} not found (contexts end when the sandbox pauses)")
        if action == "restart" and method == "POST":
            await control.io(box.owner, contexts.restart, box, context)
            return Response(status_code=204)
        if not action and method == "DELETE":
            await control.io(box.owner, contexts.remove, box, context_id)
            return Response(status_code=204)
    raise E2bError(404, f"no route {method} /contexts/{context_id[:64]}/{action[:64]} on the code interpreter")


def _checked(box: Box, body: dict[str, Any]) -> tuple[str, Any, Any]:
    """The code, and the context it names: (code, context_id or None, language or None)."""
    code, language, context_id = body.get("code"), body.get("language"), body.get("context_id")
    if not isinstance(code, str):
        raise E2bError(400, "code must be a string")
    if language and context_id:
        raise E2bError(400, "give language or context_id, not both")
    if context_id is not None and not isinstance(context_id, str):
        raise E2bError(400, "context_id must be a string")
    return code, context_id or None, language or None


def _target(box: Box, context_id: str | None, language: Any) -> contexts.Context | None:
    """The context a run goes to (None: the sandbox's own kernel); a language's default one is started here."""
    own = contexts.own(box)["id"]
    if context_id is not None and context_id != own:
        found = contexts.find(box, context_id)
        if found is None:
            raise E2bError(404, f"context {context_id[:64]!r} not found (contexts end when the sandbox pauses)")
        return found
    if language is None:
        return None
    name = contexts.language_of(box, language)
    return None if name == box.session.config.language else contexts.default(box, name, language)


def env_vars(body: dict[str, Any], language: str) -> dict[str, str]:
    """A call's ``env_vars`` (Python kernels: set in the kernel for that call only)."""
    found = wire.strings(body.get("env_vars"), "env_vars", count=wire.MAX_ENVS, size=wire.MAX_ENV_BYTES,
                         names=wire.ENV_NAME)
    if found and language != "python":
        raise E2bError(400, "per-call env_vars are offered in Python contexts; give envs when the sandbox is "
                            "created")
    return found


def env_code(envs: dict[str, str]) -> tuple[str, str] | None:
    """The hidden code that sets ``envs`` in a Python kernel, and the code that puts back what was there."""
    return (SET_ENV % (json.dumps(list(envs)), json.dumps(envs)), RESTORE_ENV) if envs else None


SET_ENV = ("import os as _nbexec_os, json as _nbexec_json\n_nbexec_saved = {k: _nbexec_os.environ.get(k) for k in "
           "_nbexec_json.loads(%r)}\n_nbexec_os.environ.update(_nbexec_json.loads(%r))")
RESTORE_ENV = ("for _k, _v in _nbexec_saved.items():\n    _nbexec_os.environ.pop(_k, None) if _v is None else "
               "_nbexec_os.environ.__setitem__(_k, _v)\ndel _nbexec_saved, _k, _v")


def run_with_env(box: Box, code: str, envs: dict[str, str], timeout: float, callback: Any) -> ExecutionResult:
    """The cell with ``envs`` set in the kernel before it and restored after it, nothing run in between."""
    session = box.session
    if not envs:
        return session.run(code, timeout=timeout, on_output=callback)
    before, after = env_code(envs) or ("", "")
    with session._held():
        handle = session._started_handle()
        if handle.run_hidden(before, min(timeout, 10.0)) is None:
            raise SessionError("the kernel did not take the call's env_vars in time")
        try:
            return session.run(code, timeout=timeout, on_output=callback)
        finally:
            handle.run_hidden(after, 10.0)


async def execute(control: Control, box: Box, request: Request) -> StreamingResponse:
    body = wire.parse_json(await request.body(), limit=control.settings.max_body)
    code, context_id, language = _checked(box, body)
    env_vars(body, "python")  # its shape, before anything starts
    target = await control.io(box.owner, _target, box, context_id, language)
    envs = env_vars(body, box.session.config.language if target is None else target.language)
    runs, session = control.runs, box.session
    try:
        runs.take_slot(box.owner)  # before the answer starts, so a refusal is a real 429
    except HTTPException as exc:
        raise E2bError(429, str(exc.detail), after=5) from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[dict[str, Any]] | None] = asyncio.Queue()

    def on_output(_: int, output: Any) -> None:  # the run's worker thread
        loop.call_soon_threadsafe(queue.put_nowait, lines_of(output))

    def render(callback: Any) -> Ended:
        limit = control.folders.capped(None)
        if target is not None:
            return contexts.run(box, target, code, limit, callback, env_code(envs))
        return ended_of(run_with_env(box, code, envs, limit, callback))

    task = asyncio.ensure_future(runs.run(box.owner, render, on_output, slot_taken=True))
    task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
    interrupt = session.interrupt if target is None else target.kernel.interrupt
    return StreamingResponse(_lines(task, queue, interrupt, control), media_type="application/json")


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
