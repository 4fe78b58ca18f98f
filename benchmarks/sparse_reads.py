"""What a sparse file in /mnt/data costs the host when it is downloaded or listed (a session's library calls).

    .venv/bin/python benchmarks/sparse_reads.py --gib 8

A session with a 600 MiB /mnt/data makes a 1 GiB and a ``--gib`` GiB sparse file (nothing written into them);
then `Session.download` of the 1 GiB one and `Session.files()` are timed, with the bytes this process read
(``rchar``) and its peak Python allocations. A reader without the caps reads both files whole.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbexec

GiB = 1 << 30


def _read_so_far() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def measure(label: str, call: Callable[[], Any]) -> None:
    tracemalloc.start()
    read, started = _read_so_far(), time.monotonic()
    try:
        out = call()
        what = f"returned {len(out):,} {'bytes' if isinstance(out, bytes) else 'files'}"
    except nbexec.NbexecError as exc:
        what = f"refused: {exc}"
    seconds, peak = time.monotonic() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"{label}: {seconds * 1000:.0f} ms, read {(_read_so_far() - read) / 2**20:.1f} MiB, "
          f"peak {peak / 2**20:.1f} MiB; {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=8, help="apparent size of the second sparse file (up to 16383)")
    args = parser.parse_args()
    config = nbexec.SandboxConfig(pool_size=0, warm_imports=(), timeout=120, max_data="600m", max_files=20)
    with nbexec.Session(config, keep_files=False) as session:
        session.run(f"open('/mnt/data/gig', 'wb').truncate({GiB})\n"
                    f"open('/mnt/data/big', 'wb').truncate({args.gib} * {GiB})")
        measure("download(a 1 GiB sparse file, max_data 600m)", lambda: session.download("gig"))
        measure(f"files() beside 1 GiB and {args.gib} GiB sparse files", session.files)


if __name__ == "__main__":
    main()
