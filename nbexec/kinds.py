"""The words nbexec's values take, each a `Literal` type: the code, mypy and the docs share one list.

docs/library.md ("Words in a result") lists each type's words; tests/test_kinds.py keeps that table equal to the
types here and drives the code that makes each error kind, so a new word cannot reach users unlisted. Pure.
"""

from __future__ import annotations

from typing import Literal, get_args

ErrorKind = Literal["exception", "timeout", "oom", "kernel_died", "limit", "protocol", "exit"]
"""`CellError.kind`: why an execution failed (``exit``: a shell command's non-zero status, `Session.shell`)."""

SessionStatus = Literal["new", "ready", "busy", "asleep", "dead", "closed"]
"""`Session.status`."""

PackageStatus = Literal["installed", "provided", "refused", "failed"]
"""`Package.status`: what became of a package the call or the code's pip line asked for."""

UploadKind = Literal["file", "image"]
"""`Upload.kind`: what was sent to the artifact store."""

UploadStatus = Literal["uploaded", "kept", "failed", "skipped"]
"""`Upload.status`: what the artifact store did with it."""

RestoredBy = Literal["checkpoint", "replay"]
"""`ExecutionResult.restored`: how a sleeping session's memory came back for this run."""

ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)
