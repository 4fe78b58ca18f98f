"""Many small programs: `execute_many` against a loop of `execute_notebook`, same config (the table in
docs/batches.md).

    .venv/bin/python benchmarks/many.py loop          # one execute_notebook() after another
    .venv/bin/python benchmarks/many.py many 2        # execute_many(..., concurrency=2)
"""

from __future__ import annotations

import sys
import time

import nbexec


def main(mode: str, concurrency: int, count: int = 50) -> None:
    config = nbexec.SandboxConfig(pool_size=2, timeout=60)
    programs = [f"print(sum(range({i} * 1000)))" for i in range(count)]
    started = time.monotonic()
    if mode == "loop":
        ok = sum(nbexec.execute_notebook(p, config=config).ok for p in programs)
    else:
        ok = sum(item.ok for item in nbexec.execute_many(programs, config=config, concurrency=concurrency))
    print(f"{mode} concurrency={concurrency if mode == 'many' else 1}: {ok}/{count} ok in "
          f"{time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
