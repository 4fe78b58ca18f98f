"""The warm pool: one sandbox per execution, never reused; nothing left behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import nbexec
from nbexec import execute_notebook
from nbexec.sandbox.docker import pool

from .conftest import IMAGE, own_containers, own_workdirs, wait_until


def test_a_sandbox_is_never_reused(config: nbexec.SandboxConfig) -> None:
    first = execute_notebook("leak = 'x'\nopen('/mnt/data/leak.txt', 'w').write('x')\n"
                             "import socket; print(socket.gethostname())", config=config)
    assert first.ok
    for _ in range(4):
        result = execute_notebook("import os\nprint('leak' in globals(), os.listdir('/mnt/data'))", config=config)
        assert result.stdout == "False []\n"


def test_warm_imports_only_touch_sys_modules(cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(pool_size=1, warm_imports=("numpy", "json"), timeout=30)
    pool.warm_up(config)  # a first call on an empty pool starts its own sandbox cold: wait for a warmed one
    wait_until(lambda: pool.ready_count(config) == 1, 120, "the pool never warmed a sandbox")
    result = execute_notebook("import sys\nprint('numpy' in sys.modules, 'numpy' in dir(), 'json' in dir(), "
                              "[k for k in globals() if 'nbexec' in k])\nprint(len(In), Out)", config=config)
    assert result.stdout == "True False False []\n2 {}\n", result.stdout


def test_the_first_call_does_not_wait_for_the_pool(cleanup_ledger: None) -> None:
    """A first call on an empty pool starts one sandbox the cold way; the pool fills after its result."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=2, timeout=30)
    result = execute_notebook("import sys\nprint('pandas' in sys.modules)", config=config)
    assert result.stdout == "False\n"  # not a warmed pool sandbox (those import pandas in advance)
    wait_until(lambda: pool.ready_count(config) == 2, 120, "the pool did not fill after the first call")
    assert execute_notebook("import sys\nprint('pandas' in sys.modules)", config=config).stdout == "True\n"


@pytest.mark.long
@pytest.mark.parametrize("count", [40, pytest.param(200, marks=pytest.mark.load)])  # the soak runs with -m load
def test_executions_from_four_threads_leave_nothing(config: nbexec.SandboxConfig, count: int) -> None:
    def one(n: int) -> str:
        return execute_notebook(f"print({n} * 2)", config=config).stdout

    with ThreadPoolExecutor(4) as workers:
        outputs = list(workers.map(one, range(count)))
    assert outputs == [f"{n * 2}\n" for n in range(count)]
    pool.shutdown()
    pool.wait_for_teardown()
    assert own_containers(include_pool=True) == []
    assert own_workdirs() == []
