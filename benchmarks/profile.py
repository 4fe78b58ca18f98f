"""Where the CPU of one fresh sandbox goes: the container's processes, the Docker engine and the host side.

    .venv/bin/python benchmarks/profile.py                      # 10 sandboxes, default warm imports and none
    .venv/bin/python benchmarks/profile.py --samples 20 --runtime runsc

Each sandbox is started, used for one `print` and destroyed, one at a time. Counted per sandbox (mean):
- inside the container, per process, from /proc of the container's processes just before teardown (a process's
  own CPU plus that of its exited children: `sh` counts the `xvfb-run` script and `xauth`), and the total from the
  container's cgroup (cpuacct.usage, cgroup v1) or cpu.stat (v2);
- the Docker engine: dockerd and containerd, plus the shims and runc (their CPU reaches containerd's children
  counters once they are reaped, so they are counted as engine CPU from /proc/stat of those two and their
  descendants' totals);
- the host side: this process's own CPU (docker-py, ZMQ, the handshake) and its children (mkfs, mount, umount).
A bare `docker run --rm --network none IMAGE python3 -c 'print(...)'` is profiled the same way for the floor.
Runs serially so the counts belong to one sandbox; other load on the machine shows up only in the wall times.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import nbexec
from nbexec.sandbox.docker import pool

TICK = os.sysconf("SC_CLK_TCK")
PRINT = "print(12345*54321)"


def engine_pids() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in ("dockerd", "containerd"):
                found.append(int(entry.name))
    return found


def process_cpu(pid: int) -> tuple[str, float, float]:
    """(name, own CPU seconds, reaped children's CPU seconds) of a process."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / TICK
    children = (int(fields[13]) + int(fields[14])) / TICK
    return name, own, children


def engine_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        _, own, children = process_cpu(pid)
        total += own + children
    return total


def host_cpu() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def container_cgroup(container_id: str) -> Path | None:
    for path in (Path(f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage"),
                 Path(f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat")):
        if path.exists():
            return path
    return None


def cgroup_seconds(path: Path | None) -> float:
    if path is None:
        return float("nan")
    text = path.read_text()
    if path.name == "cpuacct.usage":
        return int(text) / 1e9
    return int(text.split("usage_usec ")[1].split()[0]) / 1e6


def container_processes(path: Path | None) -> dict[str, float]:
    """CPU per process name in the container (own + reaped children), from the cgroup's task list."""
    per: dict[str, float] = defaultdict(float)
    if path is None:
        return per
    procs = path.parent / "cgroup.procs"
    if not procs.exists():  # v1: the cpuacct cgroup lists tasks too
        procs = path.parent / "tasks"
    for line in procs.read_text().split():
        try:
            name, own, children = process_cpu(int(line))
        except (OSError, ValueError):
            continue
        per[name] += own
        if children:
            per[f"{name} (exited children)"] += children
    return per


def one_sandbox(config: nbexec.SandboxConfig, engine: list[int]) -> dict[str, float]:
    """Start, use and destroy one sandbox; its CPU by part and its phases' wall times."""
    e0, (h0, k0), w0 = engine_cpu(engine), host_cpu(), time.perf_counter()
    sandbox = pool.start_sandbox(config, role="oneshot", warm_up=bool(config.warm_imports))
    ready = time.perf_counter()
    try:
        client = sandbox.client
        assert client is not None
        msg = client.execute(PRINT, silent=False, store_history=False)
        assert client.recv("shell", 30, parent=msg) is not None
        cgroup = container_cgroup(sandbox.container.id)
        time.sleep(0.05)  # the kernel's idle message and its publisher settle
        inside = cgroup_seconds(cgroup)
        per = container_processes(cgroup)
    finally:
        torn = time.perf_counter()
        sandbox.destroy()
    done = time.perf_counter()
    e1, (h1, k1) = engine_cpu(engine), host_cpu()
    row = {"container total": inside, "Docker engine": e1 - e0, "host (this process)": h1 - h0,
           "host children (mkfs, mount)": k1 - k0, "wall: start to ready": ready - w0,
           "wall: teardown": done - torn}
    row.update({f"  in container: {name}": seconds for name, seconds in per.items()})
    return row


def bare_run(image: str, engine: list[int]) -> dict[str, float]:
    e0, (_, k0), w0 = engine_cpu(engine), host_cpu(), time.perf_counter()
    subprocess.run(["docker", "run", "--rm", "--network", "none", image, "python3", "-c", PRINT],
                   check=True, capture_output=True)
    w1 = time.perf_counter()
    e1, (_, k1) = engine_cpu(engine), host_cpu()
    return {"Docker engine": e1 - e0, "host children (docker CLI)": k1 - k0, "wall: start to ready": w1 - w0}


def summarise(label: str, rows: list[dict[str, float]]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"| {label} | mean | |", "|---|---:|---|"]
    for key in keys:
        values = [r.get(key, 0.0) for r in rows]
        unit = "ms wall" if key.startswith("wall") else "ms CPU"
        lines.append(f"| {key} | {1000 * statistics.mean(values):.0f} | {unit} |")
    cpu = sum(statistics.mean([r.get(k, 0.0) for r in rows]) for k in keys
              if not k.startswith(("wall", "  in container")))
    lines.append(f"| **CPU per sandbox** | **{1000 * cpu:.0f}** | ms CPU |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--runtime", default=None)
    args = parser.parse_args()
    base = nbexec.from_env(pool_size=0, runtime=args.runtime)
    engine = engine_pids()
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    out: list[str] = []
    pool.start_sandbox(base.replace(warm_imports=()), role="oneshot", warm_up=False).destroy()  # page cache warm
    for label, config in (("no warm imports", base.replace(warm_imports=())),
                          ("default warm imports", base)):
        rows = [one_sandbox(config, engine) for _ in range(args.samples)]
        out += [*summarise(f"nbexec sandbox, {label}", rows), ""]
    rows = [bare_run(base.image, engine) for _ in range(args.samples)]
    out += summarise("bare docker run, python3 -c print", rows)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    print("\n".join(out))


if __name__ == "__main__":
    main()
