"""Programs judged per second: judge_many in its default mode (a sandbox per program) and with reuse="batch",
against a `docker run` of the same image per test (the table in docs/judging.md).

    .venv/bin/python benchmarks/judging.py                  # 200 programs x 10 tests, 2 at a time
    .venv/bin/python benchmarks/judging.py --programs 1000 --docker-runs 40
    .venv/bin/python benchmarks/judging.py --language cpp --programs 200   # the judge image's g++

For Python, a row of execute_many (one execute_notebook per item, the default mode's yardstick) follows.

For C++ the per-test `docker run` runs a binary compiled once, as judging does.
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import subprocess
import tempfile
import time

import nbexec

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)) + {k})"
CPP = ("#include <iostream>\nint main(){{long n,s=0;std::cin>>n;for(long i=0;i<n;i++)s+=i*i;"
       "std::cout<<s+{k}<<std::endl;}}")


def submissions(count: int, tests: int, language: str = "python") -> list[dict[str, object]]:
    source = CPP if language == "cpp" else PROGRAM
    return [{"program": source.format(k=k), "language": language,
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


def executed(config: nbexec.SandboxConfig, sources: list[str], concurrency: int) -> tuple[float, float, int]:
    started, used = time.monotonic(), cpu()
    passed = sum(item.ok for item in nbexec.execute_many(sources, concurrency=concurrency, config=config))
    return time.monotonic() - started, cpu() - used, passed


def docker_runs(image: str, runs: int, concurrency: int, language: str) -> float:
    """Seconds per test for `docker run --rm -i` of the image, ``concurrency`` at a time."""
    with tempfile.TemporaryDirectory() as folder:
        command = ["docker", "run", "--rm", "-i", "--network", "none", "--entrypoint", "python3", image, "-c",
                   PROGRAM.format(k=0)]
        if language == "cpp":  # compiled once, as judging does; each test runs the binary
            pathlib.Path(folder, "main.cpp").write_text(CPP.format(k=0))
            pathlib.Path(folder).chmod(0o777)  # the image's user writes the binary there
            subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{folder}:/w", "--entrypoint",
                            "g++", image, "-O2", "-o", "/w/main", "/w/main.cpp"], check=True)
            command = ["docker", "run", "--rm", "-i", "--network", "none", "-v", f"{folder}:/w:ro",
                       "--entrypoint", "/w/main", image]
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
    parser.add_argument("--language", choices=("python", "cpp"), default="python")
    parser.add_argument("--executions", type=int, default=200, help="items of the execute_many row (Python)")
    args = parser.parse_args()
    image = nbexec.judgelangs.IMAGE if args.language == "cpp" else nbexec.SandboxConfig().image_tag
    config = nbexec.SandboxConfig(image=image, pool_size=args.concurrency, warm_imports=())
    items = submissions(args.programs, args.tests, args.language)
    runs = args.programs * args.tests
    print("| mode | programs | test runs/s | programs/s | host CPU per program | passed |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("batch", None):
        wall, used, passed = judged(config, items, args.concurrency, mode)
        name = 'reuse="batch"' if mode else "default"
        print(f"| judge_many, {name} | {args.programs} | {runs / wall:.1f} | "
              f"{args.programs / wall:.2f} | {used / args.programs * 1000:.0f} ms | {passed} |")
    if args.language == "python":  # the default mode's yardstick: one execute_notebook per item
        count = min(args.programs, args.executions)
        wall, used, passed = executed(config, [PROGRAM.format(k=k).replace("int(input())", "9") for k in range(count)],
                                      args.concurrency)
        print(f"| execute_many (one execute_notebook per item) | {count} | | {count / wall:.2f} | "
              f"{used / count * 1000:.0f} ms | {passed} |")
    per_test = docker_runs(config.image_tag, args.docker_runs, args.concurrency, args.language)
    print(f"| docker run per test | {args.docker_runs} runs | {1 / per_test:.1f} | "
          f"{1 / per_test / args.tests:.2f} | | |")


if __name__ == "__main__":
    main()
