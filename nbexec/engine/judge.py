"""judge(): one program against many tests in one sandbox (judge_many, many programs at a time, is in `judgemany`).

The host writes the program and the tests into /mnt/data, sends the runner (`judgerunner`, in the sandbox's
kernel) a plan, and asks for the tests' verdicts a chunk at a time, the first chunk with the setup. Each answer
is the reply to the host's own request: a test cannot forge it (see `judgerunner` for what keeps the program
away from the kernel). Each answer is sized before it is decoded, each record checked; a malformed one ends the
judging with ``judge_error`` for the tests it should have judged, never an ``accepted``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import secrets
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from nbexec import judgelangs
from nbexec.config import SandboxConfig, from_env, parse_size
from nbexec.errors import ConfigError, NotOfferedError, ProtocolError, SandboxError
from nbexec.sandbox.capabilities import Capability
from nbexec.sandbox.messages import MAX_CONTROL
from nbexec.sandbox.source import SandboxHandle

from . import judgenamed
from .judgevalues import (
    JUDGE_IMAGE_HINT,
    MAX_PROGRAM,
    VERDICTS,
    Comparison,
    JudgeResult,
    Limits,
    Test,
    TestResult,
    as_bytes,
    tests_of,
)
from .session import Session

CHUNK = 100  # tests per request to the runner: its answer stays well under the kernel's reply cap
ANSWER_BUDGET = 512 * 1024  # bytes of JSON the runner may answer per chunk (base64 on the wire: 4/3 of it)
GRACE = 5.0  # seconds a request may take past the program's deadline, which ends every test (a kill, the reply)
AFTER_SECONDS = 10.0  # what a request with judged()'s ``after`` may take more (judgemany's REMOVE_SECONDS, the rest
# of the reset): a stopped kernel holds the host that much longer
CHECKER_LIMITS = {"time": 10.0, "memory": 1024**3, "output": 1024**2}
COMPILE_FILES = 256 * 1024**2  # the largest file a compile may write (RLIMIT_FSIZE): a binary past it is refused
NAMED_SLACK = 30.0  # seconds a node may take to start the judge and send the files, beyond the program's time
HEAP_ONLY = ("java", "go")  # runtimes that reserve far more address space than they use: no RLIMIT_AS


@dataclass(frozen=True)
class Job:
    """One program to judge, checked: what the sandbox is sent."""

    program: bytes
    tests: list[Test]
    language: judgelangs.JudgeLanguage
    compare: Comparison
    limits: Limits

    @classmethod
    def of(cls, program: Any, tests: Iterable[Any], language: Any, compare: Any, limits: Any) -> Job:
        if not isinstance(program, (str, bytes)) or len(program) > MAX_PROGRAM:
            raise ConfigError(f"a program is source text (str or bytes) of at most {MAX_PROGRAM // 1024**2} MiB")
        comparison = compare if isinstance(compare, Comparison) else Comparison(mode=compare)
        if limits is not None and not isinstance(limits, Limits):
            limits = Limits(**limits) if isinstance(limits, Mapping) else None
            if limits is None:
                raise ConfigError("limits is a Limits value or a mapping of its fields")
        return cls(as_bytes(program), tests_of(tests), judgelangs.get(language), comparison, limits or Limits())


def judge(program: str | bytes, tests: Iterable[Any], *, language: str = "python",
          compare: str | Comparison = "whitespace", limits: Limits | Mapping[str, Any] | None = None,
          config: SandboxConfig | None = None, **overrides: Any) -> JudgeResult:
    """Run ``program`` against each of ``tests`` (Test values, or mappings with stdin/input, args,
    expected/output) in one fresh sandbox, compiling it once first when ``language`` needs it, and return a
    verdict per test (docs/judging.md). ``compare`` says how stdout is judged (a mode or a Comparison);
    ``limits`` bound each test and the whole program. ``config`` and keyword overrides (memory="2g",
    image=...) are the sandbox's, as for execute_notebook(). Errors of the program are verdicts; only failures
    of nbexec (no Docker, a bad argument, a language the image cannot compile) raise."""
    job = Job.of(program, tests, language, compare, limits)
    session = new_session(config, overrides)
    try:
        return run(session, job)
    finally:
        session.close()


def new_session(config: SandboxConfig | None, overrides: dict[str, Any]) -> Session:
    config = (config or from_env()).replace(**overrides)
    return Session(config.replace(language="python"), ttl=None, keep_files=False, one_shot=True)


def run(session: Session, job: Job) -> JudgeResult:
    """Judge ``job`` in ``session``'s sandbox (started here); the caller closes the session."""
    return judged(session, job)[0]


NOT_RUN = object()  # judged()'s ``after`` did not run (no test did, or one was not judged)


def judged(session: Session, job: Job, batch: bool = False, after: str = "") -> tuple[JudgeResult, Any]:
    """run(), and what ``after`` answered. ``batch``: the runner and the fork server (`judgefork`) are in the
    kernel already, and Python tests are forked from it. ``after``: code for a callable the kernel calls once every
    test is judged, in the same request as the last tests (the reset of reuse="batch"; AFTER_SECONDS more are
    waited for it)."""
    return judged_in(session._started_handle(), session.config, job, batch, after)


def judged_in(sandbox: SandboxHandle, config: SandboxConfig, job: Job, batch: bool = False,
              after: str = "") -> tuple[JudgeResult, Any]:
    """judged() in ``sandbox`` (started, of ``config``): what a node runs for a judging sent by name too."""
    seconds = job.limits.program if job.limits.program is not None else config.timeout
    if not sandbox.hidden_code:  # its hidden route takes no code (a remote node): the job goes as data, by name
        return _by_name(sandbox, job, seconds), NOT_RUN
    folder = f".nbexec-judge-{secrets.token_hex(8)}"
    _upload(sandbox, folder, job)
    deadline = time.monotonic() + seconds  # the program's own time: a slow start or upload is not charged to it
    warm = list(config.warm_imports) if batch and job.language.name == "python" else None
    fork = "__nbexec_fork_ns['current']" if warm is not None else "None"
    chunks = _Chunks(sandbox, job, deadline, after)
    why = ("the sandbox did not answer while the program was prepared (its compile, within the program's limit) "
           "or its first test ran: its kernel died or was stopped (the program may have killed it)")
    code = (f"__nbexec_judge = __nbexec_judge_ns['Judge']({_plan(folder, job, seconds, warm)!r})\n"
            f"__nbexec_report = __nbexec_judge.setup(__nbexec_init_ns['seal_init'], {fork}, "
            f"{chunks.request(0, seconds)})")
    answer, why = _asked(sandbox, code, "" if batch else setup_code(), chunks.deadline(0), why)  # runs test 0 too
    if not isinstance(answer, dict):  # the kernel died or stopped: data, not an exception
        return JudgeResult(job.language.name, tuple(TestResult(i, "judge_error", message=why)
                                                    for i in range(len(job.tests)))), NOT_RUN
    if "exposed" in answer:  # a test could reach init, which outlives it: no test is run
        why = f"the sandbox cannot be judged in: {str(answer['exposed'])[:200]}"
        return JudgeResult(job.language.name, tuple(TestResult(i, "judge_error", message=why)
                                                    for i in range(len(job.tests)))), NOT_RUN
    if "missing" in answer:
        raise NotOfferedError(f"the image {config.image_tag} has no {str(answer['missing'])[:40]!r} to judge "
                          f"{job.language.name}: {JUDGE_IMAGE_HINT}")
    compiled = answer.get("compiled")
    log = str(compiled.get("log", ""))[-4096:] if isinstance(compiled, dict) else ""
    if isinstance(compiled, dict) and compiled.get("ok") is not True:
        why = f"the compiler failed ({str(compiled.get('why'))[:20]})" if compiled.get("why") else log[-300:]
        return JudgeResult(job.language.name, tuple(TestResult(i, "compile_error", message=why)
                                                    for i in range(len(job.tests))), compile_log=log), NOT_RUN
    tests = tuple(chunks.results(answer))
    return JudgeResult(job.language.name, tests, compile_log=log), chunks.after


def _by_name(sandbox: SandboxHandle, job: Job, seconds: float) -> JudgeResult:
    """judged() where the backend judges by name (`judgenamed`), within the program's time and the same slack a
    local judging has; NotOfferedError, before any file is sent, where it does not."""
    if not sandbox.offers(Capability.JUDGE):
        raise sandbox.refusal(Capability.JUDGE)
    late = CHECKER_LIMITS["time"] + GRACE + NAMED_SLACK
    return judgenamed.result(sandbox.judge(judgenamed.body(job, seconds), seconds + late), job)


class _Chunks:
    """The tests asked for in requests of 1, 15, then CHUNK tests, each at most fifteen times all before it (a
    kernel killed early takes few verdicts with it): the first with the setup, ``after`` with the last. Each
    request costs the kernel milliseconds: ten tests are two requests."""

    def __init__(self, sandbox: SandboxHandle, job: Job, deadline: float, after: str) -> None:
        self.sandbox, self.job, self.end, self.then = sandbox, job, deadline, after
        self.total = len(job.tests)
        # The runner ends every test by the deadline; the last one's checker may then take its own limit.
        self.late = (CHECKER_LIMITS["time"] if job.compare.mode == "checker" else 0.0) + GRACE
        self.after: Any = NOT_RUN

    def _last(self, first: int) -> int:
        return min(first + (1 if first == 0 else min(first * 15, CHUNK)), self.total)

    def request(self, first: int, seconds: float) -> str:
        last = self._last(first)
        after = self.then if self.then and last == self.total else "None"
        return f"[{first}, {last}, {seconds!r}, {ANSWER_BUDGET}, {after}]"

    def deadline(self, first: int) -> float:
        last_one = self.then and self._last(first) == self.total
        return self.end + self.late + (AFTER_SECONDS if last_one else 0.0)

    def results(self, answer: Any) -> Iterator[TestResult]:
        """The records of ``answer`` (the setup's, for the first tests), then of each request still to make."""
        first, why = 0, "the sandbox did not answer: its kernel died or was stopped (the program may have killed it)"
        while first < self.total:
            last = self._last(first)
            if answer is None:
                left = max(0.0, self.end - time.monotonic())
                code = f"__nbexec_report = __nbexec_judge.run(*{self.request(first, left)})"
                answer, why = _asked(self.sandbox, code, "", self.deadline(first), why)
            records = answer.get("records") if isinstance(answer, dict) else None
            if not isinstance(records, list) or len(records) > last - first:
                records = []
            if last == self.total and isinstance(answer, dict):
                self.after = answer.get("after", NOT_RUN)
            for number, record in enumerate(records, start=first):
                yield _record(number, record)
            if len(records) < last - first:  # the runner stopped early, or its answer was refused
                done = first + len(records)
                if records and isinstance(records[-1], dict) and records[-1].get("v") == "judge_error":
                    why = "judging stopped at an earlier test"
                yield from (TestResult(i, "judge_error", message=why) for i in range(done, self.total))
                return
            first, answer = last, None


def _asked(sandbox: SandboxHandle, code: str, prefix: str, deadline: float, why: str) -> tuple[Any, str]:
    """ask() for a request that runs tests: its answer, or None and why (``why`` when the kernel did not answer)."""
    try:
        return ask(sandbox, code, prefix, deadline), why
    except ProtocolError as exc:
        return None, f"the sandbox answered out of protocol: {exc}"
    except SandboxError as exc:  # the runner was interrupted (a test can signal the kernel)
        return None, str(exc)


def _record(index: int, record: Any) -> TestResult:
    """A TestResult from one record of the runner's answer; judge_error for anything malformed."""
    if not isinstance(record, dict) or record.get("v") not in VERDICTS:
        return TestResult(index, "judge_error", message="the runner's record was malformed")

    def number(key: str) -> float:
        value = record.get(key, 0)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else 0.0

    def text(key: str, most: int) -> str:
        value = record.get(key, "")
        return value[:most] if isinstance(value, str) else ""

    exit_code = record.get("exit")
    return TestResult(index, str(record["v"]), time=number("t"), cpu=number("cpu"), memory=int(number("mem")),
                      exit_code=exit_code if isinstance(exit_code, int) and abs(exit_code) < 1 << 16 else None,
                      diff=text("diff", 2048), stderr=text("err", 2048), message=text("why", 1024))


def ask(sandbox: SandboxHandle, code: str, prefix: str, deadline: float) -> Any:
    """Run ``code`` in the kernel and decode what it left in __nbexec_report (None: no answer in time)."""
    content = sandbox.run_hidden(prefix + code, max(1.0, deadline - time.monotonic()),
                                 expressions={"r": "__nbexec_report"})
    if content is None:
        return None
    if content.get("status") != "ok":
        raise SandboxError(f"the judge's runner failed in the sandbox: {str(content.get('evalue', ''))[:300]}")
    try:
        shown = content["user_expressions"]["r"]["data"]["text/plain"]
        if not isinstance(shown, str) or len(shown) > MAX_CONTROL or shown[:1] != "'" or shown[-1:] != "'":
            raise ValueError("not a short quoted string")
        return json.loads(base64.b64decode(shown[1:-1], validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error, RecursionError) as exc:
        raise ProtocolError(f"the judge's runner answered something else ({type(exc).__name__})") from exc


def shipped(name: str) -> str:
    return resources.files("nbexec").joinpath(f"engine/{name}").read_text("utf-8")


def setup_code() -> str:
    source, seal = shipped("judgerunner.py"), shipped("judgeinit.py")
    compare, process = shipped("judgecompare.py"), shipped("judgeprocess.py")
    return (f"__nbexec_judge_ns = {{'__name__': 'nbexec_judge'}}\n"
            f"exec(compile({compare!r}, '<nbexec-judge-compare>', 'exec'), __nbexec_judge_ns)\n"
            f"exec(compile({process!r}, '<nbexec-judge-process>', 'exec'), __nbexec_judge_ns)\n"
            f"exec(compile({source!r}, '<nbexec-judge>', 'exec'), __nbexec_judge_ns)\n"
            f"__nbexec_init_ns = {{'__name__': 'nbexec_judge_init'}}\n"
            f"exec(compile({seal!r}, '<nbexec-judge-init>', 'exec'), __nbexec_init_ns)\n")


def _plan(folder: str, job: Job, seconds: float, warm: list[str] | None = None) -> dict[str, Any]:
    lang, limits = job.language, job.limits
    memory, capped = parse_size(limits.memory), lang.name not in HEAP_ONLY
    run = list(lang.run)
    if lang.name == "java":  # the heap holds the limit instead
        run.insert(1, f"-Xmx{memory // 1024**2}m")
    return {"folder": f"/mnt/data/{folder}", "build": f"/mnt/data/{folder}/build", "env": lang.environment,
            "compile": list(lang.compile) if lang.compile else None, "output": lang.output, "run": run,
            "limits": {"time": limits.time, "memory": memory if capped else 0, "output": parse_size(limits.output),
                       "data": memory if lang.name == "go" else 0},  # Go's heap: what it writes, not reserves
            # files: a compiler writes objects and a binary (Go's, Rust's are MiBs); the filesystems' caps hold too
            "compile_limits": {"time": min(limits.compile_time, seconds), "output": 1024**2, "files": COMPILE_FILES,
                               "memory": parse_size(limits.compile_memory) if capped else 0},
            "checker_limits": CHECKER_LIMITS, "checker_wrapper": shipped("judgechecker.py"),
            "compare": job.compare.mode, "tolerance": job.compare.tolerance, "warm": warm,
            "checker": job.compare.checker_source() if job.compare.mode == "checker" else ""}


def _upload(sandbox: SandboxHandle, folder: str, job: Job) -> None:
    """The program into <folder>/build, the tests as one blob and an index of offsets into it."""
    sandbox.put_file(f"{folder}/build/{job.language.source}", job.program)
    index, offset = [], 0
    with tempfile.SpooledTemporaryFile(max_size=8 * 1024**2) as blob:
        for test in job.tests:
            spans: list[list[int] | None] = []
            for value in (test.stdin, test.expected):
                if value is None:
                    spans.append(None)
                    continue
                data = as_bytes(value)
                blob.write(data)
                spans.append([offset, len(data)])
                offset += len(data)
            index.append({"stdin": spans[0], "expected": spans[1], "args": list(test.args)})
        blob.seek(0)
        sandbox.put_file(f"{folder}/index.json", json.dumps(index).encode())
        sandbox.put_file(f"{folder}/tests.bin", blob)  # type: ignore[arg-type]


def judged_alone(session: Session, job: Job) -> JudgeResult:
    try:
        return run(session, job)
    finally:
        session.close()
