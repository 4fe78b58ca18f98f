"""The file routes of `nbexec serve`: a session's /mnt/data (list, upload, download) and the images and files of
sessions and one-shot results, each streamed in chunks from its owner's folder through the link-safe reader."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from nbexec.config import parse_size
from nbexec.engine.session import Session
from nbexec.errors import FileTransferError, SessionLostError, SessionPendingError
from nbexec.files import artifacts
from nbexec.sandbox.remote import paths

from .runs import Runs, Shown, owner
from .schemas import LISTING, StoredModel
from .tenants import RouteStore, Tenants

DOWNLOAD = {"description": "The file's bytes.", "content": {"application/octet-stream": {}}}
TOO_LARGE = {"description": "The file is over max_data (by its apparent size); nothing was read."}


def owned(folders: Tenants, who: str, session_id: str) -> Session:
    """The session ``session_id`` of ``who``; 404 for anyone else, as for a session that does not exist. A kept
    one a restarted node is still finding again is 503 with Retry-After; one it could not find again, 410."""
    try:
        session = folders.session(who, session_id)
    except SessionPendingError as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": str(math.ceil(exc.retry_after))}) from None
    except SessionLostError as exc:
        raise HTTPException(410, str(exc)) from None
    if session is None:
        raise HTTPException(404, "no such session")
    return session


def deletable(folders: Tenants, who: str, session_id: str) -> None:
    """As `owned`, but a lost session may be deleted too (it is forgotten: its owner was told)."""
    try:
        owned(folders, who, session_id)
    except HTTPException as exc:
        if exc.status_code != 410:
            raise


def plain(name: str) -> str:
    """``name`` when every segment is a plain one (see sandbox.remote.paths); 400 otherwise."""
    try:
        paths.check(name)
    except FileTransferError as exc:
        raise HTTPException(400, str(exc)) from exc
    return name


def listing(found: artifacts.Collection, base: str) -> dict[str, Any]:
    """A listing of /mnt/data in its public shape (`nbexec.result`), each file's URL a route under ``base``."""
    files = [dataclasses.replace(f, url=RouteStore.url(base, "files", f.name)).to_dict(public=True)
             for f in found.files]
    return {"files": files, "skipped_files": [s.to_dict() for s in found.skipped], "notes": list(found.notes)}


def add_routes(app: FastAPI, folders: Tenants, runs: Runs) -> None:
    cap = parse_size(folders.config.max_data)

    @app.get("/v1/sessions/{session_id}/files", responses={200: LISTING})
    async def list_files(session_id: str, shown: Shown, who: str = Depends(owner)) -> dict[str, Any]:
        """/mnt/data as a run would collect it: files within max_data and max_files, the rest skipped with why."""
        session = owned(folders, who, session_id)
        return listing(await runs.io(who, session.listing), f"/v1/sessions/{shown.id(session.id)}")

    @app.put("/v1/sessions/{session_id}/files/{name:path}", status_code=201)
    async def put_file(session_id: str, name: str, request: Request, who: str = Depends(owner)) -> StoredModel:
        session = owned(folders, who, session_id)
        plain(name)
        content = await request.body()  # the gateway stops it at --max-body
        try:
            path = await runs.io(who, session.upload, content, name)
        except HTTPException as exc:
            raise HTTPException(400 if exc.status_code == 404 else exc.status_code, exc.detail) from exc
        return StoredModel(path=path, size=len(content))

    @app.get("/v1/sessions/{session_id}/files/{name:path}", response_class=StreamingResponse,
             responses={200: DOWNLOAD, 413: TOO_LARGE})
    async def get_file(session_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        session = owned(folders, who, session_id)  # /mnt/data as it is now, like the listing; max_data caps it
        plain(name)
        return await download(runs, who, lambda: session.open_file(name, max_bytes=cap))

    _image_routes(app, folders, runs, cap)


def _image_routes(app: FastAPI, folders: Tenants, runs: Runs, cap: int) -> None:
    """A session's images, and a one-shot result's files and images."""

    @app.get("/v1/sessions/{session_id}/images/{name}", response_class=StreamingResponse, responses={200: DOWNLOAD})
    async def get_session_image(session_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.session_folder(owned(folders, who, session_id))
        return await _download_from(runs, who, folder / "images" if folder else None, name, 0)

    @app.get("/v1/executions/{execution_id}/files/{name:path}", response_class=StreamingResponse,
             responses={200: DOWNLOAD})
    async def get_result_file(execution_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.result_folder(who, execution_id)
        return await _download_from(runs, who, folder / "data" if folder else None, name, cap)

    @app.get("/v1/executions/{execution_id}/images/{name}", response_class=StreamingResponse,
             responses={200: DOWNLOAD})
    async def get_result_image(execution_id: str, name: str, who: str = Depends(owner)) -> StreamingResponse:
        folder = folders.result_folder(who, execution_id)
        return await _download_from(runs, who, folder / "images" if folder else None, name, 0)


async def _download_from(runs: Runs, who: str, folder: Path | None, name: str, cap: int) -> StreamingResponse:
    if folder is None:
        raise HTTPException(404, "no such file")
    plain(name)
    return await download(runs, who, lambda: artifacts.open_stream(folder, name, max_bytes=cap))


async def download(runs: Runs, who: str, opener: Callable[[], tuple[int, artifacts.FileChunks]], *,
                   sized: bool = False) -> StreamingResponse:
    """Stream a regular file in chunks on the token's I/O threads (never loaded whole); ``sized``: its size at
    opening in X-Nbexec-Size (the node protocol: the most bytes that follow)."""
    size, chunks = await runs.io(who, opener)

    async def body() -> AsyncIterator[bytes]:
        try:
            while (chunk := await runs.io(who, next, chunks, None)) is not None:
                yield chunk
        finally:
            _close(chunks)

    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"Content-Disposition": "attachment", "X-Content-Type-Options": "nosniff",
                                      **({"X-Nbexec-Size": str(size)} if sized else {})})


def _close(chunks: Iterator[bytes]) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        close()
