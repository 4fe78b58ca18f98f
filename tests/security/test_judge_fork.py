"""The fork server of judge_many(reuse="batch") (`judgefork`): Python tests forked from a warm interpreter.

Two things are judged from outside. A forked test must end as `python3 main.py` would: the same verdict, exit
status, output and error for each way a program can end. And a test that attacks the server must not reach a
later test: the server is the parent of every test, of the same uid, so a test can kill it, stop it, signal it
and change its limits and scheduling. Each attack runs in test 0 of a program; tests 1 and 2 of that program,
and the next program in the same sandbox, must see what a fresh sandbox shows."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec.engine.judge import shipped

from ..conftest import unaccounted_containers
from .test_judge_reuse import SANDBOX


@pytest.fixture
def warm(config: nbexec.SandboxConfig) -> nbexec.SandboxConfig:
    """numpy warmed: the server's own memory is then part of every child's."""
    return config.replace(pool_size=0, warm_imports=("numpy",))


def _both(submission: dict[str, Any], config: nbexec.SandboxConfig) -> tuple[Any, Any]:
    """The first test's result in a sandbox of its own, and as the second item of a batch (a forked test)."""
    fresh = nbexec.judge(**submission, config=config).tests[0]
    warmup = {"program": "print(1)", "tests": [{"expected": "1"}]}
    items = sorted(nbexec.judge_many([warmup, submission], concurrency=1, reuse="batch", config=config),
                   key=lambda item: item.index)
    assert items[1].result is not None and items[1].result.mode == "batch", items[1].error
    return fresh, items[1].result.tests[0]


def _last_line(stderr: str) -> str:
    return re.sub(r"/mnt/data/[^/]+/", "<folder>/", stderr.strip().splitlines()[-1] if stderr.strip() else "")


PROGRAMS = {
    "main": ("import os, sys\nhere = os.getcwd()\n"
             "print(__name__, sys.argv[1:], __file__ == here + '/main.py', sys.path[0] == here)",
             ["a", "b"], "__main__ ['a', 'b'] True True", None),
    "exit-3": ("import sys\nprint('x')\nsys.exit(3)", [], "x", None),
    "exit-message": ("import sys\nsys.exit('a message')", [], None, None),
    "exception": ("def f():\n    raise ValueError('boom')\nf()", [], None, None),
    "keyboard-interrupt": ("raise KeyboardInterrupt", [], None, None),
    "atexit-and-threads": ("import atexit, threading, time\natexit.register(print, 'bye')\n"
                           "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()",
                           [], "late\nbye", None),
    "stdin": ("import sys\nprint(sum(map(int, sys.stdin.read().split())))", [], "6", "1 2\n3"),
    "no-stdin": ("input()", [], None, None),
    # A diff shows one line: a digest of what would be many lines, and the first of them.
    "environment": ("import hashlib, os\nshown = repr(sorted(os.environ.items()))\n"
                    "print(hashlib.sha256(shown.encode()).hexdigest()[:16], shown[:100])", [], "?", None),
    "signals": ("import hashlib, signal\nshown = repr([signal.getsignal(n) for n in range(1, signal.NSIG)"
                " if n not in (signal.SIGKILL, signal.SIGSTOP)] + [line for line in open('/proc/self/status')"
                " if line.startswith(('SigBlk', 'SigIgn', 'SigCgt'))])\n"
                "print(hashlib.sha256(shown.encode()).hexdigest()[:16], shown[:100])", [], "?", None),
    "own-process": ("import os, resource\nos.close(os.open('/proc/self/mem', os.O_RDONLY))\n"
                    "print(sorted(os.listdir('/proc/self/fd')), os.getsid(0) == os.getpid(),"
                    " resource.getrlimit(resource.RLIMIT_CORE))", [], "?", None),
    "memory": ("x = bytearray(700 * 1024**2)", [], None, None),
    "memory-within": ("x = bytearray(300 * 1024**2)\nprint(len(x) >> 20)", [], "300", None),
    "time": ("while True:\n    pass", [], None, None),
    "output": ("print('x' * 10**7)", [], None, None),
    "unflushed": ("import sys\nsys.stdout.write('no newline')", [], "no newline", None),
    # What a reviewer who did not write the server found different (each was, before the fix)
    "exit-minus-1": ("import sys\nsys.exit(-1)", [], None, None),
    "exit-minus-256": ("import sys\nprint(1)\nsys.exit(-256)", [], "1", None),
    "exit-falsy-int": ("import sys\nclass Code(int):\n    def __bool__(self):\n        return False\n"
                       "sys.exit(Code(3))", [], None, None),
    "finalizer": ("class A:\n    def __del__(self):\n        print('bye')\na = A()", [], "bye", None),
    "unclosed-file": ("f = open(1, 'w', closefd=False)\nf.write('1\\n')", [], "1", None),
    "flags": ("import sys\nprint(sys.flags.isolated, sys.flags.ignore_environment, sys.flags.no_user_site,"
              " sys.dont_write_bytecode)", [], "?", None),
    "traced-stop": ("import ctypes, os, signal\nctypes.CDLL(None).ptrace(0, 0, None, None)\n"
                    "os.kill(os.getpid(), signal.SIGSTOP)\nprint(1)", [], "1", None),  # PTRACE_TRACEME
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_forked_test_ends_as_python3_would(warm: nbexec.SandboxConfig, name: str) -> None:
    program, args, expected, stdin = PROGRAMS[name]
    submission = {"program": program, "tests": [{"args": args, "expected": expected, "stdin": stdin or ""}],
                  "limits": {"time": 2, "memory": "512m"}}
    fresh, forked = _both(submission, warm)
    assert (forked.verdict, forked.exit_code) == (fresh.verdict, fresh.exit_code), (fresh, forked)
    assert _last_line(forked.stderr) == _last_line(fresh.stderr)
    if name == "exception":  # the trace starts at the program, as python3's
        assert "<string>" not in forked.stderr and 'main.py", line 3' in forked.stderr, forked.stderr
    if expected == "?":  # what it printed is the same
        assert forked.diff == fresh.diff and forked.diff


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_python_tests_of_a_batch_are_forked_from_a_warm_server(warm: nbexec.SandboxConfig, runtime: str) -> None:
    """numpy is imported already in a forked test; its peak memory counts the warm pages it maps. Under gVisor too,
    which has no /dev/mqueue (once, the reset's record failed on it, and no sandbox was reused)."""
    warm = warm.replace(runtime=runtime)
    program = {"program": "import sys\nprint('numpy' in sys.modules)", "tests": [{"expected": "True"}] * 3}
    fresh = nbexec.judge(**program, config=warm)
    items = list(nbexec.judge_many([program, program], concurrency=1, reuse="batch", config=warm))
    assert [test.verdict for test in fresh.tests] == ["wrong_answer"] * 3
    for item in items:
        assert item.result is not None and item.result.mode == "batch"
        assert [test.verdict for test in item.result.tests] == ["accepted"] * 3
        assert all(0 < test.memory < 128 * 1024**2 for test in item.result.tests), item.result.tests
    # numpy's global generator is seeded anew in each child, as in a fresh interpreter; `random` reseeds itself
    draw = {"program": "import numpy, random\nprint(numpy.random.randint(1 << 62), random.getrandbits(62))",
            "tests": [{"expected": "?"}] * 4}
    drawn = next(iter(nbexec.judge_many([draw], reuse="batch", config=warm))).result
    assert drawn is not None and drawn.mode == "batch"
    numbers = [test.diff.split("got ", 1)[1].split() for test in drawn.tests]
    assert len({pair[0] for pair in numbers}) == 4 and len({pair[1] for pair in numbers}) == 4, numbers


# Test 0 of a program attacks its parent, the server; tests 1 and 2 print what a child inherits, and its parent.
# A forked test's address space limit is the test's plus what the warm server holds: only its floor is shown. A diff
# shows one line, cut short: a digest of the whole, and its start.
SHOW = """
import ctypes, hashlib, os, resource
limits = [resource.getrlimit(getattr(resource, name)) for name in sorted(dir(resource))
          if name.startswith('RLIMIT_') and name != 'RLIMIT_AS']
space = resource.getrlimit(resource.RLIMIT_AS)[0] >= 512 * 1024**2
timer = ctypes.c_void_p()  # a POSIX timer takes a pending signal of the user's quota
timers = ctypes.CDLL(None).timer_create(1, None, ctypes.byref(timer)) == 0
shown = repr([os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)), space,
              timers, limits])
print(hashlib.sha256(shown.encode()).hexdigest()[:16], shown[:80])
"""
ATTACKS = {
    "limits": "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (16, 16))\n"
              "resource.prlimit(os.getppid(), resource.RLIMIT_STACK, (65536, 65536))\n"
              "resource.prlimit(os.getppid(), resource.RLIMIT_AS, (64 * 1024**2, 64 * 1024**2))",
    "schedule": "os.sched_setaffinity(os.getppid(), {0})\nos.setpriority(os.PRIO_PROCESS, os.getppid(), 9)\n"
                "os.sched_setscheduler(os.getppid(), os.SCHED_IDLE, os.sched_param(0))",
    "signals": "import signal, time\nfor number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,"
               " signal.SIGPIPE, signal.SIGALRM, signal.SIGCONT):\n    os.kill(os.getppid(), number)\n"
               "time.sleep(0.2)",
    # Signals the server blocks wait: queued until the user's quota is full, every later timer would fail.
    "queued-signals": "import ctypes, signal\nlibc = ctypes.CDLL(None)\nos.kill(os.getppid(), signal.SIGUSR1)\n"
                      "while libc.sigqueue(os.getppid(), signal.SIGRTMIN + 3, 0) == 0:\n    pass",
    "kill": "os.kill(os.getppid(), 9)",
    "stop": "import signal\nos.kill(os.getppid(), signal.SIGSTOP)",
    "stop-late": "import signal, time\nserver = os.getppid()\nif os.fork() == 0:\n    time.sleep(0.05)\n"
                 "    os.kill(server, signal.SIGSTOP)\n    time.sleep(600)",
    "fork-bomb": "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    # A chain of processes, each living only until it forks the next, that writes into every other's output:
    # a listing followed by single kills can miss it (a second reviewer's read); a stop of all at once cannot.
    "fork-chain": "if os.fork() == 0:\n    os.setsid()\n    while True:\n        for pid in os.listdir('/proc'):\n"
                  "            try:\n                os.write(os.open(f'/proc/{pid}/fd/1', os.O_WRONLY), b'CHAIN ')\n"
                  "            except (OSError, ValueError):\n                pass\n        if os.fork():\n"
                  "            os._exit(0)",
    "left-behind": "import signal, time\nserver = os.getppid()\nif os.fork() == 0:\n    os.setsid()\n"
                   "    while True:\n        os.kill(server, signal.SIGSTOP)\n        time.sleep(0.001)",
}


SEEN_BEFORE_A_TEST = ("limits", "schedule", "signals", "queued-signals")


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attack_on_the_fork_server_does_not_reach_a_later_test(warm: nbexec.SandboxConfig, attack: str) -> None:
    shown = nbexec.judge(SHOW, [{"expected": "?"}], config=warm).tests[0].diff
    want = shown.split("got ", 1)[1]
    indented = ATTACKS[attack].replace("\n", "\n    ")
    attacker = {"program": f"import os, resource\nif int(input()) == 0:\n    {indented}\nelse:\n    exec({SHOW!r})",
                "tests": [{"stdin": "0", "expected": None}, {"stdin": "1", "expected": "?"},
                          {"stdin": "2", "expected": "?"}],
                "limits": {"time": 2}}
    after = {"program": SHOW, "tests": [{"expected": "?"}] * 2}
    items = sorted(nbexec.judge_many([attacker, after], concurrency=1, reuse="batch", config=warm),
                   key=lambda item: item.index)
    first, second = items[0].result, items[1].result
    assert first is not None and second is not None, (items[0].error, items[1].error)
    for test in (*first.tests[1:], *second.tests):  # judge_error: the program was not judged further
        assert test.verdict == "judge_error" or test.diff.split("got ", 1)[1] == want, (attack, test)
    if attack in SEEN_BEFORE_A_TEST:  # the kernel's check replaces the server: the later tests are judged
        assert [test.verdict for test in first.tests[1:]] == ["wrong_answer"] * 2, first.tests
    assert [test.verdict for test in second.tests] == ["wrong_answer"] * 2, second.tests
    assert not unaccounted_containers()


def test_a_replaced_server_is_started_again_in_the_same_sandbox(warm: nbexec.SandboxConfig) -> None:
    """A test that changes the server costs that program's later tests their server; the reset (in the request of
    the last tests) leaves the start of a new one to a request of its own, and the next program is forked again."""
    replace = ("import os, resource\nsoft, hard = resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)\n"
               "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (soft - 1, hard))\n")
    show = SANDBOX + "import os\nprint(sandbox[0], b' -c ' in open(f'/proc/{os.getppid()}/cmdline', 'rb').read())"
    items = sorted(nbexec.judge_many([{"program": replace + show.replace("import os\n", ""),
                                       "tests": [{"expected": "?"}] * 2},
                                      {"program": show, "tests": [{"expected": "?"}] * 2}],
                                     concurrency=1, reuse="batch", config=warm), key=lambda item: item.index)
    shown = [[test.diff.split("got ", 1)[1].strip("'") for test in item.result.tests] for item in items if item.result]
    sandbox = shown[0][0].split()[0]
    assert shown == [[f"{sandbox} True", f"{sandbox} False"], [f"{sandbox} True"] * 2], shown


def test_signals_sent_to_the_server_after_a_test_never_reach_the_next_program(warm: nbexec.SandboxConfig) -> None:
    """A process the test left signals the server until the sweep ends it, after the server took those waiting at
    the test's end (a second reader's attack): the next program's test finds none waiting in its parent."""
    left = ("import os, signal\nserver = os.getppid()\nif os.fork() == 0:\n    os.setsid()\n    while True:\n"
            "        os.kill(server, signal.SIGCHLD)\n")
    look = "import os\nprint(open(f'/proc/{os.getppid()}/status').read().split('ShdPnd:')[1].split()[0])"
    items = sorted(nbexec.judge_many([{"program": left, "tests": [{"expected": None}]},
                                      {"program": look, "tests": [{"expected": "?"}]}],
                                     concurrency=1, reuse="batch", config=warm), key=lambda item: item.index)
    assert items[1].result is not None and items[1].result.mode == "batch", items[1].error
    assert items[1].result.tests[0].diff.split("got ", 1)[1] == "'0000000000000000'", items[1].result.tests


def test_signals_waiting_when_a_test_is_asked_for_are_taken_before_the_fork(tmp_path: Path) -> None:
    """The server, driven on this host as the kernel drives it, with signals sent between two tests and no check
    of them by the kernel (gVisor shows none in /proc): the second test finds none waiting in its parent."""
    source = shipped("judgefork.py")
    namespace: dict[str, Any] = {"__name__": "nbexec_judge_fork"}
    exec(compile(source, "<nbexec-judge-fork>", "exec"), namespace)
    (tmp_path / "main.py").write_text("import os\nprint(open(f'/proc/{os.getppid()}/status').read()"
                                      ".split('ShdPnd:')[1].split()[0])")
    server = namespace["Zygote"](source, [], {"PATH": os.environ["PATH"]}, time.monotonic() + 20)

    def test() -> bytes:
        stdin, (out, out_end), (err, err_end) = os.open(os.devnull, os.O_RDONLY), os.pipe(), os.pipe()
        server.start(["main.py"], str(tmp_path), (stdin, out_end, err_end), {"memory": 0, "time": 5, "fsize": 1 << 20})
        for fd in (stdin, out_end, err_end):
            os.close(fd)
        assert server.ended() is not None
        shown = os.read(out, 100).strip()
        os.close(out)
        os.close(err)
        return shown

    try:
        test()
        for number in (signal.SIGUSR1, signal.SIGHUP, signal.SIGRTMIN + 3):
            os.kill(server.pid, number)
        assert test() == b"0000000000000000"
    finally:
        server.close()


def test_a_signal_the_server_blocks_leaves_it_in_place(warm: nbexec.SandboxConfig) -> None:
    """Blocked signals do not cost a new server; a changed limit does (each test prints its parent)."""
    def parents(attack: str) -> list[str]:
        program = (f"import os, resource, signal\nif int(input()) == 0:\n    {attack}\n"
                   "print(os.getppid())")
        tests = [{"stdin": str(n), "expected": "?"} for n in range(3)]
        result = nbexec.judge(program, tests, config=warm)  # fresh: the kernel is every test's parent
        assert len({test.diff for test in result.tests}) == 1
        items = list(nbexec.judge_many([{"program": program, "tests": tests}], reuse="batch", config=warm))
        assert items[0].result is not None
        return [test.diff.split("got ", 1)[1] for test in items[0].result.tests]
    assert len(set(parents("os.kill(os.getppid(), signal.SIGTERM)"))) == 1
    changed = parents("resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (32, 32))")
    assert changed[1] != changed[0] and changed[2] == changed[1]


def test_a_forked_test_never_holds_another_tests_expected_output(warm: nbexec.SandboxConfig) -> None:
    """The server never held a test: test 0 scans its own memory for test 1's expected output."""
    scan = """
import re
found = 0
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if 'r' not in perms:
            continue
        start, end = (int(value, 16) for value in span.split('-'))
        for offset in range(start, end, 1 << 20):  # a MiB at a time: numpy reserves large spans
            try:
                mem.seek(offset)
                data = mem.read(min(end - offset, (1 << 20) + 16))
            except (OSError, OverflowError, ValueError):
                break
            for match in re.finditer(b'-SECRET-', data):
                digits = data[match.end():match.end() + 4]
                found += digits.isdigit() and int(digits) == 7740 + 1
print('leaked' if found else 'clean')
"""
    program = f"if int(input()) == 0:\n    exec({scan!r})\nelse:\n    print('NBX' + '-SECRET-' + str(7741))"
    tests = [{"stdin": "0", "expected": "clean"}, {"stdin": "1", "expected": "NBX-SECRET-7741"}]
    for item in nbexec.judge_many([{"program": program, "tests": tests}] * 2, concurrency=1, reuse="batch",
                                  config=warm):
        assert item.result is not None and item.result.mode == "batch"
        assert [test.verdict for test in item.result.tests] == ["accepted", "accepted"], item.result.tests


def test_a_test_cannot_read_or_trace_the_server(warm: nbexec.SandboxConfig) -> None:
    """Were it dumpable, a test could write code into the server's memory that every later test would run."""
    probe = """
import ctypes, os
server, refused = os.getppid(), []
for name in ('mem', 'environ', 'maps'):
    try:
        open(f'/proc/{server}/{name}', 'rb').close()
    except PermissionError:
        refused.append(name)
libc = ctypes.CDLL(None, use_errno=True)
refused.append('ptrace' if libc.ptrace(16, server, None, None) != 0 else 'traced')  # PTRACE_ATTACH
print(*refused)
"""
    items = list(nbexec.judge_many([{"program": probe, "tests": [{"expected": "mem environ maps ptrace"}]}],
                                   reuse="batch", config=warm))
    assert items[0].result is not None and items[0].result.mode == "batch"
    assert items[0].result.tests[0].verdict == "accepted", items[0].result.tests[0]


# Found by the same reviewer: a server started after a test had changed the kernel's settings or planted files
# inherited them (and outlived the reset); a process whose first thread had ended hid from every sweep as a zombie
# while its other threads read each later test's stdin; a child that asked to be traced left the server a zombie
# per test. Programs A (its settings and files, then the server replaced) and A2 (with a server again: the
# lurker, then tests that stop themselves) do it; program B, next in the sandbox, must see what a fresh one shows.
LEAVE = """
import ctypes, os, resource, signal, sys, threading, time
server = os.getppid()
kernel = int(open(f'/proc/{server}/stat').read().rsplit(')', 1)[1].split()[1])
step = int(input())
if step == 0:
    resource.prlimit(kernel, resource.RLIMIT_NOFILE, (200, resource.prlimit(kernel, resource.RLIMIT_NOFILE)[1]))
    os.sched_setaffinity(kernel, {0})
    os.makedirs('/tmp/.config/matplotlib', exist_ok=True)
    open('/tmp/.config/matplotlib/matplotlibrc', 'w').write('lines.linewidth: 42\\n')
    soft, hard = resource.prlimit(server, resource.RLIMIT_MSGQUEUE)
    resource.prlimit(server, resource.RLIMIT_MSGQUEUE, (soft - 1, hard))  # the server is replaced
elif step == 1 and os.fork() == 0:
    os.setsid()
    def lurk():
        while True:
            for pid in os.listdir('/proc'):
                try:
                    os.write(os.open(f'/proc/{pid}/fd/1', os.O_WRONLY), b'LURKER ')
                except (OSError, ValueError):
                    pass
            time.sleep(0.001)
    threading.Thread(target=lurk).start()
    ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: only this first thread ends
elif step == 1:
    time.sleep(0.3)  # the test ends once the lurker's first thread has (the sweep then sees a zombie leader)
elif step >= 2:
    ctypes.CDLL(None).ptrace(0, 0, None, None)  # PTRACE_TRACEME: the server is its tracer
    os.kill(os.getpid(), signal.SIGSTOP)
"""
LOOK = SHOW.replace("print(", "others = []\nfor pid in os.listdir('/proc'):\n"
                                "    if pid.isdigit() and int(pid) not in (1, os.getpid(), os.getppid()):\n"
                                "        try:\n"
                                "            if b'kernel_launcher' not in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
                                "                others.append(pid)\n"
                                "        except OSError:\n"
                                "            pass\n"
                                "import matplotlib\nprint(len(others), matplotlib.rcParams['lines.linewidth'], ")


def test_nothing_a_program_left_reaches_the_next_one(warm: nbexec.SandboxConfig) -> None:
    want = nbexec.judge(LOOK, [{"expected": "?"}], config=warm).tests[0].diff.split("got ", 1)[1]
    assert want.startswith("'0 1.5 "), want
    leave = {"program": LEAVE, "tests": [{"stdin": "0", "expected": None}], "limits": {"time": 1}}
    lurk = {"program": LEAVE, "tests": [{"stdin": str(n), "expected": None} for n in range(1, 5)],
            "limits": {"time": 1}}
    look = {"program": LOOK, "tests": [{"expected": "?"}] * 3}
    items = sorted(nbexec.judge_many([leave, lurk, look], concurrency=1, reuse="batch", config=warm),
                   key=lambda item: item.index)
    assert items[2].result is not None and items[2].result.mode == "batch", items[2].error
    assert [test.diff.split("got ", 1)[1] for test in items[2].result.tests] == [want] * 3, items[2].result.tests
    fresh = nbexec.judge(LEAVE.replace("step = int(input())", "step = int(input())\nprint('clean')"),
                         [{"stdin": "1", "expected": "clean"}, {"stdin": "-1", "expected": "clean"}],
                         limits={"time": 1}, config=warm)  # once, this failed too: the sweep missed the lurker
    assert fresh.tests[1].verdict == "accepted", fresh.tests
