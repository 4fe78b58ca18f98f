"""Judging by name, for a sandbox whose hidden route takes no code (a remote node, `Capability.JUDGE`): the host
sends the job as data, the node judges it in the sandbox with its own runner (`judge`), and answers the verdicts.

What the host sends is the body of a batch's judge item (`nbexec.service.judgeitems.JudgeBody`): text, since it
travels as JSON. What comes back is read as hostile: sized by the handle, then each field checked here. An answer
that is not a whole judgement of this job is ``judge_error`` for every test, never an ``accepted``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from nbexec.errors import NotOfferedError

from .judgevalues import VERDICTS, JudgeResult, Limits, TestResult

_DEFAULTS = Limits()
ANSWER = 16 * 1024**2  # bytes of JSON a node answers for one judging at most (10,000 tests fit without texts)
MAX_SENT = 15 * 1024**2  # bytes of JSON sent for one judging (a node takes bodies of 16 MiB by default)


def body(job: Any, seconds: float) -> dict[str, Any]:
    """The job (a `judge.Job`, which imports this module) as a judge item's JSON, its program limit ``seconds``
    (what this host would give it); NotOfferedError for what JSON text cannot carry to a node, before anything
    is sent."""
    limits = job.limits
    if (limits.compile_time, limits.compile_memory) != (_DEFAULTS.compile_time, _DEFAULTS.compile_memory):
        raise NotOfferedError("a remote node judges with its own compile limits: leave compile_time and "
                              "compile_memory as they are")
    tests = [{"stdin": _text(t.stdin, "a test's stdin"), "args": [_text(a, "a test's argument") for a in t.args],
              "expected": None if t.expected is None else _text(t.expected, "a test's expected output")}
             for t in job.tests]
    checker = job.compare.checker_source() if job.compare.mode == "checker" else None
    sent = {"program": _text(job.program, "the program"), "tests": tests, "language": job.language.name,
            "compare": job.compare.mode, "tolerance": job.compare.tolerance,
            "checker": None if checker is None else _text(checker, "the checker"),
            "limits": {"time": limits.time, "memory": str(limits.memory), "output": str(limits.output),
                       "program": seconds}}
    if len(json.dumps(sent)) > MAX_SENT:
        raise NotOfferedError(f"a remote node takes a judging of at most {MAX_SENT // 1024**2} MiB of JSON")
    return sent


def _text(value: bytes | str, what: str) -> str:
    """``value`` as text that encodes to UTF-8 (what JSON carries), else NotOfferedError."""
    try:
        text = value if isinstance(value, str) else value.decode("utf-8")
        text.encode("utf-8")  # a lone surrogate (surrogateescape's) has no UTF-8
    except UnicodeError:
        raise NotOfferedError(f"{what} is not UTF-8 text: a remote node takes judge items as JSON text") from None
    return text


def result(reply: Any, job: Any) -> JudgeResult:
    """The node's answer as a JudgeResult of ``job``: judge_error for each test when it is not a judgement of this
    job's language and tests, each field checked (verdicts known, numbers finite, texts capped)."""
    count, language = len(job.tests), job.language.name
    tests = reply.get("tests") if isinstance(reply, dict) else None
    if not isinstance(tests, list) or len(tests) != count or reply.get("language") != language:
        why = "the node answered something that is not this program's judgement"
        return JudgeResult(language, tuple(TestResult(i, "judge_error", message=why) for i in range(count)))
    notes = reply.get("notes")
    return JudgeResult(language, tuple(_test(i, test) for i, test in enumerate(tests)),
                       compile_log=_cut(reply.get("compile_log"), 4096),
                       notes=tuple(_cut(n, 300) for n in notes[:8]) if isinstance(notes, list) else ())


def _test(index: int, found: Any) -> TestResult:
    if not isinstance(found, dict) or found.get("verdict") not in VERDICTS or found.get("index") != index:
        return TestResult(index, "judge_error", message="the node's record of this test was malformed")

    def number(key: str) -> float:
        value = found.get(key, 0)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else 0.0

    exit_code = found.get("exit_code")
    return TestResult(index, str(found["verdict"]), time=number("time"), cpu=number("cpu"),
                      memory=int(min(number("memory"), 2.0**62)),
                      exit_code=exit_code if isinstance(exit_code, int) and abs(exit_code) < 1 << 16 else None,
                      diff=_cut(found.get("diff"), 2048), stderr=_cut(found.get("stderr"), 2048),
                      message=_cut(found.get("message"), 1024))


def _cut(value: Any, most: int) -> str:
    return value[:most] if isinstance(value, str) else ""


def fit(judged: dict[str, Any], budget: int = ANSWER) -> dict[str, Any]:
    """A node's answer (`JudgeResult.to_dict`) within ``budget`` bytes of JSON: past it, the tests' texts go (the
    verdicts and numbers stay), and a note says so."""
    for test in judged["tests"]:  # a checker's message may hold a lone surrogate: JSON's encoder refuses it
        for key in ("diff", "stderr", "message"):
            test[key] = test[key].encode("utf-8", "replace").decode("utf-8")
    judged["notes"] = [note.encode("utf-8", "replace").decode("utf-8") for note in judged["notes"]]
    judged["compile_log"] = judged["compile_log"].encode("utf-8", "replace").decode("utf-8")
    if len(json.dumps(judged, ensure_ascii=False).encode()) <= budget:
        return judged
    for test in judged["tests"]:
        test.update(diff="", stderr="", message="")
    judged["compile_log"] = judged["compile_log"][-4096:]
    judged["notes"] = [*judged["notes"][:7], "the tests' diff, stderr and message were dropped to fit the answer"]
    return judged
