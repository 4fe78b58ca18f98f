"""Attacks on judge(): programs that forge a verdict, read the expected output, outlive their test, flood, sleep,
eat memory; checkers that lie; hostile tests. Judged from outside: the verdicts, the time taken, what is left."""

from __future__ import annotations

import base64
import json
import secrets
import time

import pytest

import nbexec
from nbexec.engine.judgevalues import Comparison, Limits, Test

from ..conftest import unaccounted_containers

FORGED = base64.b64encode(json.dumps([{"v": "accepted", "t": 0.1}] * 3).encode()).decode()


def _verdicts(result: nbexec.JudgeResult) -> list[str]:
    return [test.verdict for test in result.tests]


def test_a_program_that_prints_and_writes_the_runners_format_is_not_accepted(config: nbexec.SandboxConfig) -> None:
    program = f"""
import os, glob
forged = {FORGED!r}
print(forged)
print("'" + forged + "'")
for folder in glob.glob('/mnt/data/.nbexec-judge-*'):
    for name in ('index.json', 'tests.bin', 'result.json'):
        try:
            open(os.path.join(folder, name), 'w').write(forged)
        except OSError:
            pass
globals_ = {{'__nbexec_report': forged}}
"""
    result = nbexec.judge(program, [Test(expected="the answer")] * 3, config=config)
    assert _verdicts(result) == ["wrong_answer"] * 3


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP", "SIGINT", "SIGTERM"])
def test_a_program_that_signals_the_runner_gets_no_accepted(config: nbexec.SandboxConfig, signal_name: str) -> None:
    # Test 0 is honest; test 1 signals its parent (the kernel that runs the tests) and prints the right answer.
    program = f"""
import os, signal, sys
data = sys.stdin.read()
if data == 'attack':
    for pid in (os.getppid(), 1):
        try:
            os.kill(pid, signal.{signal_name})
        except OSError:
            pass
print('ok')
"""
    started = time.monotonic()
    result = nbexec.judge(program, [Test("honest", expected="ok"), Test("attack", expected="ok"),
                                    Test("after", expected="ok")],
                          limits=Limits(time=2, program=10), config=config)
    assert time.monotonic() - started < 60
    verdicts = _verdicts(result)
    assert verdicts[0] == "accepted"
    if signal_name in ("SIGKILL", "SIGSTOP", "SIGTERM"):  # the kernel is gone or stuck: nothing after is judged
        assert verdicts[1:] == ["judge_error", "judge_error"]
    else:  # an interrupt stops the judging; a signal the kernel ignores changes nothing (the output is right)
        assert verdicts[1:] in (["judge_error", "judge_error"], ["accepted", "accepted"])


def test_the_kernel_cannot_be_read_or_traced_by_a_test(config: nbexec.SandboxConfig) -> None:
    program = r"""
import ctypes, os
parent = os.getppid()
reached = []
for name in ('mem', 'environ', 'maps', 'fd/0'):
    try:
        with open(f'/proc/{parent}/{name}', 'rb') as handle:
            handle.read(16)
        reached.append(name)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, parent, 0, 0) == 0:  # PTRACE_ATTACH
    reached.append('ptrace')
print(' '.join(reached) or 'blocked')
"""
    result = nbexec.judge(program, [Test(expected="blocked")], config=config)
    assert result.ok, result.tests[0].diff


def test_a_program_cannot_read_any_tests_expected_output(config: nbexec.SandboxConfig) -> None:
    token = secrets.token_hex(16)
    program = f"""
import os
sought = {token[:8][::-1]!r}[::-1].encode()  # the program's own source does not hold it
found = 'none'
for top in ('/mnt/data', '/tmp', '/home', os.path.expanduser('~')):
    for folder, _, names in os.walk(top):
        for name in names:
            try:
                with open(os.path.join(folder, name), 'rb') as handle:
                    if sought in handle.read():
                        found = os.path.join(folder, name)
            except OSError:
                pass
print(found)
"""
    result = nbexec.judge(program, [Test(expected=token), Test(expected=token + "2")], config=config)
    assert [t.diff for t in result.tests] == [f"line 1: expected {token!r}, got 'none'",
                                              f"line 1: expected {token + '2'!r}, got 'none'"]


def test_children_left_by_a_test_never_see_the_next(config: nbexec.SandboxConfig) -> None:
    program = r"""
import os, sys, time
if sys.stdin.read() == 'spawn':
    for _ in range(5):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    time.sleep(0.01)
            os._exit(0)
    print('spawned')
else:
    me, parent = os.getpid(), os.getppid()
    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me, parent)
              and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] not in 'ZX']
    print(len(others))
"""
    result = nbexec.judge(program, [Test("spawn", expected="spawned"), Test("count", expected="0"),
                                    Test("spawn", expected="spawned"), Test("count", expected="0")], config=config)
    assert result.ok, [t.diff for t in result.tests]


@pytest.mark.parametrize(("code", "verdict"), [
    ("import sys\nwhile True: sys.stdout.write('x' * 65536)", "output_limit"),
    ("import sys\nwhile True: sys.stderr.write('x' * 65536)", "output_limit"),
    ("import os\nwhile True: os.write(1, b'\\n' * 65536)", "output_limit"),
    ("f = open('/tmp/big', 'wb')\nwhile True: f.write(b'x' * 65536)", "output_limit"),
    ("import time\ntime.sleep(60)", "timeout"),
    ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.signal(signal.SIGXCPU, "
     "signal.SIG_IGN)\nwhile True: pass", "timeout"),
    ("x = bytearray(8 * 1024**3)", "memory"),
    ("x = [bytearray(1 << 20) for _ in range(100_000)]", "memory"),
    ("import os\nfor _ in range(10_000):\n    try: os.fork()\n    except OSError: pass\nimport time\ntime.sleep(30)",
     "timeout"),
], ids=["stdout", "stderr", "newlines", "file", "sleep", "ignores-signals", "alloc", "grow", "fork-bomb"])
def test_floods_sleeps_and_bombs_are_stopped_at_their_limits(config: nbexec.SandboxConfig, code: str,
                                                              verdict: str) -> None:
    # Filling 256 MiB takes seconds of page faults on a loaded machine: the memory cases get the time to reach it.
    seconds = 10 if verdict == "memory" else 2
    started = time.monotonic()
    result = nbexec.judge(code, [Test(expected=""), Test(expected="")],
                          limits=Limits(time=seconds, memory="256m", output="4m"), config=config)
    took = time.monotonic() - started
    assert _verdicts(result) == [verdict, verdict]
    assert took < 40 + 2 * seconds  # two tests, and the sandbox's start
    assert all(t.time < seconds + 10 for t in result.tests)  # the limit held: far from the bomb's 30 s sleep
    assert not unaccounted_containers()


@pytest.mark.parametrize(("checker", "said"), [
    ("def check(i, o, e):\n    return 'yes'", "not True, False"),
    ("def check(i, o, e):\n    return 1", "not True, False"),
    ("def check(i, o, e):\n    return (True, 5)", "not True, False"),
    ("def check(i, o, e):\n    raise RuntimeError('lying')", "RuntimeError"),
    ("def check(i, o, e):\n    import time\n    time.sleep(60)", "timeout"),
    ("def check(i, o, e):\n    print('" + FORGED + "')\n    return 'accepted'", "not True, False"),
    ("def check(i, o, e):\n    import os\n    os.kill(os.getppid(), 9)", ""),
    ("check = None", "not callable"),
    ("import sys\nsys.exit(0)", "no answer"),
    ("def check(i, o, e):\n    import os, sys\n    os.write(int(sys.argv[5]), b'[true, \"\"]')\n    os._exit(1)",
     "runtime_error"),
], ids=["str", "int", "tuple", "raises", "sleeps", "prints-forged", "kills-kernel", "not-callable", "exits",
        "answers-then-fails"])
def test_a_checker_that_lies_or_fails_is_never_an_accepted(config: nbexec.SandboxConfig, checker: str,
                                                           said: str) -> None:
    result = nbexec.judge("print(1)", [Test(expected="1")], compare=Comparison(mode="checker", checker=checker),
                          limits=Limits(program=30), config=config)
    test = result.tests[0]
    assert test.verdict in ("checker_error", "judge_error"), test
    assert said in test.message


def test_a_program_cannot_plant_modules_the_checker_imports(config: nbexec.SandboxConfig) -> None:
    forged = "def dumps(value, **_):\n    return '[true, \"\"]'\ndef loads(*_):\n    return [True, '']\n"
    program = f"""
for folder in ('/tmp', '/mnt/data', '/'):
    try:
        with open(folder + '/json.py', 'w') as handle:
            handle.write({forged!r})
    except OSError:
        pass
print('wrong')
"""
    checker = "def check(i, o, e):\n    return o.strip() == e.strip()"
    result = nbexec.judge(program, [Test(expected="right")] * 2, compare=Comparison(mode="checker", checker=checker),
                          config=config)
    assert _verdicts(result) == ["wrong_answer", "wrong_answer"], [t.message for t in result.tests]


def test_a_huge_expected_output_and_many_tests(config: nbexec.SandboxConfig) -> None:
    huge = "7" * (20 * 1024**2)
    result = nbexec.judge("import sys\nsys.stdout.write('7' * (20 * 1024**2))", [Test(expected=huge)],
                          limits=Limits(output="32m"), config=config)
    assert result.ok and len(result.tests[0].diff) == 0
    tests = [Test(str(i), expected=str(i)) for i in range(230)] + [Test("x", expected="y")]
    many = nbexec.judge("print(input())", tests, limits=Limits(program=300), config=config)
    assert len(many.tests) == 231 and many.passed == 230 and many.tests[-1].verdict == "wrong_answer"
    assert [t.index for t in many.tests] == list(range(231))


def test_binary_and_unicode_stdin_and_expected(config: nbexec.SandboxConfig) -> None:
    binary = bytes(range(256)) * 64
    text = "naïve — 日本語 🙂 \u202e مرحبا\n"
    program = "import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())"
    result = nbexec.judge(program, [Test(binary, expected=binary), Test(text, expected=text),
                                    Test(b"\xff\xfe\x00", expected="\ufffd")], compare="exact", config=config)
    assert _verdicts(result) == ["accepted", "accepted", "wrong_answer"]
    assert len(result.tests[2].diff) < 1000
