"""A Ray driver for tests/test_ray.py, run INSIDE the test cluster's network namespace (`raynodes.RayCluster`):
one scenario per call, its findings printed as one JSON line. It judges nothing itself; the test asserts.

    raydriver.py oneshot | session | batch | hostile | full | judge | tools | stop | rewards | kill VICTIM | back NODE
    raydriver.py bench ITEMS PROGRAMS CONCURRENCY      (benchmarks/raycluster.py)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker

import nbexec
from nbexec import Test
from nbexec.errors import NbexecError
from nbexec.sandbox.docker import daemon
from nbexec.sandbox.ray.calls import Agent
from nbexec.sandbox.ray.source import RaySource
from tests import raynodes

IMAGE = os.environ.get("NBEXEC_IMAGE", nbexec.SandboxConfig().image)
CONFIG = nbexec.SandboxConfig(image=IMAGE, source="ray", pool_size=0, warm_imports=(), timeout=60,
                              interrupt_grace=5)


def agents() -> dict[str, Agent]:
    return {a.name: a for a in RaySource.from_env().nodes().values()}


def pids() -> dict[str, int]:
    return {name: a.call("hello", timeout=30, cap=4096, what="say hello")["pid"] for name, a in agents().items()}


def held() -> dict[str, Any]:
    """What each node's agent holds ("lost: ..." for a node whose agent is gone)."""
    found: dict[str, Any] = {}
    for name, agent in agents().items():
        try:
            found[name] = agent.call("held", RaySource.from_env().owner, timeout=30, cap=65536, what="list")
        except NbexecError as exc:
            found[name] = f"lost: {exc}"
    return found


def containers(owner_pids: list[int]) -> list[str]:
    """The sandboxes the agents with ``owner_pids`` made that still exist (running or not)."""
    owners = {f"{daemon.node()}:{pid}" for pid in owner_pids}
    found = docker.from_env().containers.list(all=True, filters={"label": daemon.LABEL})
    return [c.name for c in found if c.labels.get(daemon.LABEL_OWNER) in owners]


def oneshot(tmp: Path) -> dict[str, Any]:
    started = time.monotonic()
    first = nbexec.execute_notebook("print(6 * 7)\nopen('/mnt/data/out.txt', 'w').write('made on ray')",
                                    config=CONFIG, output_dir=tmp / "first")
    first_s = time.monotonic() - started
    timings = []
    for i in range(3):
        started = time.monotonic()
        again = nbexec.execute_notebook(f"print({i})", config=CONFIG)
        timings.append((time.monotonic() - started, again.ok))
    local = []
    for i in range(3):
        started = time.monotonic()
        here = nbexec.execute_notebook(f"print({i})", config=CONFIG.replace(source="local"))
        local.append((time.monotonic() - started, here.ok))
    files = [{"name": f.name, "path": f.path, "text": Path(f.path).read_text() if f.path else None}
             for f in first.files]
    return {"ok": first.ok, "stdout": first.stdout, "node": first.node, "files": files, "first_s": first_s,
            "ray_s": timings, "local_s": local, "output_dir": str(tmp / "first"), "held": held()}


def session(tmp: Path) -> dict[str, Any]:
    with nbexec.Session(CONFIG, output_dir=tmp / "session") as one:
        made = one.run("x = 41\nopen('/mnt/data/s.txt', 'w').write('kept')")
        said = one.run("print(x + 1)")
        nodes = [made.node, said.node]
        during = held()
    return {"stdout": said.stdout, "nodes": nodes, "files": [f.name for f in made.files], "held_during": during,
            "held_after": held()}


def batch(tmp: Path) -> dict[str, Any]:
    started = time.monotonic()
    items = list(nbexec.execute_many([f"import time\ntime.sleep(1)\nprint({i})" for i in range(6)], concurrency=3,
                                     config=CONFIG))
    spent = time.monotonic() - started
    results = sorted((item.index, item.result.stdout if item.result else None,
                      item.result.node if item.result else None) for item in items)
    errors = [f"{type(item.error).__name__}: {item.error}" for item in items if item.error is not None]
    source = RaySource.from_env()
    health = {source.agents[i].name: h.last_error for i, h in source.health.items() if i in source.agents}
    started = time.monotonic()
    local = list(nbexec.execute_many([f"import time\ntime.sleep(1)\nprint({i})" for i in range(6)], concurrency=3,
                                     config=CONFIG.replace(source="local")))
    local_s = time.monotonic() - started
    return {"results": results, "errors": errors[:3], "seconds": spent, "held_after": held(), "health": health,
            "local_seconds": local_s, "local_ok": all(item.ok for item in local)}


def full(tmp: Path) -> dict[str, Any]:
    """A driver's source that may hold one sandbox per node: three sessions fill the cluster, a fourth is refused
    (what it raises, and whether a fourth sandbox appeared anywhere), and one closed makes room again."""
    source = RaySource(per_node=1)
    config = CONFIG.replace(source="local")  # the config sent to the agents; the source is this one
    handles = [source.acquire(config, purpose="session") for _ in range(3)]
    nodes = sorted(source.agents[h.ray_node].name for h in handles)  # type: ignore[attr-defined]
    retry_after = None
    try:
        source.acquire(config, purpose="session")
        refused = "none"
    except NbexecError as exc:
        refused = f"{type(exc).__name__}: {exc}"
        retry_after = getattr(exc, "retry_after", None)
    counts = {a.name: len(a.call("held", source.owner, timeout=30, cap=65536, what="list"))
              for a in source.agents.values()}
    source.release(handles.pop(), wait=True)
    again = source.acquire(config, purpose="session")
    handles.append(again)
    for handle in handles:
        source.release(handle, wait=True)
    left = {a.name: a.call("held", source.owner, timeout=30, cap=65536, what="list") for a in source.agents.values()}
    source.close()
    return {"nodes": nodes, "refused": refused, "retry_after": retry_after, "counts": counts,
            "again": source.agents[again.ray_node].name, "left": left}  # type: ignore[attr-defined]


DOUBLE = "print(2 * int(input()))"


def judge(tmp: Path) -> dict[str, Any]:
    """judge and judge_many on the cluster, unchanged: one program's verdicts, then three programs in both modes
    (``reuse="batch"`` forks its tests in a sandbox reset between programs); what each node holds afterwards."""
    tests = [Test(stdin="2", expected="4"), Test(stdin="3", expected="7"), Test(stdin="x", expected="")]
    one = nbexec.judge(DOUBLE, tests, config=CONFIG)
    programs = [DOUBLE, "print(int(input()) + 4)", "import sys\nsys.exit(3)"]
    many = {}
    for reuse in (None, "batch"):
        items = nbexec.judge_many([{"program": p, "tests": tests[:2]} for p in programs], concurrency=2, reuse=reuse,
                                  config=CONFIG)
        many[str(reuse)] = sorted((i.index, [t.verdict for t in i.result.tests] if i.result else str(i.error),
                                   i.result.mode if i.result else "") for i in items)
    return {"one": [t.verdict for t in one.tests], "one_mode": one.mode, "many": many, "held_after": held()}


def tools(tmp: Path) -> dict[str, Any]:
    """The LLM tool handler, unchanged: a one-shot, then a conversation's session whose state carries over."""
    from nbexec.integrations import toolcall

    once = toolcall.run({"code": "print(2 ** 10)"}, config=CONFIG)
    sessions = nbexec.SessionManager(CONFIG, max_sessions=2, keep_files=False)
    try:
        first = toolcall.run({"code": "total = 41"}, sessions=sessions, conversation="chat")
        named = re.search(r"session_id: (\S+);", first if isinstance(first, str) else first.text)
        second = toolcall.run({"code": "print(total + 1)", "session_id": named[1] if named else ""},
                              sessions=sessions, conversation="chat")
    finally:
        sessions.close_all()
    said = [r if isinstance(r, str) else (r.stdout, r.node) for r in (once, first, second)]
    return {"said": said, "held_after": held()}


def kill(tmp: Path, victim: str) -> dict[str, Any]:
    before = pids()
    sessions = []
    for _ in range(6):  # placement spreads sessions: at least one lands on the victim
        one = nbexec.Session(CONFIG)
        sessions.append((one, one.run("x = 1").node))
        if victim in {node for _, node in sessions} and len(sessions) >= 3:
            break
    on_victim = next(s for s, node in sessions if node == victim)
    caught: list[Any] = []

    def long_run() -> None:
        try:
            caught.append(on_victim.run("import time\nprint('started', flush=True)\ntime.sleep(60)"))
        except Exception as exc:  # the loss: what the test asserts on
            caught.append(exc)

    runner = threading.Thread(target=long_run)
    runner.start()
    time.sleep(3)
    killed = raynodes.raylets(victim)
    for pid in killed:
        os.kill(pid, 9)
    at = time.monotonic()
    runner.join(timeout=120)
    lost_after = time.monotonic() - at
    error = caught[0] if caught else None
    try:
        on_victim.run("print(x)")
        again = "ran"
    except Exception as exc:
        again = f"{type(exc).__name__}: {exc}"
    others = [(node, s.run("print(x)").stdout) for s, node in sessions if node != victim]
    for s, _ in sessions:
        try:
            s.close()
        except NbexecError as exc:  # the victim's: its node is gone
            print("closing:", type(exc).__name__, exc, file=sys.stderr)
    survivors = {name: pid for name, pid in before.items() if name != victim}
    elsewhere = nbexec.execute_notebook("print('elsewhere')", config=CONFIG)
    gone_at = time.monotonic() + 60  # Ray's control store notices a dead raylet within its health checks
    while victim in agents() and time.monotonic() < gone_at:
        time.sleep(1)
    return {"killed": killed, "error": type(error).__name__ if error is not None else None,
            "message": str(error) if error is not None else "", "lost_after_s": lost_after, "again": again,
            "others": others, "elsewhere": [elsewhere.stdout, elsewhere.node], "held_after": held(),
            "survivor_containers": containers(list(survivors.values())), "agents_after": sorted(agents())}


SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(60)"


def stop(tmp: Path) -> dict[str, Any]:
    """A user's interrupt and close() on a Ray session while a cell runs: the interrupt ends the cell and keeps
    the kernel's state; close() returns while the cell still runs there, and the sandbox is gone."""
    session = nbexec.Session(CONFIG)
    session.run("x = 41")
    ended: list[Any] = []

    def long_run() -> None:
        started = time.monotonic()
        try:
            result = session.run(SLEEPER)
            said = "ok" if result.ok or result.error is None else f"{result.error.kind}:{result.error.ename}"
            ended.append((said, result.stdout, time.monotonic() - started))
        except Exception as exc:  # what close() makes of a run under way: the test reads it
            ended.append((type(exc).__name__, str(exc)[:200], time.monotonic() - started))

    runner = threading.Thread(target=long_run)
    runner.start()
    time.sleep(4)
    session.interrupt()
    runner.join(timeout=60)
    interrupted = ended.pop() if ended else None
    kept = session.run("print(x + 1)").stdout
    node = session.run("1").node
    runner = threading.Thread(target=long_run)
    runner.start()
    time.sleep(4)
    started = time.monotonic()
    session.close()
    close_s = time.monotonic() - started
    runner.join(timeout=60)
    return {"interrupted": interrupted, "kept": kept, "node": node, "close_s": close_s,
            "closed_run": ended.pop() if ended else None, "runner_alive": runner.is_alive(), "held_after": held()}


def rewards(tmp: Path) -> dict[str, Any]:
    """examples/ray_rewards.py as a trainer would run it: reward actors judging and keeping sessions."""
    from examples import ray_rewards

    return ray_rewards.main()


def bench(tmp: Path, items: int, programs: int, concurrency: int) -> dict[str, Any]:
    """Seconds for the same batch on the cluster and on this one host: ``items`` one-shots (execute_many) and
    ``programs`` programs of ten tests (judge_many, reuse="batch"), ``concurrency`` at a time."""
    sources = [f"print({i} * {i})" for i in range(items)]
    judged = [{"program": f"print(int(input()) + {k})", "tests": [{"stdin": str(n), "expected": str(n + k)}
                                                                   for n in range(10)]} for k in range(programs)]
    found: dict[str, Any] = {}
    for where in ("ray", "local"):
        config = CONFIG.replace(source=where)
        if where == "ray":
            list(nbexec.execute_many(["1"] * concurrency, concurrency=concurrency, config=config))  # agents up
        started = time.monotonic()
        ran = list(nbexec.execute_many(sources, concurrency=concurrency, config=config))
        spent = time.monotonic() - started
        started = time.monotonic()
        verdicts = list(nbexec.judge_many(judged, concurrency=concurrency, reuse="batch", config=config))
        found[where] = {"execute_s": spent, "executed": sum(1 for r in ran if r.ok),
                        "nodes": sorted({str(r.result.node) for r in ran if r.result}),
                        "judge_s": time.monotonic() - started,
                        "accepted": sum(1 for v in verdicts if v.result and v.result.verdict == "accepted")}
    return found


def back(tmp: Path, node: str) -> dict[str, Any]:
    """A node that dies and joins again is used again by a driver that knew it before: ``node``'s raylet is
    killed (once the driver has an agent there), Ray starts a new node with its name, and sessions held open
    (placement spreads them) are made until one lands on it."""
    source = RaySource.from_env()
    known = sorted(agents())
    for pid in raynodes.raylets(node):
        os.kill(pid, 9)
    gone_at = time.monotonic() + 60
    while node in agents() and time.monotonic() < gone_at:
        time.sleep(1)
    without = sorted(agents())
    started = subprocess.run(
        ["ray", "start", "--address", os.environ["RAY_ADDRESS"], "--node-ip-address", "127.0.0.1", "--resources",
         json.dumps({node: 1}), "--num-cpus", "1", "--object-store-memory", str(80 * 1024 * 1024),
         "--disable-usage-stats"], capture_output=True, text=True, timeout=180)
    sessions, landed = [], []
    until = time.monotonic() + 120
    while node not in landed and time.monotonic() < until and started.returncode == 0:
        one = nbexec.Session(CONFIG)
        sessions.append(one)
        try:
            landed.append(str(one.run("print('here')").node))
        except NbexecError as exc:  # the new node still starting its agent: the test reads what happened
            landed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        if len(sessions) >= 4:
            sessions.pop(0).close()  # keep a few open: each new one goes to the freest node
    for one in sessions:
        one.close()
    return {"known": known, "without": without, "started": started.returncode, "start_log": started.stderr[-1500:],
            "landed": landed, "after": sorted(agents()), "held_after": held(),
            "health": {source.agents[i].name: h.last_error for i, h in source.health.items() if i in source.agents}}


def hostile(tmp: Path) -> dict[str, Any]:
    import resource

    import ray

    RaySource.from_env().nodes()  # joins the cluster
    actor = ray.remote(raynodes.HostileAgent).options(max_concurrency=4).remote()
    agent = Agent("hostile", actor)
    agent.call("hello", timeout=60, cap=4096, what="say hello")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        agent.call("run", "sid", "code", 1.0, timeout=30, cap=1 << 20, what="run code")
        oversized = "kept"
    except Exception as exc:
        oversized = f"{type(exc).__name__}: {exc}"
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    started = time.monotonic()
    try:
        agent.call("state", "sid", timeout=2, cap=4096, what="report a state")
        silent = "answered"
    except Exception as exc:
        silent = f"{type(exc).__name__}: {exc}"
    ray.kill(actor)  # type: ignore[arg-type]
    return {"oversized": oversized, "rss_growth_mib": growth, "silent": silent,
            "silent_s": time.monotonic() - started}


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    tmp = Path(os.environ.get("NBEXEC_RAY_TMP", "/tmp"))
    scenarios = {"oneshot": oneshot, "session": session, "batch": batch, "hostile": hostile, "full": full,
                 "judge": judge, "tools": tools, "stop": stop, "rewards": rewards}
    if scenario == "bench":
        found = bench(tmp, *(int(a) for a in args))
    else:
        found = kill(tmp, args[0]) if scenario == "kill" else back(tmp, args[0]) if scenario == "back" \
            else scenarios[scenario](tmp)
    RaySource.from_env().close()
    print(json.dumps(found, default=str))


if __name__ == "__main__":
    main()
