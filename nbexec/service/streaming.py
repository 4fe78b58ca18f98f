"""Server-sent events for a run (sse-starlette): one `output` event per output as the cell runs, then exactly one
`result` or `error`; keep-alive comments on a quiet stream, and a client that leaves interrupts the run. Also how
any call notices that its client hung up (``first_or_gone``), streamed or not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import HTTPException
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive

log = logging.getLogger(__name__)
Start = Callable[[Any], Any]  # (on_output) -> awaitable of the public result
FINAL = ("result", "error")


async def _produce(start: Start, on_output: Any, queue: asyncio.Queue[tuple[str, Any]]) -> None:
    """Run the execution and put exactly one final event: ``result``, or ``error`` whatever went wrong."""
    try:
        event: tuple[str, Any] = ("result", await start(on_output))
    except HTTPException as exc:
        event = ("error", {"status": exc.status_code, "detail": exc.detail})
    except Exception:
        log.exception("a streamed execution failed")
        event = ("error", {"status": 500, "detail": "nbexec failed to run this; see the server's log"})
    await queue.put(event)


async def disconnected(receive: Receive) -> None:
    """Return once the client has hung up (call it after the request's body was read)."""
    while (await receive())["type"] != "http.disconnect":
        continue


async def first_or_gone(task: asyncio.Future[Any], receive: Receive) -> bool:
    """Wait for ``task`` or for the client to hang up, whichever comes first: True when the task finished. The
    task is left running either way."""
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return task.done()


async def interrupt_until_done(task: asyncio.Future[Any], interrupt: Callable[[], None]) -> None:
    """The client left: interrupt the run (again each second, in case the cell had not started yet)."""
    while not task.done():
        with contextlib.suppress(Exception):
            interrupt()
        await asyncio.wait({task}, timeout=1.0)


def _event(kind: str, data: Any) -> ServerSentEvent:
    return ServerSentEvent(event=kind, data=json.dumps(data, ensure_ascii=False), sep="\n")


def respond(start: Start, interrupt: Callable[[], None], keepalive: float,
            background: set[asyncio.Task[None]], headers: dict[str, str] | None = None) -> EventSourceResponse:
    """Stream the run ``start`` makes. When the client goes, sse-starlette cancels the events; the run is then
    interrupted from a task kept in ``background`` until it ends (its execution slot is freed only then)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_output(cell_index: int, output: Any) -> None:  # called on the run's worker thread
        loop.call_soon_threadsafe(queue.put_nowait, ("output", {"cell_index": cell_index, **dict(output)}))

    async def events() -> AsyncIterator[ServerSentEvent]:
        task = asyncio.create_task(_produce(start, on_output, queue))
        kind = ""
        try:
            while kind not in FINAL:
                kind, data = await queue.get()
                yield _event(kind, data)
        finally:
            if kind not in FINAL:
                watcher = asyncio.ensure_future(interrupt_until_done(task, interrupt))
                background.add(watcher)
                watcher.add_done_callback(background.discard)

    return EventSourceResponse(events(), ping=keepalive, sep="\n", headers=headers,  # no-store by default
                               ping_message_factory=lambda: ServerSentEvent(comment="keep-alive", sep="\n"))
