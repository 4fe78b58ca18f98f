"""The allowlist proxy under its own sandboxes' load (`nbexec.egress.proxy`, `nbexec.egress.budget`), judged from
outside: the answers a sandbox's connections get (and how soon), what the allowed servers receive, the host's open
descriptors, and whether a proxy still serves after its process ran out of descriptors.

A proxy runs in a child process with a small RLIMIT_NOFILE where the process limit is the point, in this process
otherwise, and behind real sandboxes (network="allowlist") for several sandboxes at once."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec import egress
from nbexec.egress import budget
from nbexec.egress.proxy import Limits, Proxy

from ..conftest import IMAGE, wait_until
from ..test_egress import Server

CHILD = Path(__file__).with_name("egress_child.py")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    found = Server()
    yield found
    found.close()


class Tarpit:
    """An allowed loopback TCP server that holds every connection: it reads and drops what comes and, with
    ``drip``, sends one byte each ``drip`` seconds (an allowed host that trickles). ``open`` counts the
    connections it holds now."""

    def __init__(self, drip: float | None = None) -> None:
        self.drip = drip
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port = self.listener.getsockname()[1]
        self.held: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def open(self) -> int:
        with self._lock:
            return len(self.held)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.held.add(conn)
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        conn.settimeout(self.drip)
        with contextlib.suppress(OSError):
            while True:
                try:
                    if not conn.recv(65536):
                        break
                except TimeoutError:
                    conn.sendall(b".")
        with self._lock:
            self.held.discard(conn)
        conn.close()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            held = list(self.held)
        for conn in held:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def tarpit() -> Iterator[Tarpit]:
    found = Tarpit()
    yield found
    found.close()


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working folder: sockets are named relative to it (a Unix socket's address is at most
    107 bytes, and TMPDIR may be deep)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _answer(sock: socket.socket) -> bytes:
    """Everything until the other side closes, or b"" when nothing came in time."""
    answer = b""
    with contextlib.suppress(TimeoutError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _get(name: str, port: int, path: str, timeout: float = 10) -> bytes:
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(timeout)
        client.connect(name)
        with contextlib.suppress(OSError):  # a connection refused at once may be closed before this is sent
            client.sendall(f"GET http://127.0.0.1:{port}{path} HTTP/1.1\r\n\r\n".encode())
        return _answer(client)


def _tunnel(name: str, port: int) -> tuple[socket.socket, str]:
    """A CONNECT to 127.0.0.1:port through the proxy at ``name``: the socket and the answer's status ("none"
    when no answer came within 10 s)."""
    client = socket.socket(socket.AF_UNIX)
    client.settimeout(10)
    client.connect(name)
    with contextlib.suppress(OSError):  # a connection refused at once may be closed before this is sent
        client.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    line = b""
    with contextlib.suppress(TimeoutError, OSError):
        while b"\r\n" not in line and (chunk := client.recv(1)):
            line += chunk
    parts = line.split(b" ")
    return client, parts[1].decode() if len(parts) > 1 else "none"


class Child:
    """egress_child.py: proxies in a process of their own with a small descriptor limit."""

    def __init__(self, limit: int, max_open: int, rules: list[str], names: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), str(limit), str(max_open), ",".join(rules), *names],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._done = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        ready = self._line()
        assert ready == "ready", f"the child did not start: {ready!r} {''.join(self.log)}"

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self.log.append(line)
        self._done.set()

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def command(self, word: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()
        return self._line()

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def threads(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        wait_until(lambda: self.process.stderr is None or self.process.stderr.closed or self._done.is_set(), 10,
                   "the child's log did not end")


def test_the_accept_loop_survives_running_out_of_descriptors(here: Path, server: Server) -> None:
    # The process's table is full (here filled by the child itself; in a service, by anything it does), so accept
    # fails with EMFILE. The proxy must keep the waiting connection and serve it once descriptors are free, not end
    # for good. (A thread blocked in accept holds one slot: the first connection takes it and, sending nothing,
    # keeps it, so the next accept surely meets the full table.)
    child = Child(limit=64, max_open=4, rules=[f"127.0.0.1:{server.port}"], names=["a.sock"])
    holder, queued = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        idle = child.threads()
        assert _get("a.sock", server.port, "/before").endswith(b"hello from the allowed server")
        wait_until(lambda: child.threads() == idle, 10, "the first connection's thread did not end")
        assert child.command("hog").startswith("full")
        holder.connect("a.sock")
        wait_until(lambda: child.descriptors() == 64, 10, "the proxy did not take the first connection")
        wait_until(lambda: any("could not accept" in line for line in child.log) or child.threads() == idle, 30,
                   "the proxy never met the full table")
        queued.settimeout(15)
        queued.connect("a.sock")  # into the listen queue: no descriptor of the child's needed
        queued.sendall(f"GET http://127.0.0.1:{server.port}/during HTTP/1.1\r\n\r\n".encode())
        assert child.command("free") == "freed"
        answer = _answer(queued)
        assert answer.startswith(b"HTTP/1.0 200"), f"the connection that waited got {answer[:100]!r}"
        assert _get("a.sock", server.port, "/after").endswith(b"hello from the allowed server")
        assert [path for path, _ in server.seen][-2:] == ["/during", "/after"]
    finally:
        holder.close()
        queued.close()
        child.close()


def test_the_process_budget_refuses_at_once_and_every_proxy_keeps_serving(
        here: Path, server: Server, tarpit: Tarpit) -> None:
    # A limit of 64 descriptors: the proxies of the process may hold 32, that is 16 connections; each sandbox 8.
    # Two sandboxes take all of it; a third is refused at once with a reason, and served once one lets go.
    child = Child(limit=64, max_open=8, rules=[f"127.0.0.1:{server.port}", f"127.0.0.1:{tarpit.port}"],
                  names=["a.sock", "b.sock", "c.sock"])
    held: list[socket.socket] = []
    try:
        answers = {}
        for name in ("a.sock", "b.sock"):
            tunnels = [_tunnel(name, tarpit.port) for _ in range(12)]
            held += [sock for sock, status in tunnels]
            answers[name] = [status for _, status in tunnels]
        assert answers == {"a.sock": ["200"] * 8 + ["503"] * 4, "b.sock": ["200"] * 8 + ["503"] * 4}, str(answers)
        refused = _get("c.sock", server.port, "/while-spent")
        assert refused.startswith(b"HTTP/1.1 503") and b"host" in refused, refused[:300]
        assert "/while-spent" not in [path for path, _ in server.seen]
        for sock in held[:12]:  # a's tunnels end
            sock.close()
        wait_until(lambda: _get("c.sock", server.port, "/after").startswith(b"HTTP/1.0 200"), 20,
                   "the third sandbox's proxy did not serve once descriptors were free")
        _, status = _tunnel("b.sock", tarpit.port)
        assert status == "503", "b's own budget still holds"
        assert not any("could not accept" in line for line in child.log), "the process ran out of descriptors"
    finally:
        for sock in held:
            sock.close()
        child.close()


@pytest.mark.parametrize(("shape", "why"), [("trickle-up", "closed"), ("trickle-down", "closed"),  # either rule
                                           ("idle", "without traffic")], ids=["trickle-up", "trickle-down", "idle"])
def test_a_slow_tunnel_is_closed_at_its_deadline(here: Path, shape: str, why: str) -> None:
    # idle_timeout 1 s, at least 1,000 bytes a window: a byte every 0.2 s (5 a second) keeps no tunnel open.
    far = Tarpit(drip=0.2 if shape == "trickle-down" else None)
    started = Proxy.start(Path("p.sock"), egress.Allowlist.of([f"127.0.0.1:{far.port}"]),
                          # idle: the idle rule alone (with both, either may end it first: the windows are 1 s)
                          Limits(max_bytes=0, max_connections=8, idle_timeout=1.0,
                                 min_rate=0 if shape == "idle" else 1000))
    try:
        client, status = _tunnel("p.sock", far.port)
        assert status == "200"
        with client:
            client.settimeout(0.2)
            client.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc")  # a ClientHello starts it
            for _ in range(100):  # 20 s of trickling at most: twenty windows
                try:
                    if shape == "trickle-up":
                        client.sendall(b"x")
                    if client.recv(64) == b"":
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            else:
                pytest.fail(f"the proxy kept a {shape} tunnel open for 20 s")
        wait_until(lambda: far.open == 0, 10, "the upstream side stayed open")
        (shown,), _ = started.take()
        assert not shown.open and why in (shown.reason or "") and "TLS" not in (shown.reason or ""), shown
    finally:
        started.close()
        far.close()


@pytest.mark.parametrize(("events", "verdict"), [
    ([(0.5, 600), (0.9, 600), (1.5, 1200), (1.9, 0)], None),  # 1,200 bytes in each window: alive at 1.9 s
    ([(0.2, 1), (0.4, 1), (0.6, 1), (0.8, 1), (1.0, 0)], "bytes"),  # trickled: too little in the first window
    ([(0.5, 5000), (1.0, 0), (1.6, 0)], "without traffic"),  # a big start, then silence
    ([(0.5, 5000), (1.0, 0), (1.4, 1), (2.0, 0)], "bytes"),  # a big start buys no later window
    ([(0.999, 0)], None),
])
def test_pace_rules(events: list[tuple[float, int]], verdict: str | None) -> None:
    pace = budget.Pace(window=1.0, least=1000, now=0.0)
    found = None
    for when, count in events:
        if count:
            pace.moved(count, when)
        found = pace.check(when) or found
    assert (found is None) if verdict is None else (verdict in (found or "")), found


def test_budgets_count_what_they_hand_out() -> None:
    own = budget.Budget(4)
    assert [own.take(2), own.take(2), own.take(2)] == [True, True, False] and own.used == 4
    own.give(2)
    assert own.take(2) and own.used == 4
    assert budget.host_capacity() == min(budget.HOST_MOST, os.sysconf("SC_OPEN_MAX") // 2)


# -- several real sandboxes ------------------------------------------------------------------------------------

HOLD = """
import socket, time
held, waiting, answers = [], [], {{}}
for _ in range({tries}):
    conn = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    conn.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\n\\r\\n")
    waiting.append(conn)
deadline = time.monotonic() + 15
for conn in waiting:
    line = b""
    try:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        while b"\\r\\n" not in line and (chunk := conn.recv(1)):
            line += chunk
    except OSError:
        pass
    status = line.split(b" ")[1].decode() if line.count(b" ") else "none"
    answers[status] = answers.get(status, 0) + 1
    (held if status == "200" else []).append(conn)
print(sorted(answers.items()))
"""


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sandboxes_that_spend_their_budgets_leave_the_others_served(
        server: Server, tarpit: Tarpit, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                                  allowed_hosts=(f"127.0.0.1:{server.port}", f"127.0.0.1:{tarpit.port}"))
    most = config.max_open_connections
    with nbexec.Session(config) as first, nbexec.Session(config) as second:
        before = _descriptors()
        results = [session.run(HOLD.format(tries=most + 24, port=tarpit.port)) for session in (first, second)]
        for result in results:  # each: its budget held, the rest refused at once (none left waiting)
            assert result.ok and f"[('200', {most}), ('503', 24)]" in result.stdout, (result.stdout, result.error)
            refused = [c for c in result.connections if not c.allowed]
            assert len(refused) == 24 and all("max_open_connections" in (c.reason or "") for c in refused)
        wait_until(lambda: tarpit.open == 2 * most, 10, "the tunnels did not reach the upstream")
        grown = _descriptors() - before - tarpit.open  # the tarpit's own ends are this process's too
        print(f"\nhost descriptors held for two sandboxes at their budgets: {grown} "
              f"(budget {2 * most * budget.PER_CONNECTION}; upstream ends not counted)")
        assert grown <= 2 * most * budget.PER_CONNECTION + 8, f"the host holds {grown} more descriptors"
        fetch = (f"import urllib.request\nfor n in range(3):\n"
                 f"    print(urllib.request.urlopen('http://127.0.0.1:{server.port}/third-%d' % n, timeout=10).read())")
        third = nbexec.execute_notebook(fetch, config=config)
        assert third.ok and third.stdout.count("hello from the allowed server") == 3, (third.stdout, third.error)
    wait_until(lambda: tarpit.open == 0, 20, "closing the sessions did not close their tunnels")
    wait_until(lambda: _descriptors() <= before + 8, 20, "the host kept the proxies' descriptors")
