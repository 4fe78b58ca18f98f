"""Each language's pool and throughput: pooled and cold one-shot latency, a session's run, and executions per second
from 2 callers, for Python, R, Deno and Bash with the same sandbox and limits (the per-language table in
docs/languages.md).

    .venv/bin/python benchmarks/languages.py                       # about 5 minutes
    .venv/bin/python benchmarks/languages.py --samples 5 --duration 10 --languages r bash

The kernels image must exist (`nbexec image build --kernels r,deno,bash`). Prints a Markdown table and writes JSON
to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from run import check, percentile, run_callers, session_times, timed, wait_pool_ready

import nbexec
from nbexec import languages
from nbexec.sandbox.docker import pool

PRINT = {"python": "print(12345*54321)", "r": "cat(12345*54321)", "deno": "console.log(12345*54321)",
         "bash": "echo $((12345*54321))"}


def measure(language: str, samples: int, duration: float) -> dict[str, object]:
    code = PRINT[language]
    pooled = nbexec.from_env(pool_size=2, language=language)
    cold = nbexec.from_env(pool_size=0, language=language)
    row: dict[str, object] = {"language": language}
    for mode, times in (
            ("pooled", timed(lambda: check(nbexec.execute_notebook(code, config=pooled)), samples,
                             wait_pool_ready(pooled))),
            ("cold", timed(lambda: check(nbexec.execute_notebook(code, config=cold)), samples,
                           pool.wait_for_teardown)),
            ("session", session_times(pooled, code, samples))):
        row[f"{mode}_p50_ms"] = 1000 * statistics.median(times)
        row[f"{mode}_p90_ms"] = 1000 * percentile(times, 0.9)
    pool.shutdown()
    started = time.monotonic()
    done = run_callers(lambda: check(nbexec.execute_notebook(code, config=pooled)), duration)
    row["per_s"] = done / (time.monotonic() - started)
    pool.shutdown()
    print(json.dumps(row), file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10, help="samples per language and mode")
    parser.add_argument("--duration", type=float, default=20, help="seconds of throughput per language")
    parser.add_argument("--languages", nargs="+", default=list(languages.NAMES), choices=list(languages.NAMES))
    args = parser.parse_args()
    rows = [measure(language, args.samples, args.duration) for language in args.languages]
    print("| language | pooled one-shot p50 / p90 | cold one-shot p50 / p90 | session run p50 / p90 | "
          "one-shots per second (2 callers) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['language']} | {row['pooled_p50_ms']:.0f} / {row['pooled_p90_ms']:.0f} ms | "
              f"{row['cold_p50_ms']:.0f} / {row['cold_p90_ms']:.0f} ms | "
              f"{row['session_p50_ms']:.0f} / {row['session_p90_ms']:.0f} ms | {row['per_s']:.2f} |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"languages-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
