"""judge()'s runner, as an attacker: a sentinel an expected output can equal, the one process that
outlives every test (init), and a host that stops waiting before the checker's own limit. Judged from outside:
the verdicts, and what a test can reach."""

from __future__ import annotations

import time

import nbexec
from nbexec.engine.judgevalues import Comparison, Limits, Test


def _verdicts(result: nbexec.JudgeResult) -> list[str]:
    return [test.verdict for test in result.tests]


def test_an_expected_output_of_one_nul_byte_is_compared_like_any_other(config: nbexec.SandboxConfig) -> None:
    # The runner once stood b"\0" for "no expected output": a test expecting one NUL accepted any output.
    result = nbexec.judge("import sys\nsys.stdout.write(sys.stdin.read())",
                          [Test("anything", expected="\0"), Test(b"\0", expected=b"\0"), Test("x", expected=None)],
                          compare="exact", config=config)
    assert _verdicts(result) == ["wrong_answer", "accepted", "accepted"], [t.diff for t in result.tests]
    checker = "def check(i, o, e):\n    return e is not None and o == e"
    checked = nbexec.judge("import sys\nsys.stdout.write(sys.stdin.read())",
                           [Test("\0", expected="\0"), Test("\0", expected=None)],
                           compare=Comparison(mode="checker", checker=checker), config=config)
    assert _verdicts(checked) == ["accepted", "wrong_answer"], [t.message for t in checked.tests]


def test_a_test_cannot_trace_or_write_init_the_process_that_outlives_every_test(
        config: nbexec.SandboxConfig) -> None:
    # PID 1 (tini) runs as the sandbox's user and survives kill(-1): a test that could write its memory could
    # leave code running into the next test or the checker. Before: '/proc/1/mem' opened for writing, and
    # PTRACE_ATTACH and PTRACE_SEIZE succeeded.
    program = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
reached = []
for name, mode in (('mem', 'r+b'), ('mem', 'rb'), ('environ', 'rb')):
    try:
        with open(f'/proc/1/{name}', mode) as handle:
            handle.read(1) if name == 'environ' else None
        reached.append(name + ':' + mode)
    except OSError:
        pass
for request, name in ((16, 'attach'), (0x4206, 'seize')):
    if libc.ptrace(request, 1, None, None) == 0:
        reached.append(name)
print(' '.join(reached) or 'blocked')
"""
    result = nbexec.judge(program, [Test(expected="blocked"), Test(expected="blocked")],
                          limits=Limits(time=5), config=config)
    assert _verdicts(result) == ["accepted", "accepted"], [t.diff or t.message for t in result.tests]
    honest = nbexec.judge("print(int(input()) * 2)", [Test(str(i), expected=str(2 * i)) for i in range(5)],
                          config=config)
    assert honest.ok, [t.message for t in honest.tests]


def test_the_program_limit_is_not_spent_starting_the_sandbox(config: nbexec.SandboxConfig) -> None:
    # The deadline once started before the sandbox did: a 1 s program limit was gone before the first test
    # (a sandbox takes seconds to start, more on a loaded host), and an honest program got timeout, "not run".
    # Two tests: the first runs in the setup's request (timed in the kernel), the second in one the host times.
    result = nbexec.judge("print(1)", [Test(expected="1")] * 2, limits=Limits(program=1), config=config)
    assert _verdicts(result) == ["accepted"] * 2, result.tests


def test_the_host_waits_out_the_checkers_own_limit(config: nbexec.SandboxConfig) -> None:
    # A checker may take up to its 10 s; the host waited the test's limit and 5 s past the program's, then called
    # the kernel dead: an honest program's accepted test came back judge_error.
    checker = "def check(i, o, e):\n    import time\n    time.sleep(9)\n    return o.strip() == e.strip()"
    started = time.monotonic()
    result = nbexec.judge("print(1)", [Test(expected="1"), Test(expected="1")],
                          compare=Comparison(mode="checker", checker=checker),
                          limits=Limits(time=0.5, program=2), config=config)
    took = time.monotonic() - started
    assert _verdicts(result) == ["accepted", "timeout"], result.tests
    assert took < 60


def test_a_tests_own_limit_never_outlasts_the_programs(config: nbexec.SandboxConfig) -> None:
    # time=3600 with program=3: the test slept its 20 s and was accepted, and the host would have waited an hour
    # past the program's limit for a stopped kernel (a judge item over HTTP caps only `program`, by the node's
    # timeout). Now the program's limit ends the test: timeout.
    started = time.monotonic()
    result = nbexec.judge("import time\ntime.sleep(20)", [Test(expected=""), Test(expected="")],
                          limits=Limits(time=3600, program=3), config=config)
    took = time.monotonic() - started
    assert _verdicts(result) == ["timeout", "timeout"], result.tests
    assert result.tests[0].time < 5
    assert took < 18


def test_under_gvisor_an_honest_program_is_judged_not_blamed(config: nbexec.SandboxConfig) -> None:
    # gVisor has no pidfd_open: every test was runtime_error, "could not start: Function not implemented" (nbexec's
    # failure blamed on the program), and the started test was left running, unwatched, until the next kill.
    result = nbexec.judge("import time\nprint(int(input()) * 2)\nif input() == 's':\n    time.sleep(30)",
                          [Test("2\nx", expected="4"), Test("3\nx", expected="7"), Test("1\ns", expected="2")],
                          limits=Limits(time=2), config=config.replace(runtime="runsc"))
    assert _verdicts(result) == ["accepted", "wrong_answer", "timeout"], result.tests
    assert 1.5 < result.tests[2].time < 4

