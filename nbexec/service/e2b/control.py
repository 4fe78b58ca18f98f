"""The E2B door's control plane under /e2b (E2B_API_URL): create, connect (which resumes), list, info, kill,
set_timeout, pause, snapshots and fork, answered in E2B's shapes. The caller is the API token the gateway read
from ``X-API-KEY``; another token's sandbox is 404 exactly as an unknown one. A sandbox counts in its token's cap
of live sessions; a refused create says so with 429 and ``Should-Retry: false`` (it will not clear by waiting)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError, SessionLimitError, SnapshotError

from .. import snapshots
from ..gateway import OWNER_KEY
from ..runs import Runs
from ..settings import ServerSettings
from ..tenants import Tenants
from . import wire
from .boxes import Box, Boxes
from .wire import E2bError

ENVD_VERSION = "0.5.7"  # what this door implements of envd (0.5.7: octet-stream and gzip uploads, close_stdin)
DEFAULT_TEMPLATES = ("base", "code-interpreter-v1")  # E2B's default names: nbexec's default image
MAX_FORKS = 20
MAX_UPLOADS = 2  # uploads in flight per token
ENDERS = 4  # threads that end (kill or pause) sandboxes whose time is up
PAUSE_GRACE = 30.0  # seconds a running call may outlive its sandbox's end before a pause interrupts it
DEFAULT_TIMEOUT = 300
log = logging.getLogger(__name__)


def who(request: Request) -> str:
    found = request.scope.get("state", {}).get(OWNER_KEY)
    if not found:  # unreachable behind the gateway
        raise E2bError(401, "missing or wrong API key (X-API-KEY)")
    return str(found)


class Control:
    """The control routes' shared state: the node's tenants and runs, the door's sandboxes, the page tokens."""

    def __init__(self, folders: Tenants, runs: Runs, settings: ServerSettings, boxes: Boxes) -> None:
        self.folders, self.runs, self.settings, self.boxes = folders, runs, settings, boxes
        self.pages = wire.Pages()
        self.sweeper: asyncio.Task[None] | None = None
        self._uploads: dict[str, int] = {}
        # The sweeper's own threads: ends never wait behind an owner's busy threads nor the loop's shared ones.
        self._enders = concurrent.futures.ThreadPoolExecutor(ENDERS, thread_name_prefix="nbexec-e2b-end")

    @contextlib.contextmanager
    def uploading(self, owner: str) -> Iterator[None]:
        """One of the owner's MAX_UPLOADS places for an upload in flight (a multipart body waits in a private
        temporary file until it is whole: at most that many times max_body per token); 429 when none is free."""
        if self._uploads.get(owner, 0) >= MAX_UPLOADS:
            raise E2bError(429, f"{MAX_UPLOADS} uploads are in flight for this token", after=1)
        self._uploads[owner] = self._uploads.get(owner, 0) + 1
        try:
            yield
        finally:
            self._uploads[owner] -= 1

    async def io(self, owner: str, func: Callable[..., Any], *args: Any) -> Any:
        """Blocking work on the token's I/O threads, nbexec's errors in E2B's shape."""
        try:
            return await asyncio.wrap_future(self.folders.lanes(owner).io.submit(func, *args))
        except SessionLimitError as exc:
            raise E2bError(429, str(exc), retry=False) from None
        except SnapshotError as exc:
            raise E2bError(404, str(exc)) from None
        except NbexecError as exc:
            raise E2bError(500 if not isinstance(exc, ConfigError) else 400, str(exc)) from None

    def timeout(self, asked: Any, default: int = DEFAULT_TIMEOUT) -> float:
        """A sandbox's lifetime in seconds: the client's, within 1 s and the operator's maximum."""
        if asked is None:
            asked = default
        if not isinstance(asked, (int, float)) or isinstance(asked, bool) or asked < 0 \
                or (isinstance(asked, float) and not math.isfinite(asked)):
            raise E2bError(400, "timeout must be a number of seconds")
        return float(min(max(asked, 1), self.settings.e2b_max_timeout))

    def config(self, owner: str, template: str) -> SandboxConfig | None:
        """The policy for ``template``: the default image, a named image, or None for one of the owner's
        snapshots; 404 naming what exists otherwise."""
        if template in DEFAULT_TEMPLATES:
            return self.folders.config
        if template in self.folders.config.images:
            return self.folders.config.choose_image(template)
        if any(s.id == template for s in snapshots.store(self.folders).listing(owner)):
            return None
        offered = ", ".join((*DEFAULT_TEMPLATES, *self.folders.config.images))
        raise E2bError(404, f"template {template!r} not found; this server offers {offered} and your snapshots")

    def make(self, owner: str, template: str, envs: dict[str, str], end: float, lifetime: float) -> Box:
        """A started session in a new box (blocking: on the token's I/O threads). ``lifetime``: the seconds the
        client asked for, given again whenever the box resumes (not what its start left of them)."""
        config = self.config(owner, template)
        with self.folders.making(owner, self.settings.max_sessions_per_token) as place:
            if config is None:
                session = self.folders.restore_session(owner, template, self.settings.store, place=place)
            else:
                if envs:
                    config = config.replace(env={**config.env, **envs})
                session = self.folders.new_session(owner, self.settings.store, str, config, place=place)
            session.ttl = None  # the box's end decides, not idleness
            try:
                session.start()
            except BaseException:
                self.folders.delete_session(session.id)
                raise
        box = Box(session.id, owner, session, template, {}, envs, end, lifetime=lifetime)
        self.boxes.add(box)
        return box

    def kill(self, box: Box) -> None:
        self.boxes.pop(box.id)
        box.close_extra("contexts")  # its kernels, through the supervisor
        helper = box.extra.pop("supervisor", None)  # (handle, supervisor): see envd
        if helper is not None:
            helper[1].close()
        self.folders.delete_session(box.session.id)

    def described(self, box: Box, *, tokens: bool) -> dict[str, Any]:
        config, session = box.session.config, box.session
        found: dict[str, Any] = {
            "templateID": box.template, "alias": box.template, "sandboxID": box.id, "clientID": "nbexec",
            "envdVersion": ENVD_VERSION, "startedAt": wire.rfc3339(box.started), "endAt": wire.rfc3339(box.end),
            "cpuCount": max(1, math.ceil(config.cpus)), "memoryMB": config.memory_bytes // 1024**2,
            "diskSizeMB": config.max_data_bytes // 1024**2, "state": box.state, "metadata": box.metadata,
            "allowInternetAccess": box.internet,
            "lifecycle": {"autoResume": box.auto_resume, "onTimeout": box.on_timeout},
        }
        if box.paused:  # memory kept only where the runtime checkpoints; otherwise cells are replayed on resume
            found["pauseMode"] = "full" if getattr(session, "_asleep", None) == "checkpoint" else "filesystem"
        if tokens:
            found["envdAccessToken"] = box.tokens["envdAccessToken"]
        return found

    def sandbox(self, box: Box) -> dict[str, Any]:
        return {"templateID": box.template, "alias": box.template, "sandboxID": box.id, "clientID": "nbexec",
                "envdVersion": ENVD_VERSION, "domain": None, **box.tokens}

    def owned(self, request: Request, sandbox_id: str) -> Box:
        box = self.boxes.get(who(request), sandbox_id)
        if box is None:
            raise E2bError(404, f"sandbox {sandbox_id[:64]!r} not found")
        return box

    async def sweep_forever(self) -> None:
        """End the sandboxes whose time is up (kill, or pause with on_timeout "pause"), once a second: each on a
        thread of its own, so one sandbox's slow end (or its owner's busy threads) delays no other's."""
        ending: set[str] = set()
        while True:
            await asyncio.sleep(1.0)
            for box in self.boxes.due():
                if box.id not in ending:
                    ending.add(box.id)
                    task = asyncio.ensure_future(self._end(box))
                    task.add_done_callback(functools.partial(_ended, ending, box.id))
                    self.folders.background.add(task)
                    task.add_done_callback(self.folders.background.discard)

    async def _end(self, box: Box) -> None:
        await asyncio.get_running_loop().run_in_executor(self._enders, self._expire, box)

    def _expire(self, box: Box) -> None:
        if box.on_timeout == "pause" and box.session.busy and box.session.status != "closed":
            # A pause waits for the running call; a call that outlives the end by PAUSE_GRACE is interrupted.
            if time.time() > box.end + PAUSE_GRACE:
                box.session.interrupt()
            return
        if box.on_timeout == "pause" and box.session.status != "closed" and not box.paused:
            with box.lock:
                box.close_extra("contexts")  # more kernels do not sleep: a pause ends them
                box.paused = box.session.hibernate() or box.paused
            if box.paused:
                return
        self.kill(box)

    def start_sweeper(self) -> None:
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.ensure_future(self.sweep_forever())
            self.folders.background.add(self.sweeper)


def _ended(ending: set[str], name: str, task: asyncio.Future[None]) -> None:
    ending.discard(name)
    if not task.cancelled() and task.exception() is not None:
        log.error("ending sandbox %s failed: %s", name, task.exception())


def check_create(control: Control, body: dict[str, Any]) -> tuple[str, dict[str, str], dict[str, str], bool]:
    """The template, metadata and envs of a create body; what nbexec refuses on purpose is 403, with why."""
    template = body.get("templateID") or "base"
    if not isinstance(template, str) or len(template) > 256:
        raise E2bError(400, "templateID must be a template name")
    metadata = wire.strings(body.get("metadata"), "metadata", count=wire.MAX_METADATA, size=wire.MAX_METADATA_BYTES)
    envs = wire.strings(body.get("envVars"), "envVars", count=wire.MAX_ENVS, size=wire.MAX_ENV_BYTES,
                        names=wire.ENV_NAME)
    internet = body.get("allow_internet_access")
    if internet is None:
        internet = body.get("allowInternetAccess")
    network = control.folders.config.network
    if internet is True and network is not True:
        raise E2bError(403, "internet access is off on this server: create the sandbox without "
                            "allow_internet_access (the operator turns network on with NBEXEC_NETWORK)")
    network_rules = body.get("network")
    if network_rules is not None and not isinstance(network_rules, dict):
        raise E2bError(400, "network must be an object")
    if (network_rules or {}).get("allowOut"):
        raise E2bError(403, "network rules are not offered through the E2B API on this server")
    for name in ("mcp", "iam", "volumeMounts", "secure_env"):
        if body.get(name):
            raise E2bError(403, f"{name} is not offered by nbexec")
    return template, metadata, envs, network is True


def add_routes(app: FastAPI, control: Control) -> None:
    _life(app, control)
    _state(app, control)
    _copies(app, control)


def _life(app: FastAPI, control: Control) -> None:
    @app.post("/e2b/v2/sandboxes", include_in_schema=False)
    @app.post("/e2b/sandboxes", include_in_schema=False)
    async def create(request: Request) -> JSONResponse:
        owner, body = who(request), wire.parse_json(await request.body())
        template, metadata, envs, internet = check_create(control, body)
        lifetime = control.timeout(body.get("timeout"))
        box = await control.io(owner, control.make, owner, template, envs, time.time() + lifetime, lifetime)
        box.metadata, box.internet = metadata, internet
        box.on_timeout = "pause" if body.get("autoPause") is True else "kill"
        box.auto_resume = body.get("autoResume") is True
        control.start_sweeper()
        return JSONResponse(control.sandbox(box), status_code=201)

    @app.post("/e2b/v2/sandboxes/{sandbox_id}/connect", include_in_schema=False)
    @app.post("/e2b/sandboxes/{sandbox_id}/resume", include_in_schema=False)
    async def connect(sandbox_id: str, request: Request) -> JSONResponse:
        box, body = control.owned(request, sandbox_id), wire.parse_json(await request.body())
        if "timeout" in body:
            box.lifetime = control.timeout(body["timeout"])
            box.end = max(box.end, time.time() + box.lifetime)
        was_paused = box.paused

        def resume() -> None:
            with box.lock:
                if box.paused:
                    box.session.start()  # wakes it: its memory back, or its cells replayed
                    box.resumed()
        await control.io(box.owner, resume)
        return JSONResponse(control.sandbox(box), status_code=201 if was_paused else 200)

    @app.delete("/e2b/sandboxes/{sandbox_id}", status_code=204, include_in_schema=False)
    async def kill(sandbox_id: str, request: Request) -> Response:
        box = control.owned(request, sandbox_id)
        box.abandon_extra("contexts")  # a context start it stalls frees its I/O thread for this
        await control.io(box.owner, control.kill, box)
        return Response(status_code=204)

    @app.post("/e2b/sandboxes/{sandbox_id}/timeout", status_code=204, include_in_schema=False)
    async def set_timeout(sandbox_id: str, request: Request) -> Response:
        box, body = control.owned(request, sandbox_id), wire.parse_json(await request.body())
        box.lifetime = control.timeout(body.get("timeout"))
        box.end = time.time() + box.lifetime
        return Response(status_code=204)

    @app.post("/e2b/sandboxes/{sandbox_id}/pause", status_code=204, include_in_schema=False)
    async def pause(sandbox_id: str, request: Request) -> Response:
        box = control.owned(request, sandbox_id)
        if box.paused:
            raise E2bError(409, f"sandbox {sandbox_id} is already paused")

        def sleep() -> bool:
            with box.lock:
                box.close_extra("contexts")
                box.paused = box.paused or box.session.hibernate()
                return box.paused
        box.abandon_extra("contexts")
        if not await control.io(box.owner, sleep):
            raise E2bError(409, "the sandbox cannot pause now (it is busy, or not started)")
        return Response(status_code=204)


def _state(app: FastAPI, control: Control) -> None:
    @app.get("/e2b/sandboxes/{sandbox_id}", include_in_schema=False)
    async def info(sandbox_id: str, request: Request) -> JSONResponse:
        return JSONResponse(control.described(control.owned(request, sandbox_id), tokens=True))

    @app.get("/e2b/v2/sandboxes", include_in_schema=False)
    @app.get("/e2b/sandboxes", include_in_schema=False)
    async def listing(request: Request) -> JSONResponse:
        owner, query = who(request), request.query_params
        wanted, states = wire.metadata_filter(query.get("metadata")), wire.states(query.get("state"))
        count, after = wire.limit(query.get("limit")), control.pages.read(owner, query.get("nextToken"))
        found = sorted((b for b in control.boxes.owned(owner)
                        if b.state in states and wire.matches(b.metadata, wanted)),
                       key=lambda b: (b.started, b.id), reverse=query.get("order") == "desc")
        if after is not None:
            ids = [b.id for b in found]
            found = found[ids.index(after) + 1:] if after in ids else []
        page, more = found[:count], len(found) > count
        headers = {"X-Next-Token": control.pages.make(owner, page[-1].id)} if more else {}
        return JSONResponse([control.described(b, tokens=False) for b in page], headers=headers)

    @app.get("/e2b/sandboxes/{sandbox_id}/metrics", include_in_schema=False)
    async def metrics(sandbox_id: str, request: Request) -> JSONResponse:
        control.owned(request, sandbox_id)
        return JSONResponse([])


def _copies(app: FastAPI, control: Control) -> None:
    @app.post("/e2b/sandboxes/{sandbox_id}/snapshots", status_code=201, include_in_schema=False)
    async def snapshot(sandbox_id: str, request: Request) -> JSONResponse:
        box, body = control.owned(request, sandbox_id), wire.parse_json(await request.body())
        made = await control.io(box.owner, box.session.snapshot)
        name = body.get("name")
        return JSONResponse({"snapshotID": made, "names": [name] if isinstance(name, str) else []},
                            status_code=201)

    @app.get("/e2b/snapshots", include_in_schema=False)
    async def listing(request: Request) -> JSONResponse:
        owner = who(request)
        found = await control.io(owner, lambda: snapshots.store(control.folders).listing(owner))
        return JSONResponse([{"snapshotID": s.id, "names": []} for s in found])

    @app.delete("/e2b/templates/{snapshot_id}", status_code=204, include_in_schema=False)
    async def delete(snapshot_id: str, request: Request) -> Response:
        owner = who(request)
        await control.io(owner, lambda: snapshots.store(control.folders).delete(owner, snapshot_id))
        return Response(status_code=204)

    @app.post("/e2b/sandboxes/{sandbox_id}/fork", status_code=201, include_in_schema=False)
    async def fork(sandbox_id: str, request: Request) -> JSONResponse:
        box, body = control.owned(request, sandbox_id), wire.parse_json(await request.body())
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_FORKS:
            raise E2bError(400, f"count must be between 1 and {MAX_FORKS}")
        lifetime = control.timeout(body.get("timeout"))
        end = time.time() + lifetime
        made = await control.io(box.owner, box.session.snapshot)
        answers: list[dict[str, Any]] = []
        try:
            for _ in range(count):
                try:
                    copy = await control.io(box.owner, control.make, box.owner, made, box.envs, end, lifetime)
                except E2bError as exc:
                    answers.append({"error": {"code": exc.status, "message": exc.message}})
                    continue
                copy.metadata, copy.internet, copy.template = dict(box.metadata), box.internet, box.template
                answers.append({"sandbox": control.sandbox(copy)})
        finally:  # the forks' common snapshot is theirs only: it does not take one of the owner's places
            await control.io(box.owner, lambda: snapshots.store(control.folders).delete(box.owner, made))
        control.start_sweeper()
        return JSONResponse(answers, status_code=201)

