"""One run on a node, seen from this host: send the cells, gather the outputs, stream the files home.

A node's result is its public JSON (relative URLs, no host paths). Its outputs land in the local notebook under
the local cell numbers; images are saved from the outputs themselves (as a local run saves them); each file is
streamed from its route into ``<output_dir>/data`` through directory descriptors, never past max_data in total,
max_files in count, or a name that leaves the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mimetypes
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

from nbexec import notebook
from nbexec.config import SandboxConfig, is_image_name
from nbexec.engine.budget import MAX_ERROR, OutputCallback
from nbexec.errors import FileTransferError, NodeLostError, NodeUnavailableError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder
from nbexec.notebook import outputs
from nbexec.result import ERROR_KINDS, CellError, ExecutionResult, File, SkippedFile, Upload

from . import paths
from .nodes import NodeClient

_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class Run:
    """What one execution gathered so far from its node."""

    def __init__(self, nb: NotebookNode, cells: list[int], config: SandboxConfig,
                 on_output: OutputCallback | None, packages: tuple[str, ...] = ()) -> None:
        self.nb, self.cells, self.config, self.on_output = nb, cells, config, on_output
        self.packages = packages  # asked for by the call: sent with the first cell, installed by the node
        self.deadline = time.monotonic() + config.timeout
        self.error: CellError | None = None
        self.truncated = 0
        self.notes: list[str] = []
        self.node: str | None = None
        self.files: list[dict[str, Any]] = []  # the last result's listing: /mnt/data as the run left it
        self.skipped: list[SkippedFile] = []
        self.node_uploads: list[Upload] = []
        self.kept: list[File] = []  # files downloaded here
        self.linked: list[File] = []  # files the node uploaded to its store: only their links travel

    def local(self, node_index: Any) -> int:
        """The local cell index of the node's cell ``node_index`` (the node numbers only the cells it was sent)."""
        index = int(node_index)
        if not 0 <= index < len(self.cells):
            raise FileTransferError(f"a node reported output of cell {index}, which it was not sent")
        return self.cells[index]

    def on_event(self, kind: str, data: Any) -> None:
        if kind != "output" or self.on_output is None or not isinstance(data, dict):
            return
        output = {k: v for k, v in data.items() if k != "cell_index"}
        self.on_output(self.local(data.get("cell_index", 0)), nbformat.from_dict(output))

    def take(self, result: dict[str, Any]) -> None:
        """Add one node result (one cell, or the whole one-shot) to the run."""
        self.node = str(result.get("node") or self.node or "")
        for output in result.get("outputs", []):
            index = self.local(output.get("cell_index", 0))
            plain = {k: v for k, v in output.items() if k != "cell_index"}
            self.nb.cells[index].outputs.append(nbformat.from_dict(plain))
        failed = _node_error(result, self.local)
        self.error = failed if failed is not None else self.error
        self.truncated += int(result.get("truncated_bytes", 0))
        self.notes += [str(n) for n in result.get("notes", [])]
        self.files = list(result.get("files", []))
        self.skipped = [SkippedFile(str(s["name"]), str(s["reason"])) for s in result.get("skipped_files", [])]
        self.node_uploads += [Upload(str(u["name"]), str(u["kind"]), str(u["status"]), u.get("url"), u.get("reason"),
                                     u.get("blob")) for u in result.get("uploads", [])
                              if u.get("url") and not str(u["url"]).startswith("/")]

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())


def _node_error(result: dict[str, Any], local: Callable[[Any], int]) -> CellError | None:
    """The failure a node's result reports, checked like any hostile input: its error (fields of the wrong type
    made text, trimmed to MAX_ERROR, terminal controls made visible), else the first error among its outputs,
    else, when it says ``ok`` is not true, a failure that says so. A node's failure is never dropped."""
    error = result.get("error")
    if not isinstance(error, dict):
        shown = result.get("outputs")
        found = outputs.first_error([o for o in shown if isinstance(o, dict)] if isinstance(shown, list) else [])
        error = found.to_dict() if found is not None else None
    if error is None:
        return None if result.get("ok") is True else CellError(
            "NodeError", "The node said the run failed without saying why.", (), "exception")
    lines = error.get("traceback")
    lines = [str(line) for line in lines] if isinstance(lines, list) else []
    ename, evalue, lines = outputs.trim_error(str(error.get("ename") or "UnknownError"), str(error.get("evalue", "")),
                                              lines, MAX_ERROR)
    kind = error.get("kind") if error.get("kind") in ERROR_KINDS else "exception"
    index = error.get("cell_index")
    try:
        cell = local(index) if index is not None else None
    except (TypeError, ValueError, FileTransferError):
        cell = None
    cleaned = outputs.first_error([{"output_type": "error", "ename": ename, "evalue": evalue, "traceback": lines,
                                    "cell_index": cell}])
    assert cleaned is not None
    return dataclasses.replace(cleaned, kind=str(kind))


def image_body(config: SandboxConfig) -> dict[str, str]:
    """What a body says of the image: a named image's name (the node checks it against its own NBEXEC_IMAGES);
    nothing for a Docker tag, which is this host's choice and means the node's own image."""
    return {"image": config.image} if is_image_name(config.image) else {}


def one_shot(client: NodeClient, run: Run, files: dict[str, bytes], folder: OutputFolder) -> None:
    """The notebook's one code cell as /v1/execute; its files streamed home."""
    import base64

    body: dict[str, Any] = {"code": run.nb.cells[run.cells[0]].source, "timeout": run.remaining(),
                            "packages": list(run.packages), **image_body(run.config)}
    if files:
        body["files"] = {n: base64.b64encode(c).decode("ascii") for n, c in files.items()}
    result = client.run("/v1/execute", body, run.on_event)
    run.take(result)
    download(client, run, folder)


def cell_by_cell(client: NodeClient, run: Run, files: dict[str, bytes], folder: OutputFolder) -> None:
    """Each code cell in turn in a throwaway session on ``client``'s node, up to the first failure."""
    routes = {name: paths.encode(name) for name in files}  # checked before anything is sent
    made = client.request("POST", "/v1/sessions", "start a session", json=image_body(run.config) or None).json()["id"]
    session = "/v1/sessions/" + paths.encode(str(made))
    try:
        for name, content in files.items():
            client.request("PUT", f"{session}/files/{routes[name]}", "take a file", content=content)
        for index in run.cells:
            if time.monotonic() >= run.deadline:
                run.error = CellError("TimeoutError", f"The run passed its {run.config.timeout:g} s time limit "
                                      "before this cell started.", (), "timeout", index)
                break
            body = {"code": run.nb.cells[index].source, "timeout": run.remaining(),
                    "packages": list(run.packages) if index == run.cells[0] else []}
            try:
                run.take(client.run(f"{session}/execute", body, run.on_event))
            except NodeUnavailableError as exc:  # earlier cells ran there: running again elsewhere would repeat them
                if index == run.cells[0]:
                    raise
                raise NodeLostError(f"{exc}; earlier cells had run there, so the run is not retried") from exc
            if run.error is not None:
                break
        download(client, run, folder)
    finally:
        with contextlib.suppress(Exception):  # a lost node took the session with it
            client.request("DELETE", session, "end a session")


def download(client: NodeClient, run: Run, folder: OutputFolder, known: dict[str, File] | None = None) -> None:
    """Stream the files of the run's last listing into ``folder``/data, within max_data and max_files.

    ``known`` (a session's memory, updated here) spares fetching files whose sha256 did not change."""
    cap = run.config.max_data_bytes  # 0: no cap
    left = cap
    known = {} if known is None else known
    with folder.child("data") as data:
        for item in run.files:
            name, url, sha = str(item.get("name", "")), str(item.get("url") or ""), str(item.get("sha256", ""))
            if url and not url.startswith("/"):
                run.linked.append(File(name, "", int(item.get("size", 0)), str(item.get("mime", "")), sha, url))
                continue
            reason = _over(run, cap, left)
            if reason is not None:
                run.skipped.append(SkippedFile(name, reason))
                continue
            try:
                kept = known[name] if name in known and known[name].sha256 == sha else \
                    _fetch(client, url, data, name, left)
            except FileTransferError as exc:
                run.skipped.append(SkippedFile(name, str(exc)))
                continue
            left -= kept.size
            known[name] = kept
            run.kept.append(kept)


def _over(run: Run, cap: int, left: int) -> str | None:
    """Why no further file of the run is kept here: max_files reached, or max_data spent (a spent budget is
    never "no cap")."""
    if len(run.kept) >= run.config.max_files:
        return f"over the cap of {run.config.max_files} files"
    if cap and left <= 0:
        return f"over the {run.config.max_data} cap on a run's files (max_data), spent by the files before it"
    return None


def _fetch(client: NodeClient, url: str, folder: OutputFolder, name: str, cap: int) -> File:
    if not url.startswith("/v1/"):
        raise FileTransferError("the node gave no route for it")
    with client.call(f"send {name}"), client.http.stream("GET", url) as response:
        client.check(response)
        return save(folder, name, response.iter_bytes(1 << 20), cap)


def _parts(name: str) -> list[str]:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or "\0" in p or len(p.encode()) > 255 for p in parts):
        raise FileTransferError(f"{name!r} is not a plain relative name")
    return parts


def save(folder: OutputFolder, name: str, chunks: Iterator[bytes], cap: int) -> File:
    """Write ``chunks`` to ``folder``/``name`` (folders made privately, nothing followed), stopping past ``cap``
    bytes (0: none) with nothing left behind."""
    parts = _parts(name)
    opened: list[OutputFolder] = []
    try:
        here = folder
        for part in parts[:-1]:
            here = here.child(part)
            opened.append(here)
        return _write(here, parts[-1], name, chunks, cap)
    except (OSError, ValueError) as exc:
        raise FileTransferError(f"cannot keep {name!r} here: {exc}") from exc
    finally:
        for item in opened:
            item.close()


def _write(folder: OutputFolder, leaf: str, name: str, chunks: Iterator[bytes], cap: int) -> File:
    """Write into a new private file, then rename it over ``leaf`` (a session's file may change between runs)."""
    temp = f".nbexec-download-{os.urandom(6).hex()}"
    fd = os.open(temp, _WRITE, folder.file_mode, dir_fd=folder.fd)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if cap and size > cap:
                    raise FileTransferError(f"larger than the /mnt/data cap ({cap} bytes)")
                digest.update(chunk)
                handle.write(chunk)
        os.replace(temp, leaf, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder.fd)
        raise
    mime = mimetypes.guess_type(leaf)[0] or "application/octet-stream"
    return File(name, str(folder.path / leaf), size, mime, digest.hexdigest())


def finish(run: Run, execution_id: str, out: Path, folder: OutputFolder, started: float, *, first_cell: int = 0,
           notebook_name: str | None = None) -> ExecutionResult:
    """The result of the run's cells from ``first_cell`` on, its images saved from the outputs and its notebook
    written into ``folder`` (as a new notebook.ipynb, or replacing ``notebook_name``)."""
    flat = outputs.flatten(run.nb, first_cell)
    view = outputs.views(flat)
    images, image_notes = transfer.save_images(outputs.images(flat), folder, max_bytes=run.config.max_display_bytes)
    run.nb.metadata.setdefault("nbexec", {}).update(
        {"execution_id": execution_id, "ok": run.error is None, "node": run.node})
    if notebook_name is None:
        path = artifacts.write_new(folder, "notebook.ipynb", notebook.dumps(run.nb))
    else:
        path = artifacts.replace(folder, notebook_name, notebook.dumps(run.nb))
    duration = time.monotonic() - started
    return ExecutionResult(
        ok=run.error is None, execution_id=execution_id, stdout=view.stdout, stderr=view.stderr, text=view.text,
        error=run.error, outputs=tuple(flat), images=tuple(images), files=tuple(run.kept),
        skipped_files=tuple(run.skipped), notebook=run.nb, notebook_path=str(path), output_dir=str(out),
        duration_s=duration, timings={"total_s": duration}, truncated_bytes=run.truncated,
        notes=tuple(run.notes + image_notes), node=run.node)


def published(result: ExecutionResult, run: Run) -> ExecutionResult:
    """Add the files the node uploaded itself (links only) after the local store had the downloaded ones."""
    return dataclasses.replace(result, files=result.files + tuple(run.linked),
                               uploads=result.uploads + tuple(run.node_uploads))
