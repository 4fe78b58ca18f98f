"""execute_many(): many sources in fresh sandboxes, streamed; one item's failure is its own; a stop (closing the
iterator, Ctrl-C, cancelling the async one) interrupts the rest and leaves nothing, judged from outside."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec.sandbox.docker import pool

from .conftest import IMAGE, own_workdirs, owned_by, settle, unaccounted_containers

SLEEP = "import time\ntime.sleep(600)"


def test_one_items_failure_never_stops_the_others(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    sources = ["print('first')", "1/0", "import os\nos._exit(3)", Path(tmp_path / "missing.py"), "print('last')"]
    items = list(nbexec.execute_many(sources, config=config, concurrency=2))
    by_index = {item.index: item for item in items}
    assert sorted(by_index) == [0, 1, 2, 3, 4]
    assert by_index[0].ok and by_index[0].result is not None and by_index[0].result.stdout.strip() == "first"
    assert by_index[1].result is not None and by_index[1].result.error is not None
    assert by_index[1].result.error.ename == "ZeroDivisionError"
    assert by_index[2].result is not None and not by_index[2].ok  # the kernel died: a sandbox failure, as data
    assert by_index[3].result is None and isinstance(by_index[3].error, nbexec.NotebookError)
    assert by_index[4].ok and by_index[4].result is not None and by_index[4].result.stdout.strip() == "last"


def test_sources_are_read_lazily_and_results_streamed(config: nbexec.SandboxConfig) -> None:
    read = itertools.count()

    def endless() -> Iterator[str]:
        while True:
            yield f"print({next(read)})"

    with contextlib.closing(nbexec.execute_many(endless(), config=config, concurrency=2)) as items:
        taken = list(itertools.islice(items, 3))
    assert len(taken) == 3 and all(item.ok for item in taken)
    assert next(read) <= 3 + 2  # what was handed out, and at most `concurrency` places more


def test_closing_the_iterator_interrupts_the_running_items(config: nbexec.SandboxConfig) -> None:
    config = config.replace(timeout=120)
    items = nbexec.execute_many(["print('quick')", SLEEP, SLEEP, SLEEP], config=config, concurrency=3)
    first = next(items)
    assert first.index == 0 and first.ok
    time.sleep(3)  # the sleepers are running by now
    started = time.monotonic()
    items.close()
    took = time.monotonic() - started
    assert took < 60, f"closing took {took:.1f} s: the running items were not interrupted"
    pool.wait_for_teardown()
    settle(lambda: not unaccounted_containers(), 20)
    assert unaccounted_containers() == []


def test_cancelling_the_async_iterator_interrupts_and_leaves_nothing(config: nbexec.SandboxConfig) -> None:
    config = config.replace(timeout=120)
    seen: list[int] = []

    async def consume() -> None:
        async for item in nbexec.execute_many_async(["print(1)", SLEEP, SLEEP], config=config, concurrency=3):
            seen.append(item.index)

    async def main() -> float:
        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.1)
        await asyncio.sleep(3)
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    took = asyncio.run(main())
    assert seen == [0]
    assert took < 60, f"cancelling took {took:.1f} s: the running items were not interrupted"
    pool.wait_for_teardown()
    settle(lambda: not unaccounted_containers(), 20)
    assert unaccounted_containers() == []


CTRL_C = f"""
import sys, nbexec
config = nbexec.SandboxConfig(image={IMAGE!r}, pool_size=0, warm_imports=(), timeout=120, interrupt_grace=3)
for item in nbexec.execute_many(["print(1)"] + [{SLEEP!r}] * 6, config=config, concurrency=3):
    print("item", item.index, flush=True)
"""


@pytest.mark.usefixtures("cleanup_ledger")
def test_ctrl_c_stops_the_batch_and_leaves_no_container_or_folder() -> None:
    child = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "item 0"
        settle(lambda: len(owned_by(child.pid)) >= 3, 60)  # the sleepers run
        running = len(owned_by(child.pid))
        started = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert running >= 3
    assert "KeyboardInterrupt" in err
    assert took < 60, f"Ctrl-C took {took:.1f} s to end the batch"
    assert owned_by(child.pid) == [] and own_workdirs(child.pid) == []
    assert not os.path.exists(f"/proc/{child.pid}")
