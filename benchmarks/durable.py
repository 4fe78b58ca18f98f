"""Durable sessions, side by side in one run: wake from sleep, snapshot and restore, re-adoption after a restart.

    .venv/bin/python benchmarks/durable.py --samples 5 [--runtime runsc] [--remote]

A session imports pandas and holds a 10 MB frame (and a 10 MB pickle of it in /mnt/data). Measured: the wake
time (p50/p90) by replay, and by checkpoint when this machine's source can keep memory (`SandboxSource.hibernate`
returns a record; else "n/a"); the memory of the session awake and asleep (the container's cgroup, as Docker
reports it), and its disk asleep (the data image's allocated blocks); snapshot time and size, restore time; and
the time a new process takes to find a session again after its owner was killed (`Session.resume`). With
--remote, only the wake, of a library session whose sandbox is on a node (a real `nbexec serve` started here on
loopback with the same runtime): the node keeps what sleeps, one HTTP call each way.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import nbexec
from nbexec import Session
from nbexec.sandbox.docker import daemon

SETUP = ("import pandas as pd, numpy as np\n"
         "df = pd.DataFrame(np.random.default_rng(1).random((131072, 10)))\n"
         "df.to_pickle('frame.pkl')")
CHECK = "print(round(float(df.values.sum())))"


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def memory_mib(session: Session) -> float:
    handle: Any = session._sandbox
    if handle is None or handle.node is not None:  # asleep by checkpoint, or on a node (not measured here)
        return 0.0
    container = daemon.connect().containers.get(handle.describe()["container"])
    container.reload()
    if not container.attrs["State"]["Running"]:
        return 0.0  # stopped: no process, no cgroup
    stats = container.stats(stream=False)
    return float(stats.get("memory_stats", {}).get("usage", 0)) / 2**20


def disk_mib(session: Session) -> float:
    handle: Any = session._sandbox
    if handle is None or handle.node is not None:
        return 0.0
    image = Path(handle.describe()["workdir"]) / "data.img"
    return os.stat(image).st_blocks * 512 / 2**20 if image.exists() else 0.0


def wake_times(config: nbexec.SandboxConfig, samples: int) -> tuple[list[float], str, dict[str, float]]:
    times, how, sizes = [], "", {}
    with Session(config) as session:
        assert session.run(SETUP).ok
        expected = session.run(CHECK).stdout
        sizes["awake_mib"] = memory_mib(session)
        for _ in range(samples):
            assert session.hibernate()
            sizes["asleep_mib"] = memory_mib(session)
            sizes["asleep_disk_mib"] = disk_mib(session)
            started = time.perf_counter()
            result = session.run(CHECK)
            times.append(time.perf_counter() - started)
            how = result.restored or ""
            assert result.stdout == expected, result
    return times, how, sizes


def snapshot_times(config: nbexec.SandboxConfig, samples: int, store: Path) -> tuple[list[float], list[float], float]:
    taken, restored, size = [], [], 0.0
    with Session(config, owner="bench") as session:
        assert session.run(SETUP).ok
        for _ in range(samples):
            started = time.perf_counter()
            snapshot_id = session.snapshot(snapshot_dir=store)
            taken.append(time.perf_counter() - started)
            folder = store / snapshot_id.split(".")[0]
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
            started = time.perf_counter()
            with Session.from_snapshot(snapshot_id, owner="bench", snapshot_dir=store) as copy:
                restored.append(time.perf_counter() - started)
                assert copy.run(CHECK).ok
            nbexec.engine.snapshots.SnapshotStore(store).delete("bench", snapshot_id)
    return taken, restored, size


OWNER = textwrap.dedent("""
    import os, signal, sys, nbexec
    config = nbexec.SandboxConfig(pool_size=0, warm_imports=(), runtime=sys.argv[2] or None)
    session = nbexec.Session(config, state_dir=sys.argv[1])
    assert session.run(sys.argv[3]).ok
    print(session.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def adoption_times(runtime: str, samples: int, root: Path) -> list[float]:
    times = []
    for index in range(samples):
        state = root / f"state{index}"
        child = subprocess.run([sys.executable, "-c", OWNER, str(state), runtime, SETUP], capture_output=True,
                               text=True, timeout=300)
        assert child.returncode == -signal.SIGKILL, child.stderr
        probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import time, nbexec
            started = time.perf_counter()
            session = nbexec.Session.resume({child.stdout.strip()!r}, state_dir={str(state)!r})
            took = time.perf_counter() - started
            assert session.run({CHECK!r}).ok
            session.close()
            print(took)
        """)], capture_output=True, text=True, timeout=300)
        assert probe.returncode == 0, probe.stderr
        times.append(float(probe.stdout.strip().splitlines()[-1]))
    return times


def remote_wake(runtime: str, samples: int, root: Path) -> None:
    """The wake of a library session whose sandbox is on a local `nbexec serve` node (see the module docstring)."""
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "bench-node-token-" + "t" * 16
    env = {**os.environ, "NBEXEC_API_TOKENS": token, "NBEXEC_POOL_SIZE": "0", "NBEXEC_WARM_IMPORTS": "",
           "NBEXEC_RUNTIME": runtime, "TMPDIR": str(root)}
    node = subprocess.Popen([sys.executable, "-m", "nbexec.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        os.environ.update({"NBEXEC_NODES": f"http://127.0.0.1:{port}", "NBEXEC_NODE_TOKEN": token})
        config = nbexec.SandboxConfig(source="remote", pool_size=0, warm_imports=(), timeout=120)
        wake, how, _ = wake_times(config, samples)
        print(f"| wake over the wire by {how or 'replay'} (pandas + 10 MB frame) | {p(wake, .5):.2f} s | "
              f"{p(wake, .9):.2f} s |")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--runtime", default="", help="runsc for gVisor (default: Docker's)")
    parser.add_argument("--remote", action="store_true", help="only the wake of a session on a node")
    args = parser.parse_args()
    if args.remote:
        with tempfile.TemporaryDirectory(prefix="d-", dir="/tmp") as tmp:
            Path(tmp).chmod(0o755)
            print(f"| measure ({args.runtime or 'runc'}, {args.samples} samples) | p50 | p90 |\n|---|---|---|")
            remote_wake(args.runtime, args.samples, Path(tmp))
        return
    config = nbexec.SandboxConfig(pool_size=0, warm_imports=(), runtime=args.runtime or None, timeout=120)
    runtime = args.runtime or "runc (Docker's default)"
    print(f"| measure ({runtime}, {args.samples} samples) | p50 | p90 |")
    print("|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        wake, how, sizes = wake_times(config, args.samples)
        print(f"| wake by {how or 'replay'} (pandas + 10 MB frame) | {p(wake, .5):.2f} s | {p(wake, .9):.2f} s |")
        if how != "checkpoint":
            print("| wake by checkpoint | n/a: this source keeps no memory (hibernate returned None) | |")
        print(f"| memory awake / asleep | {sizes['awake_mib']:.0f} MiB | {sizes['asleep_mib']:.0f} MiB |")
        print(f"| disk asleep (data image, allocated) | {sizes['asleep_disk_mib']:.1f} MiB | |", flush=True)
        taken, restored, size = snapshot_times(config, args.samples, root / "snaps")
        print(f"| snapshot (files + notebook) | {p(taken, .5):.2f} s | {p(taken, .9):.2f} s |")
        print(f"| snapshot size | {size:.1f} MiB | |")
        print(f"| restore from snapshot (start + files + replay) | {p(restored, .5):.2f} s | "
              f"{p(restored, .9):.2f} s |", flush=True)
        adopted = adoption_times(args.runtime, args.samples, root)
        print(f"| re-adoption after SIGKILL (Session.resume) | {p(adopted, .5):.3f} s | {p(adopted, .9):.3f} s |")
    print(f"(mean wake {statistics.mean(wake):.2f} s)")


if __name__ == "__main__":
    main()
