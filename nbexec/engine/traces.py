"""OpenTelemetry spans of each execution, for callers that use OpenTelemetry (the ``otel`` extra).

nbexec never imports OpenTelemetry and never configures a tracer provider or an exporter. Spans are made only when
the process has imported ``opentelemetry.trace`` already, through OpenTelemetry's global provider. That is when the
caller set a provider up (an SDK ``TracerProvider`` with an OTLP exporter, say); without one, the API makes no-op
spans. Without the extra, or when the caller never imported it, nothing is made and nothing imported.

One execution's tree (`nbexec.engine.session.Session.run_notebook`, under ``execute_notebook`` too):

    nbexec.execute    the root: nbexec.execution_hash, nbexec.session_hash, nbexec.image, nbexec.runtime,
                      nbexec.node, nbexec.ok, nbexec.error_kind (status ERROR when the run failed)
      nbexec.acquire  a sandbox started for this run (every one-shot; a session's first run): nbexec.purpose
      nbexec.packages the host provides the packages asked for and the cells' pip lines (before any cell runs)
      nbexec.cell     one per code cell run: nbexec.cell.index, nbexec.cell.status (ok, error, timeout, died, ...)
      nbexec.collect  the outputs and /mnt/data gathered
      nbexec.upload   files and images stored: nbexec.files, nbexec.images

Attributes are names, counts and statuses nbexec chose. They never hold code, outputs, error messages, values, file
names or environment values. An exception ends a span with its type's name only (``record_exception`` is off).
Session and execution ids are not in clear either, since whoever reads the traces could name a session with one.
A span carries the `pseudonym` of each: a keyed hash, stable within the process, so a session's runs correlate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import hmac
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

from nbexec.result import ExecutionResult

T = TypeVar("T")
Run = TypeVar("Run", bound=Callable[..., ExecutionResult])
Value = str | int | bool
_ROOT: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar("nbexec_root", default=None)
_KEY: list[bytes] = []  # the process's key for `pseudonym`, made at its first use (importing makes nothing)


def pseudonym(value: str) -> str:
    """What spans carry for a session or execution id: a keyed hash, the same within this process only."""
    if not _KEY:
        _KEY.append(os.urandom(32))  # two threads racing here may make two keys; the first one kept wins
    return hmac.new(_KEY[0], value.encode("utf-8"), hashlib.sha256).hexdigest()[:16]


def _api() -> Any | None:
    """``opentelemetry.trace`` when the process imported it (never imported here)."""
    return sys.modules.get("opentelemetry.trace")


@contextlib.contextmanager
def span(name: str, attributes: dict[str, Value] | None = None) -> Iterator[Any | None]:
    """A child of the current span (None: no tracing); an exception ends it with status ERROR and its type."""
    api = _api()
    if api is None:
        yield None
        return
    tracer = api.get_tracer("nbexec")
    with tracer.start_as_current_span(name, attributes=attributes or {}, record_exception=False,
                                      set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            fail(current, type(exc).__name__)
            raise


def fail(current: Any | None, why: str) -> None:
    """Mark ``current`` failed with ``why`` (a kind or a type's name nbexec chose, never a message)."""
    api = _api()
    if current is not None and api is not None:
        current.set_status(api.Status(api.StatusCode.ERROR, why))


def mark(current: Any | None, attributes: dict[str, Value]) -> None:
    if current is not None:
        current.set_attributes(attributes)


@contextlib.contextmanager
def entered(manager: AbstractContextManager[T], name: str) -> Iterator[T]:
    """``manager`` entered inside a span ``name`` that ends once it is entered (its body is not in the span)."""
    with contextlib.ExitStack() as stack:
        with span(name):
            value = stack.enter_context(manager)
        yield value


def spanned(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Make each call of a function a span ``name``."""
    def wrap(function: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> T:
            with span(name):
                return function(*args, **kwargs)
        return traced
    return wrap


@contextlib.contextmanager
def root(session: Any) -> Iterator[Any | None]:
    """The root span of ``session``'s next execution, opened early; `execution` settles it.

    ``execute_notebook`` opens it before the sandbox is acquired, so the acquisition is in it."""
    config = session.config
    with span("nbexec.execute", {"nbexec.session_hash": pseudonym(session.id), "nbexec.image": config.image,
                                 "nbexec.runtime": config.runtime or "default"}) as current:
        token = _ROOT.set((session, current))
        try:
            yield current
        finally:
            _ROOT.reset(token)


def execution(method: Run) -> Run:
    """Make ``Session.run_notebook`` the root span of its execution, or settle the one `root` opened for it."""
    @functools.wraps(method)
    def traced(session: Any, *args: Any, **kwargs: Any) -> ExecutionResult:
        held = _ROOT.get()
        with contextlib.nullcontext(held[1]) if held and held[0] is session else root(session) as current:
            result = method(session, *args, **kwargs)
            mark(current, {"nbexec.execution_hash": pseudonym(result.execution_id), "nbexec.ok": result.ok,
                           "nbexec.node": result.node or "", "nbexec.error_kind": _kind(result)})
            if not result.ok:
                fail(current, _kind(result) or "failed")
            return result
    return cast(Run, traced)


def _kind(result: ExecutionResult) -> str:
    return result.error.kind if result.error is not None and result.error.kind else ""
