"""One-shot latency and executions/s through the router, next to one node called directly and a local run.

    .venv/bin/python benchmarks/cluster.py --samples 30 --duration 30 --nodes 2

Starts ``--nodes`` real `nbexec serve` nodes (loopback, this Docker engine, no warm imports) and a router, then:
latency of a `print` one-shot (p50/p90) locally (execute_notebook, pooled), on a node over HTTP, through the
router, and through the library with NBEXEC_NODES; executions/s with ``--callers`` concurrent callers, each
execution in a fresh sandbox; and the memory of an idle session and of a session that imported pandas. All
processes share this machine's CPUs, so the cluster rows measure the router's cost, not added capacity.
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

import httpx

import nbexec
from nbexec.sandbox.docker import pool

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-node-token-" + "x" * 16
CLIENT = "bench-client-token-" + "y" * 16
CODE = "print(12345*54321)"


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    process = subprocess.Popen([sys.executable, "-m", "nbexec.cli", "serve", "--port", str(port), *args],
                               env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{args} never became ready")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(func: Callable[[], object], samples: int, before: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(samples):
        before()  # the pools are full again: latency of a warm call, as the local benchmark measures it
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return times


def http_one_shot(url: str, token: str) -> Callable[[], object]:
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    def call() -> object:
        data = client.post("/v1/execute", json={"code": CODE}).json()
        assert data["stdout"] == "670592745\n", data
        return data

    return call


def throughput(call: Callable[[], object], callers: int, duration: float) -> float:
    done = [0]
    lock = threading.Lock()
    stop = time.monotonic() + duration

    def worker() -> None:
        while time.monotonic() < stop:
            call()
            with lock:
                done[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(callers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done[0] / (time.monotonic() - started)


def session_memory(url: str) -> dict[str, float]:
    """MiB charged to a session's sandbox (its cgroup's memory.current, read inside), idle and after pandas."""
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    sid = client.post("/v1/sessions").json()["id"]
    probe = ("import os\nfor p in ('/sys/fs/cgroup/memory.current', '/sys/fs/cgroup/memory/memory.usage_in_bytes'):\n"
             "    if os.path.exists(p):\n        print(int(open(p).read()))")
    found = {}
    for label, code in (("idle session (kernel only)", probe), ("session after import pandas, matplotlib",
                                                               "import pandas, matplotlib.pyplot\n" + probe)):
        stdout = client.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()["stdout"]
        found[label] = round(int(stdout.split()[-1]) / 1024**2, 1)
    client.delete(f"/v1/sessions/{sid}")
    return found


def pools_full(urls: list[str]) -> Callable[[], None]:
    """Wait until every node's pool is full again (so each sample is a warm call, as locally)."""
    client = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def wait() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            caps = [client.get(f"{url}/v1/capacity").json() for url in urls]
            if all(c["pool_free"] >= c["pool_size"] for c in caps):
                return
            time.sleep(0.05)

    return wait


def local_pool_full(config: nbexec.SandboxConfig) -> Callable[[], None]:
    def wait() -> None:
        deadline = time.monotonic() + 60
        while pool.ready_count(config) < config.pool_size and time.monotonic() < deadline:
            time.sleep(0.05)

    return wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--callers", type=int, default=2)
    args = parser.parse_args()
    base_tmp = Path(tempfile.mkdtemp(prefix="nbexec-bench-cluster-"))
    base_tmp.chmod(0o755)
    processes = []
    try:
        node_urls = []
        for index in range(args.nodes):
            folder = base_tmp / f"n{index}"
            folder.mkdir(mode=0o755)
            folder.chmod(0o755)
            process, url = _serve(["--node-name", f"bench-{os.getpid()}-n{index}", "--max-running-per-token", "16"],
                                  {"TMPDIR": str(folder), "NBEXEC_API_TOKENS": TOKEN, "NBEXEC_POOL_SIZE": "2",
                                   "NBEXEC_WARM_IMPORTS": ""})
            processes.append(process)
            node_urls.append(url)
        router, router_url = _serve(["--nodes", ",".join(node_urls)],
                                    {"NBEXEC_API_TOKENS": CLIENT, "NBEXEC_NODE_TOKEN": TOKEN})
        processes.append(router)
        report(args, node_urls, router_url)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
        shutil.rmtree(base_tmp, ignore_errors=True)


def report(args: argparse.Namespace, node_urls: list[str], router_url: str) -> None:
    config = nbexec.SandboxConfig(pool_size=2, warm_imports=())
    os.environ.pop("NBEXEC_NODES", None)
    nbexec.execute_notebook(CODE, config=config)
    pool.warm_up(config)
    modes: dict[str, tuple[Callable[[], object], Callable[[], None]]] = {
        "local pooled one-shot (execute_notebook)": (lambda: nbexec.execute_notebook(CODE, config=config),
                                                     local_pool_full(config)),
        "one node over HTTP": (http_one_shot(node_urls[0], TOKEN), pools_full(node_urls[:1])),
        f"router in front of {args.nodes} nodes": (http_one_shot(router_url, CLIENT), pools_full(node_urls)),
    }
    rows = []
    for name, (call, before) in modes.items():
        call()
        times = timed(call, args.samples, before)
        rows.append({"mode": name, "p50_ms": round(statistics.median(times) * 1000, 1),
                     "p90_ms": round(percentile(times, 0.9) * 1000, 1)})
    os.environ.update({"NBEXEC_NODES": ",".join(node_urls), "NBEXEC_NODE_TOKEN": TOKEN})
    times = timed(lambda: nbexec.execute_notebook(CODE), args.samples, pools_full(node_urls))
    rows.append({"mode": "library with NBEXEC_NODES (files streamed home)",
                 "p50_ms": round(statistics.median(times) * 1000, 1),
                 "p90_ms": round(percentile(times, 0.9) * 1000, 1)})
    os.environ.pop("NBEXEC_NODES")
    rates = {name: round(throughput(call, args.callers, args.duration), 2) for name, (call, _) in modes.items()}
    pool.shutdown()
    print("| print one-shot | p50 | p90 |\n|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['p50_ms']} ms | {row['p90_ms']} ms |")
    print(f"\n| throughput, {args.callers} callers, fresh sandbox each | executions/s |\n|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate} |", flush=True)
    memory = session_memory(node_urls[0])
    print("\n| memory on a node | MiB |\n|---|---|")
    for name, mib in memory.items():
        print(f"| {name} | {mib} |")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / f"cluster-{int(time.time())}.json").write_text(json.dumps(
        {"latency": rows, "throughput": rates, "memory": memory, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
