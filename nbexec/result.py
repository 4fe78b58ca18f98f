"""The value types of an execution's result and their stable JSON shape."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nbformat import NotebookNode

ERROR_KINDS = ("exception", "timeout", "oom", "kernel_died", "limit", "protocol")


@dataclass(frozen=True)
class CellError:
    """Why an execution failed. ``kind`` is one of ERROR_KINDS; ``traceback`` lines carry no ANSI escapes."""

    ename: str
    evalue: str
    traceback: tuple[str, ...]
    kind: str = "exception"
    cell_index: int | None = None

    @property
    def traceback_text(self) -> str:
        return "\n".join(self.traceback)

    def to_dict(self) -> dict[str, Any]:
        return {"ename": self.ename, "evalue": self.evalue, "traceback": list(self.traceback), "kind": self.kind,
                "cell_index": self.cell_index}


@dataclass(frozen=True)
class Image:
    """An image output, saved on the host."""

    mime: str
    path: str
    cell_index: int
    size: int
    url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"mime": self.mime, "path": self.path, "cell_index": self.cell_index, "size": self.size,
                "url": self.url}


@dataclass(frozen=True)
class File:
    """A regular file the code left in /mnt/data. ``name`` is relative to /mnt/data."""

    name: str
    path: str
    size: int
    mime: str
    sha256: str
    url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "size": self.size, "mime": self.mime, "sha256": self.sha256,
                "url": self.url}


@dataclass(frozen=True)
class SkippedFile:
    """Something in /mnt/data that was not collected, and why (a link, a FIFO, a size cap, a bad name...)."""

    name: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class Upload:
    """What happened to one file or image in the artifact store: uploaded, kept (local store), failed or
    skipped (a cap). ``url`` is set when the file can be fetched; ``reason`` says why not."""

    name: str
    kind: str
    status: str
    url: str | None
    reason: str | None = None
    blob: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "status": self.status, "url": self.url, "reason": self.reason,
                "blob": self.blob}


@dataclass(frozen=True)
class Package:
    """A package asked for by the call or a pip line of the code, and what became of it (see `nbexec.packages`).

    ``status``: installed (asked by the call, installed before the code ran), provided (its wheel was put in
    /mnt/wheels for the code's own pip line, or as a dependency), refused (the policy; never downloaded) or
    failed (it could not be resolved or installed). ``reason`` says why for the last two."""

    name: str
    status: str
    version: str | None = None
    sha256: str | None = None
    filename: str | None = None
    size: int | None = None
    requested: bool = True
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "version": self.version, "sha256": self.sha256,
                "filename": self.filename, "size": self.size, "requested": self.requested, "reason": self.reason}


@dataclass(frozen=True)
class Connection:
    """One connection through the egress proxy of ``network="allowlist"`` (see `nbexec.egress`): where to, whether
    it was allowed, why it was refused or ended (``reason``), the address the host connected to, and the bytes
    sent up (from the sandbox) and down. ``open``: still open when the execution ended (logged again next time)."""

    host: str
    port: int
    method: str
    allowed: bool
    reason: str | None = None
    address: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    open: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "method": self.method, "allowed": self.allowed,
                "reason": self.reason, "address": self.address, "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down, "open": self.open}


@dataclass(frozen=True)
class ExecutionResult:
    """Everything one execution produced. ``ok`` is False when the code raised, timed out or was stopped."""

    ok: bool
    execution_id: str
    stdout: str
    stderr: str
    text: str
    error: CellError | None
    outputs: tuple[dict[str, Any], ...]
    images: tuple[Image, ...]
    files: tuple[File, ...]
    skipped_files: tuple[SkippedFile, ...]
    notebook: NotebookNode = field(repr=False, compare=False)
    notebook_path: str | None
    output_dir: str
    duration_s: float
    timings: dict[str, float]
    truncated_bytes: int = 0
    uploads: tuple[Upload, ...] = ()
    notes: tuple[str, ...] = ()  # nbexec's own remarks on what it capped, dropped or enforced (never the code's)
    packages: tuple[Package, ...] = ()  # packages asked for and what became of them (nbexec.packages)
    connections: tuple[Connection, ...] = ()  # network="allowlist": every connection tried (nbexec.egress)
    node: str | None = None  # the node that ran it (NBEXEC_NODES, `nbexec serve`); None for a local run

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON shape (see the README); the notebook itself is at ``notebook_path``."""
        return {
            "ok": self.ok,
            "execution_id": self.execution_id,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "text": self.text,
            "error": self.error.to_dict() if self.error else None,
            "outputs": [dict(o) for o in self.outputs],
            "images": [i.to_dict() for i in self.images],
            "files": [f.to_dict() for f in self.files],
            "skipped_files": [s.to_dict() for s in self.skipped_files],
            "notebook_path": self.notebook_path,
            "output_dir": self.output_dir,
            "duration_s": round(self.duration_s, 6),
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
            "truncated_bytes": self.truncated_bytes,
            "uploads": [u.to_dict() for u in self.uploads],
            "notes": list(self.notes),
            "packages": [p.to_dict() for p in self.packages],
            "connections": [c.to_dict() for c in self.connections],
            "node": self.node,
        }

    def to_json(self, **dumps_options: Any) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, **dumps_options)
