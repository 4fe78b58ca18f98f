"""Programs judged per second: judge_many in its default mode (a sandbox per program) and with reuse="batch",
against a `docker run` of the same image per test (the table in docs/judging.md).

    .venv/bin/python benchmarks/judging.py                  # 200 programs x 10 tests, 2 at a time
    .venv/bin/python benchmarks/judging.py --programs 1000 --docker-runs 40
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time

import nbexec

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)) + {k})"


def submissions(count: int, tests: int) -> list[dict[str, object]]:
    return [{"program": PROGRAM.format(k=k),
             "tests": [{"stdin": str(n), "expected": str(sum(i * i for i in range(n)) + k)} for n in range(tests)]}
            for k in range(count)]


def cpu() -> float:
    """CPU seconds of this process and its children so far (the engine's and the sandboxes' are not in it)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def judged(config: nbexec.SandboxConfig, items: list[dict[str, object]], concurrency: int,
           reuse: str | None) -> tuple[float, float, int]:
    started, used = time.monotonic(), cpu()
    passed = sum(item.ok for item in nbexec.judge_many(items, concurrency=concurrency, reuse=reuse, config=config))
    return time.monotonic() - started, cpu() - used, passed


def docker_runs(image: str, runs: int, concurrency: int) -> float:
    """Seconds per test for `docker run --rm -i` of the image, ``concurrency`` at a time."""
    command = ["docker", "run", "--rm", "-i", "--network", "none", "--entrypoint", "python3", image, "-c",
               PROGRAM.format(k=0)]
    started, running = time.monotonic(), []
    for _ in range(runs):
        if len(running) >= concurrency:
            running.pop(0).communicate()
        running.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True))
        running[-1].stdin.write("100\n")  # type: ignore[union-attr]
        running[-1].stdin.close()  # type: ignore[union-attr]
    for process in running:
        process.wait()
    return (time.monotonic() - started) / runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--docker-runs", type=int, default=40)
    args = parser.parse_args()
    config = nbexec.SandboxConfig(pool_size=args.concurrency, warm_imports=())
    items = submissions(args.programs, args.tests)
    runs = args.programs * args.tests
    print("| mode | programs | test runs/s | programs/s | host CPU per program | passed |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("batch", None):
        wall, used, passed = judged(config, items, args.concurrency, mode)
        name = 'reuse="batch"' if mode else "default"
        print(f"| judge_many, {name} | {args.programs} | {runs / wall:.1f} | "
              f"{args.programs / wall:.2f} | {used / args.programs * 1000:.0f} ms | {passed} |")
    per_test = docker_runs(config.image_tag, args.docker_runs, args.concurrency)
    print(f"| docker run per test | {args.docker_runs} runs | {1 / per_test:.1f} | "
          f"{1 / per_test / args.tests:.2f} | | |")


if __name__ == "__main__":
    main()
