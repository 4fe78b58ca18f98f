"""What judging takes and gives: tests, limits, the comparison, verdicts (pure).

Everything a caller passes is checked here, before a sandbox starts: sizes and counts are capped, types are
what they say. How each language is compiled and run is `nbexec.judgelangs`'s table.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbexec import judgelangs
from nbexec.config import parse_size
from nbexec.errors import ConfigError

VERDICTS = ("accepted", "wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "compile_error",
            "checker_error", "judge_error")
MODES = ("exact", "whitespace", "float", "checker")
MAX_TESTS = 10_000  # tests of one program
MAX_TEST_BYTES = 256 * 1024**2  # stdin and expected output of all tests of one program, together
MAX_ARGS = 256  # arguments of one test (each at most 4 KiB)
MAX_PROGRAM = 4 * 1024**2  # bytes of a program's source
MAX_CHECKER = 256 * 1024  # bytes of a checker's source
JUDGE_IMAGE_HINT = (f"build the judge image with `nbexec image build --kernels judge` and pass its tag as "
                    f"image={judgelangs.IMAGE!r} (the default image has Python only)")


@dataclass(frozen=True)
class Limits:
    """Limits of each test (``time`` wall-clock seconds, ``memory`` address space or the JVM's heap, ``output``
    bytes of stdout and of stderr) and of the whole program (``program``: seconds for the compile and every test;
    None: the config's timeout). ``compile_time`` and ``compile_memory`` bound the compiler."""

    time: float = 2.0
    memory: str = "512m"
    output: str = "16m"
    program: float | None = None
    compile_time: float = 30.0
    compile_memory: str = "1g"

    def __post_init__(self) -> None:
        for name in ("time", "compile_time", "program"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)
                                      or not 0 < value <= 86_400):
                raise ConfigError(f"limits.{name} must be seconds above 0 and at most a day, got {value!r}")
        for name in ("memory", "output", "compile_memory"):
            size = parse_size(getattr(self, name))
            if size < (1024 if name == "output" else 16 * 1024**2):
                raise ConfigError(f"limits.{name} {getattr(self, name)!r} is too small")

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "memory": self.memory, "output": self.output, "program": self.program,
                "compile_time": self.compile_time, "compile_memory": self.compile_memory}


@dataclass(frozen=True)
class Comparison:
    """How an output is judged: "exact" (byte for byte), "whitespace" (the same tokens, whatever whitespace
    separates them), "float" (tokens; numbers equal within ``tolerance``, relative beyond 1, absolute below), or
    "checker": ``checker`` (Python source defining ``check(input, output, expected)``, or a self-contained
    function whose source is taken) is run in the sandbox and returns True, False or (bool, message)."""

    mode: str = "whitespace"
    tolerance: float = 1e-6
    checker: str | Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"compare {str(self.mode)[:40]!r} is not one of {', '.join(MODES)}")
        if not isinstance(self.tolerance, (int, float)) or not 0 <= self.tolerance < math.inf:
            raise ConfigError(f"tolerance must be a finite number at least 0, got {self.tolerance!r}")
        if (self.mode == "checker") != (self.checker is not None):
            raise ConfigError("compare='checker' takes a checker, and a checker needs compare='checker'")

    def checker_source(self) -> str:
        """The checker's source, checked to be text of a bounded size."""
        checker = self.checker
        if callable(checker):
            try:
                checker = textwrap.dedent(inspect.getsource(checker))
            except (OSError, TypeError) as exc:
                raise ConfigError("the checker's source cannot be found; pass it as a string") from exc
            if getattr(self.checker, "__name__", "check") != "check":
                checker += f"\ncheck = {self.checker.__name__}\n"  # type: ignore[union-attr]
        if not isinstance(checker, str) or len(checker.encode()) > MAX_CHECKER:
            raise ConfigError(f"a checker is Python source of at most {MAX_CHECKER // 1024} KiB")
        return checker


@dataclass(frozen=True)
class Test:
    """One test: ``stdin`` (bytes, or text sent as UTF-8), ``args`` (the program's arguments), ``expected``
    (what stdout must be; None: the exit status alone decides, as a HumanEval-style assertion does)."""

    stdin: bytes | str = b""
    args: tuple[str, ...] = ()
    expected: bytes | str | None = None
    __test__ = False  # not a test class of pytest's, in the caller's own test files

    @classmethod
    def of(cls, value: Any, index: int) -> Test:
        """A Test from a Test or a mapping (``stdin``/``input``, ``args``, ``expected``/``output``)."""
        if isinstance(value, Test):
            test = value
        elif isinstance(value, Mapping):
            unknown = set(value) - {"stdin", "input", "args", "expected", "output"}
            if unknown:
                raise ConfigError(f"test {index}: unknown field {sorted(map(str, unknown))[0][:40]!r}")
            test = cls(value.get("stdin", value.get("input", b"")), tuple(value.get("args", ()) or ()),
                       value.get("expected", value.get("output")))
        else:
            raise ConfigError(f"test {index} is a {type(value).__name__}, not a Test or a mapping")
        if not isinstance(test.stdin, (bytes, str)) or not isinstance(test.expected, (bytes, str, type(None))):
            raise ConfigError(f"test {index}: stdin and expected are bytes or str (expected may be None)")
        if len(test.args) > MAX_ARGS or not all(isinstance(a, str) and len(a) <= 4096 and "\0" not in a
                                                for a in test.args):
            raise ConfigError(f"test {index}: args are at most {MAX_ARGS} strings of 4 KiB, without NUL")
        return test


def tests_of(tests: Iterable[Any]) -> list[Test]:
    """The tests, checked, at most MAX_TESTS of them and MAX_TEST_BYTES together."""
    if isinstance(tests, (str, bytes, Mapping)):
        raise ConfigError("tests is a list of tests (Test values or mappings), not a single one")
    checked: list[Test] = []
    total = 0
    for index, value in enumerate(tests):
        if index >= MAX_TESTS:
            raise ConfigError(f"a program is judged against at most {MAX_TESTS} tests")
        test = Test.of(value, index)
        total += _size(test.stdin) + _size(test.expected)
        if total > MAX_TEST_BYTES:
            raise ConfigError(f"the tests' inputs and expected outputs exceed {MAX_TEST_BYTES // 1024**2} MiB")
        checked.append(test)
    if not checked:
        raise ConfigError("judge() needs at least one test")
    return checked


def _size(value: bytes | str | None) -> int:
    return 0 if value is None else len(value) if isinstance(value, bytes) else len(value) * 4


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class TestResult:
    """A test's verdict (one of VERDICTS), wall ``time`` and ``cpu`` seconds, ``memory`` (peak RSS, bytes), the
    ``exit_code`` (negative: the signal), a bounded ``diff`` for a wrong answer, the end of its ``stderr`` and
    ``message`` (why, when nbexec can say)."""

    index: int
    verdict: str
    time: float = 0.0
    cpu: float = 0.0
    memory: int = 0
    exit_code: int | None = None
    diff: str = ""
    stderr: str = ""
    message: str = ""
    __test__ = False

    @property
    def ok(self) -> bool:
        return self.verdict == "accepted"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "verdict": self.verdict, "time": self.time, "cpu": self.cpu,
                "memory": self.memory, "exit_code": self.exit_code, "diff": self.diff, "stderr": self.stderr,
                "message": self.message}


@dataclass(frozen=True)
class JudgeResult:
    """One program's judgement: a TestResult per test, in order; ``compile_log`` (compiled languages); ``mode``:
    "fresh" (a sandbox of its own) or "batch" (judge_many's reuse="batch": a sandbox reset between items)."""

    language: str
    tests: tuple[TestResult, ...]
    compile_log: str = ""
    notes: tuple[str, ...] = field(default=())
    mode: str = "fresh"

    @property
    def ok(self) -> bool:
        """Every test accepted."""
        return all(test.ok for test in self.tests)

    @property
    def verdict(self) -> str:
        """"accepted", or the first test's verdict that is not."""
        return next((test.verdict for test in self.tests if not test.ok), "accepted")

    @property
    def passed(self) -> int:
        return sum(test.ok for test in self.tests)

    def to_dict(self) -> dict[str, Any]:
        return {"language": self.language, "verdict": self.verdict, "passed": self.passed,
                "tests": [test.to_dict() for test in self.tests], "compile_log": self.compile_log,
                "notes": list(self.notes), "mode": self.mode}
