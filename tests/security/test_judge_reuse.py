"""judge_many(reuse="batch") against what one item leaves for the next in their shared sandbox: files in every
place a test can write (folders it made unwritable too), and processes. Judged from outside the reset: what the
next item finds, and which sandbox each item ran in (the container's id, as its mounts name it)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import nbexec

from ..conftest import unaccounted_containers

# The container's id, as the source of its /etc/hostname mount names it: which sandbox an item ran in.
SANDBOX = """
sandbox = [line.split()[3].split('/')[-2][:12] for line in open('/proc/self/mountinfo') if ' /etc/hostname ' in line]
"""
WHERE = SANDBOX + "print(*sandbox)\n"
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
    "os.kill(os.getppid(), 9)",  # the kernel that runs the tests: the item is judge_error
    # a folder deeper than a path may name: the reset cannot reach it
    "os.chdir('/tmp')\nfor _ in range(24):\n    os.mkdir('d' * 250)\n    os.chdir('d' * 250)\nopen('x', 'w')",
], ids=["kernel-killed", "past-path-max"])
def test_a_sandbox_the_reset_cannot_clean_is_not_handed_on(config: nbexec.SandboxConfig, left: str) -> None:
    items = _batch(PLANT + left + "\n", FIND, config=config)
    assert items[0].result is not None and items[1].result is not None
    if items[0].result.verdict == "judge_error":  # no line printed: the next item's answer says enough
        assert items[1].result.verdict == "wrong_answer"
    else:
        assert _where(items[0])[0] != _where(items[1])[0], "a sandbox the reset could not clean was handed on"
    fresh = _where(nbexec.judge(FIND, [{"expected": "?"}], config=config))[1:]
    assert _where(items[1])[1:] == fresh


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
