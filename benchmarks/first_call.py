"""Time to the first result of a plain execute_notebook() in a fresh process, pool on against pool off.

    .venv/bin/python benchmarks/first_call.py --samples 6

Each sample is a new interpreter (import nbexec included), so the pool starts empty: the first call must cost
no more with the pool on (it starts its own sandbox the cold way and the pool fills after the result).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

SAMPLE = """import sys, time
started = time.monotonic()
import nbexec
result = nbexec.execute_notebook("print(6 * 7)", pool_size=int(sys.argv[1]))
assert result.ok, result.error
print(time.monotonic() - started)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    args = parser.parse_args()
    times: dict[int, list[float]] = {2: [], 0: []}
    for _ in range(args.samples):
        for size in times:  # interleaved, so a busy moment of the machine hits both
            done = subprocess.run([sys.executable, "-c", SAMPLE, str(size)], capture_output=True, text=True,
                                  check=True)
            times[size].append(float(done.stdout.split()[-1]))
    for size, values in times.items():
        print(f"pool_size={size}: median {statistics.median(values):.3f} s, min {min(values):.3f} s "
              f"({args.samples} fresh processes)")


if __name__ == "__main__":
    main()
