"""Latency of nbexec under each OCI runtime that works on this engine (runc, runsc, crun), side by side.

    .venv/bin/python benchmarks/runtimes.py                  # every working runtime, default samples
    .venv/bin/python benchmarks/runtimes.py --samples 10 --runtimes runc runsc

Rows per runtime: a bare `docker run --rm --network none --runtime R IMAGE python3 -c pass` (the floor), nbexec
cold one-shot `print` (no pool), pooled one-shot `print` and plot (default warm imports; the pool is refilled
before each sample), and a session round trip. Samples of the runtimes are interleaved, so a load change on a
shared machine hits them alike. Prints a Markdown table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import nbexec
from nbexec.sandbox.docker import pool, runtimes

PRINT = "print(12345*54321)"
PLOT = "import matplotlib.pyplot as plt\nplt.plot(range(10))\nplt.show()"


def ok(result: nbexec.ExecutionResult) -> None:
    if not result.ok:
        raise SystemExit(f"benchmark execution failed: {result.error}")


def pool_refilled(config: nbexec.SandboxConfig) -> None:
    """Wait until the pool of ``config`` is full again and its kernels have settled."""
    pool.wait_for_teardown()
    current = pool._pool_for(config)
    current.replenish()
    deadline = time.monotonic() + 180
    while current.ready < config.pool_size and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)


def bare_run(config: nbexec.SandboxConfig) -> None:
    subprocess.run(["docker", "run", "--rm", "--network", "none", "--runtime", config.runtime or "runc",
                    config.image, "python3", "-c", "pass"], check=True, capture_output=True)


Configs = dict[str, nbexec.SandboxConfig]


def modes() -> dict[str, tuple[Callable[[nbexec.SandboxConfig], None], Callable[[Configs], None]]]:
    """Each measured mode as (what is timed, what runs untimed before each sample)."""
    def cold(config: nbexec.SandboxConfig) -> None:
        ok(nbexec.execute_notebook(PRINT, config=config.replace(pool_size=0)))

    def untimed_cold(configs: Configs) -> None:
        pool.wait_for_teardown()

    def refilled(configs: Configs) -> None:  # every runtime's pool: none refills while another is timed
        for config in configs.values():
            pool_refilled(config)

    return {
        "bare docker run": (bare_run, untimed_cold),
        "cold one-shot print": (cold, untimed_cold),
        "pooled one-shot print": (lambda c: ok(nbexec.execute_notebook(PRINT, config=c)), refilled),
        "pooled one-shot plot": (lambda c: ok(nbexec.execute_notebook(PLOT, config=c)), refilled),
    }


def measure(configs: Configs, samples: int) -> list[dict[str, object]]:
    times: dict[tuple[str, str], list[float]] = {}
    for mode, (timed, before) in modes().items():
        for _ in range(samples):
            for name, config in configs.items():
                before(configs)
                started = time.perf_counter()
                timed(config)
                times.setdefault((mode, name), []).append(time.perf_counter() - started)
        print(f"measured {mode}", file=sys.stderr)
    for name, config in configs.items():
        with nbexec.Session(config.replace(pool_size=0)) as session:
            session.run("pass")
            for _ in range(samples * 2):
                started = time.perf_counter()
                ok(session.run(PRINT))
                times.setdefault(("session round trip", name), []).append(time.perf_counter() - started)
    return [{"mode": mode, "runtime": name, "n": len(found), "p50_ms": 1000 * statistics.median(found),
             "min_ms": 1000 * min(found)} for (mode, name), found in times.items()]


def table(rows: list[dict[str, object]], names: list[str]) -> str:
    lines = ["| mode | " + " | ".join(f"{n} p50 (min)" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for mode in dict.fromkeys(str(r["mode"]) for r in rows):
        cells = []
        for name in names:
            row = next(r for r in rows if r["mode"] == mode and r["runtime"] == name)
            cells.append(f"{row['p50_ms']:.0f} ms ({row['min_ms']:.0f})" if row["p50_ms"] >= 100  # type: ignore
                         else f"{row['p50_ms']:.1f} ms ({row['min_ms']:.1f})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=7, help="samples per mode and runtime")
    parser.add_argument("--runtimes", nargs="+", default=list(runtimes.SUPPORTED))
    args = parser.parse_args()
    base = nbexec.from_env(pool_size=2)
    configs = {}
    for name in args.runtimes:
        found = runtimes.check(name, image=base.image)
        print(f"{name}: {'works' if found.works else 'skipped: ' + found.reason}", file=sys.stderr)
        if found.works:
            configs[name] = base.replace(runtime=name)
    if not configs:
        raise SystemExit("no runtime works here: see `nbexec doctor`")
    rows = measure(configs, args.samples)
    print(table(rows, list(configs)))
    out = Path(__file__).parent / "results" / f"runtimes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"samples": args.samples, "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    pool.shutdown()


if __name__ == "__main__":
    main()
