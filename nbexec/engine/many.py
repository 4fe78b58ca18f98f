"""execute_many(): many sources, each in its own fresh sandbox, a few at a time, each result yielded as it ends.

The sources are read one at a time, only when a place is free; a place is freed when its item has been handed
to the caller, so memory holds at most ``concurrency`` items, however many sources there are. A failure of one
item (its code, its sandbox, nbexec itself) is that item's outcome and never stops the others. Closing the
iterator (or Ctrl-C, or cancelling the async one) stops reading sources, interrupts the running items, and
returns once their sandboxes and folders are gone. `nbexec run -j N` runs on the same `Runner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from nbexec.errors import ConfigError, NbexecError
from nbexec.overrides import Unpack
from nbexec.result import ExecutionResult

from . import execute
from .options import BatchOptions
from .session import Session

S = TypeVar("S")
R = TypeVar("R")
log = logging.getLogger(__name__)
_POLL = 0.2  # seconds between checks of the stop flag while waiting (a wait never outlives a stop by more)
_STOP_GRACE = 5.0  # seconds a stop waits on interrupted items before it closes their sessions
_RUN_OPTIONS = ("files", "packages", "allow_errors")  # execute_notebook()'s options for the run, not the session


class StoppedError(NbexecError):
    """The batch was stopped before this item ran (never yielded: the caller stopped reading)."""


class Exhausted(Exception):
    """Every item was handed out (StopIteration cannot cross a thread's future, so this says it)."""


class _Result(Protocol):
    @property
    def ok(self) -> bool: ...


Done = TypeVar("Done", bound=_Result)


@dataclass(frozen=True)
class Outcome(Generic[Done]):
    """One item's outcome: ``index`` is its place in the inputs (from 0); ``result``, or ``error`` (the exception)
    when nbexec could not run it, and then ``result`` is None."""

    index: int
    result: Done | None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok


class BatchItem(Outcome[ExecutionResult]):
    """One source's outcome in execute_many(). Errors in the code are in ``result`` (``result.ok`` False);
    ``error`` is for a bad source or Docker failing."""


class Running:
    """The sessions of the items in flight, so that a stop can interrupt them (thread-safe)."""

    def __init__(self) -> None:
        self._sessions: set[Session] = set()
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def run(self, session: Session, call: Callable[[], R]) -> R:
        """``call()`` (which runs and closes ``session``), interruptible by ``stop``; StoppedError after one."""
        with self._lock:
            if self.stopped.is_set():
                session.close()
                raise StoppedError("the batch was stopped before this item ran")
            self._sessions.add(session)
        try:
            return call()
        finally:
            with self._lock:
                self._sessions.discard(session)

    def close(self) -> None:
        """Close the sessions still running: for items whose kernel did not answer the interrupt (a test can stop
        it). Their sandboxes are removed, so their calls end."""
        with self._lock:
            running = list(self._sessions)
        for session in running:
            try:
                session.close()
            except Exception:  # one that fails never keeps the others open
                log.warning("closing a stopped batch item's session failed", exc_info=True)

    def interrupt(self) -> None:
        """Stop taking items and interrupt the running ones (again on each call: one may not have started)."""
        self.stopped.set()
        with self._lock:
            running = list(self._sessions)
        for session in running:
            with contextlib.suppress(Exception):  # it may be closing under us; the next round tries again
                session.interrupt()


class Runner(Generic[S, R]):
    """Runs ``work(source, running)`` for each source on ``concurrency`` threads; ``next()`` hands out each
    ``(index, value, error)`` as it ends. Call ``stop()`` when done (also after the last one): it interrupts what
    still runs and waits for it."""

    def __init__(self, sources: Iterable[S], work: Callable[[S, Running], R], concurrency: int) -> None:
        if concurrency < 1:
            raise ConfigError("concurrency must be at least 1")
        self.running = Running()
        self._sources = iter(sources)
        self._work = work
        self._places = threading.Semaphore(concurrency)  # items read and not yet handed out
        self._done: queue.Queue[tuple[int, R | None, Exception | None]] = queue.Queue()
        self._futures: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._read = 0
        self._handed = 0
        self._exhausted = threading.Event()
        self._failure: BaseException | None = None  # the sources' own iterator raised it
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="nbexec-many")
        self._feeder = threading.Thread(target=self._feed, name="nbexec-many-feed", daemon=True)
        self._feeder.start()

    def _feed(self) -> None:
        try:
            while not self.running.stopped.is_set():
                if not self._places.acquire(timeout=_POLL):
                    continue
                if self.running.stopped.is_set():
                    return
                try:
                    source = next(self._sources)
                except StopIteration:
                    return
                with self._lock:
                    index, self._read = self._read, self._read + 1
                    future = self._pool.submit(self._one, index, source)
                    self._futures.add(future)
                future.add_done_callback(self._forget)
        except BaseException as exc:  # the caller's iterable failed (a KeyboardInterrupt too): what was read
            self._failure = exc  # still runs, then next() raises it; a failed batch never ends as a clean one
        finally:
            self._exhausted.set()

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _one(self, index: int, source: S) -> None:
        try:
            value, error = self._work(source, self.running), None
        except StoppedError:
            return  # never handed out: the caller stopped reading
        except Exception as exc:  # this item's failure, whatever it was: the others go on
            value, error = None, exc
        self._done.put((index, value, error))

    def next(self, timeout: float | None = None) -> tuple[int, R | None, Exception | None] | None:
        """The next item to end; None after ``timeout`` seconds without one; Exhausted after the last."""
        waited = 0.0
        while True:
            with contextlib.suppress(queue.Empty):
                index, value, error = self._done.get(timeout=_POLL)
                self._handed += 1
                self._places.release()
                return index, value, error
            if self._exhausted.is_set() and self._done.empty() and self._handed == self._read:
                if self._failure is not None:
                    raise self._failure
                raise Exhausted
            waited += _POLL
            if timeout is not None and waited >= timeout:
                return None

    def stop(self) -> None:
        """Stop reading sources, interrupt the running items, and return once every one has ended."""
        self.running.interrupt()
        self._feeder.join(timeout=_POLL * 5)  # it stops at its next check (unless the caller's iterable blocks)
        self._pool.shutdown(wait=False, cancel_futures=True)
        closing = time.monotonic() + _STOP_GRACE
        while True:
            with self._lock:
                pending = set(self._futures)
            if not pending:
                break
            wait(pending, timeout=1.0)
            self.running.interrupt()  # again: one may have been starting its sandbox at the last round
            if time.monotonic() > closing:  # a kernel that answers no interrupt does not hold the stop
                self.running.close()
        self._pool.shutdown(wait=True)


def concurrency_or_cores(asked: int | None) -> int:
    """The caller's, or one item per core (a fresh sandbox costs about a core-second to start)."""
    return asked if asked is not None else max(1, os.cpu_count() or 1)


def _executor(options: dict[str, Any]) -> Callable[[tuple[int, Any], Running], ExecutionResult]:
    """One item's run: execute_notebook()'s own two halves, the session handed to ``running`` in between."""
    if "on_output" in options:
        raise ConfigError("execute_many() takes no on_output: each result has its outputs")
    root = options.pop("output_dir", None)
    run_options = {key: options.pop(key) for key in _RUN_OPTIONS if key in options}

    def work(numbered: tuple[int, Any], running: Running) -> ExecutionResult:
        index, source = numbered
        output_dir = None if root is None else Path(root, str(index))
        session, nb = execute.prepare(source, output_dir=output_dir, **options)
        return running.run(session, lambda: execute.run_prepared(session, nb, **run_options))

    return work


def execute_many(sources: Iterable[Any], *, concurrency: int | None = None,
                 **options: Unpack[BatchOptions]) -> Iterator[BatchItem]:
    """Run each source (what execute_notebook() takes: code, a path, a notebook) in its own fresh sandbox, at most
    ``concurrency`` at a time (default: one per core), and yield a `BatchItem` for each as it ends (not in order:
    ``item.index`` says which). ``options`` are execute_notebook()'s (config, timeout=..., files, packages, ...),
    the same for every item, but ``output_dir`` is a root: item ``i`` keeps its files in ``<output_dir>/<i>``.

    Sources are read lazily (an endless generator is fine) and results are never all held. Leaving the loop
    early, closing the iterator or Ctrl-C stops the rest: running items are interrupted and nothing of them is
    left. Use ``with contextlib.closing(execute_many(...)) as items:`` to stop at once when the loop is left."""
    return outcomes(lambda: Runner(enumerate(sources), _executor(dict(options)), concurrency_or_cores(concurrency)),
                    BatchItem)


def outcomes(start: Callable[[], Runner[Any, R]],
             item: Callable[[int, R | None, Exception | None], S]) -> Generator[S, None, None]:
    """Each outcome of the runner ``start()`` makes (at the first ``next``: nothing runs before the loop asks) as
    ``item(index, result, error)``, as it ends; leaving the loop stops the rest."""
    runner = start()
    try:
        while True:
            try:
                done = runner.next()
            except Exhausted:
                return
            assert done is not None
            yield item(*done)
    finally:
        runner.stop()


def execute_many_async(sources: Iterable[Any], *, concurrency: int | None = None,
                       **options: Unpack[BatchOptions]) -> AsyncIterator[BatchItem]:
    """execute_many() for asyncio code. Cancelling the task that iterates (or ``aclose()``) stops the rest as
    closing execute_many() does; ``async with contextlib.aclosing(execute_many_async(...)) as items:``."""
    return outcomes_async(
        lambda: Runner(enumerate(sources), _executor(dict(options)), concurrency_or_cores(concurrency)), BatchItem)


async def outcomes_async(start: Callable[[], Runner[Any, R]],
                         item: Callable[[int, R | None, Exception | None], S]) -> AsyncGenerator[S, None]:
    """outcomes() for asyncio code: the runner's calls on a thread; a cancel stops the rest and waits for it."""
    runner = start()
    try:
        while True:
            try:
                done = await asyncio.to_thread(runner.next, _POLL * 2)
            except Exhausted:
                return
            if done is not None:
                yield item(*done)
    finally:
        await _stopped(runner)


async def _stopped(runner: Runner[Any, Any]) -> None:
    """``runner.stop()``, waited for through any further cancel (a timeout around the first, a task group
    ending): the caller gets control back only once the sandboxes are gone; such a cancel is raised after."""
    stopping = asyncio.ensure_future(asyncio.to_thread(runner.stop))
    cancelled = False
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            cancelled = True
    stopping.result()
    if cancelled:
        raise asyncio.CancelledError
