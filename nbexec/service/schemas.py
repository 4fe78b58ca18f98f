"""The JSON shapes of `nbexec serve`: request bodies and typed responses, so the OpenAPI document describes both.

A result, a file and a listing are not described here: their shape (and its JSON schema) is read off the value
types in `nbexec.result`, the one definition (``public``: without host paths), which allows extra keys, so a field
the result gains reaches clients before they know it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nbexec.egress import MAX_RULES
from nbexec.result import File, SkippedFile, json_schema

MAX_CODE = 1_000_000
MAX_CELLS = 1000  # cells of one request (`cells`)
MAX_TIMEOUT = 3600


class SessionExecuteBody(BaseModel):
    code: str | None = Field(default=None, min_length=1, max_length=MAX_CODE,
                             description="Source to run as one cell, in the session's language (or give `cells`).")
    cells: list[Annotated[str, Field(max_length=MAX_CODE)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CELLS, description=(
            "Sources to run as cells, in order, instead of `code` (their sizes add up to at most the size of one "
            "`code`). The run stops at the first cell that raises, unless `allow_errors`."))
    allow_errors: bool = Field(default=False, description=(
        "Run every cell and keep each error (nbclient's option): the result still fails (`ok` false, `error` the "
        "first error, a note lists the cells that raised). A time limit, sys.exit() or a dead kernel still end it."))
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT,
                                  description="Seconds; capped by the server's limit (default: that limit).")
    packages: list[str] = Field(default_factory=list, max_length=50, description=(
        "Packages to install before the code runs (e.g. tabulate, pyarrow==17.*): wheels fetched by the server "
        "under its package policy and installed offline; what became of each is in the result's `packages`."))
    language: str | None = Field(default=None, max_length=40, description=(
        "The session's language, when the client wants it checked: any other is refused with 400 (a session keeps "
        "the language it started with)."))

    @model_validator(mode="after")
    def _one_source(self) -> SessionExecuteBody:
        if (self.code is None) == (self.cells is None):
            raise ValueError("give either code (one cell) or cells (a list of sources), not both or neither")
        if self.cells is not None and sum(len(cell) for cell in self.cells) > MAX_CODE:
            raise ValueError(f"the cells hold more than {MAX_CODE} characters in all")
        if not any(source.strip() for source in self.sources()):
            raise ValueError("there is no code to run: the code or every cell is blank")
        return self

    def sources(self) -> list[str]:
        """The cells to run: ``cells``, or ``code`` as the one cell."""
        return list(self.cells) if self.cells is not None else [self.code or ""]


IMAGE_FIELD = Field(default=None, description=(
    "A named image to run in, one the server allows (NBEXEC_IMAGES); omitted or \"default\": the server's image. "
    "Any other value is refused with 400."))


LANGUAGE_FIELD = Field(default=None, max_length=40, description=(
    "The code's language: python, r, deno (TypeScript/JavaScript) or bash (aliases: py, R, ts, js, sh); omitted: "
    "the server's language. One the server does not offer (NBEXEC_LANGUAGES) is refused with 400."))


class ExecuteBody(SessionExecuteBody):
    files: dict[str, str] | None = Field(
        default=None, description="Files to put in /mnt/data first: name -> base64 content (one-shot only).")
    image: str | None = IMAGE_FIELD
    language: str | None = LANGUAGE_FIELD


class SessionBody(BaseModel):
    """POST /v1/sessions (the body is optional)."""

    image: str | None = IMAGE_FIELD
    language: str | None = LANGUAGE_FIELD
    from_snapshot: str | None = Field(default=None, max_length=200,
                                      description="Start from this snapshot of yours (POST .../snapshot).")


class EgressBody(BaseModel):
    """POST /v1/sessions/{id}/egress (and a node's /v1/sandboxes/{id}/egress): change a running allowlist."""

    allow: list[str] = Field(default_factory=list, max_length=MAX_RULES, description=(
        "allowed_hosts entries to allow from now on (within the session's first ones unless NBEXEC_EGRESS_WIDEN)."))
    deny: list[str] = Field(default_factory=list, max_length=MAX_RULES, description=(
        "allowed_hosts entries to deny from now on; open connections to them are closed. Applied after allow."))


class SandboxBody(BaseModel):
    purpose: Literal["oneshot", "session"] = Field(
        default="session", description="oneshot: a warm, pooled sandbox for one execution; session: kept for many.")
    image: str | None = IMAGE_FIELD
    language: str | None = LANGUAGE_FIELD


class RunBody(BaseModel):
    code: str = Field(max_length=MAX_CODE, description="Source to run as one cell, in the sandbox's language.")
    timeout: float = Field(gt=0, le=MAX_TIMEOUT, description="Seconds; capped by the node's limit.")


class HiddenBody(BaseModel):
    """A node's hidden route takes one of nbexec's own requests by name (`nbexec.sandbox.hidden`), never code."""

    model_config = ConfigDict(extra="forbid")
    operation: Literal["packages.setup", "packages.install"] = Field(description="The request (hidden.NAMES).")
    args: dict[str, Any] = Field(default_factory=dict, max_length=8, description="Its arguments: data, not code.")
    timeout: float = Field(gt=0, le=MAX_TIMEOUT, description="Seconds; capped by the node's limit.")


class WakeBody(BaseModel):
    """A wake from a checkpoint may name its own time limit (a run's, whose limit covers its wake)."""

    model_config = ConfigDict(extra="forbid")
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT, description="Seconds; capped by the node's.")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class SessionModel(BaseModel):
    id: str
    status: str = Field(description="new, ready, busy, asleep, dead or closed")
    idle_s: float
    cells: int
    language: str = Field(default="python", description="The session's language (its kernel).")


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


RESULT = {
    "description": "The result as JSON; with ?stream=true, server-sent events instead: `output` (one per output, "
                   "with its cell_index), then `result` (the result JSON) or `error` ({status, detail}).",
    "content": {"application/json": {"schema": json_schema(public=True)},
                "text/event-stream": {"schema": {"type": "string"}}},
}
LISTING = {
    "description": "/mnt/data as a run would collect it: `files` within max_data and max_files (hashed), "
                   "`skipped_files` (over a cap: never read; links, devices, ...) with why, and `notes`.",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["files", "skipped_files", "notes"],
        "properties": {"files": {"type": "array", "items": json_schema(File, public=True)},
                       "skipped_files": {"type": "array", "items": json_schema(SkippedFile, public=True)},
                       "notes": {"type": "array", "items": {"type": "string"}}}}}},
}


def refused(errors: Sequence[Any]) -> dict[str, Any]:
    """A 422's body for a request that failed its schema: where and why, never the value sent back (a NaN or
    an Infinity a client sent cannot be written as JSON: echoed, it made the answer a 500)."""
    return {"detail": [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                       for e in errors[:20]]}
