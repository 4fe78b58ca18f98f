"""Time is a budget (issue #36): a kernel that never falls silent cannot hold one of nbexec's own silent requests.

An earlier cell starts a thread that prints continuously, so the kernel publishes a small signed message every
millisecond or so, and never the short silence the old reader waited for. Judged from outside: the wall time and
host CPU of the waiting call (measured in the thread that waits), the HTTP answer of a node's hidden route, and
how long close() takes while a silent request is waiting. Each wait runs in a thread joined with a limit, so code
that hangs fails the test at that limit (and the sandbox is killed to let the thread go) instead of the suite.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import nbexec
from nbexec import Session
from nbexec.sandbox import kernel

from .. import cluster
from ..conftest import IMAGE
from ..fakenode import for_header, raw_id

HANG = 30.0  # seconds after which a wait counts as endless (today's code: no end at all)
# A thread of the kernel that publishes, for as long as the kernel lives, a signed message every few milliseconds
# whose headers are costly to parse (2,000 lone surrogates each; a header of lists is refused at once): the host
# never sees silence.
FLOOD = ("import json, threading, time\n"
         "def _flood(k=get_ipython().kernel, parent=get_ipython().kernel.get_parent()):\n"
         "    s, n = k.session, 0\n"
         "    head = json.dumps(dict(s.msg_header('stream'), pad='\\ud800' * 2000), default=str).encode()\n"
         "    above = json.dumps(dict(parent['header'], pad='\\ud800' * 2000), default=str).encode()\n"
         "    while True:\n"
         "        n += 1\n"
         "        parts = [head, above, b'{\"n\": %d}' % n, b'{\"name\": \"stdout\", \"text\": \".\"}']\n"
         "        k.iopub_socket.send_multipart([b'stream', b'<IDS|MSG>', s.sign(parts), *parts])\n"
         "        time.sleep(0.002)\n"
         "threading.Thread(target=_flood, daemon=True).start()\n")
HIDDEN_CALLS, HIDDEN_LIMIT = 5, 2.0  # silent requests in a row, and each one's own time limit


@dataclass
class Timed:
    """What a call did, from outside: seconds of wall time and of its own thread's CPU, its value or error."""

    wall: float = 0.0
    cpu: float = 0.0
    value: Any = None
    error: BaseException | None = None
    done: bool = False


def timed(call: Callable[[], Any]) -> tuple[threading.Thread, Timed]:
    """Start ``call`` in a thread that measures its own CPU (RUSAGE_THREAD: the kernel client reads in it)."""
    seen = Timed()

    def work() -> None:
        start, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_THREAD)
        try:
            seen.value = call()
        except BaseException as exc:  # judged by the test
            seen.error = exc
        end = resource.getrusage(resource.RUSAGE_THREAD)
        seen.wall = time.monotonic() - start
        seen.cpu = end.ru_utime - cpu.ru_utime + end.ru_stime - cpu.ru_stime
        seen.done = True

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, seen


def cfg() -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3)


def _let_go(session: Session) -> None:
    """Kill the sandbox under a hung call (so its thread ends with the test)."""
    sandbox = session._sandbox  # the test reaches the real handle only to free a hung thread
    if sandbox is not None:
        sandbox.kill()


def waited(session: Session, call: Callable[[], Any], what: str) -> Timed:
    """``call`` timed in a thread given HANG seconds; past them the test fails naming ``what``, and the sandbox
    under the call is killed so that its thread ends with the test."""
    thread, seen = timed(call)
    thread.join(HANG)
    if not seen.done:
        _let_go(session)
        thread.join(30)
    assert seen.done, f"{what} had not returned after {HANG:g} s"
    assert seen.error is None, seen.error
    return seen


@pytest.fixture
def flooded(cleanup_ledger: None) -> Iterator[Session]:
    """A session whose kernel runs FLOOD from its first cell on; closed after the test."""
    session = Session(cfg())
    try:
        assert session.run(FLOOD).ok
        yield session
    finally:
        session.close()


def test_silent_requests_on_a_flooding_kernel_end_within_their_bound(flooded: Session) -> None:
    """The hidden path (the package set-up's, the replay's): each silent request ends within its own limit and
    the fixed tail read past its reply, and the host CPU of the waiting thread stays bounded."""
    sandbox = flooded._sandbox  # the hidden path itself, as the engine's package set-up calls it
    assert sandbox is not None
    seen = waited(flooded, lambda: [sandbox.run_hidden("pass", HIDDEN_LIMIT) for _ in range(HIDDEN_CALLS)],
                  f"{HIDDEN_CALLS} silent requests")
    bound = HIDDEN_CALLS * (HIDDEN_LIMIT + kernel.TAIL)
    assert seen.wall < bound + 3, (seen.wall, bound)  # each ends by its limit and the tail: not "fast"
    assert seen.cpu < bound, seen.cpu


def test_a_flooding_kernel_cannot_hold_a_wake_by_replay(flooded: Session) -> None:
    """A slept session whose replay starts the flood: run(timeout=20) wakes it (two silent requests) and returns,
    its host CPU bounded; the flood's messages belong to another request and are read past, not waited out."""
    assert flooded.run("x = 41").ok
    assert flooded.hibernate()
    seen = waited(flooded, lambda: flooded.run("print(x + 1)", timeout=20),
                  "run(timeout=20) on a woken flooding session")
    result = seen.value
    assert result.restored == "replay" and "42" in result.stdout, (result.stdout[-200:], result.notes)
    assert seen.wall < 28, seen.wall  # within its limit and the interrupt's grace: ends, not "fast"
    assert seen.cpu < 15, seen.cpu


def test_close_ends_a_silent_request_that_is_waiting(flooded: Session) -> None:
    """close() from another thread, while the wake's replay waits on a long silent cell under a flood: close
    returns within a few seconds, and the waiting call ends with it."""
    # Sleeps only when replayed (the marker file is made after): a silent request that takes long.
    assert flooded.run("import os, time\nif os.path.exists('/mnt/data/replayed'):\n    time.sleep(25)\n").ok
    flooded.upload(b"1", "replayed")
    assert flooded.hibernate()
    thread, seen = timed(lambda: flooded.run("1", timeout=30))
    time.sleep(4)  # the wake is in its replay by now (a fresh kernel starts in about a second)
    assert not seen.done, "the replay ended before close was called: the test proves nothing"
    closed = waited(flooded, flooded.close, "close()")
    thread.join(30)
    assert closed.wall < 5, closed.wall  # about a second: the sandbox is stopped, the wait ends
    assert seen.done and (seen.error is not None or not seen.value.ok), seen


# -- a node's hidden route ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node(docker_ready: None) -> Iterator[cluster.Server]:
    with cluster.running_node("tb", {"NBEXEC_POOL_SIZE": "0"}, running=2, sessions=2, timeout=30) as server:
        yield server


def _signed(http: httpx.Client, method: str, path: str, **options: Any) -> httpx.Response:
    return http.request(method, path, headers=for_header(method, path, "alice", "r0", cluster.NODE_TOKEN),
                        **options)


def _node_cpu(server: cluster.Server) -> float:
    """Seconds of CPU the node's process has used (user and system, from /proc)."""
    assert server.process is not None
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ is 100 on Linux)


@pytest.fixture
def flooding(node: cluster.Server) -> Iterator[tuple[httpx.Client, str]]:
    """Alice's sandbox on the node, its kernel flooding."""
    with cluster.client(node, cluster.NODE_TOKEN, timeout=HANG) as http:
        made = _signed(http, "POST", "/v1/sandboxes", json={"purpose": "session"})
        assert made.status_code == 201, made.text
        raw = raw_id(made.json()["id"])
        try:
            ran = _signed(http, "POST", f"/v1/sandboxes/{raw}/run", json={"code": FLOOD, "timeout": 20})
            assert ran.status_code == 200, ran.text
            yield http, raw
        finally:
            _signed(http, "POST", f"/v1/sandboxes/{raw}/kill")
            _signed(http, "DELETE", f"/v1/sandboxes/{raw}")


def test_the_hidden_route_refuses_code(flooding: tuple[httpx.Client, str], node: cluster.Server) -> None:
    """The hidden route is nbexec's own: a body with code is refused at once, whatever the kernel does."""
    http, raw = flooding
    start, cpu = time.monotonic(), _node_cpu(node)
    try:
        answer = _signed(http, "POST", f"/v1/sandboxes/{raw}/hidden", json={"code": "pass", "timeout": 5})
    except httpx.TimeoutException:
        pytest.fail(f"the node's hidden route had not answered after {HANG:g} s "
                    f"({_node_cpu(node) - cpu:.1f} s of node CPU)")
    assert answer.status_code == 422, answer.text[:300]
    assert time.monotonic() - start < 10
    # Code inside a named request's arguments is refused as well: they are data, checked by shape.
    marker = "open('/mnt/data/ran', 'w')"
    for args in ({"texts": [], "wheels": [], "asked": [], "code": marker}, {"code": marker}):
        answer = _signed(http, "POST", f"/v1/sandboxes/{raw}/hidden",
                         json={"operation": "packages.install", "args": args, "timeout": 5})
        assert answer.status_code == 422, answer.text[:300]
    assert _signed(http, "GET", f"/v1/sandboxes/{raw}/files/ran").status_code == 400  # no such file: never ran


def test_the_hidden_route_answers_a_named_request_under_a_flood(flooding: tuple[httpx.Client, str],
                                                                node: cluster.Server) -> None:
    """nbexec's own request, by name, on a flooding kernel: the node answers within its bound, its CPU bounded."""
    http, raw = flooding
    start, cpu = time.monotonic(), _node_cpu(node)
    try:
        answer = _signed(http, "POST", f"/v1/sandboxes/{raw}/hidden",
                         json={"operation": "packages.setup", "timeout": 20})
    except httpx.TimeoutException:
        pytest.fail(f"the node's hidden route had not answered after {HANG:g} s "
                    f"({_node_cpu(node) - cpu:.1f} s of node CPU)")
    wall, spent = time.monotonic() - start, _node_cpu(node) - cpu
    assert answer.status_code == 200, answer.text[:300]
    reply = answer.json()["reply"]
    assert reply is not None and reply["status"] == "ok", reply
    assert "target" in reply["user_expressions"], reply
    assert wall < 20 and spent < 15, (wall, spent)
