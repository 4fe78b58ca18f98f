"""Under gVisor: a fresh sandbox restored from a template checkpoint of a warmed kernel, against booting one.

    .venv/bin/python benchmarks/template_restore.py --samples 5

Warm imports: numpy, pandas, matplotlib.pyplot. "boot": a sandbox started and warmed (`pool.start_sandbox`), its
first `print` answered. "restore": the warmed kernel checkpointed once (`checkpoint.checkpoint`), then each sample
makes a new sandbox from it (`checkpoint.from_template`: its own id, working folder and data filesystem, the
checkpoint copied in and sha256-checked, a fresh key and session id, started, the kernel reconnected) and its
first `print` answered. Both are destroyed after their sample (not timed). Samples alternate, so a load change
hits both alike; one at a time, so sandboxes per second is 1 / mean. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import nbexec
from nbexec.sandbox.docker import checkpoint, pool
from nbexec.sandbox.docker.container import Sandbox

WARM = ("numpy", "pandas", "matplotlib.pyplot")


def first_answer(sandbox: Sandbox) -> None:
    reply = sandbox.run_hidden("print(12345*54321)", 60)
    assert reply is not None and reply.get("status") == "ok", reply


def boot(config: nbexec.SandboxConfig) -> float:
    started = time.perf_counter()
    sandbox = pool.start_sandbox(config, role="session", warm_up=True)
    try:
        first_answer(sandbox)
        return time.perf_counter() - started
    finally:
        sandbox.destroy()


def restore(config: nbexec.SandboxConfig, record: dict, folder: Path) -> float:
    started = time.perf_counter()
    sandbox = checkpoint.from_template(config, record, folder)
    try:
        first_answer(sandbox)
        return time.perf_counter() - started
    finally:
        sandbox.destroy()


def row(name: str, times: list[float]) -> str:
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return f"| {name} | {statistics.median(times):.2f} s | {p90:.2f} s | {1 / statistics.mean(times):.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    config = nbexec.SandboxConfig(runtime="runsc", warm_imports=WARM, pool_size=0, startup_timeout=120)
    template = pool.start_sandbox(config, role="session", warm_up=True)
    with tempfile.TemporaryDirectory(prefix="nbexec-template-") as kept:
        started = time.perf_counter()
        record = checkpoint.checkpoint(template, Path(kept))
        made = time.perf_counter() - started
        size = sum(size for size, _ in record["files"].values())
        booted, restored = [], []
        try:
            for _ in range(args.samples):
                booted.append(boot(config))
                restored.append(restore(config, record, Path(kept)))
        finally:
            template.destroy()
    print(f"template: checkpointed in {made:.2f} s, {size / 1e6:.1f} MB\n")
    print("| runsc, warm imports numpy/pandas/matplotlib | p50 first answer | p90 | sandboxes/s (one at a time) |")
    print("|---|---|---|---|")
    print(row("boot a sandbox", booted))
    print(row("restore the template", restored))


if __name__ == "__main__":
    main()
