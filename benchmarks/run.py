"""Side-by-side latency, throughput and memory benchmark: nbexec against the reference flow and host Python.

    .venv/bin/python benchmarks/run.py                 # everything (about 10 minutes)
    .venv/bin/python benchmarks/run.py --samples 10 --duration 20 --only print

Modes: nbexec pooled one-shot (pool warm before each sample), nbexec cold one-shot (no pool), nbexec session
run, the reference flow (`docker run --rm IMAGE xvfb-run -a jupyter nbconvert --execute` on a one-cell
notebook, then parsing its JSON), and `python3 -c` on the host. Prints a Markdown table and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import nbformat

import nbexec
from nbexec.sandbox import daemon, pool

WORKLOADS = {
    "print": "print(12345*54321)",
    "plot": "import matplotlib.pyplot as plt\nplt.plot(range(10))\nplt.show()",
    "pandas": "import numpy as np, pandas as pd\n"
              "df = pd.DataFrame(np.random.rand(100_000, 4), columns=list('abcd'))\nprint(df.describe())",
    "write5mb": "open('/mnt/data/blob.bin', 'wb').write(b'\\0' * 5_000_000)",
}
HOST_PLOT = "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt, io\nplt.plot(range(10))\n" \
            "plt.savefig(io.BytesIO(), format='png')"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(func: Callable[[], object], samples: int, before: Callable[[], None] = lambda: None) -> list[float]:
    times = []
    for _ in range(samples):
        before()
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return times


def wait_pool_ready(config: nbexec.SandboxConfig) -> Callable[[], None]:
    def wait() -> None:
        pool.wait_for_teardown()
        current = pool._pool_for(config)
        current.replenish()
        deadline = time.monotonic() + 120
        while current.ready < config.pool_size and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # let the refilled kernels settle
    return wait


def check(result: nbexec.ExecutionResult) -> None:
    if not result.ok:
        raise SystemExit(f"benchmark execution failed: {result.error}")


def reference_flow(image: str, code: str) -> None:
    """docker run --rm + nbconvert --execute on a one-cell notebook, then parse the executed JSON."""
    with tempfile.TemporaryDirectory() as temp:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
        nbformat.write(nb, Path(temp) / "in.ipynb")
        Path(temp).chmod(0o777)
        subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{temp}:/mnt/data", image,
                        "xvfb-run", "-a", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                        "/mnt/data/in.ipynb", "--output", "/mnt/data/out.ipynb"],
                       check=True, capture_output=True)
        executed = json.loads((Path(temp) / "out.ipynb").read_text())
        assert executed["cells"][0]["outputs"] is not None
        subprocess.run(["docker", "run", "--rm", "-v", f"{temp}:/mnt/data", "--user", "0", "--entrypoint", "sh",
                        image, "-c", "rm -rf /mnt/data/*"], check=True, capture_output=True)


def host_python(code: str) -> None:
    with tempfile.TemporaryDirectory() as temp:
        code = code.replace("/mnt/data", temp)
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def modes(name: str, samples: int) -> dict[str, Callable[[], list[float]]]:
    """Each way of running one workload, as a function that returns its sample times."""
    code = WORKLOADS[name]
    pooled = nbexec.from_env(pool_size=2)
    cold = nbexec.from_env(pool_size=0)
    return {
        "nbexec pooled one-shot": lambda: timed(lambda: check(nbexec.execute_notebook(code, config=pooled)),
                                                samples, wait_pool_ready(pooled)),
        "nbexec cold one-shot": lambda: timed(lambda: check(nbexec.execute_notebook(code, config=cold)),
                                              samples, pool.wait_for_teardown),
        "nbexec session run": lambda: session_times(pooled, code, samples),
        "reference flow": lambda: timed(lambda: reference_flow(pooled.image, code), max(3, samples // 2)),
        "host python3 -c": lambda: timed(lambda: host_python(HOST_PLOT if name == "plot" else code), samples),
    }


def latency(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for name in args.only:
        for mode, run in modes(name, args.samples).items():
            try:
                times = run()
            except subprocess.CalledProcessError:  # host Python without the workload's libraries
                print(f"{name:9} {mode:24} skipped: this Python lacks the workload's libraries", file=sys.stderr)
                continue
            rows.append({"workload": name, "mode": mode, "n": len(times), "p50_ms": 1000 * statistics.median(times),
                         "p90_ms": 1000 * percentile(times, 0.9)})
            print(f"{name:9} {mode:24} p50 {rows[-1]['p50_ms']:8.1f} ms  p90 {rows[-1]['p90_ms']:8.1f} ms",
                  file=sys.stderr)
    return rows


def session_times(config: nbexec.SandboxConfig, code: str, samples: int) -> list[float]:
    with nbexec.Session(config) as session:
        session.run("pass")
        return timed(lambda: check(session.run(code)), samples)


def throughput(args: argparse.Namespace) -> list[dict[str, object]]:
    """Executions per second, each in a fresh sandbox, from 2 concurrent callers."""
    rows = []
    configs = {
        "nbexec pooled one-shot (default warm imports)": nbexec.from_env(pool_size=2),
        "nbexec pooled one-shot (no warm imports)": nbexec.from_env(pool_size=2, warm_imports=()),
    }
    runners: dict[str, Callable[[], None]] = {
        name: (lambda config=config: check(nbexec.execute_notebook(WORKLOADS["print"], config=config)))
        for name, config in configs.items()
    }
    runners["reference flow"] = lambda: reference_flow(nbexec.from_env().image, WORKLOADS["print"])
    for name, run in runners.items():
        pool.shutdown()
        count = [0]
        stop = time.monotonic() + args.duration

        def caller(run: Callable[[], None] = run, stop: float = stop, count: list[int] = count) -> None:
            while time.monotonic() < stop:
                run()
                count[0] += 1

        started = time.monotonic()
        threads = [threading.Thread(target=caller) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        rows.append({"mode": name, "executions": count[0], "seconds": elapsed, "per_s": count[0] / elapsed})
        print(f"throughput {name}: {count[0] / elapsed:.2f}/s", file=sys.stderr)
    pool.shutdown()
    return rows


def idle_memory() -> list[dict[str, object]]:
    """Memory of a waiting pooled sandbox, as `docker stats` reports it (usage less inactive page cache)."""
    rows = []
    for label, warm in (("no warm imports", ()), ("default warm imports", nbexec.SandboxConfig().warm_imports)):
        sandbox = pool.start_sandbox(nbexec.from_env(warm_imports=warm), role="pool", warm_up=True)
        try:
            time.sleep(2)
            stats = sandbox.container.stats(stream=False)["memory_stats"]
            detail = stats.get("stats", {})
            cache = detail.get("total_inactive_file", detail.get("inactive_file", 0))
            rows.append({"sandbox": label, "idle_mb": (stats["usage"] - cache) / 2**20})
            print(f"idle memory, {label}: {rows[-1]['idle_mb']:.1f} MiB", file=sys.stderr)
        finally:
            sandbox.destroy()
    return rows


def table(latency_rows: list[dict[str, object]], throughput_rows: list[dict[str, object]],
          memory_rows: list[dict[str, object]]) -> str:
    lines = ["| workload | mode | p50 | p90 |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['mode']} | {r['p50_ms']:.1f} ms | {r['p90_ms']:.1f} ms |" for r in latency_rows]
    lines += ["", "| throughput, 2 callers, fresh sandbox each | executions/s |", "|---|---|"]
    lines += [f"| {r['mode']} | {r['per_s']:.2f} |" for r in throughput_rows]
    lines += ["", "| idle pooled sandbox | memory |", "|---|---|"]
    lines += [f"| {r['sandbox']} | {r['idle_mb']:.0f} MiB |" for r in memory_rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20, help="samples per workload and mode")
    parser.add_argument("--duration", type=float, default=60, help="seconds per throughput run")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--skip", nargs="*", default=[], choices=["latency", "throughput", "memory"])
    args = parser.parse_args()
    daemon.connect()
    latency_rows = latency(args) if "latency" not in args.skip else []
    pool.shutdown()
    throughput_rows = throughput(args) if "throughput" not in args.skip else []
    memory_rows = idle_memory() if "memory" not in args.skip else []
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}.json").write_text(json.dumps(
        {"latency": latency_rows, "throughput": throughput_rows, "memory": memory_rows}, indent=1))
    print(table(latency_rows, throughput_rows, memory_rows))


if __name__ == "__main__":
    main()
