"""judge_many(reuse="batch") against what one item leaves for the next in their shared sandbox: files in every
place a test can write (folders it made unwritable too), and processes. Judged from outside the reset: what the
next item finds, and which sandbox each item ran in (the container's id, as its mounts name it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

import nbexec
from nbexec.engine import judgemany

from ..conftest import unaccounted_containers

# The container's id, as the source of its /etc/hostname mount names it: which sandbox an item ran in.
SANDBOX = """
sandbox = [line.split()[3].split('/')[-2][:12] for line in open('/proc/self/mountinfo') if ' /etc/hostname ' in line]
"""
WHERE = SANDBOX + "print(*sandbox)\n"
# The kernel's pid, for a program (which imported os): with reuse="batch" a Python test's parent is the fork server.
KERNEL = ("kernel = next(int(p) for p in os.listdir('/proc') if p.isdigit()"
          " and b'kernel_launcher' in open('/proc/' + p + '/cmdline', 'rb').read())\n")
# A change to the fork server (a Python test's parent in a batch): the reset then starts a new one, from the kernel,
# so what a test changed on the kernel reaches later Python tests only if the reset did not put it back.
REPLACE_SERVER = ("import resource\nsoft, hard = resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)\n"
                  "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (soft - 1, hard))\n")
PLACES = ("/tmp", "/dev/shm", "/dev/mqueue", "/mnt/data", "/mnt/packages", "/home/sandbox", "/home/user")
PLANT = WHERE + f"""
import os, subprocess, sys
def attempt(action, *args):
    try:
        action(*args)
    except OSError:
        pass
for place in {PLACES!r}:
    attempt(lambda: open(place + '/.left', 'w').write('from the last item'))  # /dev/mqueue: a queue
    attempt(os.symlink, '/etc/passwd', place + '/link')
    attempt(os.makedirs, place + '/left/deep')
    attempt(lambda: open(place + '/left/deep/secret', 'w').write('from the last item'))
    attempt(os.chmod, place + '/left/deep', 0o500)
    attempt(os.chmod, place + '/left', 0)
    attempt(os.makedirs, place + '/nest' + '/n' * 300)
import ctypes
libc = ctypes.CDLL(None)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0x4E42, 4096, 0o1600)  # IPC_CREAT | 0600: memory that outlives every process
ctypes.memmove(libc.shmat(segment, None, 0), b"from the last item", 18)
libc.msgget(0x4E43, 0o1600)
libc.semget(0x4E44, 1, 0o1600)
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', 'nbexec-left-behind'],
                 start_new_session=True)
"""
FIND = SANDBOX + f"""
import os
own, found = os.path.basename(os.path.dirname(os.getcwd())), []  # this item's folder: <own>/build
for place in {PLACES!r}:
    try:
        found += [place + '/' + name for name in os.listdir(place) if name != own]
    except OSError:
        pass
for pid in os.listdir('/proc'):
    try:
        if b'nbexec-left-behind' in open('/proc/' + pid + '/cmdline', 'rb').read():
            found.append('process ' + pid)
    except OSError:
        pass
for kind in ('shm', 'msg', 'sem'):
    try:
        found += [kind + ' ' + line.split()[0] for line in open('/proc/sysvipc/' + kind).read().splitlines()[1:]]
    except OSError:
        pass
print(*sandbox, len(found), ','.join(sorted(found)))  # a diff shows 160 characters: the count says the rest
"""


def _where(item: nbexec.JudgeItem | nbexec.JudgeResult) -> list[str]:
    """What an item's program printed on its one line: the expected "?" makes it a wrong answer's diff."""
    result = item.result if isinstance(item, nbexec.JudgeItem) else item
    assert result is not None, getattr(item, "error", None)
    return result.tests[0].diff.split("got '", 1)[1].rstrip("'").split()


def _batch(*programs: str, config: nbexec.SandboxConfig) -> list[nbexec.JudgeItem]:
    submissions = [{"program": program, "tests": [{"expected": "?"}]} for program in programs]
    return sorted(nbexec.judge_many(submissions, concurrency=1, reuse="batch", config=config),
                  key=lambda item: item.index)


def test_the_next_item_finds_nothing_the_last_one_left(config: nbexec.SandboxConfig) -> None:
    """Files and folders in every writable place (some unwritable, unreadable or nested 300 deep), symlinks out,
    a process in a session of its own: the next item in the same sandbox sees what a fresh sandbox shows."""
    fresh = _where(nbexec.judge(FIND, [{"expected": "?"}], config=config))[1:]
    items = _batch(PLANT, FIND, config=config)
    assert _where(items[0])[0] == _where(items[1])[0], "the two items did not share a sandbox"
    assert items[1].result is not None and items[1].result.mode == "batch"
    assert _where(items[1])[1:] == fresh


@pytest.mark.parametrize("left", [
    KERNEL + "os.kill(kernel, 9)",  # the kernel that runs the tests: the item is judge_error
    # a folder deeper than a path may name: the reset cannot reach it
    "os.chdir('/tmp')\nfor _ in range(24):\n    os.mkdir('d' * 250)\n    os.chdir('d' * 250)\nopen('x', 'w')",
    # the kernel's own files removed (its Matplotlib settings, IPython's): a fresh sandbox has them
    "for root, _, names in [*os.walk('/home/sandbox'), *os.walk('/home/user')]:\n    for name in names:\n"
    "        attempt(os.unlink, os.path.join(root, name))",
], ids=["kernel-killed", "past-path-max", "kernel-files-removed"])
def test_a_sandbox_the_reset_cannot_clean_is_not_handed_on(config: nbexec.SandboxConfig, left: str) -> None:
    items = _batch(PLANT + left + "\n", FIND, config=config)
    assert items[0].result is not None and items[1].result is not None
    if items[0].result.verdict == "judge_error":  # no line printed: the next item's answer says enough
        assert items[1].result.verdict == "wrong_answer"
    else:
        assert _where(items[0])[0] != _where(items[1])[0], "a sandbox the reset could not clean was handed on"
    fresh = _where(nbexec.judge(FIND, [{"expected": "?"}], config=config))[1:]
    assert _where(items[1])[1:] == fresh


@pytest.mark.parametrize("tests", [1, 3], ids=["reset-with-the-setup", "reset-with-the-last-tests"])
def test_a_reset_out_of_time_keeps_the_verdicts_and_hands_nothing_on(config: nbexec.SandboxConfig, tests: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The reset runs in the request of the last tests, within its own time: past it (here at once, as after a
    test that left very many files) the verdicts stand and the next item gets another sandbox."""
    monkeypatch.setattr(judgemany, "REMOVE_SECONDS", 0.0)
    plant = WHERE + "open('/tmp/left', 'w').write('x')\n"
    submissions = [{"program": program, "tests": [{"expected": "?"}] * tests} for program in (plant, WHERE)]
    items = sorted(nbexec.judge_many(submissions, concurrency=1, reuse="batch", config=config),
                   key=lambda item: item.index)
    assert items[0].result is not None and items[0].result.mode == "batch"
    assert [test.verdict for test in items[0].result.tests] == ["wrong_answer"] * tests
    assert _where(items[0])[0] != _where(items[1])[0], "a sandbox the reset did not finish was handed on"


def test_sandboxes_are_shared_within_one_call_only(config: nbexec.SandboxConfig) -> None:
    first = _batch(WHERE, WHERE, WHERE, config=config)
    second = _batch(WHERE, WHERE, config=config)
    fresh = list(nbexec.judge_many([{"program": WHERE, "tests": [{"expected": "?"}]}] * 2, config=config))
    assert len({_where(item)[0] for item in first}) == 1
    assert len({_where(item)[0] for item in second} | {_where(item)[0] for item in first}) == 2
    assert len({_where(item)[0] for item in fresh}) == 2
    assert {item.result.mode for item in first + second if item.result} == {"batch"}
    assert {item.result.mode for item in fresh if item.result} == {"fresh"}
    assert not unaccounted_containers(), "a sandbox of a batch outlived its call"


def test_leaving_a_reusing_batch_stops_its_items_and_closes_its_sandboxes(config: nbexec.SandboxConfig) -> None:
    sleeper = {"program": "import time\ntime.sleep(600)", "tests": [{"expected": None}],
               "limits": {"time": 600, "program": 600}}
    quick = {"program": "print(1)", "tests": [{"expected": "1"}]}
    items = nbexec.judge_many([quick, sleeper, sleeper, sleeper], concurrency=2, reuse="batch", config=config)
    first = next(items)
    assert first.index == 0 and first.ok
    time.sleep(3)  # the sleepers are under way, one in the sandbox the quick item left
    started = time.monotonic()
    items.close()
    assert time.monotonic() - started < 30, "leaving the loop waited for the sleepers"
    assert not unaccounted_containers(), "a sandbox of the batch outlived the loop"


def test_the_async_form_judges_and_a_cancel_closes_every_sandbox(config: nbexec.SandboxConfig) -> None:
    quick = {"program": "print(int(input()) + 1)", "tests": [{"stdin": "1", "expected": "2"}]}
    sleeper = {"program": "import time\ntime.sleep(600)", "tests": [{"expected": None}],
               "limits": {"time": 600, "program": 600}}

    async def scenario() -> tuple[list[nbexec.JudgeItem], float]:
        judged = [item async for item in nbexec.judge_many_async([quick] * 3, concurrency=1, reuse="batch",
                                                                 config=config)]

        async def drain() -> None:
            async for _ in nbexec.judge_many_async([quick, sleeper, sleeper], concurrency=2, reuse="batch",
                                                   config=config):
                pass
        task = asyncio.create_task(drain())
        await asyncio.sleep(5)  # the sleepers are under way
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return judged, time.monotonic() - started

    judged, stopping = asyncio.run(scenario())
    assert [item.ok for item in judged] == [True] * 3
    assert {item.result.mode for item in judged if item.result} == {"batch"}
    assert stopping < 30, "the cancel waited for the sleepers"
    assert not unaccounted_containers(), "a sandbox of the batch outlived the cancel"


@pytest.fixture
def cold_config(config: nbexec.SandboxConfig) -> nbexec.SandboxConfig:
    return config.replace(pool_size=0)


def _judged(*submissions: dict[str, Any], config: nbexec.SandboxConfig) -> list[nbexec.JudgeItem]:
    return sorted(nbexec.judge_many(list(submissions), concurrency=1, reuse="batch", config=config),
                  key=lambda item: item.index)


def _shown(program: str) -> dict[str, Any]:
    return {"program": program, "tests": [{"expected": "?"}]}


def _fresh(program: str, config: nbexec.SandboxConfig) -> list[str]:
    return _where(nbexec.judge(program, [{"expected": "?"}], config=config))[1:]


# What follows came from a review by someone who did not write the reset.
# The kernel's rlimits: a test is the kernel's child, of the same uid, so prlimit(2) on the kernel is allowed
# (non-dumpable does not stop it), and every later test inherits them. A hard limit lowered cannot be raised again.
LOWER_KERNEL_LIMITS = WHERE + """
import os, resource
""" + KERNEL + """
resource.prlimit(kernel, resource.RLIMIT_MSGQUEUE, (424242, 424242))
resource.prlimit(kernel, resource.RLIMIT_RTTIME, (31337, 31337))
""" + REPLACE_SERVER
SHOW_LIMITS = WHERE.replace("print(*sandbox)", "") + """
import resource
print(*sandbox, *resource.getrlimit(resource.RLIMIT_MSGQUEUE), *resource.getrlimit(resource.RLIMIT_RTTIME))
"""


def test_limits_a_submission_set_on_the_kernel_do_not_reach_the_next(cold_config: nbexec.SandboxConfig) -> None:
    """A hard limit lowered cannot be raised again: that sandbox is closed, and the next item's is fresh."""
    items = _judged(_shown(LOWER_KERNEL_LIMITS), _shown(SHOW_LIMITS), config=cold_config)
    assert _where(items[1])[1:] == _fresh(SHOW_LIMITS, cold_config)


@pytest.mark.parametrize("limit", ["RLIMIT_NPROC, (1, 1)", "RLIMIT_STACK, (16384, 16384)"])
def test_a_submission_cannot_fail_every_later_one_through_the_kernels_limits(cold_config: nbexec.SandboxConfig,
                                                                             limit: str) -> None:
    """Once, each later correct submission in that sandbox was a runtime_error ("could not start: Resource
    temporarily unavailable" for NPROC; a crash for STACK)."""
    poison = {"program": f"import os, resource\n{KERNEL}{REPLACE_SERVER}resource.prlimit(kernel, resource.{limit})",
              "tests": [{"expected": None}]}
    correct = {"program": "print(int(input()) + 1)", "tests": [{"stdin": "1", "expected": "2"}]}
    items = _judged(poison, correct, correct, config=cold_config)
    assert [item.result.verdict if item.result else item.error for item in items[1:]] == ["accepted", "accepted"]


# The scheduling of the kernel: SCHED_IDLE, nice and CPU affinity may be set on a process of the same uid; later
# tests inherit them (slower, or starved on a busy host: timeouts that are not the program's).
SCHEDULE_KERNEL = WHERE + """
import os
""" + KERNEL + """
os.sched_setaffinity(kernel, {0})
os.setpriority(os.PRIO_PROCESS, kernel, 7)
os.sched_setscheduler(kernel, os.SCHED_IDLE, os.sched_param(0))
""" + REPLACE_SERVER
SHOW_SCHEDULE = WHERE.replace("print(*sandbox)", "") + """
import os
print(*sandbox, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), len(os.sched_getaffinity(0)))
"""


def test_the_kernels_scheduling_a_submission_set_does_not_reach_the_next(cold_config: nbexec.SandboxConfig) -> None:
    """SCHED_IDLE and a higher nice cannot be undone without privilege: that sandbox is closed."""
    items = _judged(_shown(SCHEDULE_KERNEL), _shown(SHOW_SCHEDULE), config=cold_config)
    assert _where(items[1])[1:] == _fresh(SHOW_SCHEDULE, cold_config)


# sched_setattr on the kernel: a custom time slice (Linux 6.12 on), or utilization clamps where the kernel has
# them, which later tests inherit and the reset cannot put back.
SLICE_KERNEL = WHERE + """
import ctypes, os, struct
""" + KERNEL + """
attr = ctypes.create_string_buffer(struct.pack('IIQiIQQQII', 56, 0, 0, 0, 0, 3_000_000, 0, 0, 0, 0), 56)
ctypes.CDLL(None).syscall(314, kernel, attr, 0)  # sched_setattr: SCHED_OTHER with a 3 ms slice
""" + REPLACE_SERVER
SHOW_SLICE = WHERE.replace("print(*sandbox)", "") + """
import ctypes, struct
attr = ctypes.create_string_buffer(56)
ctypes.CDLL(None).syscall(315, 0, attr, 56, 0)  # sched_getattr
print(*sandbox, struct.unpack('IIQiIQQQII', attr.raw)[5])
"""


def test_the_kernels_time_slice_a_submission_set_does_not_reach_the_next(cold_config: nbexec.SandboxConfig) -> None:
    """A slice or clamp set with sched_setattr is not put back: that sandbox is closed."""
    items = _judged(_shown(SLICE_KERNEL), _shown(SHOW_SLICE), config=cold_config)
    assert _where(items[1])[1:] == _fresh(SHOW_SLICE, cold_config)


# The places themselves: the reset empties them but keeps their own inode, with its extended attributes (user.*
# on ext4 and tmpfs: kilobytes each), its mode and its times.
MARK_PLACES = WHERE + """
import os
for place in ('/mnt/data', '/mnt/packages', '/home/sandbox'):
    os.setxattr(place, 'user.left', b'from-the-last-item')
os.utime('/mnt/packages', ns=(1, 123456789))
os.chmod('/mnt/packages', 0o500)
"""
SHOW_PLACES = WHERE.replace("print(*sandbox)", "") + """
import os
shown = []
for place in ('/mnt/data', '/mnt/packages', '/home/sandbox'):
    shown += [name + '=' + os.getxattr(place, name).decode() for name in os.listxattr(place)]
st = os.stat('/mnt/packages')
print(*sandbox, oct(st.st_mode), st.st_mtime_ns == 123456789, *shown)
"""


def test_the_places_own_attributes_are_not_left_to_the_next(cold_config: nbexec.SandboxConfig) -> None:
    """Their mode, extended attributes and times are put back, and the sandbox handed on."""
    items = _judged(_shown(MARK_PLACES), _shown(SHOW_PLACES), config=cold_config)
    assert _where(items[0])[0] == _where(items[1])[0], "the two items did not share a sandbox"
    assert _where(items[1])[1:] == _fresh(SHOW_PLACES, cold_config)


def test_a_default_acl_on_the_data_folder_does_not_fail_the_next_submission(
        cold_config: nbexec.SandboxConfig) -> None:
    """A default POSIX ACL (an xattr of /mnt/data) that grants its owner nothing: once, the host's next upload
    inherited it and the runner could not read its tests (item.error)."""
    acl = ("import os, struct\nacl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, 0, 0xFFFFFFFF) "
           "for tag in (0x01, 0x04, 0x20))\nos.setxattr('/mnt/data', 'system.posix_acl_default', acl)\n")
    correct = {"program": "print(int(input()) + 1)", "tests": [{"stdin": "1", "expected": "2"}]}
    items = _judged({"program": acl, "tests": [{"expected": None}]}, correct, config=cold_config)
    assert items[1].error is None and items[1].result is not None and items[1].result.verdict == "accepted"


# The kernel's own files: its start copies Matplotlib's settings and font list into ~/.config/matplotlib.
WRITE_KEPT_FILE = WHERE + """
open('/home/sandbox/.config/matplotlib/matplotlibrc', 'w').write('from-the-last-item')
"""
READ_KEPT_FILE = WHERE.replace("print(*sandbox)", "") + """
print(*sandbox, open('/home/sandbox/.config/matplotlib/matplotlibrc').read().split()[0])
"""


def test_files_outside_ipython_kept_by_the_reset_are_not_a_channel(cold_config: nbexec.SandboxConfig) -> None:
    """A remembered file that changed: that sandbox is closed."""
    items = _judged(_shown(WRITE_KEPT_FILE), _shown(READ_KEPT_FILE), config=cold_config)
    assert _where(items[1])[1:] == _fresh(READ_KEPT_FILE, cold_config)


@pytest.mark.parametrize("reuse", [None, "batch"])
def test_leaving_the_loop_does_not_wait_for_a_stopped_kernel(cold_config: nbexec.SandboxConfig,
                                                             reuse: str | None) -> None:
    """A test that SIGSTOPs the kernel: the stop's interrupt is never answered. Once, leaving the loop waited for
    the program's whole limit (47 s with a 45 s limit); now the stop closes the sessions it could not interrupt."""
    stopper = {"program": f"import os, signal, time\n{KERNEL}os.kill(kernel, signal.SIGSTOP)\ntime.sleep(600)",
               "tests": [{"expected": None}], "limits": {"time": 45, "program": 45}}
    quick = {"program": "print(1)", "tests": [{"expected": "1"}]}
    items = nbexec.judge_many([quick, stopper, stopper], concurrency=2, reuse=reuse, config=cold_config)
    assert next(items).ok
    time.sleep(3)
    started = time.monotonic()
    items.close()
    assert time.monotonic() - started < 20, "leaving the loop waited for the stopped kernels"
    assert not unaccounted_containers(), "a sandbox of the batch outlived the loop"
