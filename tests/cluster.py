"""A test cluster on loopback: real `nbexec serve` node processes (each its own name and TMPDIR, sharing this
machine's Docker engine) and a real router in front of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbexec.files.workdir import remove_tree
from nbexec.sandbox.docker import daemon

from .azurite import free_port
from .conftest import LONG_LIVED_CHILDREN, wait_until

NODE_TOKEN = "node-token-" + "n" * 24
CLIENT_TOKEN = "client-token-" + "c" * 24
OTHER_TOKEN = "other-token-" + "o" * 24
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    """One `nbexec serve` process (a node, or the router with ``nodes``)."""

    name: str
    port: int
    env: dict[str, str]
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="nbexec-serve-", suffix=".log")[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nbexec.cli", "serve", "--port", str(self.port), *self.args],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        LONG_LIVED_CHILDREN.add(self.process.pid)
        return self

    def kill(self, sig: int = signal.SIGKILL, within: float = 60) -> None:
        """Send ``sig`` and wait ``within`` seconds for the process to end; one that does not is killed (so it
        leaves nothing to the next test) and reported."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=within)
        except subprocess.TimeoutExpired as hung:
            self.process.kill()
            self.process.wait(timeout=60)
            raise AssertionError(f"{self.name} had not exited {within:.0f} s after signal {sig} "
                                 f"(log: {self.log})") from hung
        finally:
            LONG_LIVED_CHILDREN.discard(self.process.pid)

    def ready(self, token: str = NODE_TOKEN) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def containers(self) -> list[str]:
        """Names of the containers this node's processes made (any of its lives)."""
        found = daemon.connect().containers.list(all=True, sparse=True,
                                                 filters={"label": f"{daemon.LABEL_NODE}={self.name}"})
        return [(c.attrs.get("Names") or ["/"])[0] for c in found]

    def end(self, sig: int) -> None:
        """After a test that judged it: stop the process with ``sig`` if it still runs, give its containers a
        minute to go, then remove what is left."""
        if self.process is not None and self.process.poll() is None:
            self.kill(sig)
        with contextlib.suppress(pytest.fail.Exception):  # judged by the test, never here
            wait_until(lambda: not self.containers(), 60, "")
        self.remove_containers()

    def remove_containers(self) -> None:
        """Remove what this node's processes left (after a test judged it): a node that failed, hung or lost its
        engine mid-test (a restart of the engine) must not leave containers to the rest of the suite, since no
        later node of this name will sweep them."""
        for found in daemon.connect().containers.list(all=True, filters={"label": f"{daemon.LABEL_NODE}={self.name}"}):
            with contextlib.suppress(Exception):  # gone meanwhile
                found.remove(force=True)


def stop(*servers: Server) -> None:
    """SIGTERM to each server still running, each given its minute; then the first that did not exit is reported
    (after the others were stopped, so one hung server leaves nothing running)."""
    failures: list[AssertionError] = []
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            try:
                server.kill(signal.SIGTERM)
            except AssertionError as failure:
                failures.append(failure)
    if failures:
        raise failures[0]


def node(index: int, tmp: Path, *, running: int = 8, sessions: int = 16, timeout: int = 60,
         tag: str = "n") -> Server:
    name = f"test{os.getpid()}-{tag}{index}"
    folder = tmp / name
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)  # the sandbox user reaches its bind mounts through it
    env = {**os.environ, "TMPDIR": str(folder), "NBEXEC_API_TOKENS": NODE_TOKEN, "NBEXEC_POOL_SIZE": "1",
           "NBEXEC_WARM_IMPORTS": "", "NBEXEC_TIMEOUT": str(timeout), "NBEXEC_INTERRUPT_GRACE": "2",
           "PYTHONPATH": str(ROOT)}
    env.pop("NBEXEC_NODES", None)
    return Server(name, free_port(), env, ["--node-name", name, "--max-running-per-token", str(running),
                                           "--max-sessions-per-token", str(sessions)])


@contextlib.contextmanager
def running_node(tag: str, env: dict[str, str], *, running: int = 8, sessions: int = 16,
                 timeout: int = 60) -> Iterator[Server]:
    """One started node whose TMPDIR is a short folder in /tmp (the egress proxy's and the kernels' socket paths
    below it must fit AF_UNIX's limit), with ``env`` over `node`'s; stopped on exit, and judged to have left no
    container behind."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))
    tmp.chmod(0o755)  # the sandbox user reaches its bind mounts through it
    server = node(0, tmp, running=running, sessions=sessions, timeout=timeout, tag=tag)
    server.env.update(env)
    server.start()
    try:
        wait_ready([server])
        yield server
    finally:
        try:
            server.kill(signal.SIGTERM)
            wait_until(lambda: not server.containers(), 60, f"the node {server.name} left containers behind")
        finally:
            server.remove_containers()  # judged above; on a failure, nothing is left to later tests
            remove_tree(tmp)  # its TMPDIR in /tmp (what a leak leaves there was judged by the tests)


def router(nodes: list[Server], port: int | None = None) -> Server:
    """A router in front of ``nodes``, naming each as the node names itself (``--nodes name=URL``)."""
    return router_at([f"{n.name}={n.url}" for n in nodes], port)


def router_at(urls: list[str], port: int | None = None, env: dict[str, str] | None = None,
              args: tuple[str, ...] = ()) -> Server:
    """A router in front of ``urls`` (entries as --nodes takes them), with the two client tokens."""
    environ = {**os.environ, "NBEXEC_API_TOKENS": f"{CLIENT_TOKEN},{OTHER_TOKEN}", "NBEXEC_NODE_TOKEN": NODE_TOKEN,
               "PYTHONPATH": str(ROOT), **(env or {})}
    environ.pop("NBEXEC_NODES", None)
    return Server("router", port or free_port(), environ, ["--nodes", ",".join(urls), *args])


def nodes_up(router_server: Server) -> int:
    """How many nodes the router sees up (its operator view, /v1/nodes with the node token); -1 when it does not
    answer."""
    try:
        answer = httpx.get(f"{router_server.url}/v1/nodes", headers={"Authorization": f"Bearer {NODE_TOKEN}"},
                           timeout=5)
        return sum(1 for n in answer.json()["nodes"] if n["up"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def all_up(router_server: Server, count: int) -> bool:
    """Whether the router sees ``count`` nodes up."""
    return nodes_up(router_server) == count


def wait_ready(servers: list[Server], timeout: float = 180) -> None:
    for server in servers:
        wait_until(server.ready, timeout, f"{server.name} never became ready (log: {server.log})", interval=0.2)


def client(server: Server, token: str | None = CLIENT_TOKEN, timeout: float = 60) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


def peak_kib(server: Server) -> int:
    """The server process's peak resident memory (VmHWM), in KiB."""
    assert server.process is not None
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


@contextlib.contextmanager
def fake_behind_router(env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Iterator[tuple[Any, Server]]:
    """A fake node (tests/fakenode.py: honest until a test says otherwise) and a router in front of it, started
    with ``env`` and ``args``; both stopped after."""
    from .fakenode import FakeNode

    fake = FakeNode(token=NODE_TOKEN).start()
    front = router_at([fake.url], env=env, args=args).start()
    try:
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw the fake node", interval=0.2)
        yield fake, front
    finally:
        stop(front)
        fake.close()
