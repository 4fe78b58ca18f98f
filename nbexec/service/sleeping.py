"""The node routes that let a library client's sandbox sleep and wake (durable sessions over the wire).

The engine on the client's host decides when, as for a local sandbox (`nbexec.engine.hibernation`). These routes
do on this node what its own source does.

- ``POST /v1/sandboxes/{id}/hibernate``: the source keeps the sandbox's memory where its runtime can (a
  checkpoint under gVisor), in a private folder. The answer says ``kept: "checkpoint"``, or ``kept: null`` when
  it cannot; the sandbox then runs on untouched.
- ``POST /v1/sandboxes/{id}/wake``: the checkpointed sandbox runs again, and its kept memory is removed. The wake
  ends with 409 by the body's ``timeout`` (capped by the node's), when its client hangs up, or when the sandbox is
  deleted. Nothing ran then, and the sandbox sleeps on with its memory.
- ``POST /v1/sandboxes/{id}/sleep``: no process runs, /mnt/data kept (`SandboxHandle.sleep`). ``/awake`` starts a
  fresh kernel over it, and the client's engine replays the session's cells.

A sleeping sandbox still belongs to its client and counts in its caps. Every other route answers 409 until it
wakes. Releasing it (DELETE, its idle time-to-live, shutdown) removes its memory too. Each is one call at a time,
like every other use of a held sandbox.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request

from nbexec.errors import SessionLostError, WakeStoppedError
from nbexec.files.folders import work_root
from nbexec.files.workdir import WORKDIR_PREFIX, remove_tree
from nbexec.sandbox.capabilities import Capability

from .held import Entry, Owned
from .runs import Runs, Shown, owner
from .schemas import WakeBody
from .tenants import Tenants


def add_routes(app: FastAPI, folders: Tenants, runs: Runs, owned: Owned) -> None:
    """The sleep and wake routes of /v1/sandboxes (see the module docstring)."""
    _memory_routes(app, folders, runs, owned)
    _stop_routes(app, folders, runs, owned)


def expect(entry: Entry, asleep: str) -> None:
    """Checked under the entry's lock: a second call that raced this one finds the state it left."""
    if entry.asleep != asleep:
        raise HTTPException(409, f"this sandbox is asleep ({entry.asleep})" if entry.asleep
                            else "this sandbox is not asleep")


def _memory_routes(app: FastAPI, folders: Tenants, runs: Runs, owned: Owned) -> None:
    held = folders.held

    @app.post("/v1/sandboxes/{sandbox_id}/hibernate", include_in_schema=False)
    async def hibernate(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        entry: Entry = owned(who, sandbox_id, asleep_too=True)

        def work() -> str | None:
            with held.using(entry) as handle:
                expect(entry, "")
                folder = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-memory-", dir=work_root()))
                try:
                    offered = folders.source.offers(Capability.CHECKPOINT)  # else answered "kept: null"
                    record = folders.source.hibernate(handle, folder) if offered else None
                except BaseException:
                    remove_tree(folder)
                    raise
                if record is None:  # this runtime cannot keep memory: untouched, still running
                    remove_tree(folder)
                    return None
                entry.asleep, entry.memory, entry.memory_dir = "checkpoint", record, folder
                return "checkpoint"

        return {"sandbox": shown.id(sandbox_id), "kept": await runs.io(who, work)}

    @app.post("/v1/sandboxes/{sandbox_id}/wake", include_in_schema=False)
    async def wake(sandbox_id: str, request: Request, shown: Shown, body: WakeBody | None = None,
                   who: str = Depends(owner)) -> dict[str, Any]:
        entry: Entry = owned(who, sandbox_id, asleep_too=True)
        limit = max(folders.config.timeout, folders.config.startup_timeout)  # the node's, as the hidden route's
        if body is not None and body.timeout is not None:
            limit = min(body.timeout, limit)
        gone = threading.Event()
        check = _stops(entry, gone, time.monotonic() + limit)

        def work() -> dict[str, Any]:
            with held.using(entry) as old:
                expect(entry, "checkpoint")
                assert entry.memory is not None and entry.memory_dir is not None
                handle = folders.source.wake(old.config, entry.memory, entry.memory_dir, check=check)
                if not held.swap(entry, handle):  # deleted while it woke: its memory is gone already
                    folders.source.release(handle, wait=True)
                    raise SessionLostError("the sandbox was deleted while it woke")
                folder = entry.memory_dir
                entry.asleep, entry.memory, entry.memory_dir = "", None, None
                if folder is not None:  # None: a DELETE just after the swap took it with the sandbox
                    remove_tree(folder)
                return handle.language_info

        watcher = asyncio.ensure_future(_hung_up(request, gone))
        try:
            return {"sandbox": shown.id(sandbox_id), "language_info": await runs.io(who, work)}
        finally:
            watcher.cancel()


def _stops(entry: Entry, gone: threading.Event, deadline: float) -> Callable[[], None]:
    """The check a wake's waits poll: WakeStoppedError once its sandbox was deleted, its client hung up or its
    time limit passed."""
    def check() -> None:
        if entry.released.is_set():
            raise WakeStoppedError("the sandbox was deleted while it woke")
        why = "its client went away" if gone.is_set() else \
            "it ran out of its time limit" if time.monotonic() > deadline else ""
        if why:
            raise WakeStoppedError(f"the wake stopped before the kernel was back ({why}); nothing ran, and the "
                                   "sandbox sleeps on with its memory")
    return check


async def _hung_up(request: Request, gone: threading.Event) -> None:
    """Set ``gone`` once the client of ``request`` disconnects."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    gone.set()


def _stop_routes(app: FastAPI, folders: Tenants, runs: Runs, owned: Owned) -> None:
    held = folders.held

    @app.post("/v1/sandboxes/{sandbox_id}/sleep", include_in_schema=False)
    async def sleep(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        entry: Entry = owned(who, sandbox_id, asleep_too=True)

        def work() -> None:
            with held.using(entry) as handle:
                expect(entry, "")
                handle.sleep()
                entry.asleep = "replay"

        await runs.io(who, work)
        return {"sandbox": shown.id(sandbox_id), "asleep": "replay"}

    @app.post("/v1/sandboxes/{sandbox_id}/awake", include_in_schema=False)
    async def awake(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        entry: Entry = owned(who, sandbox_id, asleep_too=True)

        def work() -> dict[str, Any]:
            with held.using(entry) as handle:
                expect(entry, "replay")
                handle.awake()
                entry.asleep = ""
                return handle.language_info

        return {"sandbox": shown.id(sandbox_id), "language_info": await runs.io(who, work)}
