"""nbclient's NotebookClient against nbexec's own cell loop, on the same sandbox kernel (the numbers behind the
choice written in nbexec/cells.py's docstring). nbclient is not an nbexec dependency: `pip install nbclient`.

    .venv/bin/python benchmarks/nbclient_loop.py

It prints, for each loop, the p50 latency of a print() cell and what a cell writing 50 MB to stdout costs the host
(seconds, bytes kept in the notebook, peak Python memory as tracemalloc sees it).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import nbformat
from jupyter_client.asynchronous import AsyncKernelClient
from nbclient import NotebookClient

import nbexec
from nbexec.engine import budget, cells
from nbexec.sandbox.docker import pool

PRINT = "print(12345*54321)"
FLOOD = "import sys\nfor _ in range(50): sys.stdout.write('x' * 1_000_000); sys.stdout.flush()"


def report(name: str, run: Callable[[str], Any], samples: int = 30) -> None:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        run(PRINT)
        times.append(time.perf_counter() - started)
    tracemalloc.start()
    started = time.perf_counter()
    cell = run(FLOOD)
    took = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    kept = sum(len(o.get("text", "")) for o in cell.outputs)
    print(f"{name:8} print p50 {1000 * statistics.median(times):5.1f} ms | 50 MB of stdout: {took:.2f} s, "
          f"{kept / 1e6:.1f} MB kept, host peak {peak / 2**20:.0f} MiB")


def main() -> None:
    config = nbexec.from_env(pool_size=0, warm_imports=())
    sandbox = pool.start_sandbox(config, role="oneshot", warm_up=False)
    try:
        info = {**sandbox._connection, "transport": "ipc", "ip": str(sandbox.runtime_dir / "kernel")}
        kc = AsyncKernelClient()
        kc.load_connection_info(info)
        kc.start_channels()
        client = NotebookClient(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell()]), kernel_name="python3",
                                timeout=60)
        client.kc = kc
        loop = asyncio.new_event_loop()
        loop.run_until_complete(kc.wait_for_ready(timeout=30))

        def with_nbclient(code: str) -> Any:
            cell = nbformat.v4.new_code_cell(code)
            loop.run_until_complete(client.async_execute_cell(cell, 0))
            return cell

        def with_nbexec(code: str) -> Any:
            cell = nbformat.v4.new_code_cell(code)
            cells.run_cell(sandbox, cell, 0, deadline=time.monotonic() + 60, budget=budget.Budget.from_config(config))
            return cell

        report("nbclient", with_nbclient)
        kc.stop_channels()
        loop.close()
        report("nbexec", with_nbexec)
    finally:
        sandbox.destroy()


if __name__ == "__main__":
    main()
