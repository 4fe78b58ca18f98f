"""The Ray source: sandboxes on the nodes of a Ray cluster, each node's made and held by its agent
(`agent.NodeAgent`), one long-lived actor per node pinned there by NodeAffinitySchedulingStrategy.

The driver (this process) joins the cluster the usual way (``ray.init(address="auto")``: RAY_ADDRESS, or the
cluster this process runs in), or uses the connection the caller already made (a trainer's actor). The alive
nodes are read from Ray; each gets an agent of this source's own (an unnamed actor: no other driver finds it by
name, nor is one of theirs ever adopted), made again when it dies or fails to start, after the node's backoff. A
sandbox goes to the node with the most free capacity (each agent asked, within PROBE_TIMEOUT, ranked as remote
nodes are: `nbexec.sandbox.remote.nodes.rank`); a node that fails to answer or to make it is left alone a while
and the next is asked (no code ran yet). Once a sandbox is held, its node is never swapped. Nothing of this host
is mounted on a node (``mounts_host_folders`` is False: a config with ``input_dir`` is refused).

Back-pressure: this source holds at most `node_limit` sandboxes on a node (the node's ``nbexec_sandboxes`` Ray
resource, else four per CPU it declares; ``per_node`` overrides both). When no node made the sandbox and one was
at its limit, `acquire` raises ClusterFullError, a NodeUnavailableError: nothing ran, and a retry may succeed.
It counts what it holds itself too, so an agent replaced after a timeout (the old one keeps its sandboxes) does
not double it.
network=True is refused: Docker's bridge on a node reaches the node's Ray ports, and through them the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nbexec.config import SandboxConfig
from nbexec.errors import (
    ClusterFullError,
    ConfigError,
    NbexecError,
    NodeLostError,
    NodeUnavailableError,
    NotOfferedError,
    ProtocolError,
    SessionLimitError,
)
from nbexec.sandbox.remote.nodes import Capacity as NodeCapacity
from nbexec.sandbox.remote.nodes import Health, rank
from nbexec.sandbox.source import Capacity, Readiness, SandboxHandle, SandboxSource

from .agent import NodeAgent
from .calls import Agent
from .handle import SMALL, RayHandle

log = logging.getLogger(__name__)
PROBE_TIMEOUT = 5.0  # seconds an agent has to say its capacity
AGENT_TIMEOUT = 120.0  # seconds a new agent has to start on its node (a worker process importing nbexec)
ACQUIRE_SLACK = 120.0  # seconds past startup_timeout a node may take to make a sandbox (pulling, a cold pool)
CLUSTER_TIMEOUT = 30.0  # seconds to join the cluster or read its nodes from Ray's control store
AGENT_THREADS = 64  # calls an agent runs at once (an interrupt reaches a sandbox whose run waits)
STANDARD = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}
LIMIT_RESOURCE = "nbexec_sandboxes"  # a node's Ray resource: how many sandboxes a driver may hold there
PER_CPU = 4  # sandboxes per CPU a node declares, when it does not declare LIMIT_RESOURCE
FULL_RETRY = 5.0  # seconds a caller of a full cluster is told to wait


class RaySource(SandboxSource):
    """Sandboxes on the nodes of a Ray cluster (see the module docstring)."""

    backend = "ray"
    mounts_host_folders = False

    def __init__(self, address: str = "auto", namespace: str = "nbexec", per_node: int | None = None) -> None:
        self.address, self.namespace, self.per_node = address, namespace, per_node
        self.owner = secrets.token_hex(16)  # what the agents file this source's sandboxes under
        self.agents: dict[str, Agent] = {}  # by Ray node id
        self.health: dict[str, Health] = {}
        self.inflight: dict[str, int] = {}
        self.limits: dict[str, int] = {}  # by Ray node id: the sandboxes this source may hold there
        self._lock = threading.Lock()
        self._joining = threading.Lock()  # one thread at a time joins the cluster and makes agents
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="nbexec-ray")  # probes, new agents, teardowns
        self._control = ThreadPoolExecutor(4, thread_name_prefix="nbexec-ray-control")  # `_bounded` only

    @classmethod
    def from_env(cls) -> RaySource:
        """The process's one Ray source (the cluster of RAY_ADDRESS, or the one this process already joined)."""
        with _lock:
            global _source
            if _source is None:
                _source = cls()
            return _source

    # -- the cluster ----------------------------------------------------------------------------------------

    def _bounded(self, work: Any, timeout: float, what: str) -> Any:
        """``work()`` within ``timeout`` seconds (Ray's control-store calls have no deadline of their own)."""
        try:
            return self._control.submit(work).result(timeout=timeout)
        except FutureTimeout as exc:
            raise NodeUnavailableError(f"the Ray cluster did not {what} within {timeout:g} s") from exc
        except NbexecError:
            raise
        except Exception as exc:
            raise NodeUnavailableError(f"the Ray cluster could not {what}: {type(exc).__name__}: {exc}") from exc

    def _join(self) -> None:
        if not ray.is_initialized():
            self._bounded(lambda: ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                                           ignore_reinit_error=True), CLUSTER_TIMEOUT, "let this process join")

    def nodes(self, wait: float = AGENT_TIMEOUT) -> dict[str, Agent]:
        """An agent for each alive node (made on a node that has none yet), by Ray node id. One caller at a time:
        two threads joining at once would both call ray.init, and an agent handle dropped by one of them would
        end the actor (a driver's actor lives while it holds a reference). A new agent has ``wait`` seconds to
        start; the wait for the thread joining now is bounded too."""
        if not self._joining.acquire(timeout=2 * CLUSTER_TIMEOUT + wait):
            raise NodeUnavailableError("the Ray cluster's nodes were not read in time (another call is still "
                                       "starting agents)")
        try:
            return self._nodes(wait)
        finally:
            self._joining.release()

    def _nodes(self, wait: float) -> dict[str, Agent]:
        self._join()
        alive = [n for n in self._bounded(ray.nodes, CLUSTER_TIMEOUT, "list its nodes") if n.get("Alive")]
        with self._lock:
            known = dict(self.agents)
            before = set(known)
            resting = {i for i, h in self.health.items() if not h.due()}
        # each started at once (a worker each to boot); a node whose agent failed is left alone for its backoff
        new = [n for n in alive if str(n["NodeID"]) not in known and str(n["NodeID"]) not in resting]
        with self._lock:
            self.limits.update({str(n["NodeID"]): node_limit(n, self.per_node) for n in new})
        made = self._pool.map(lambda n: (str(n["NodeID"]), self._agent(str(n["NodeID"]), node_name(n), wait)), new)
        for node_id, agent in made:
            if isinstance(agent, Agent):
                known[node_id] = agent
            else:
                with self._lock:
                    self.health.setdefault(node_id, Health()).failed(str(agent))
        found = {str(n["NodeID"]): known[str(n["NodeID"])] for n in alive if str(n["NodeID"]) in known}
        with self._lock:  # an agent dropped meanwhile (`_failed`) stays dropped
            found = {i: a for i, a in found.items() if i not in before or i in self.agents}
            self.agents = found
            for node_id in found:
                self.health.setdefault(node_id, Health())
                self.inflight.setdefault(node_id, 0)
        return found

    def _agent(self, node_id: str, name: str, wait: float) -> Agent | str:
        """A new agent of this source's own on the node (unnamed: never another driver's), or why not."""
        with self._lock:
            limit = self.limits.get(node_id, PER_CPU)
        try:
            actor = self._bounded(lambda: ray.remote(NodeAgent).options(
                num_cpus=0, max_concurrency=AGENT_THREADS, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(name, limit),
                CLUSTER_TIMEOUT, f"start an agent on node {name}")
            agent = Agent(name, actor)
            agent.call("hello", timeout=wait, cap=SMALL, what="start its agent")
        except NbexecError as exc:
            log.info("no agent on Ray node %s: %s", name, exc)
            return f"no agent: {exc}"
        return agent

    def _probe(self, node_id: str, agent: Agent, config: SandboxConfig) -> None:
        try:
            data = agent.call("capacity", config, timeout=PROBE_TIMEOUT, cap=SMALL, what="say its capacity")
            capacity = NodeCapacity(agent.name, node_id, int(data["held"]), int(data["ready"]), int(data["size"]),
                                    int(data["held"]))
        except (NbexecError, TypeError, KeyError, ValueError) as exc:
            self._failed(node_id, str(exc), drop=isinstance(exc, NodeLostError))
            return
        with self._lock:
            self.health[node_id].ok(capacity)

    def _count(self, node_id: str, change: int) -> None:
        with self._lock:
            self.inflight[node_id] = max(0, self.inflight.get(node_id, 0) + change)

    def _take(self, node_id: str) -> bool:
        """Count one more sandbox on the node, unless this source holds its limit there already."""
        with self._lock:
            held = self.inflight.get(node_id, 0)
            if held >= self.limits.get(node_id, held + 1):
                return False
            self.inflight[node_id] = held + 1
            return True

    def _failed(self, node_id: str, reason: str, drop: bool = False) -> None:
        """The node rests a backoff; ``drop``: its agent is gone too (a new one is made once the rest is over)."""
        with self._lock:
            if node_id in self.health:
                self.health[node_id].failed(reason)
            if drop:
                self.agents.pop(node_id, None)
        log.info("Ray node %s is down: %s", node_id, reason)

    def candidates(self, config: SandboxConfig) -> list[tuple[str, Agent]]:
        """The nodes to try, most free first; those in backoff are left out (all of them, when every node is)."""
        agents = self.nodes(min(AGENT_TIMEOUT, config.startup_timeout))
        due = [i for i in agents if self.health[i].due()] or list(agents)
        list(self._pool.map(lambda i: self._probe(i, agents[i], config), due))
        with self._lock:
            up = {i: self.health[i].capacity for i in agents if self.health[i].up}
            order = rank({i: c for i, c in up.items() if c is not None}, self.inflight)
        if not order:
            with self._lock:
                why = [f"{a.name}: {self.health[i].last_error or 'not probed'}" for i, a in agents.items()] or \
                    [f"{i[:8]}: {h.last_error}" for i, h in self.health.items() if h.last_error]
            raise NodeUnavailableError("no node of the Ray cluster has an agent that answers: " + "; ".join(why))
        return [(i, agents[i]) for i in order]

    # -- the seam -----------------------------------------------------------------------------------------

    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        """A sandbox on the freest node."""
        _refuse(config)
        last: NbexecError | None = None
        tried = self.candidates(config)
        full: list[str] = []
        for node_id, agent in tried:
            if not self._take(node_id):  # this source's own count: an agent replaced meanwhile starts at zero
                full.append(agent.name)
                continue
            made = refused = False
            name = secrets.token_hex(16)  # named here, so a sandbox whose answer never came can be released
            try:
                answer = agent.call("acquire", config, purpose, self.owner, name, cap=SMALL, what="make a sandbox",
                                    timeout=config.startup_timeout + ACQUIRE_SLACK)
                if not isinstance(answer, dict) or answer.get("id") != name:
                    raise ProtocolError(f"node {agent.name} answered a new sandbox with another one's name")
                handle = RayHandle(agent, answer, config, purpose, owner=self.owner)
                made = True
            except (SessionLimitError, NotOfferedError) as exc:  # at its cap, or not offering it: the next is asked
                refused = True
                if isinstance(exc, SessionLimitError):
                    full.append(agent.name)
                last = exc
                continue
            except NbexecError as exc:  # Docker, its image, its disk, the agent: nothing ran; the next is asked
                self._failed(node_id, str(exc), drop=isinstance(exc, NodeLostError))
                last = exc
                continue
            finally:
                if not made:
                    self._count(node_id, -1)
                    if not refused:  # it may exist, or come to: its slot on the node comes back either way
                        agent.send("release", self.owner, name)
            handle.ray_node = node_id
            return handle
        raise _nothing_made(full, len(tried), last)

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        """Remove the sandbox from its node (a one-shot's in the background unless ``wait``)."""
        if not isinstance(sandbox, RayHandle):
            raise TypeError(f"{sandbox!r} is not a sandbox of a Ray node")
        self._count(sandbox.ray_node, -1)
        if wait:
            sandbox.destroy()
        else:
            self._pool.submit(sandbox.destroy)

    def capacity(self, config: SandboxConfig) -> Capacity:
        """The warm sandboxes the agents last said they had (no I/O)."""
        with self._lock:
            known = [h.capacity for h in self.health.values() if h.up and h.capacity is not None]
        return Capacity(ready=sum(c.pool_free for c in known), size=sum(c.pool_size for c in known))

    def readiness(self, config: SandboxConfig) -> Readiness:
        try:
            up = len(self.candidates(config))
        except NbexecError as exc:
            return Readiness(False, {"nodes_up": 0, "error": str(exc)})
        return Readiness(True, {"nodes_up": up})

    def close(self) -> None:
        """Release what this source holds on every node (the agents stay, for the next source of this process
        and for other drivers)."""
        with self._lock:
            agents = list(self.agents.values())
        for agent in agents:
            with contextlib.suppress(NbexecError):
                agent.call("close", self.owner, timeout=AGENT_TIMEOUT, cap=SMALL, what="release its sandboxes")


def node_name(node: dict[str, Any]) -> str:
    """What errors call a node: its first custom Ray resource (``--resources '{"node_a": 1}'``), else its address
    and the start of its id."""
    custom = sorted(k for k in (node.get("Resources") or {})
                    if k not in STANDARD and k != LIMIT_RESOURCE and not k.startswith("node:"))
    if custom:
        return str(custom[0])[:64]
    return f"{node.get('NodeManagerAddress', '?')}/{str(node.get('NodeID', ''))[:8]}"[:64]


def _refuse(config: SandboxConfig) -> None:
    """What a Ray node cannot give a sandbox, refused before a node is asked."""
    if config.input_dir:
        raise ConfigError("input_dir (--mount-input) is a folder of this host, which Ray nodes cannot mount: "
                          "pass the files with files={name: bytes} or upload() instead")
    if config.network is True:
        raise ConfigError("network=True is not offered on Ray: Docker's bridge on a node reaches that node's "
                          "Ray ports, and through them every node. Use network='allowlist' or no network")


def _nothing_made(full: list[str], tried: int, last: NbexecError | None) -> NbexecError:
    """Why no node made a sandbox. A full node may free a slot: retryable, and its name goes to the log alone
    (a node's name may be its address)."""
    if full:
        log.info("Ray nodes full for this driver: %s", ", ".join(full))
        others = "" if len(full) == tried else "; the others could not make one"
        return ClusterFullError(f"{len(full)} of the {tried} Ray nodes that answer hold as many of this driver's "
                                f"sandboxes as they take{others}; nothing ran: retry after {FULL_RETRY:g} s or once "
                                "a sandbox is released", FULL_RETRY)
    return last or NodeUnavailableError("no node of the Ray cluster could make a sandbox")


def node_limit(node: dict[str, Any], per_node: int | None = None) -> int:
    """How many sandboxes a driver may hold on ``node``: ``per_node`` if given, else the node's LIMIT_RESOURCE,
    else PER_CPU per CPU it declares (at least one)."""
    if per_node is not None:
        return max(1, int(per_node))
    resources = node.get("Resources") or {}
    declared = resources.get(LIMIT_RESOURCE)
    if isinstance(declared, (int, float)) and declared >= 1:
        return int(declared)
    cpus = resources.get("CPU")
    return max(1, PER_CPU * int(cpus)) if isinstance(cpus, (int, float)) and cpus >= 1 else PER_CPU


_source: RaySource | None = None
_lock = threading.Lock()
