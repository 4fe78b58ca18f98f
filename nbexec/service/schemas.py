"""The JSON shapes of `nbexec serve`: request bodies and typed responses, so the OpenAPI document describes both.

Result models allow extra keys: a field the result gains reaches clients before it is described here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_CODE = 1_000_000
MAX_TIMEOUT = 3600


class SessionExecuteBody(BaseModel):
    code: str = Field(min_length=1, max_length=MAX_CODE, description="Python source to run.")
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT,
                                  description="Seconds; capped by the server's limit (default: that limit).")
    packages: list[str] = Field(default_factory=list, max_length=50, description=(
        "Packages to install before the code runs (e.g. tabulate, pyarrow==17.*): wheels fetched by the server "
        "under its package policy and installed offline; what became of each is in the result's `packages`."))


IMAGE_FIELD = Field(default=None, description=(
    "A named image to run in, one the server allows (NBEXEC_IMAGES); omitted or \"default\": the server's image. "
    "Any other value is refused with 400."))


class ExecuteBody(SessionExecuteBody):
    files: dict[str, str] | None = Field(
        default=None, description="Files to put in /mnt/data first: name -> base64 content (one-shot only).")
    image: str | None = IMAGE_FIELD


class SessionBody(BaseModel):
    """POST /v1/sessions (the body is optional)."""

    image: str | None = IMAGE_FIELD


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CellErrorModel(_Open):
    ename: str
    evalue: str
    traceback: list[str]
    kind: str = Field(description="exception, timeout, oom, kernel_died, limit, ...")
    cell_index: int | None = None


class ImageModel(_Open):
    name: str
    mime: str
    cell_index: int
    size: int
    url: str | None = Field(None, description="A relative route of this server, or the artifact store's URL.")


class FileModel(_Open):
    name: str = Field(description="Relative to /mnt/data.")
    size: int
    mime: str
    sha256: str
    url: str | None = None


class SkippedFileModel(_Open):
    name: str
    reason: str


class UploadModel(_Open):
    name: str
    kind: str
    status: str
    url: str | None = None
    reason: str | None = None
    blob: str | None = None


class ResultModel(_Open):
    """An execution's result: the library's result JSON without host paths."""

    ok: bool
    execution_id: str
    stdout: str
    stderr: str
    text: str
    error: CellErrorModel | None
    outputs: list[dict[str, Any]]
    images: list[ImageModel]
    files: list[FileModel]
    skipped_files: list[SkippedFileModel]
    duration_s: float
    timings: dict[str, float]
    truncated_bytes: int = 0
    uploads: list[UploadModel] = []
    notes: list[str] = []


class SessionModel(BaseModel):
    id: str
    status: str = Field(description="ready, busy or closed")
    idle_s: float
    cells: int


class FileListModel(BaseModel):
    files: list[FileModel] = Field(description="Regular files within max_data and max_files, hashed.")
    skipped_files: list[SkippedFileModel] = Field(default_factory=list, description=(
        "Entries not listed as files, with why (over a cap: never read; links, devices, ...)."))
    notes: list[str] = Field(default_factory=list)


class StoredModel(BaseModel):
    path: str = Field(description="Where the file is inside the sandbox.")
    size: int


class HealthModel(BaseModel):
    status: str


class ReadyModel(_Open):
    ready: bool
    docker: str
    image: str
    pool_ready: int
    pool_filled: bool
    error: str | None = None


class ProblemModel(BaseModel):
    detail: Any


STREAMED = {
    "description": "The result as JSON; with ?stream=true, server-sent events instead: `output` (one per output, "
                   "with its cell_index), then `result` (the result JSON) or `error` ({status, detail}).",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}
