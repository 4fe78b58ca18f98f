"""Install latency: cold (first download into an empty wheel cache) and warm (cached wheels), per step.

    python benchmarks/packages.py                                   # a tiny wheel on a loopback index
    python benchmarks/packages.py --index file:///srv/pypi/simple --package humanize --package polars

Rows: the host's resolution alone (the confined pip, one round per level of dependencies, vs. the cache; on the
default index also a chain of three wheels, three rounds), Session.install in a started sandbox (cold, warm, and
again in the same sandbox), and execute_notebook from the warm pool without and with the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nbexec
from nbexec import packages
from nbexec.packages import wheelhouse
from tests.pyindex import Index


def _timed(func: Callable[[], object], samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        func()
        times.append(time.perf_counter() - started)
    return times


def _row(name: str, times: list[float]) -> str:
    return f"| {name} | {len(times)} | {statistics.median(times) * 1000:,.0f} | {max(times) * 1000:,.0f} |"


def _fresh(config: nbexec.SandboxConfig, root: Path) -> nbexec.SandboxConfig:
    return config.replace(package_cache=tempfile.mkdtemp(dir=root))


def _host_rows(config: nbexec.SandboxConfig, root: Path, wanted: list[str], samples: int, label: str = "") -> list[str]:
    target = wheelhouse.Target(python="3.11", machine="x86_64", glibc="2.36")
    policy = packages.Policy.of(config)

    def resolve(source: wheelhouse.Source) -> None:
        wheelhouse.resolve(wanted, policy, target, wheelhouse.Budget(source), deadline=time.monotonic() + 300)

    cold = _timed(lambda: resolve(packages.source_of(_fresh(config, root))), samples)
    source = packages.source_of(config)
    resolve(source)
    warm = _timed(lambda: resolve(source), samples)
    return [_row(f"host resolve{label}, cold (confined pip, a round per level)", cold),
            _row(f"host resolve{label}, warm (cache)", warm)]


def _install_rows(config: nbexec.SandboxConfig, root: Path, wanted: list[str], samples: int) -> list[str]:
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "again": []}
    for _ in range(samples):
        for kind in ("cold", "warm"):
            with nbexec.Session(_fresh(config, root) if kind == "cold" else config) as session:
                session.run("pass")
                started = time.perf_counter()
                done = session.install(*wanted)
                rows[kind].append(time.perf_counter() - started)
                assert all(p.status in ("installed", "provided") for p in done), done
                if kind == "warm":
                    started = time.perf_counter()
                    session.install(*wanted)
                    rows["again"].append(time.perf_counter() - started)
    return [_row("Session.install, cold (download + unpack in the sandbox)", rows["cold"]),
            _row("Session.install, warm (cached wheels unpacked, no pip)", rows["warm"]),
            _row("Session.install, again in the same sandbox (already there)", rows["again"])]


def _execute_rows(config: nbexec.SandboxConfig, wanted: list[str], samples: int) -> list[str]:
    pooled = config.replace(pool_size=1)
    nbexec.execute_notebook("pass", config=pooled)
    bare = _timed(lambda: nbexec.execute_notebook("pass", config=pooled), samples)
    nbexec.execute_notebook("pass", config=pooled, packages=wanted)
    with_packages = _timed(lambda: nbexec.execute_notebook("pass", config=pooled, packages=wanted), samples)
    return [_row("execute_notebook from the pool, no packages", bare),
            _row("execute_notebook from the pool, packages=[...] (warm cache)", with_packages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--index", help="package index URL or folder (default: a tiny wheel on loopback)")
    parser.add_argument("--package", action="append", help="requirement to install (repeatable)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nbexec-bench-packages-"))
    served = None
    if args.index is None:
        served = Index(root / "index")
        served.add("nbexec-tiny", "1.0", "VALUE = 42\n")
        served.add("nbexec-chain", "1.0", "A = 1\n", requires=("nbexec-chain-b",))
        served.add("nbexec-chain-b", "1.0", "B = 1\n", requires=("nbexec-chain-c",))
        served.add("nbexec-chain-c", "1.0", "C = 1\n")
    wanted = args.package or ["nbexec-tiny"]
    config = nbexec.from_env(pool_size=0, warm_imports=(), timeout=300, packages="any",
                             package_index=args.index or (served.url if served else None),
                             package_cache=str(root / "cache"))
    print(f"packages: {', '.join(wanted)}; index: {config.package_index}\n")
    print("| step | samples | median ms | max ms |\n|---|---|---|---|")
    chain = _host_rows(config, root, ["nbexec-chain"], args.samples, ", a chain of 3") if served else []
    for row in (_host_rows(config, root, wanted, args.samples) + chain
                + _install_rows(config, root, wanted, args.samples) + _execute_rows(config, wanted, args.samples)):
        print(row, flush=True)
    if served is not None:
        served.close()


if __name__ == "__main__":
    main()
