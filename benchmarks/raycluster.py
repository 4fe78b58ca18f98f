"""The same batch on a Ray cluster and on one host (#39 item 5): a head and two workers in a network namespace
of their own on this machine (as tests/test_ray.py starts them), the driver inside it.

    .venv/bin/python benchmarks/raycluster.py                       # 60 one-shots, 20 programs x 10 tests, 3 at a time
    .venv/bin/python benchmarks/raycluster.py --items 120 --programs 40 --concurrency 3

Every Ray node shares this machine's cores and Docker engine: the figures say what Ray's placement and calls
cost, not what more machines gain.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import raynodes
from tests.conftest import IMAGE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--programs", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=3)
    args = parser.parse_args()
    why = raynodes.can_make_namespaces()
    if why:
        sys.exit(f"no Ray cluster here: {why}")
    with tempfile.TemporaryDirectory() as tmp, raynodes.ray_cluster(Path(tmp)) as cluster:
        cluster.env["NBEXEC_IMAGE"] = IMAGE
        cluster.env["NBEXEC_RAY_TMP"] = tmp
        found = cluster.driver("bench", str(args.items), str(args.programs), str(args.concurrency), timeout=3600)
    print(f"Ray cluster up in {cluster.started:.1f} s; {args.concurrency} at a time\n")
    print("| workload | on one host | on the Ray cluster (3 nodes, this machine) |")
    print("|---|---:|---:|")
    for name, key, count in (("one-shots (execute_many)", "execute_s", args.items),
                             ("programs x 10 tests (judge_many, reuse=\"batch\")", "judge_s", args.programs)):
        local, ray = found["local"][key], found["ray"][key]
        print(f"| {count} {name} | {local:.1f} s ({count / local:.1f}/s) | {ray:.1f} s ({count / ray:.1f}/s) |")
    print(f"\nnodes used: {found['ray']['nodes']}; ok: local {found['local']['executed']}/{args.items}, "
          f"Ray {found['ray']['executed']}/{args.items}; accepted: local {found['local']['accepted']}, "
          f"Ray {found['ray']['accepted']} of {args.programs}")


if __name__ == "__main__":
    main()
