"""The node routes behind `nbexec.sandbox.remote`: a library client drives a sandbox of this node through them,
method by method of the seam (`nbexec.sandbox.source.SandboxHandle`), and builds the result on its own host.

Every route is authenticated by the gateway and owned: a sandbox belongs to the client that made it (a token, or a
router's signed client: ``token~client``), anyone else gets 404 as for an id that does not exist, and it counts in
that client's caps (live sessions and sandboxes, executions in flight). A sandbox serves one call at a time (409
otherwise; an interrupt or a state query may come any time). Every answer names the sandbox it is about, so the
client can tell an answer for another. The node's own limits hold where the bytes first arrive: a run's messages
are relayed whole only within the node's output allowance (`frames.Allowance`), a listing within max_data and
max_files, a file within max_data, wheels within max_package_download and max_packages, and checked by sha256.
These routes are the node protocol (docs/scale-out.md), not the public API: they are left out of the OpenAPI
document.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from nbexec import packages
from nbexec.config import parse_size
from nbexec.engine import collect, judge, judgenamed
from nbexec.errors import ConfigError, NbexecError, PackageError, ProtocolError, SessionError
from nbexec.hostconfig import host_from_env
from nbexec.sandbox.hidden import Named
from nbexec.sandbox.remote import frames
from nbexec.sandbox.source import SandboxHandle, WheelFile

from . import files, judgeitems, sleeping, streaming
from .held import Entry, Held, Owned
from .runs import Runs, Shown, apply_egress, chosen, egress_change, owner, too_many
from .schemas import EgressBody, HiddenBody, RunBody, SandboxBody, StoredModel
from .settings import ServerSettings
from .tenants import Tenants

QUEUE_FRAMES = 256  # frames of a run waiting for a slow client; the kernel's reading waits past that
WHEEL = re.compile(r"[A-Za-z0-9_.+-]{1,200}\.whl")
WHEEL_ROUTE = re.compile(r"/v1/sandboxes/[^/]+/wheels/[^/]+")  # bodies up to max_package_download (the gateway)
SHA256 = re.compile(r"[0-9a-f]{64}")


def add_routes(app: FastAPI, folders: Tenants, runs: Runs, settings: ServerSettings) -> None:
    """The /v1/sandboxes routes (see the module docstring)."""
    held = folders.held

    def owned(who: str, sandbox_id: str, *, asleep_too: bool = False) -> Entry:
        entry = held.get(who, sandbox_id)
        if entry is None:
            raise HTTPException(404, "no such sandbox")
        if entry.asleep and not asleep_too:  # its kernel is stopped or checkpointed: only a wake-up reaches it
            raise HTTPException(409, f"this sandbox is asleep ({entry.asleep}): wake it first")
        return entry

    async def call(who: str, entry: Entry, work: Callable[[SandboxHandle], Any]) -> Any:
        """``work`` on the sandbox, on the client's I/O threads, one call at a time."""
        def guarded() -> Any:
            with held.using(entry) as handle:
                return work(handle)
        try:
            return await runs.io(who, guarded)
        except HTTPException as exc:  # a refused file is 400 here: 404 means only "no such sandbox"
            raise HTTPException(400 if exc.status_code == 404 else exc.status_code, exc.detail) from exc

    _held_routes(app, folders, runs, held, settings, owned)
    _run_routes(app, folders, runs, held, settings, owned)
    _life_routes(app, held, runs, owned, call)
    _file_routes(app, folders, runs, owned, call)
    _wheel_routes(app, folders, runs, owned, call)
    sleeping.add_routes(app, folders, runs, owned)


Call = Callable[[str, Entry, Callable[[SandboxHandle], Any]], Any]


def _held_routes(app: FastAPI, folders: Tenants, runs: Runs, held: Held, settings: ServerSettings,
                 owned: Owned) -> None:
    @app.post("/v1/sandboxes", status_code=201, include_in_schema=False)
    async def acquire(body: SandboxBody, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        """A ready sandbox of this node's source (in the named image the body asks for), held for the caller."""
        config = chosen(folders.config, body.image, body.language)
        # The place is taken with the check: concurrent calls would all pass a check made before the wait.
        try:
            with folders.making(who, settings.max_sessions_per_token):
                handle = await runs.io(who, lambda: folders.source.acquire(config, purpose=body.purpose))
                raw = held.add(who, handle, body.purpose)
        except SessionError as exc:
            raise too_many(str(exc)) from exc
        return shown.outward({"id": raw, "node": host_from_env().node_name, "language_info": handle.language_info,
                              "memory": config.memory, "max_data": config.max_data, "max_files": config.max_files,
                              "timeout": config.timeout, "interrupt_grace": config.interrupt_grace}, raw)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, response_class=Response, include_in_schema=False)
    async def release(sandbox_id: str, who: str = Depends(owner)) -> Response:
        owned(who, sandbox_id, asleep_too=True)  # a sleeping one too, with the memory it kept
        await runs.io(who, held.remove, who, sandbox_id)
        return Response(status_code=204)


def _run_routes(app: FastAPI, folders: Tenants, runs: Runs, held: Held, settings: ServerSettings,
                owned: Owned) -> None:
    config = folders.config

    @app.post("/v1/sandboxes/{sandbox_id}/run", response_class=StreamingResponse, include_in_schema=False)
    async def run(sandbox_id: str, body: RunBody, shown: Shown, who: str = Depends(owner)) -> StreamingResponse:
        """Run one cell; its kernel messages stream back as frames (see `nbexec.sandbox.remote.frames`)."""
        entry = owned(who, sandbox_id)
        if entry.lock.locked():
            raise HTTPException(409, "this sandbox is busy with another call")
        runs.take_slot(who)  # before the answer starts, so a refusal is a real 429
        relay = _Run(entry, held, shown.id(sandbox_id), frames.Allowance(
            config.max_output_bytes + config.max_display_bytes))
        task = asyncio.ensure_future(runs.run(who, lambda _: relay.work(body.code, folders.capped(body.timeout)),
                                              slot_taken=True))
        return StreamingResponse(relay.stream(task, settings.keepalive, folders.background),
                                 media_type=frames.MEDIA_TYPE)

    @app.post("/v1/sandboxes/{sandbox_id}/hidden", include_in_schema=False)
    async def hidden(sandbox_id: str, body: HiddenBody, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        """Run one of nbexec's own requests outside the notebook, by name: the code is built here from its name
        and arguments (`packages.hidden_code`), never taken from the client; its execute_reply content."""
        entry = owned(who, sandbox_id)
        limit = min(body.timeout, max(config.timeout, config.startup_timeout))
        try:
            named = Named(body.operation, body.args)
            code, expressions = packages.hidden_code(named)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from exc

        def work(_: Any) -> Any:
            with held.using(entry) as handle:
                return handle.run_hidden(code, limit, expressions=expressions, named=named)

        return {"sandbox": shown.id(sandbox_id), "reply": await runs.run(who, work)}

    @app.post("/v1/sandboxes/{sandbox_id}/judge", response_class=StreamingResponse, include_in_schema=False)
    async def judge_named(sandbox_id: str, request: Request, shown: Shown,
                          who: str = Depends(owner)) -> StreamingResponse:
        """Judge a program in the sandbox with this node's own runner (judging by name: the client sends the job as
        data, never code), its program limit within the node's timeout; the JudgeResult as JSON (judgenamed.fit).
        Whose sandbox it is is checked before the body: another client's is 404, whatever it sends."""
        entry = owned(who, sandbox_id)
        try:
            body = judgeitems.JudgeBody.model_validate_json(await request.body())
            job = judgeitems.check(body, folders.capped(None))
        except ValidationError as exc:
            raise HTTPException(422, judgeitems.problems(exc)) from None
        except ConfigError as exc:  # what judge() refuses
            raise HTTPException(422, str(exc)[:300]) from None
        asked = body.limits.program
        cut = f"the program's limit was cut to this node's {job.limits.program:g} s" \
            if asked is not None and asked > (job.limits.program or 0) else ""

        def work(_: Any) -> dict[str, Any]:
            with held.using(entry) as handle:
                judged = judge.judged_in(handle, handle.config, job)[0].to_dict()
            judged["notes"] += [cut] if cut else []
            return judgenamed.fit(judged)

        runs.take_slot(who)  # before the answer starts, so a refusal is a real 429
        task = asyncio.ensure_future(runs.run(who, work, slot_taken=True))
        return StreamingResponse(_judging(task, shown.id(sandbox_id), settings.keepalive),
                                 media_type="application/json")


async def _judging(task: asyncio.Future[Any], shown_id: str, keepalive: float) -> AsyncIterator[bytes]:
    """A judging's answer: a space every ``keepalive`` seconds while it runs (JSON allows them before a value, and
    a router gives up on a node silent for a minute), then the JSON; an error once it has started is in the body
    (``error``: its status and detail, which the client raises as the node's HTTP error)."""
    while not task.done():
        await asyncio.wait({task}, timeout=keepalive)
        if not task.done():
            yield b" "
    try:
        answer: dict[str, Any] = {"sandbox": shown_id, "judge": task.result()}
    except HTTPException as exc:
        answer = {"sandbox": shown_id, "error": {"status": exc.status_code, "detail": str(exc.detail)[:2000]}}
    yield json.dumps(answer, ensure_ascii=False).encode()


def _life_routes(app: FastAPI, held: Held, runs: Runs, owned: Owned, call: Call) -> None:
    @app.post("/v1/sandboxes/{sandbox_id}/interrupt", status_code=204, response_class=Response, include_in_schema=False)
    async def interrupt(sandbox_id: str, who: str = Depends(owner)) -> Response:
        handle = owned(who, sandbox_id).handle  # any time: it interrupts the call running now
        await runs.io(who, handle.interrupt)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/state", include_in_schema=False)
    async def state(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        entry = owned(who, sandbox_id, asleep_too=True)  # any time: the engine asks while a run stops
        if entry.asleep:  # nothing runs; a checkpointed one has no container to ask
            return {"sandbox": shown.id(sandbox_id), "running": False, "exit_code": None, "oom_killed": False,
                    "kernel_lost": False, "asleep": entry.asleep}
        found = await runs.io(who, entry.handle.state)
        return {"sandbox": shown.id(sandbox_id), "running": found.running, "exit_code": found.exit_code,
                "oom_killed": found.oom_killed, "kernel_lost": entry.handle.kernel_lost, "asleep": ""}

    @app.post("/v1/sandboxes/{sandbox_id}/freeze", status_code=204, response_class=Response, include_in_schema=False)
    async def freeze(sandbox_id: str, who: str = Depends(owner)) -> Response:
        await call(who, owned(who, sandbox_id), lambda handle: handle.freeze())
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/kill", status_code=204, response_class=Response, include_in_schema=False)
    async def kill(sandbox_id: str, who: str = Depends(owner)) -> Response:
        handle = owned(who, sandbox_id).handle  # any time: it ends a run that will not stop
        await runs.io(who, handle.kill)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/notes", include_in_schema=False)
    async def notes(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        def read(handle: SandboxHandle) -> dict[str, Any]:
            data, stopped = handle.data_notes()
            return {"data_notes": data, "stopped": stopped, "input_notes": handle.input_notes(),
                    "input_links": sorted(handle.input_links)}
        return {"sandbox": shown.id(sandbox_id), **await call(who, owned(who, sandbox_id), read)}

    @app.post("/v1/sandboxes/{sandbox_id}/egress", status_code=204, response_class=Response, include_in_schema=False)
    async def change_egress(sandbox_id: str, body: EgressBody, who: str = Depends(owner)) -> Response:
        handle = owned(who, sandbox_id).handle  # any time: a run in progress meets it on its next request
        egress_change(handle.config, body.allow, body.deny, widen=runs.settings.config.egress_widen)  # this node's
        await apply_egress(runs, who, lambda: handle.change_egress(body.allow, body.deny))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/connections", include_in_schema=False)
    async def connections(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        found, remarks = await call(who, owned(who, sandbox_id), lambda handle: handle.take_connections())
        return {"sandbox": shown.id(sandbox_id), "connections": [c.to_dict() for c in found], "notes": remarks}


def _file_routes(app: FastAPI, folders: Tenants, runs: Runs, owned: Owned, call: Call) -> None:
    cap = parse_size(folders.config.max_data)

    @app.get("/v1/sandboxes/{sandbox_id}/files", include_in_schema=False)
    async def list_files(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        """/mnt/data as a run collects it, within this node's max_data and max_files (each file hashed once)."""
        entry = owned(who, sandbox_id)
        found = await call(who, entry, lambda h: h.list_files(collect.limits(folders.config), entry.hashed))
        return {"sandbox": shown.id(sandbox_id), **files.listing(found, f"/v1/sandboxes/{shown.id(sandbox_id)}")}

    @app.get("/v1/sandboxes/{sandbox_id}/files/{name:path}", response_class=StreamingResponse, include_in_schema=False)
    async def get_file(sandbox_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        handle = owned(who, sandbox_id).handle  # read while the engine holds it: a collection in progress
        files.plain(name)
        try:
            return await files.download(runs, who, lambda: handle.open_file(name, max_bytes=cap), sized=True)
        except HTTPException as exc:  # 404 means only "no such sandbox"
            raise HTTPException(400 if exc.status_code == 404 else exc.status_code, exc.detail) from exc

    @app.put("/v1/sandboxes/{sandbox_id}/files/{name:path}", status_code=201, include_in_schema=False)
    async def put_file(sandbox_id: str, name: str, request: Request, who: str = Depends(owner)) -> StoredModel:
        entry = owned(who, sandbox_id)
        files.plain(name)
        content = await request.body()  # the gateway stops it at --max-body
        await call(who, entry, lambda handle: handle.put_file(name, content))
        return StoredModel(path=f"/mnt/data/{name}", size=len(content))


def _wheel_routes(app: FastAPI, folders: Tenants, runs: Runs, owned: Owned, call: Call) -> None:
    config = folders.config
    budget, count = parse_size(config.max_package_download), config.max_packages

    @app.put("/v1/sandboxes/{sandbox_id}/wheels/{filename}", status_code=201, include_in_schema=False)
    async def put_wheel(sandbox_id: str, filename: str, sha256: str, request: Request,
                        who: str = Depends(owner)) -> StoredModel:
        """A wheel the client's host resolved under its policy, into /mnt/wheels: the name of a wheel, within this
        node's max_package_download and max_packages for the sandbox, and its bytes matching ``sha256``."""
        entry = owned(who, sandbox_id)
        if not WHEEL.fullmatch(filename) or filename.startswith(".") or not SHA256.fullmatch(sha256):
            raise HTTPException(400, "a wheel needs a wheel's file name and its sha256 (64 hex digits)")
        if entry.wheel_count >= count:
            raise HTTPException(413, f"this sandbox was given {count} wheels already (max_packages)")
        assert folders.root is not None
        fd, path = tempfile.mkstemp(prefix=".wheel-", dir=folders.root)
        try:
            size = await _receive(request, fd, budget - entry.wheel_bytes, sha256, runs, who)
            os.chmod(path, 0o644)  # read by the sandbox's user, as the host's own wheel cache is
            entry.wheel_bytes += size
            entry.wheel_count += 1
            wheel = WheelFile(filename, sha256, size, folders.root / os.path.basename(path))
            await call(who, entry, lambda handle: handle.provide_wheels([wheel]))
        except PackageError as exc:
            raise HTTPException(400, str(exc)) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return StoredModel(path=f"/mnt/wheels/{filename}", size=size)


async def _receive(request: Request, fd: int, room: int, sha256: str, runs: Runs, who: str) -> int:
    """Write the request's body to ``fd`` (closed here), refused past ``room`` bytes or when its sha256 differs."""
    digest, size = hashlib.sha256(), 0
    with os.fdopen(fd, "wb") as out:
        async for chunk in request.stream():
            size += len(chunk)
            if size > room:
                raise HTTPException(413, "the wheels given to this sandbox passed max_package_download")
            digest.update(chunk)
            await runs.io(who, out.write, chunk)
    if digest.hexdigest() != sha256:
        raise HTTPException(400, "the wheel's bytes do not match its sha256")
    return size


class _Run:
    """One run relayed as frames: the kernel's messages (within the node's allowance) from a worker thread to the
    answer, then the end; keep-alives while the kernel is quiet; an interrupt when the client goes."""

    def __init__(self, entry: Entry, held: Held, shown_id: str, allowance: frames.Allowance) -> None:
        self.entry, self.held, self.shown_id, self.allowance = entry, held, shown_id, allowance
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.room = threading.Semaphore(QUEUE_FRAMES)
        self.gone = threading.Event()
        self.give_up = float("inf")  # time.monotonic() past which a client that reads nothing is gone
        self.last: bytes | None = None  # the end (or failure) frame, sent once the run's thread is done

    def put(self, data: bytes) -> None:
        """Queue a frame (worker thread); waits while QUEUE_FRAMES are queued, never once the client left or the
        run's time (and a minute) is over."""
        while not self.room.acquire(timeout=1.0):
            if self.gone.is_set() or time.monotonic() > self.give_up:
                return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, data)

    def work(self, code: str, timeout: float) -> None:
        self.give_up = time.monotonic() + timeout + self.entry.handle.config.interrupt_grace + 60
        try:
            with self.held.using(self.entry) as handle:
                self.put(frames.begin(self.shown_id))
                try:
                    run = handle.run(code, deadline=time.monotonic() + timeout, on_output=self._relay)
                    self.last = frames.end(self.shown_id, run)
                except ProtocolError as exc:
                    self.last = frames.failure("protocol", str(exc), handle.kernel_lost)
        except NbexecError as exc:
            self.last = frames.failure("node", str(exc), False)
        finally:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def _relay(self, msg: Any) -> None:
        self.put(frames.message(msg, self.allowance.keep(msg)))

    async def stream(self, task: asyncio.Future[Any], keepalive: float,
                     background: set[asyncio.Task[None]]) -> AsyncIterator[bytes]:
        done = False
        try:
            while True:
                try:
                    data = await asyncio.wait_for(self.queue.get(), keepalive)
                except asyncio.TimeoutError:
                    yield frames.keepalive()
                    continue
                if data is None:
                    done = True
                    # The end goes out once the run's thread has let go of the sandbox and the token's slot: a
                    # client that reads it may call on the sandbox at once (the files' freeze, the next cell).
                    await asyncio.wait([task])
                    if self.last is not None:
                        yield self.last
                    return
                self.room.release()
                yield data
        finally:
            if not done:  # the client left mid-run: interrupt it until it ends (its slot is freed then)
                self.gone.set()
                watcher = asyncio.ensure_future(streaming.interrupt_until_done(task, self.entry.handle.interrupt))
                background.add(watcher)
                watcher.add_done_callback(background.discard)

