"""Helpers for the Ray tests: an agent reached in this process (fast tier: the agent's and the handle's logic,
the fake source behind it), and a Ray cluster in a network namespace of its own (Docker tier).

Ray started outside a namespace advertises the machine's external address and probes a public resolver, so a
cluster here is only ever started inside one: a namespace with its loopback up, a head and two worker nodes on
127.0.0.1 (each named by a custom resource: node_head, node_a, node_b), and the driver run inside it too
(`nsenter --net`, tests/raydriver.py printing JSON). Docker's unix socket is not affected by the namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbexec.sandbox.docker import daemon
from nbexec.sandbox.ray.agent import NodeAgent
from nbexec.sandbox.ray.calls import Agent, unwrap

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "bin"
NODES = ("node_head", "node_a", "node_b")


class InProcess(Agent):
    """An agent called in this process: what Ray would carry, without Ray (the answers are unwrapped alike)."""

    def __init__(self, inner: NodeAgent, name: str = "node_x") -> None:
        super().__init__(name, None)
        self.inner = inner
        self.answers: list[Any] = []  # what the agent answered, as Ray would have carried it

    def call(self, method: str, *args: Any, timeout: float, cap: int, what: str) -> Any:
        answer = getattr(self.inner, method)(*args)
        self.answers.append(answer)
        return unwrap(answer, self.name, what)

    def send(self, method: str, *args: Any) -> None:
        getattr(self.inner, method)(*args)


class HostileAgent:
    """An actor that misbehaves as a node's agent could: 32 MiB for a run, no answer at all for a state."""

    def hello(self) -> dict[str, Any]:
        return {"ok": {"node": "hostile", "pid": os.getpid()}}

    def run(self, *args: Any) -> dict[str, Any]:
        return {"ok": b"x" * (32 << 20)}

    def state(self, *args: Any) -> dict[str, Any]:
        time.sleep(3600)
        return {"ok": None}


def can_make_namespaces() -> str:
    """Why a namespace cannot be made here ("" when it can)."""
    if os.geteuid() != 0:
        return "making a network namespace needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if not (VENV / "ray").exists():
        return "Ray is not installed in .venv (pip install -e '.[ray]', or scripts/setup.sh --test)"
    name = f"nbexec-ray-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


@dataclass
class RayCluster:
    namespace: str
    address: str
    temp: Path
    started: float  # seconds the cluster took to come up
    env: dict[str, str]

    def inside(self, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the cluster's namespace."""
        return subprocess.run([*enter(self.namespace), *argv], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=ROOT)

    def driver(self, scenario: str, *args: str, timeout: float = 600) -> dict[str, Any]:
        """Run tests/raydriver.py's ``scenario`` inside the namespace; its JSON (it fails the test otherwise)."""
        done = self.inside(str(VENV / "python"), str(ROOT / "tests" / "raydriver.py"), scenario, *args,
                           timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise AssertionError(f"the driver's {scenario} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                                 f"{done.stderr[-6000:]}")
        return dict(json.loads(lines[-1]))


def raylets(node: str) -> list[int]:
    """The raylet processes of this network namespace's node named by the custom resource ``node``."""
    here = os.readlink("/proc/self/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"raylet") and any(node.encode() in a for a in argv[1:]) \
                    and os.readlink(entry / "ns" / "net") == here:
                found.append(int(entry.name))
    return found


def enter(namespace: str) -> list[str]:
    """The command prefix that runs a program in ``namespace``'s network and nothing else: the host's mounts stay
    (`ip netns exec` would give it a mount namespace of its own, and the sandboxes' filesystems that the agents
    mount would then be invisible to the Docker engine)."""
    return ["nsenter", f"--net=/run/netns/{namespace}"]


def _ray(namespace: str, env: dict[str, str], *args: str) -> None:
    done = subprocess.run([*enter(namespace), str(VENV / "ray"), *args], capture_output=True,
                          text=True, timeout=180, env=env, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"ray {' '.join(args[:2])} failed: {done.stdout[-2000:]}\n{done.stderr[-3000:]}")


@contextlib.contextmanager
def ray_cluster(tmp: Path) -> Iterator[RayCluster]:
    """A head and two worker nodes in a new network namespace; everything stopped and removed at the end."""
    namespace = f"nbexec-ray-{secrets.token_hex(4)}"
    temp = Path("/tmp") / f"nbr-{secrets.token_hex(3)}"
    temp.mkdir(mode=0o700)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
           "PATH": f"{VENV}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"], check=True)
        started = time.monotonic()
        common = ["--object-store-memory", str(80 * 1024 * 1024), "--num-cpus", "1", "--disable-usage-stats"]
        _ray(namespace, env, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", "6379",
             "--temp-dir", str(temp), "--include-dashboard", "false", "--resources", json.dumps({NODES[0]: 1}),
             *common)
        for node in NODES[1:]:
            _ray(namespace, env, "start", "--address", "127.0.0.1:6379", "--node-ip-address", "127.0.0.1",
                 "--resources", json.dumps({node: 1}), *common)
        env = {**env, "RAY_ADDRESS": "127.0.0.1:6379"}
        yield RayCluster(namespace, "127.0.0.1:6379", temp, time.monotonic() - started, env)
    finally:
        inside = _pids(namespace)  # the agents among them: their sandboxes must all be gone afterwards
        with contextlib.suppress(Exception):
            subprocess.run([*enter(namespace), str(VENV / "ray"), "stop", "--force"],
                           capture_output=True, timeout=120, env=env)
        _kill_left(namespace)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
        LEFT[namespace] = _sandboxes_of(inside)


LEFT: dict[str, list[str]] = {}  # a namespace's agents' sandboxes still there after its teardown


def assert_nothing_left(cluster: RayCluster) -> None:
    """No sandbox of an agent alive at ``cluster``'s teardown is left (the drivers released theirs). A killed
    node's agent died holding its sandbox: that orphan of a dead process is removed by the engine's sweep, as it
    would be at the node's next start."""
    left = LEFT.pop(cluster.namespace, [])
    daemon.cleanup(daemon.connect())  # only containers whose owner process is gone
    assert not left, f"sandboxes of the Ray agents left at the cluster's teardown: {left}"


def _pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _sandboxes_of(pids: list[int]) -> list[str]:
    owners = {f"{daemon.node()}:{pid}" for pid in pids}
    found = daemon.connect().containers.list(all=True, filters={"label": daemon.LABEL})
    return [c.name for c in found if c.labels.get(daemon.LABEL_OWNER) in owners]


def _kill_left(namespace: str) -> None:
    """Kill what still runs in the namespace (ray stop leaves nothing, normally)."""
    for pid in _pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
