"""What `nbexec mcp`'s tools do with a client's session.

They run a call that the client's cancellation interrupts, put an uploaded file into /mnt/data, and run shell
commands.

Cancellation: the SDK applies ``notifications/cancelled`` by cancelling the handler's scope, and never answers.
The run is a worker thread that cancellation cannot stop. So the handler, shielded, interrupts the session's
kernel until the run has ended. Its cell stops, the session's lock is free for the next call, and the notebook
records the cell as interrupted (an error, never ok).

Uploads: `upload_checked` checks the name and size before a byte is decoded or written. The name must be plain: no
folder, absolute path, ``..``, NUL or control character, at most 255 bytes. The base64 content must fit the
argument limit, its decoded size max_data, and one more file must fit under max_files.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

from nbexec.config import SandboxConfig
from nbexec.engine.session import Session
from nbexec.errors import FileTransferError
from nbexec.files import transfer

T = TypeVar("T")

MAX_UPLOAD_CHARS = 16 * 1024 * 1024  # the content argument's length: base64 of 12 MiB
_INTERRUPT_EVERY_S = 0.5
UPLOAD_DESCRIPTION = ("Put a file into /mnt/data (the working directory of code and shell commands) for later calls "
                      "to read. name: a plain file name (no folders); content_base64: its bytes in standard base64. "
                      "The /mnt/data size and file-count caps apply.")


async def interruptible(session: Session, call: Callable[[], T]) -> T:
    """``call()``, a run of ``session``, in a worker thread that the client's cancellation interrupts.

    When the handler is cancelled, the session is interrupted until the call has ended; then the cancellation goes
    on. A run that had not reached its cell yet (starting the sandbox, installing) is interrupted once it does."""
    finished = threading.Event()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the awaiting handler below
            failure.append(exc)
        finally:
            finished.set()

    try:
        await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        with anyio.CancelScope(shield=True):
            while not finished.is_set():
                await anyio.to_thread.run_sync(session.interrupt)
                await anyio.to_thread.run_sync(finished.wait, _INTERRUPT_EVERY_S)
        raise
    if failure:
        raise failure[0]
    return outcome[0]


def upload_checked(session: Session, config: SandboxConfig, name: str, content: str, *,
                   max_chars: int = MAX_UPLOAD_CHARS) -> str:
    """Decode base64 ``content`` and write it to /mnt/data/``name``; FileTransferError (a clear message, nothing
    written) for a name or size the caps refuse. Returns the path inside the sandbox."""
    problem = name_problem(name)
    if problem:
        raise FileTransferError(f"refused {name[:80]!r}: {problem}")
    if not isinstance(content, str):
        raise FileTransferError("content must be the file's bytes in base64 (a string)")
    if len(content) > max_chars:
        raise FileTransferError(f"content is {len(content):,} characters of base64; the limit is {max_chars:,} "
                                "(put larger files in place another way)")
    limit = config.max_data_bytes  # the decoded bytes are bounded by max_chars: decode, then check
    try:
        data = base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise FileTransferError("content is not valid base64 (standard alphabet, with padding)") from None
    if limit and len(data) > limit:
        raise FileTransferError(f"{name!r} is {len(data):,} bytes, larger than the /mnt/data cap ({config.max_data})")
    listing = session.listing()
    present = {f.name for f in listing.files} | {s.name for s in listing.skipped}
    if name not in present and len(present) >= config.max_files:
        raise FileTransferError(f"/mnt/data already holds {len(present)} files, the max_files cap "
                                f"({config.max_files}); delete some first")
    return session.upload(data, name)


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain file name for /mnt/data, or None."""
    if not isinstance(name, str) or not name:
        return "the name must be a non-empty string"
    if "\0" in name:
        return "the name holds a NUL byte"
    if "/" in name or "\\" in name:
        return "give a plain file name, without folders or an absolute path"
    if name in (".", ".."):
        return "the name must not be . or .."
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 255:
        return f"the name is {len(raw)} bytes long; the limit is 255"
    return transfer.valid_name(raw)
