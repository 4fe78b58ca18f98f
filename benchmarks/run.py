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
import os
import shutil
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
from nbexec.files.folders import output_root
from nbexec.sandbox.docker import daemon, pool

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


def bare_docker_run(image: str, runtime: str | None = None) -> None:
    """The floor: a bare `docker run --rm --network none` of the same image running the same `print`."""
    subprocess.run(["docker", "run", "--rm", "--network", "none", "--runtime", runtime or "runc", image,
                    "python3", "-c", WORKLOADS["print"]], check=True, capture_output=True)


def run_callers(run: Callable[[], None], seconds: float) -> int:
    """Executions finished by 2 concurrent callers within ``seconds``."""
    count = [0]
    stop = time.monotonic() + seconds

    def caller() -> None:
        while time.monotonic() < stop:
            run()
            count[0] += 1

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return count[0]


def throughput(args: argparse.Namespace, runtime: str | None = None) -> list[dict[str, object]]:
    """Executions per second, each in a fresh sandbox, from 2 concurrent callers, against a bare `docker run` of
    the same image: the modes run in alternating segments (``--segments`` rounds of ``--duration`` seconds split
    between them), so a change of load on a shared machine hits every mode alike."""
    base = nbexec.from_env(pool_size=2, runtime=runtime)
    configs = {"no warm imports": base.replace(warm_imports=()), "default warm imports": base}
    runners: dict[str, Callable[[], None]] = {
        f"nbexec pooled one-shot ({name})": (lambda config=config: check(
            nbexec.execute_notebook(WORKLOADS["print"], config=config)))
        for name, config in configs.items()}
    runners["bare docker run"] = lambda: bare_docker_run(base.image, runtime)
    done = dict.fromkeys(runners, 0)
    spent = dict.fromkeys(runners, 0.0)
    segment = args.duration / args.segments
    for _ in range(args.segments):
        for name, run in runners.items():
            pool.shutdown()  # each segment starts from an empty pool: every execution pays for its sandbox
            started = time.monotonic()
            done[name] += run_callers(run, segment)
            pool.shutdown()
            spent[name] += time.monotonic() - started
    rows: list[dict[str, object]] = []
    for name in runners:
        rows.append({"mode": name, "runtime": runtime or "runc", "executions": done[name], "seconds": spent[name],
                     "per_s": done[name] / spent[name]})
    floor = float(rows[-1]["per_s"])  # type: ignore[arg-type]
    for row in rows:
        row["ratio"] = float(row["per_s"]) / floor  # type: ignore[arg-type]
        print(f"throughput {row['runtime']} {row['mode']}: {row['per_s']:.2f}/s ({row['ratio']:.2f}x)",
              file=sys.stderr)
    return rows


def cold_against_bare(args: argparse.Namespace, runtime: str | None = None) -> list[dict[str, object]]:
    """Cold one-shot `print` (no pool) against a bare `docker run` of the same image, samples interleaved."""
    cold = nbexec.from_env(pool_size=0, warm_imports=(), runtime=runtime)
    times: dict[str, list[float]] = {"nbexec cold one-shot print": [], "bare docker run print": []}
    for _ in range(args.samples):
        pool.wait_for_teardown()
        times["nbexec cold one-shot print"] += timed(
            lambda: check(nbexec.execute_notebook(WORKLOADS["print"], config=cold)), 1)
        pool.wait_for_teardown()
        times["bare docker run print"] += timed(lambda: bare_docker_run(cold.image, runtime), 1)
    rows: list[dict[str, object]] = [
        {"mode": mode, "runtime": runtime or "runc", "p50_ms": 1000 * statistics.median(found),
         "p90_ms": 1000 * percentile(found, 0.9)} for mode, found in times.items()]
    rows[0]["ratio"] = float(rows[0]["p50_ms"]) / float(rows[1]["p50_ms"])  # type: ignore[arg-type]
    print(f"cold one-shot {runtime or 'runc'}: {rows[0]['p50_ms']:.0f} ms against bare {rows[1]['p50_ms']:.0f} ms "
          f"({rows[0]['ratio']:.2f}x)", file=sys.stderr)
    return rows


def idle_memory() -> list[dict[str, object]]:
    """Memory of a waiting pooled sandbox, as `docker stats` reports it (usage less inactive page cache)."""
    rows = []
    for label, warm in (("no warm imports", ()), ("default warm imports", nbexec.SandboxConfig().warm_imports)):
        found = []
        for _ in range(3):
            sandbox = pool.start_sandbox(nbexec.from_env(warm_imports=warm), role="pool", warm_up=True)
            try:
                time.sleep(2)
                stats = sandbox.container.stats(stream=False)["memory_stats"]
                detail = stats.get("stats", {})
                cache = detail.get("total_inactive_file", detail.get("inactive_file", 0))
                found.append((stats["usage"] - cache) / 2**20)
            finally:
                sandbox.destroy()
        rows.append({"sandbox": label, "idle_mb": statistics.median(found)})
        print(f"idle memory, {label}: {rows[-1]['idle_mb']:.1f} MiB", file=sys.stderr)
    return rows


TARGETS = {"no warm imports": 0.9, "default warm imports": 0.6}


def table(latency_rows: list[dict[str, object]], throughput_rows: list[dict[str, object]],
          cold_rows: list[dict[str, object]], memory_rows: list[dict[str, object]]) -> str:
    lines = ["| workload | mode | p50 | p90 |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['mode']} | {r['p50_ms']:.1f} ms | {r['p90_ms']:.1f} ms |" for r in latency_rows]
    lines += ["", "| throughput, 2 callers, fresh sandbox each | runtime | executions/s | x bare docker run | target |",
              "|---|---|---|---|---|"]
    for r in throughput_rows:
        target = next((f"≥ {t}x" for k, t in TARGETS.items() if k in str(r["mode"])), "")
        lines.append(f"| {r['mode']} | {r['runtime']} | {r['per_s']:.2f} | {r['ratio']:.2f} | {target} |")
    lines += ["", "| cold one-shot `print` | runtime | p50 | p90 | x bare docker run | target |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['runtime']} | {r['p50_ms']:.0f} ms | {r['p90_ms']:.0f} ms | "
              + (f"{r['ratio']:.2f} | ≤ 1.3x |" if "ratio" in r else " | |") for r in cold_rows]
    lines += ["", "| idle pooled sandbox (usage less inactive file cache) | memory | target |", "|---|---|---|"]
    lines += [f"| {r['sandbox']} | {r['idle_mb']:.0f} MiB | ≤ {40 if r['sandbox'] == 'no warm imports' else 70} MiB |"
              for r in memory_rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20, help="samples per workload and mode")
    parser.add_argument("--duration", type=float, default=60, help="seconds per throughput mode and runtime")
    parser.add_argument("--segments", type=int, default=4, help="alternating segments the throughput time is cut in")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--skip", nargs="*", default=[], choices=["latency", "throughput", "cold", "memory"])
    parser.add_argument("--runtimes", nargs="+", default=["runc"], help="runtimes for the throughput and cold rows")
    args = parser.parse_args()
    daemon.connect()
    # nbexec keeps each run's output folder for its caller; the benchmark's are removed when it ends.
    outputs = output_root()
    kept = set(outputs.iterdir())
    try:
        measure(args)
    finally:
        for folder in set(outputs.iterdir()) - kept:
            shutil.rmtree(folder, ignore_errors=True)


def measure(args: argparse.Namespace) -> None:
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    latency_rows = latency(args) if "latency" not in args.skip else []
    pool.shutdown()
    throughput_rows: list[dict[str, object]] = []
    cold_rows: list[dict[str, object]] = []
    for runtime in args.runtimes:
        if "throughput" not in args.skip:
            throughput_rows += throughput(args, runtime)
        if "cold" not in args.skip:
            cold_rows += cold_against_bare(args, runtime)
    memory_rows = idle_memory() if "memory" not in args.skip else []
    print(f"load average at end: {os.getloadavg()}", file=sys.stderr)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}.json").write_text(json.dumps({"latency": latency_rows, "throughput": throughput_rows,
                                                   "cold": cold_rows, "memory": memory_rows}, indent=1))
    print(table(latency_rows, throughput_rows, cold_rows, memory_rows))


if __name__ == "__main__":
    main()
