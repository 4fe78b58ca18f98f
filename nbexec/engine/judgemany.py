"""judge_many(): many programs judged at a time, each in a sandbox of its own, or with reuse="batch" in a few
sandboxes reset between two programs (`judgereset` runs in their kernels)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Mapping
from typing import Any

from nbexec import judgelangs
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError
from nbexec.sandbox.source import DATA_MOUNT, PACKAGES_MOUNT

from .judge import NOT_RUN, Job, ask, judged, judged_alone, new_session, setup_code, shipped
from .judgevalues import JudgeResult
from .many import Outcome, Runner, Running, concurrency_or_cores, outcomes, outcomes_async
from .session import Session

RESET_SECONDS = 30.0  # a reset's own deadline, on the host: past it the sandbox is closed
REMOVE_SECONDS = 5.0  # the reset's removal of what a test left (it may have left many files), in the kernel
FORK_START_SECONDS = 20.0  # the fork server's start (its warm imports): with the removal, within RESET_SECONDS
FORK_TO_START = "a fork server is to start"  # judgefork.START: the reset did not start one itself


class JudgeItem(Outcome[JudgeResult]):
    """One submission's outcome in judge_many(): ``result``, or ``error`` when nbexec could not judge it."""


_FIELDS = ("program", "tests", "language", "compare", "limits")


def _job(submission: Any) -> Job:
    if not isinstance(submission, Mapping):
        submission = {name: getattr(submission, name) for name in _FIELDS if hasattr(submission, name)}
    unknown = set(submission) - set(_FIELDS)
    if unknown or "program" not in submission or "tests" not in submission:
        raise ConfigError(f"a submission has program and tests, and may have language, compare and limits "
                          f"(got {sorted(map(str, submission))[:8]})")
    return Job.of(submission["program"], submission["tests"], submission.get("language", "python"),
                  submission.get("compare", "whitespace"), submission.get("limits"))


def judge_many(submissions: Iterable[Any], *, concurrency: int | None = None, reuse: str | None = None,
               config: SandboxConfig | None = None, **overrides: Any) -> Generator[JudgeItem, None, None]:
    """judge() for each submission (a mapping or value with ``program``, ``tests`` and optionally
    ``language``, ``compare``, ``limits``), ``concurrency`` at a time (default: one per core), yielded as each
    ends (``item.index`` says which), on execute_many()'s machinery: read lazily, never all held, one's failure
    is its own, and leaving the loop stops the rest. Each submission has a sandbox of its own, unless
    ``reuse="batch"``: then this call's submissions share a few sandboxes, each reset between two of them
    (docs/judging.md says what a reset does not undo)."""
    kept, start = _many(submissions, concurrency, reuse, config, overrides)
    items = outcomes(start, JudgeItem)
    return items if kept is None else kept.closing(items)


def judge_many_async(submissions: Iterable[Any], *, concurrency: int | None = None, reuse: str | None = None,
                     config: SandboxConfig | None = None, **overrides: Any) -> AsyncGenerator[JudgeItem, None]:
    """judge_many() for asyncio code. Cancelling the task that iterates (or ``aclose()``) stops the rest and
    returns once their sandboxes are gone."""
    kept, start = _many(submissions, concurrency, reuse, config, overrides)
    items = outcomes_async(start, JudgeItem)
    return items if kept is None else kept.closing_async(items)


def _many(submissions: Iterable[Any], concurrency: int | None, reuse: str | None, config: SandboxConfig | None,
          overrides: dict[str, Any]) -> tuple[Kept | None, Callable[[], Runner[Any, JudgeResult]]]:
    """The sandboxes a call keeps (reuse="batch"), and what starts its runner at the first item asked for."""
    if reuse not in (None, "batch"):
        raise ConfigError(f"reuse is None (a sandbox per submission) or 'batch', not {reuse!r}")
    kept = Kept() if reuse == "batch" else None

    def work(numbered: tuple[int, Any], running: Running) -> JudgeResult:
        job = _job(numbered[1])
        if kept is None:
            session = new_session(config, dict(overrides))
            return running.run(session, lambda: judged_alone(session, job))
        reused = kept.take()
        session = reused or new_session(config, dict(overrides))
        return running.run(session, lambda: kept.judged(session, job, fresh=reused is None))

    return kept, lambda: Runner(enumerate(submissions), work, concurrency_or_cores(concurrency))


class Kept:
    """The sandboxes one judge_many(reuse="batch") call holds between its items. Each is reset after an item
    (`judgereset`) and handed to the next only if the reset left it clean; all close when the call ends."""

    def __init__(self, end: Callable[[Session], None] = Session.close) -> None:
        self._idle: list[Session] = []
        self._lock = threading.Lock()
        self._closed = False
        self._end = end  # what closes a sandbox it does not keep (nbexec serve also expires its folder)

    def take(self) -> Session | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def judged(self, session: Session, job: Job, fresh: bool) -> JudgeResult:
        """``job`` judged in ``session`` (``fresh``: new, no item judged in it yet), then reset and kept, or
        closed."""
        try:
            reusable = _remembered(session) if fresh else True  # else judged as in a sandbox of its own
            # With the last tests, a request fewer: no time there for a fork server's start (FORK_TO_START).
            reset = f"lambda: {_reset_code(session, None)}" if reusable else ""
            result, after = judged(session, job, batch=reusable, after=reset)
            clean = reusable and all(t.verdict != "judge_error" for t in result.tests) and (
                _reset(session) if after is NOT_RUN else after == [] or (
                    after == [FORK_TO_START] and _in_kernel(session, _prepared(session)) == []))
        except BaseException:
            self._end(session)
            raise
        with self._lock:
            keep = clean and not self._closed
            if keep:
                self._idle.append(session)
        if not keep:
            self._end(session)
        return dataclasses.replace(result, mode="batch" if reusable else "fresh")

    def closing(self, items: Generator[JudgeItem, None, None]) -> Generator[JudgeItem, None, None]:
        """``items``, then every kept sandbox closed (the runner has ended every item by then)."""
        try:
            yield from items  # closing this closes ``items``, whose runner waits for every item to end
        finally:
            self.close()

    async def closing_async(self, items: AsyncGenerator[JudgeItem, None]) -> AsyncGenerator[JudgeItem, None]:
        """closing() for asyncio code: ``items`` closed first (its runner waits for every item to end)."""
        try:
            async for item in items:
                yield item
        finally:
            try:
                await items.aclose()
            finally:
                await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Close every kept sandbox; one that ends its item after this is closed then."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for session in idle:
            with contextlib.suppress(Exception):  # one that fails to close never keeps the others open
                self._end(session)


PLACES = [DATA_MOUNT, PACKAGES_MOUNT, "/tmp", "/dev/shm", "/dev/mqueue"]  # where a test can write, and the home


def _in_kernel(session: Session, code: str, prefix: str = "") -> Any:
    """What a `judgereset` call answered in the session's kernel (None: no answer, out of protocol, or a node lost
    on the way: the sandbox is then closed, and the verdicts already made stand)."""
    sandbox = session._started_handle()
    try:
        return ask(sandbox, f"__nbexec_report = __nbexec_judge_ns['_encode']({code})", prefix,
                    time.monotonic() + RESET_SECONDS)
    except NbexecError:
        return None


def _prepared(session: Session, seconds: float | None = FORK_START_SECONDS) -> str:
    """What starts the fork server of Python tests (`judgefork`) where no test has run since the last reset
    (``seconds`` None: what says whether one is to start)."""
    python = judgelangs.get("python").environment
    return (f"__nbexec_fork_ns['prepare']({list(session.config.warm_imports)!r}, "
            f"dict(__nbexec_judge_ns['ENV'], **{python!r}), {seconds!r}, __nbexec_judge_ns['SPARED'])")


def _remembered(session: Session) -> bool:
    """Before a new sandbox's first item: what its kernel's start left, so that each reset keeps only that; then
    the fork server."""
    prefix = (setup_code() + "__nbexec_reset_ns = {'__name__': 'nbexec_judge_reset'}\n"
              f"exec(compile({shipped('judgereset.py')!r}, '<nbexec-judge-reset>', 'exec'), __nbexec_reset_ns)\n"
              f"__nbexec_fork_ns = {{'__name__': 'nbexec_judge_fork'}}\n"
              f"__nbexec_fork_src = {shipped('judgefork.py')!r}\n"
              "exec(compile(__nbexec_fork_src, '<nbexec-judge-fork>', 'exec'), __nbexec_fork_ns)\n"
              "__nbexec_fork_ns['SOURCE'] = __nbexec_fork_src\n")
    code = f"__nbexec_reset_ns['remember']({PLACES!r}) and ({_prepared(session)} or True)"
    return _in_kernel(session, code, prefix) is True


def _reset_code(session: Session, seconds: float | None = FORK_START_SECONDS) -> str:
    """What resets the sandbox after an item, and starts the fork server again where it changed: [] once clean."""
    return (f"__nbexec_reset_ns['reset']({PLACES!r}, __nbexec_judge.blob, __nbexec_judge_ns['end_all'], "
            f"{REMOVE_SECONDS!r}) or {_prepared(session, seconds)}")


def _reset(session: Session) -> bool:
    """After an item whose tests did not run (a compile error): True once the sandbox is as clean as
    `judgereset` makes it."""
    return _in_kernel(session, _reset_code(session)) == []
