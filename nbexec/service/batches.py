"""Batches over HTTP: many one-shot executions in one call, for evaluation and training sweeps.

``POST /v1/batches`` takes a JSON array of items, each a ``POST /v1/execute`` body, and answers 202 with the
batch's id; the items run in fresh sandboxes on the token's own run slots (as its /v1/execute calls do), and each
result is written to the batch's folder as it ends. ``GET /v1/batches/{id}`` gives the counts and a page of
results from a cursor; ``GET /v1/batches/{id}/events`` streams them as server-sent events; ``DELETE`` cancels
(running items are interrupted, their sandboxes stopped, the batch and its files deleted). A batch belongs to its
token: any other token gets 404. Caps per token: batches kept and items queued (429 with Retry-After), items per
batch and the body's bytes (413); the body is read item by item, so neither its size nor its nesting costs more
than one item at a time. With a state folder, batches outlive a restart of the node (`batchrecord.load`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from . import batchbody, batchrecord, judgeitems, streaming
from .batchbody import Item
from .batchrecord import FINAL, Batch
from .batchreuse import MODES, Held
from .identity import View
from .judgeitems import JudgeBody
from .runs import Runs, Shown, chosen, owner
from .runs import execute as run_body
from .tenants import Tenants, public

log = logging.getLogger(__name__)
REUSE_HELP = ("batch: the batch's judge items share a few sandboxes, reset between two (docs/judging.md says what a "
              "reset does not undo); absent: a sandbox per item")
CANCEL_WAIT = 60.0  # seconds DELETE waits for interrupted items beyond the sandbox's interrupt grace


class Batches:
    """The batches of every token of this node (changed on the event loop only)."""

    def __init__(self, folders: Tenants, runs: Runs) -> None:
        self.folders = folders
        self.runs = runs
        self.settings = runs.settings
        self.kept: dict[str, Batch] = {}
        self.closing = False

    async def resume(self, shown: View) -> None:
        """At start with a state folder: find the batches the node's last life left, and run what they had not."""
        root = self.folders.root
        if self.folders.state_dir is None or root is None:
            return
        names = [name for name in await asyncio.to_thread(os.listdir, root) if name.startswith("batch-")]
        for name in names:
            batch = await asyncio.to_thread(batchrecord.load, root / name, shown, self.settings.max_batch_items)
            if batch is None:  # not a batch of this node's: a link goes, never what it points to
                await asyncio.to_thread(batchrecord.remove, root / name)
                continue
            self.kept[batch.id] = batch
            if batch.status in FINAL:
                batch.expires = time.monotonic() + self.folders.result_ttl
            else:
                self.start(batch)

    def shut(self) -> None:
        """At shutdown: stop every batch where it is, without recording its running items as done."""
        self.closing = True
        for batch in self.kept.values():
            if batch.task is not None:
                batch.task.cancel()

    def admit(self, who: str, count: int) -> None:
        """429 with Retry-After when ``who`` keeps too many batches or would queue too many items."""
        mine = [b for b in self.kept.values() if b.owner == who]
        settings = self.settings
        if len(mine) >= settings.max_batches_per_token:
            ends = [b.expires - time.monotonic() for b in mine if b.status in FINAL]
            wait = max(1, math.ceil(min(ends))) if ends else 5
            raise HTTPException(429, f"{settings.max_batches_per_token} batches are kept for this token; delete "
                                     "one or wait", headers={"Retry-After": str(wait)})
        queued = sum(b.queued for b in mine)
        if queued + count > settings.max_batch_items:
            raise HTTPException(429, f"{queued} items are queued for this token and the cap is "
                                     f"{settings.max_batch_items}", headers={"Retry-After": "5"})

    def owned(self, who: str, given: str, shown: Any) -> Batch:
        """``who``'s batch by the id its caller holds; 404 for any other, as for one that does not exist."""
        self.sweep()
        for batch in self.kept.values():
            if batch.owner == who and given in (batch.id, shown.id(batch.id)):
                return batch
        raise HTTPException(404, "no such batch")

    def sweep(self) -> None:
        """Forget batches whose time is up, and delete their folders."""
        now = time.monotonic()
        for batch in [b for b in self.kept.values() if b.expires <= now]:
            self.forget(batch)

    def forget(self, batch: Batch) -> None:
        self.kept.pop(batch.id, None)
        for execution_id in batch.executions:
            self.folders.expire_result(execution_id)
        batchrecord.remove(batch.folder)

    def start(self, batch: Batch) -> None:
        batch.task = asyncio.create_task(self._drive(batch))

    async def _drive(self, batch: Batch) -> None:
        """Start each item when one of the token's run slots is free (with ``reuse``, workers that keep their slot
        and a sandbox run them); end once every started one has ended."""
        running: set[asyncio.Task[None]] = set()
        try:
            items = self._items(batch)
            if batch.reuse is None:
                async for index, body in items:
                    await self._slot(batch.owner)
                    task = asyncio.create_task(self._run_item(batch, index, body))
                    running.add(task)
                    task.add_done_callback(running.discard)
            else:
                turns = asyncio.Lock(), asyncio.Lock()  # one worker reads the next item, one waits for a slot
                workers = min(self.settings.max_running_per_token, batch.total - len(batch.finished))
                running.update(asyncio.create_task(self._worker(batch, items, *turns)) for _ in range(workers))
            if running:
                await asyncio.wait(running)
                ended = [t.exception() for t in running if not t.cancelled()]
                failed = next((exc for exc in ended if exc is not None), None)
                if failed is not None:  # a worker's own fault (reading the record...): the batch failed, not done
                    raise failed
            batch.status = "done"
        except asyncio.CancelledError:
            if self.closing:  # the node stops: with a state folder, the next start runs the rest
                raise
            batch.status = "cancelled"
            if running:
                await streaming.interrupt_until_done(asyncio.gather(*running), batch.interrupt)
            raise
        except Exception:  # nbexec's own fault (the folder removed under it...): end it, so no stream waits forever
            log.exception("batch %s stopped unexpectedly", batch.id)
            batch.status = "failed"
            if running:
                await streaming.interrupt_until_done(asyncio.gather(*running), batch.interrupt)
        finally:
            batch.expires = time.monotonic() + self.folders.result_ttl
            batch.notify()

    async def _items(self, batch: Batch) -> AsyncIterator[tuple[int, Item]]:
        """The batch's items not yet finished, read from its record one at a time; a line tampered with is that
        item's error."""
        index, offset = 0, 0
        while True:
            try:
                line, offset = await asyncio.to_thread(batch.item, offset)
                body = None if line is None or index in batch.finished else batchbody.load(line)
            except (batchrecord.TooLong, ValidationError) as exc:
                offset = exc.next if isinstance(exc, batchrecord.TooLong) else offset
                if index not in batch.finished:
                    await self._record(batch, {"index": index, "error": {
                        "status": 422, "detail": "the item kept for this batch is not a /v1/execute body"}})
                index += 1
                continue
            if line is None:
                return
            if body is not None:  # None: done before the node restarted
                yield index, body
            index += 1

    async def _worker(self, batch: Batch, items: AsyncIterator[tuple[int, Item]], reading: asyncio.Lock,
                      waiting: asyncio.Lock) -> None:
        """With ``reuse``: take a slot, then run items one after another in it with the sandbox kept between them
        (batchreuse.Held); at the end, close that sandbox, then free the slot. Never waits past the batch's end."""
        async with waiting:  # one worker of the batch waits for a slot at a time
            if not await self._slot(batch.owner, batch):
                return
        held = Held(self.folders)
        try:
            while batch.status == "running" and not self.closing:
                async with reading:
                    found = await anext(items, None)
                if found is None:
                    return
                if not isinstance(found[1], JudgeBody):  # an execution makes a sandbox of its own: one at a time
                    await asyncio.to_thread(held.drop)
                await self._run_item(batch, *found, held=held)
        finally:
            try:
                await asyncio.to_thread(held.close)
            finally:
                self.runs.free_slot(batch.owner)

    async def _slot(self, who: str, batch: Batch | None = None) -> bool:
        """Wait for one of ``who``'s run slots and take it (its /v1/execute calls share them); with ``batch``, stop
        waiting (False) once it is no longer running or the node stops."""
        while self.runs.running.get(who, 0) >= self.settings.max_running_per_token:
            if batch is not None and (batch.status != "running" or self.closing):
                return False
            await asyncio.sleep(0.05)
        self.runs.take_slot(who)
        return True

    async def _run_item(self, batch: Batch, index: int, body: Item, held: Held | None = None) -> None:
        execution_id = uuid.uuid4().hex[:16]
        batch.executions.append(execution_id)
        line: dict[str, Any] = {"index": index}
        try:
            line["result"] = await self.runs.run(batch.owner, self._work(batch, execution_id, body, held),
                                                 slot_taken=True, frees_slot=held is None)
        except HTTPException as exc:  # nbexec could not run this item: its error, the others go on
            line["error"] = {"status": exc.status_code, "detail": exc.detail}
        except Exception:
            log.exception("a batch item failed unexpectedly")
            line["error"] = {"status": 500, "detail": "nbexec failed to run this; see the server's log"}
        finally:
            batch.sessions.pop(execution_id, None)
        if self.closing:
            return  # stopped by the node's shutdown: with a state folder, the next start runs it again
        await self._record(batch, line)

    def _work(self, batch: Batch, execution_id: str, body: Item, held: Held | None) -> Callable[[Any], dict[str, Any]]:
        """What runs the item on the token's thread: a judgement (judgeitems) or an execution."""
        if isinstance(body, JudgeBody):
            return judgeitems.work(self.folders, self.settings.config, self.settings.store, batch, execution_id, body,
                                   held)
        config = chosen(self.settings.config, body.image, body.language)
        session = self.folders.one_shot(execution_id, self.settings.store, batch.shown.id, config)
        batch.sessions[execution_id] = session
        uploads = {name: base64.b64decode(data) for name, data in (body.files or {}).items()}

        def render(_: Any) -> dict[str, Any]:
            self.folders.keep(batch.owner, execution_id, session)
            try:
                for name, content in uploads.items():
                    session.upload(content, name)
                result = run_body(session, body, self.folders.capped(body.timeout))
            finally:
                self.folders.finish_one_shot(execution_id)
            return batch.shown.outward(public(result, execution_id), execution_id)

        return render

    async def _record(self, batch: Batch, line: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a batch deleted while this item would not stop
            await asyncio.to_thread(batch.append, line)
        batch.notify()

    async def cancel(self, batch: Batch) -> None:
        """Stop the batch: interrupt its running items, wait for their sandboxes to go, delete it."""
        if batch.task is not None and not batch.task.done():
            batch.task.cancel()
            grace = self.settings.config.interrupt_grace + CANCEL_WAIT
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(batch.task), grace)
        batch.status = "cancelled" if batch.status not in FINAL else batch.status
        batch.notify()
        await asyncio.to_thread(self.forget, batch)


def add_routes(app: FastAPI, folders: Tenants, runs: Runs) -> None:
    batches = Batches(folders, runs)
    app.state.batches = batches  # read by the tests
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(started: Any) -> AsyncIterator[Any]:
        async with inner(started) as state:  # the node's own start (its folders open) and, after, its stop
            await batches.resume(View(None, app.state.instance))
            try:
                yield state
            finally:
                batches.shut()

    app.router.lifespan_context = lifespan

    @app.post("/v1/batches", status_code=202, responses={202: {}, 413: {}, 429: {}})
    async def create_batch(request: Request, shown: Shown, who: str = Depends(owner),
                           reuse: str | None = Query(None, max_length=20, description=REUSE_HELP)) -> Response:
        """Run a JSON array of /v1/execute bodies and judge items, each in a fresh sandbox (or with
        ``reuse=batch``, the judge items in a few sandboxes reset between two), on this token's run slots."""
        reuse = reuse or None  # ?reuse= (empty): as absent
        if reuse not in (None, *MODES):
            raise HTTPException(422, f"reuse is absent (a sandbox per item) or one of {', '.join(MODES)}")
        body = await request.body()
        # Parsed on the token's own threads: a body of a million tiny values is not the loop's to check.
        items, lines = await runs.io(who, batchbody.parsed, body, runs.settings.max_batch_items)
        del body
        for item in items:  # 400 before anything runs
            chosen(runs.settings.config, item.image, None if isinstance(item, JudgeBody) else item.language)
        batches.sweep()
        batches.admit(who, len(items))
        batch_id = uuid.uuid4().hex[:16]
        assert folders.root is not None
        batch = Batch(batch_id, who, len(items), folders.root / f"batch-{batch_id}", shown, reuse=reuse)
        batches.kept[batch_id] = batch  # with the check, before any await: concurrent posts count it
        try:
            await runs.io(who, batch.write_items, lines)
        except BaseException:
            batches.kept.pop(batch_id, None)
            raise
        batches.start(batch)
        return Response(json.dumps(batch.summary()), 202, media_type="application/json",
                        headers={"Location": f"/v1/batches/{shown.id(batch_id)}"})

    @app.get("/v1/batches/{batch_id}", responses={404: {}})
    async def get_batch(batch_id: str, shown: Shown, cursor: str = "0", limit: int = Query(50, ge=1, le=100),
                        who: str = Depends(owner)) -> Response:
        """The batch's status and counts, and up to ``limit`` results from ``cursor`` (``next_cursor`` goes on)."""
        batch = batches.owned(who, batch_id, shown)
        lines, after = await runs.io(who, _page, batch, cursor, limit)
        head = json.dumps(batch.summary())[:-1].encode()
        body = head + b',"items":[' + b",".join(lines) + b'],"next_cursor":"%d"}' % after
        return Response(body, media_type="application/json")

    @app.get("/v1/batches/{batch_id}/events", responses={404: {}})
    async def batch_events(batch_id: str, shown: Shown, cursor: str = "0",
                           last_event_id: str | None = Header(None, include_in_schema=False),
                           who: str = Depends(owner)) -> EventSourceResponse:
        """Server-sent events: one ``item`` per result as it ends (its ``id`` a cursor to resume from), then
        ``end`` with the batch's counts. A reconnect's Last-Event-ID resumes after that event (400 for one that
        is not a cursor of this batch's)."""
        batch = batches.owned(who, batch_id, shown)
        cursor = cursor if last_event_id is None else last_event_id
        _page(batch, cursor, 1)  # 400 now for a cursor that is not one
        return EventSourceResponse(_events(batch, int(cursor), runs, who), ping=runs.settings.keepalive, sep="\n",
                                   ping_message_factory=lambda: ServerSentEvent(comment="keep-alive", sep="\n"))

    @app.delete("/v1/batches/{batch_id}", status_code=204, response_class=Response, responses={404: {}})
    async def delete_batch(batch_id: str, shown: Shown, who: str = Depends(owner)) -> Response:
        """Cancel the batch: running items are interrupted, and it is deleted with its results and files."""
        await batches.cancel(batches.owned(who, batch_id, shown))
        return Response(status_code=204)


def _page(batch: Batch, cursor: str, limit: int) -> tuple[list[bytes], int]:
    if not (cursor.isascii() and cursor.isdigit()) or len(cursor) > 18:
        raise HTTPException(400, "cursor is not one of this batch's")
    try:
        return batch.page(int(cursor), limit)
    except (ValueError, OSError):
        raise HTTPException(400, "cursor is not one of this batch's") from None


async def _events(batch: Batch, cursor: int, runs: Runs, who: str) -> AsyncIterator[ServerSentEvent]:
    """One result at a time from disk, so a client that does not read holds the node to one result."""
    while True:
        changed = batch.changed()
        try:
            lines, after = await runs.io(who, batch.page, cursor, 1)
        except OSError:  # deleted under the stream
            lines, after = [], cursor
        if lines:
            cursor = after
            yield ServerSentEvent(event="item", id=str(cursor), data=lines[0].decode(), sep="\n")
            continue
        if batch.status in FINAL and (cursor >= batch.written or not batch.folder.exists()):
            yield ServerSentEvent(event="end", data=json.dumps(batch.summary()), sep="\n")
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), 5.0)
