"""E2B's files (port 49983): envd's ``filesystem.Filesystem`` over Connect (stat, list, make, move, remove, watch)
and file contents over HTTP (``GET /files`` streams a file, ``POST /files`` writes one or many: multipart or raw,
gzip-encoded or not). Every operation runs inside the sandbox, as its user, through the process supervisor: the
host never follows a name the sandbox made. What is written is capped by the sandbox's own filesystems (data, /tmp)
and by ``max_data`` per file; a gzip body is inflated as it arrives and stops at the same cap (a bomb costs at most
the cap); a multipart body is read part by part within the gateway's ``max_body``."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import connect, envd, paths, wire
from .boxes import Box
from .connect import ConnectError
from .control import Control

PACKAGE = "filesystem.Filesystem/"
TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK",
         "other": "FILE_TYPE_UNSPECIFIED"}
EVENTS = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
          "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
MAX_PARTS = 256  # files of one multipart upload
MAX_DEPTH = 16
FEED = 8  # chunks between the request and the supervisor's writer


def entry(found: dict[str, Any]) -> dict[str, Any]:
    """An EntryInfo as proto3 JSON (int64 as a string, the time as RFC 3339, the home as /home/user)."""
    info: dict[str, Any] = {"name": found["name"], "type": TYPES[found["type"]], "path": paths.outward(found["path"]),
                            "size": str(found["size"]), "mode": found["mode"], "permissions": found["permissions"],
                            "owner": found["owner"], "group": found["group"],
                            "modifiedTime": wire.rfc3339(found["mtime"])}
    if found.get("symlink_target") is not None:
        info["symlinkTarget"] = found["symlink_target"]
    return info


def _path(message: dict[str, Any], key: str = "path") -> str:
    found = message.get(key)
    if not isinstance(found, str) or not found or "\x00" in found or len(found) > 4096:
        raise ConnectError("invalid_argument", f"{key} must be a path")
    return paths.inward(found)


def _unary(box: Box, method: str, message: dict[str, Any]) -> dict[str, Any]:
    files = envd.supervisor(box).files
    if method == "Stat":
        return {"entry": entry(files.stat(_path(message)))}
    if method == "ListDir":
        depth = message.get("depth") or 1
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be between 1 and {MAX_DEPTH}")
        return {"entries": [entry(e) for e in files.list_dir(_path(message), depth)]}
    if method == "MakeDir":
        path = _path(message)
        if not files.make_dir(path):
            raise ConnectError("already_exists", f"{paths.outward(path)} exists already")
        return {"entry": entry(files.stat(path))}
    if method == "Move":
        return {"entry": entry(files.move(_path(message, "source"), _path(message, "destination")))}
    if method == "Remove":
        files.remove(_path(message))
        return {}
    raise ConnectError("unimplemented", f"filesystem.Filesystem/{method[:64]} is not offered (watch folders with "
                                        "the streaming watch of the async and TypeScript SDKs)")


async def route(control: Control, box: Box, request: Request, method: str) -> Response:
    envd.user_of(request)
    if method == "WatchDir":
        message = await connect.Envelopes(request.stream()).only(time.monotonic() + connect.READ_DEADLINE)
        path, recursive = _path(message), message.get("recursive") is True
        give_back = envd.stream_place(box)
        try:
            sub = await envd.call(control, box, lambda: envd.supervisor(box).files.watch_dir(path,
                                                                                            recursive=recursive))
        except BaseException:
            give_back()
            raise
        return envd.streamed(_watch(control, box, sub, control.settings.keepalive), give_back)
    message = await connect.unary_body(request.stream())
    return JSONResponse(await envd.call(control, box, _unary, box, method, message))


async def _watch(control: Control, box: Box, sub: Any, keepalive: float) -> AsyncIterator[bytes]:
    yield connect.envelope({"start": {}})
    pump = envd.Pump(sub, lambda: box.session.status == "closed" or box.id not in control.boxes.ids())
    try:
        while True:
            event = await pump.get(keepalive)
            if event is None:
                yield connect.envelope({"keepalive": {}})
            elif isinstance(event, Exception):
                yield connect.end(ConnectError("unavailable", f"the watch was lost: {event}"))
                return
            elif (kind := EVENTS.get(getattr(event, "type", ""))) is not None:
                yield connect.envelope({"filesystem": {"name": event.name, "type": kind}})
    finally:
        pump.close()


# -- file contents over HTTP ------------------------------------------------------------------------------------


def _user(request: Request) -> None:
    name = request.query_params.get("username")
    if name == "root":
        raise wire.E2bError(403, "nbexec never runs as root: files are read and written as the sandbox's user")
    if name not in (None, "", "user"):
        raise wire.E2bError(401, f"invalid username: {name[:64]!r}")


def _http_path(raw: str | None) -> str:
    if not raw or "\x00" in raw or len(raw) > 4096:
        raise wire.E2bError(400, "path must name a file")
    return paths.inward(raw)


async def files(control: Control, box: Box, request: Request) -> Response:
    _user(request)
    if request.method == "GET":
        return await _read(control, box, request)
    if request.method == "POST":
        return await _write(control, box, request)
    raise wire.E2bError(405, "files are read with GET and written with POST")


async def _read(control: Control, box: Box, request: Request) -> Response:
    path, cap = _http_path(request.query_params.get("path")), box.session.config.max_data_bytes
    chunks: Iterator[bytes] = await _http_call(control, box, lambda: iter(envd.supervisor(box).files.read_file(
        path, max_bytes=cap)))
    first = await _http_call(control, box, next, chunks, b"")  # errors (missing, a folder) before the answer
    gzip = "gzip" in (request.headers.get("accept-encoding") or "")

    async def body() -> AsyncIterator[bytes]:
        packer = zlib.compressobj(wbits=31) if gzip else None
        chunk = first
        while chunk:
            yield packer.compress(chunk) if packer else chunk
            chunk = await control.io(box.owner, next, chunks, b"")
        if packer:
            yield packer.flush()
    headers = {"Content-Encoding": "gzip"} if gzip else {}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def _http_call(control: Control, box: Box, func: Any, *args: Any) -> Any:
    """Supervisor work with its errors as envd's HTTP answers (404 missing, 400 a folder, 507 no space)."""
    try:
        return await envd.call(control, box, func, *args)
    except ConnectError as exc:
        status = {"not_found": 404, "invalid_argument": 400, "permission_denied": 403,
                  "resource_exhausted": 507}.get(exc.code, 502)
        raise wire.E2bError(status, exc.message) from None


async def _write(control: Control, box: Box, request: Request) -> Response:
    with control.uploading(box.owner):
        return await _written(control, box, request)


async def _written(control: Control, box: Box, request: Request) -> Response:
    cap = box.session.config.max_data_bytes
    kind = request.headers.get("content-type") or ""
    if kind.startswith("multipart/form-data"):
        written = []
        async for name, part in _parts(request, kind):
            written.append(await _store(control, box, _http_path(request.query_params.get("path") or name),
                                        part, cap))
        if not written:
            raise wire.E2bError(400, "the upload has no file part")
        return JSONResponse(written)
    stream = _inflated(request.stream(), cap) if request.headers.get("content-encoding") == "gzip" \
        else request.stream()
    path = _http_path(request.query_params.get("path"))
    return JSONResponse([await _store(control, box, path, stream, cap)])


async def _store(control: Control, box: Box, path: str, chunks: AsyncIterator[bytes], cap: int) -> dict[str, Any]:
    """Write ``chunks`` to ``path`` in the sandbox: the request is read here while the supervisor writes on a
    worker thread, a few chunks apart (host memory stays flat whatever the body's size). A body that fails on the
    way (over the cap, cut off) aborts the write: nothing of it stays."""
    feed: queue.Queue[bytes | None] = queue.Queue(FEED)
    failed: list[BaseException] = []

    def produced() -> Iterator[bytes]:
        while True:
            try:
                chunk = feed.get(timeout=connect.READ_DEADLINE)
            except queue.Empty:  # the reading side is gone: the write is abandoned, nothing of it stays
                raise wire.E2bError(408, "the upload stopped coming") from None
            if chunk is None:
                break
            yield chunk
        if failed:  # the supervisor's writer discards what it wrote
            raise wire.E2bError(400, "the upload was cut off")
    writer = asyncio.ensure_future(_http_call(control, box, lambda: envd.supervisor(box).files.write_file(
        path, produced(), max_bytes=cap)))
    try:
        async for chunk in idle_deadline(chunks):
            if not await _put(feed, chunk, writer):
                break
    except BaseException as exc:
        failed.append(exc)
        raise
    finally:
        await _put(feed, None, writer)
        if failed:
            with contextlib.suppress(Exception):
                await writer
    found = await writer
    return {"name": found["name"], "type": "file", "path": paths.outward(found["path"])}


async def idle_deadline(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` while each comes within the read deadline: a body that stops holds nothing for long (408)."""
    iterator = chunks.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), connect.READ_DEADLINE)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise wire.E2bError(408, "the upload stopped coming") from None


async def _put(feed: queue.Queue[bytes | None], item: bytes | None, writer: asyncio.Future[Any]) -> bool:
    """Hand ``item`` to the writer without blocking the event loop; False once the writer has ended."""
    while not writer.done():
        try:
            feed.put_nowait(item)
            return True
        except queue.Full:
            await asyncio.sleep(0.005)
    return False


async def _inflated(chunks: AsyncIterator[bytes], cap: int) -> AsyncIterator[bytes]:
    """A gzip body inflated as it arrives, never past ``cap`` bytes (then 507, as a full disk is)."""
    unpacker, total = zlib.decompressobj(wbits=31), 0
    async for chunk in chunks:
        data = unpacker.decompress(chunk, cap + 1 - total)
        while True:
            total += len(data)
            if total > cap:
                raise wire.E2bError(507, f"the file is over the cap of {cap} bytes")
            if data:
                yield data
            if not unpacker.unconsumed_tail:
                break
            data = unpacker.decompress(unpacker.unconsumed_tail, cap + 1 - total)


async def _parts(request: Request, kind: str) -> AsyncIterator[tuple[str, AsyncIterator[bytes]]]:
    """The file parts of a multipart body: Starlette's parser, within MAX_PARTS parts and the gateway's max_body
    (a part past its first MiB waits in a private temporary file); each part's filename is its path."""
    del kind
    form = await request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS, max_part_size=64 * 1024)
    try:
        for _, value in form.multi_items():
            if isinstance(value, str):
                continue
            yield value.filename or "", _upload_chunks(value)
    finally:
        await form.close()


async def _upload_chunks(upload: Any) -> AsyncIterator[bytes]:
    while chunk := await upload.read(256 * 1024):
        yield chunk
