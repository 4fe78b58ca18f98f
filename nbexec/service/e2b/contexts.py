"""The code interpreter's contexts: more kernels in one sandbox, each its own state and working folder.

The sandbox's own kernel (its session's) is the default context of its language. Another context is a kernel the
sandbox's supervisor starts inside the same container (`nbexec.sandbox.docker.contexts`), so it shares the
sandbox's files and limits. A run with ``language`` and no ``context_id`` goes to that language's default context,
started on first use, as E2B's server does. A language is offered when the sandbox's image has its kernel.

Contexts live as long as the sandbox's container: pausing the sandbox ends them (its own kernel comes back).
At most MAX_CONTEXTS per sandbox; one run at a time in each (a second waits within its own time limit)."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

from nbexec import languages, notebook
from nbexec.config import SandboxConfig
from nbexec.engine import cells
from nbexec.errors import ConfigError, SandboxError, SessionBusyError, SessionError
from nbexec.result import CellError
from nbexec.sandbox.docker import kernels
from nbexec.sandbox.docker.contexts import ContextKernel
from nbexec.sandbox.docker.supervisor import MAX_CWD_BYTES, BadArgumentError, NotFoundError, PermissionDeniedError
from nbexec.sandbox.source import DATA_MOUNT, SandboxHandle

from . import envd
from .boxes import Box
from .wire import E2bError

MAX_CONTEXTS = 8  # contexts per sandbox besides its own kernel: each is a kernel process in its memory
_NO_LOCK = contextlib.nullcontext()
E2B_NAMES = {"python": "python", "r": "r", "deno": "typescript", "bash": "bash"}  # what the SDKs call them


class Starting(E2bError):
    """The context's id is taken by a start or restart in flight."""


@dataclass
class Context:
    id: str
    language: str  # nbexec's name
    said: str  # the name the client gave (javascript, ts ...), reported back
    cwd: str
    kernel: ContextKernel
    lock: threading.Lock = field(default_factory=threading.Lock)

    def described(self) -> dict[str, str]:
        return {"id": self.id, "language": self.said, "cwd": self.cwd}


@dataclass(frozen=True)
class Ended:
    """How a run ended, for the interpreter's last lines: its error (None when it succeeded), its count."""

    error: CellError | None
    execution_count: int | None


class Contexts:
    """One sandbox's contexts, in the container they live in (``handle``, reached through ``supervisor``)."""

    def __init__(self, handle: Any, supervisor: Any) -> None:
        self.handle, self.supervisor = handle, supervisor
        self.items: dict[str, Context] = {}
        self.starting: set[str] = set()  # ids whose kernel is starting (a create, a restart): each counts and is taken
        self.ended = False
        self.lock = threading.Lock()

    def abandon(self) -> None:
        """The sandbox is ending: starts in flight give up (see `_start`), nothing more is kept."""
        with self.lock:
            self.ended = True

    def going(self) -> None:
        if self.ended:
            raise SandboxError("the sandbox paused or ended while the context started")

    def close(self) -> None:
        with self.lock:
            found, self.items, self.ended = list(self.items.values()), {}, True
        for context in found:
            context.kernel.close()


def own(box: Box) -> dict[str, str]:
    """The sandbox's own kernel as a context."""
    language = box.session.config.language
    return {"id": language, "language": E2B_NAMES.get(language, language), "cwd": DATA_MOUNT}


def listed(box: Box) -> list[dict[str, str]]:
    found = box.extra.get("contexts")
    with found.lock if found else _NO_LOCK:
        made = [c.described() for c in (found.items.values() if found else ())]
    return [own(box), *made]


def _of(box: Box) -> Contexts:
    """The contexts of the sandbox's running container; those of a container it no longer has are ended."""
    sup = envd.supervisor(box)  # starts the sandbox (a wake) when it sleeps
    handle = box.session._started_handle()
    with box.lock:
        found = box.extra.get("contexts")
        if found is not None and found.handle is handle and found.supervisor is sup and not found.ended:
            return cast(Contexts, found)  # a supervisor the sandbox's code killed took its kernels: a new one
        box.extra["contexts"] = made = Contexts(handle, sup)
    if found is not None:
        found.close()
    return made


def find(box: Box, context_id: str) -> Context | None:
    found = box.extra.get("contexts")
    if found is None:
        return None
    with found.lock:
        return cast("Context | None", found.items.get(context_id))


def language_of(box: Box, asked: Any) -> str:
    """nbexec's name for the language ``asked``, when this sandbox's image has its kernel; 400 otherwise."""
    if not isinstance(asked, str) or not asked or len(asked) > 64:
        raise E2bError(400, "language must be a language name")
    config = box.session.config
    try:
        name = languages.canonical(asked.strip(), "language")
        config.offer_language(name)  # the operator's NBEXEC_LANGUAGES
    except ConfigError as exc:
        raise E2bError(400, str(exc)) from None
    offered = (config.language,) if name == config.language else kernels.of_image(config.image_tag)
    if name not in offered:
        raise E2bError(400, f"this sandbox's image ({config.image_tag}) has no {name} kernel; it offers "
                            f"{', '.join(dict.fromkeys((config.language, *offered)))}. The operator adds kernels "
                            f"with `nbexec image build --kernels {name}` and offers that image as a template")
    return name


def create(box: Box, language: str, said: str, cwd: Any, *, context_id: str = "") -> Context:
    """Start a context (blocking: a kernel starts within the sandbox's start-up limit)."""
    cwd = DATA_MOUNT if cwd is None else cwd
    if not isinstance(cwd, str) or not cwd.startswith("/") or len(cwd.encode()) > MAX_CWD_BYTES or "\0" in cwd:
        raise E2bError(400, "cwd must be an absolute path")
    contexts = _of(box)
    made_id = context_id or secrets.token_hex(8)
    with contexts.lock:
        if made_id in contexts.items or made_id in contexts.starting:
            raise Starting(409, f"context {made_id!r} is starting or restarting; try again when it is up")
        if len(contexts.items) + len(contexts.starting) >= MAX_CONTEXTS:
            raise E2bError(429, f"a sandbox has at most {MAX_CONTEXTS} contexts besides its own kernel: remove one "
                                "first", retry=False)
        contexts.starting.add(made_id)
    return _start(box, contexts, made_id, language, said, cwd)


def _start(box: Box, contexts: Contexts, context_id: str, language: str, said: str, cwd: str) -> Context:
    """The kernel of the context ``context_id`` (taken in ``contexts.starting`` by the caller) started and kept."""
    try:
        kernel = ContextKernel.start(contexts.handle, contexts.supervisor, language, cwd=cwd,
                                     timeout=box.session.config.startup_timeout, check=contexts.going)
    except (NotFoundError, BadArgumentError, PermissionDeniedError) as exc:  # the client's cwd, said plainly
        raise E2bError(400, f"the context cannot start in {cwd[:256]!r}: {exc}") from None
    finally:
        with contexts.lock:
            contexts.starting.discard(context_id)
    made = Context(context_id, language, said, cwd, kernel)
    with contexts.lock:
        if not contexts.ended:
            contexts.items[made.id] = made
            return made
    kernel.close()
    raise E2bError(409, "the sandbox paused or ended while the context started")


def default(box: Box, language: str, said: str) -> Context:
    """The default context of ``language`` (not the sandbox's own): started on first use; a call that finds
    another starting it waits for that one (within the start-up limit)."""
    deadline = time.monotonic() + box.session.config.startup_timeout
    while True:
        found = find(box, language)
        if found is not None and found.kernel.alive():
            return found
        if found is not None:
            remove(box, language)
        try:
            return create(box, language, said, None, context_id=language)
        except Starting:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def remove(box: Box, context_id: str) -> bool:
    found = box.extra.get("contexts")
    if found is None:
        return False
    with found.lock:
        context = found.items.pop(context_id, None)
    if context is None:
        return False
    context.kernel.close()
    return True


def restart(box: Box, context: Context) -> None:
    """The context's kernel started again: its state gone, its id, language and folder kept."""
    contexts = box.extra.get("contexts")
    with contexts.lock if contexts else _NO_LOCK:  # taken out and its id held in one step: one restart at a time
        if contexts is None or contexts.items.get(context.id) is not context:
            raise E2bError(409, f"context {context.id!r} was removed or is restarting")
        del contexts.items[context.id]
        contexts.starting.add(context.id)
    context.kernel.close()
    _start(box, contexts, context.id, context.language, context.said, context.cwd)


def run(box: Box, context: Context, code: str, timeout: float, on_output: Any,
        around: tuple[str, str] | None = None) -> Ended:
    """Run ``code`` as one cell in ``context`` (a run thread): the sandbox's output allowance and ``timeout``;
    ``around``: hidden code run just before and after it (a call's env_vars)."""
    if not context.lock.acquire(timeout=timeout):
        raise SessionBusyError(f"the context stayed busy with another run for the whole {timeout:g} s limit")
    client, taken = context.kernel.client, False
    try:
        if around and (client is None or client.run_silent(around[0], min(timeout, 10.0)) is None):
            context.kernel.interrupt()
            raise SessionError("the context's kernel did not take the call's env_vars in time")
        taken = bool(around)
        nb = notebook.build(code, context.language)
        config: SandboxConfig = box.session.config.replace(timeout=timeout)
        handle = cast(SandboxHandle, context.kernel)  # run_cell uses its kernel half: run, state, kill
        error, _ = cells.run_cells(handle, nb, config, on_output=on_output)
        count = nb.cells[-1].get("execution_count")
        return Ended(error, count if isinstance(count, int) else None)
    finally:
        if taken and around and client is not None and not client.lost:
            client.run_silent(around[1], 10.0)
        context.lock.release()
