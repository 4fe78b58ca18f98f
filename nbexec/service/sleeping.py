"""The node routes that let a library client's sandbox sleep and wake (durable sessions over the wire): the engine
on the client's host decides when, as it does for a local sandbox (`nbexec.engine.hibernation`), and these routes
do on this node what its own source does.

- ``POST /v1/sandboxes/{id}/hibernate``: this node's source keeps the sandbox's memory where its runtime can
  (`SandboxSource.hibernate`, a checkpoint under gVisor) in a private folder of this node; the answer says
  ``kept: "checkpoint"``, or ``kept: null`` when it cannot (the sandbox is then untouched and still running).
- ``POST /v1/sandboxes/{id}/wake``: the checkpointed sandbox running again (`SandboxSource.wake`); its kept memory
  is removed from this node once it runs.
- ``POST /v1/sandboxes/{id}/sleep``: no process runs, /mnt/data kept (`SandboxHandle.sleep`); ``/awake`` starts a
  fresh kernel over it, and the client's engine replays the session's cells.

A sleeping sandbox still belongs to its client and counts in its caps; every other route answers 409 until it
wakes; releasing it (DELETE, its idle time-to-live, shutdown) removes its memory with it. Each is one call at a
time, like every other use of a held sandbox.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException

from nbexec.files.folders import work_root
from nbexec.sandbox.docker.workdir import WORKDIR_PREFIX, remove_tree

from .held import Entry, Owned
from .runs import Runs, Shown, owner
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
                    record = folders.source.hibernate(handle, folder)
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
    async def wake(sandbox_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        entry: Entry = owned(who, sandbox_id, asleep_too=True)

        def work() -> dict[str, Any]:
            with held.using(entry) as old:
                expect(entry, "checkpoint")
                assert entry.memory is not None and entry.memory_dir is not None
                handle = folders.source.wake(old.config, entry.memory, entry.memory_dir)
                folder, entry.handle = entry.memory_dir, handle
                entry.asleep, entry.memory, entry.memory_dir = "", None, None
                remove_tree(folder)
                return handle.language_info

        return {"sandbox": shown.id(sandbox_id), "language_info": await runs.io(who, work)}


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
