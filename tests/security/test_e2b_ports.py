"""Attacks on the E2B door's port relay (#40, ports), from outside, against a real `nbexec serve` and real Docker
sandboxes: another tenant's token, a hostile server inside the sandbox (silent, a slow-loris head, huge headers, an
endless body, a body dripped a byte at a time), more connections than a sandbox may hold, a request body past the
cap, and a sandbox killed mid-answer. Each is judged by what the client sees (status, bytes, wall time) and by
what the server process pays (its CPU time and memory, its threads) and leaves behind (connections inside the
sandbox, relay places). The server runs in this process, so its CPU is this process's."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

import nbexec
from nbexec.sandbox.docker.supervisor import ports as relays
from nbexec.service.e2b import ports
from nbexec.service.settings import ServerSettings

from .. import e2bsdk
from ..conftest import IMAGE, wait_until
from ..test_server import TOKEN_A, TOKEN_B, Running
from .test_e2b_attacks import rss_bytes

HOSTILE = """import socket, sys, threading, time
mode, port = sys.argv[1], int(sys.argv[2])
def serve(c):
    c.recv(65536)
    if mode == "silent":
        time.sleep(3600)
    elif mode == "loris":
        c.sendall(b"HTTP/1.1 200 OK\\r\\n")
        while True:
            c.sendall(b"X")
            time.sleep(0.05)
    elif mode == "headers":
        c.sendall(b"HTTP/1.1 200 OK\\r\\n" + b"".join(b"X-%d: %s\\r\\n" % (i, b"v" * 4000) for i in range(4096)))
        time.sleep(3600)
    elif mode == "endless":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n")
        block = b"x" * 65536
        while True:
            c.sendall(block)
    elif mode == "drip":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n")
        while True:
            c.sendall(b"x")
            time.sleep(0.001)
    elif mode == "stall":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 1000\\r\\n\\r\\nfirst bytes")
        time.sleep(3600)
    elif mode == "ok":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 11\\r\\nConnection: close\\r\\n\\r\\nSECRET-PAGE")
        c.close()
""" + e2bsdk.SERVE_FOREVER
MODES = {"ok": 8000, "silent": 8001, "loris": 8002, "headers": 8003, "endless": 8004, "drip": 8005, "stall": 8006}


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door(max_body=256 * 1024, e2b_ports=True) as service:
        yield service


def use(door: Running, monkeypatch: pytest.MonkeyPatch, token: str = TOKEN_A) -> None:
    e2bsdk.point(monkeypatch, door.url, token)


def serve_hostile(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/hostile.py", HOSTILE)
    for mode, port in MODES.items():
        sandbox.commands.run(f"python3 /home/user/hostile.py {mode} {port}", background=True, timeout=0)
    probe = "import socket\nfor p in %r:\n    socket.create_connection(('127.0.0.1', p)).close()\nprint('up')"
    sandbox.files.write("/home/user/probe.py", probe % (sorted(MODES.values()),))
    wait_until(lambda: "up" in sandbox.commands.run("python3 /home/user/probe.py 2>/dev/null || true").stdout,
               30, "the hostile servers did not start")


@pytest.fixture
def hostile(door: Running, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    """A sandbox of token A whose code serves a hostile HTTP server on each of MODES' ports."""
    use(door, monkeypatch)
    sandbox = Sandbox.create(timeout=120)
    try:
        serve_hostile(sandbox)
        yield sandbox
    finally:
        sandbox.kill()


def headers(sandbox: Sandbox, port: int, token: str | None = None) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(port),
            "E2B-Traffic-Access-Token": sandbox.traffic_access_token if token is None else token}


def fetch(door: Running, sandbox: Sandbox, port: int, *, limit: float = 120, **more: str) -> dict[str, Any]:
    """One GET through the relay, read to its end or its break: status, bytes, wall time, how it ended."""
    start, got, status, ended = time.monotonic(), 0, 0, "whole"
    try:
        with httpx.stream("GET", f"{door.url}/e2b/sandbox/", headers={**headers(sandbox, port), **more},
                          timeout=httpx.Timeout(limit)) as answer:
            status = answer.status_code
            for chunk in answer.iter_raw():
                got += len(chunk)
    except httpx.HTTPError as exc:
        ended = type(exc).__name__
    end = time.monotonic()
    return {"status": status, "bytes": got, "wall": end - start, "end": end, "ended": ended}


def connections_to(sandbox: Sandbox, port: int) -> int:
    """Established TCP connections to ``port`` inside the sandbox (its /proc/net/tcp, hex ports)."""
    table = sandbox.commands.run("cat /proc/net/tcp").stdout.splitlines()[1:]
    return sum(1 for row in table if row.split()[2].endswith(f":{port:04X}") and row.split()[3] == "01")


# -- who may reach a port ------------------------------------------------------------------------------------------

def test_only_the_sandboxs_own_tokens_reach_its_ports(door: Running, hostile: Sandbox,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    use(door, monkeypatch, TOKEN_B)
    other = Sandbox.create(timeout=60)  # token B's sandbox: its tokens are valid, for itself only
    try:
        url = f"{door.url}/e2b/sandbox/"
        answers = {
            "other-sandbox-token": httpx.get(url, headers=headers(hostile, 8000, other.traffic_access_token)),
            "no-token": httpx.get(url, headers={**headers(hostile, 8000, ""), "X-API-KEY": TOKEN_A}),
            "api-key-as-token": httpx.get(url, headers=headers(hostile, 8000, TOKEN_A)),
            "bearer-api-key": httpx.get(url, headers={**headers(hostile, 8000, ""),
                                                      "Authorization": f"Bearer {TOKEN_A}"}),
        }
        own = httpx.get(url, headers=headers(hostile, 8000))
    finally:
        other.kill()
    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(answers, 401)
    assert all("SECRET-PAGE" not in a.text for a in answers.values())
    assert own.status_code == 200 and own.text == "SECRET-PAGE"


# -- a hostile server inside the sandbox ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode,status", [("silent", 504), ("loris", 504), ("headers", 502)],
                         ids=["never-answers", "slow-loris-head", "huge-headers"])
def test_a_server_that_never_finishes_its_head_costs_bounded_time(door: Running, hostile: Sandbox, mode: str,
                                                                  status: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "READ_TIMEOUT", 3.0)
    monkeypatch.setattr(ports, "HEAD_TIMEOUT", 5.0)
    cpu = time.process_time()
    found = fetch(door, hostile, MODES[mode], limit=30)
    cpu = time.process_time() - cpu
    assert found["status"] == status and found["wall"] < 20, found
    assert cpu < 5, f"{cpu:.1f} s of the server's CPU for one request"
    wait_until(lambda: connections_to(hostile, MODES[mode]) == 0, 10, "the relay's connection stayed open")


def test_a_server_silent_mid_answer_is_cut_by_the_read_deadline(door: Running, hostile: Sandbox,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "READ_TIMEOUT", 3.0)
    found = fetch(door, hostile, MODES["stall"], limit=30)
    assert found["status"] == 200 and found["bytes"] == len("first bytes") and found["ended"] != "whole", found
    assert found["wall"] < 20, found
    wait_until(lambda: connections_to(hostile, MODES["stall"]) == 0, 10, "the relay's connection stayed open")


def test_an_endless_answer_is_cut_at_the_cap_and_said(door: Running, hostile: Sandbox) -> None:
    rss, cpu = rss_bytes(), time.process_time()
    found = fetch(door, hostile, MODES["endless"])
    rss, cpu = rss_bytes() - rss, time.process_time() - cpu
    assert found["status"] == 200 and found["bytes"] <= ports.MAX_RESPONSE, found
    assert found["ended"] != "whole", "a cut answer must not look whole"
    assert found["wall"] < 60 and cpu < 30 and rss < 64 * 1024**2, (found, cpu, rss)
    wait_until(lambda: connections_to(hostile, MODES["endless"]) == 0, 10, "the relay's connection stayed open")


def test_a_client_that_stops_reading_holds_a_window_not_the_answer(door: Running, hostile: Sandbox) -> None:
    """The relay reads from the sandbox only as fast as the client takes: a stalled client costs the host a
    window per direction, and the answer goes on (to its cap) once the client reads again."""
    got, rss = 0, rss_bytes()
    with httpx.stream("GET", f"{door.url}/e2b/sandbox/", headers=headers(hostile, MODES["endless"]),
                      timeout=60) as answer:
        chunks = answer.iter_raw()
        got += len(next(chunks))
        time.sleep(5)  # the client stalls; the server in the sandbox writes on
        grown = rss_bytes() - rss
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                got += len(chunk)
    assert grown < 32 * 1024**2, f"the host's memory grew by {grown / 2**20:.0f} MiB for a stalled client"
    assert ports.MAX_RESPONSE // 2 < got <= ports.MAX_RESPONSE, got  # not broken early: only the cap ended it


def test_an_answer_dripped_a_byte_at_a_time_costs_bounded_frames(door: Running, hostile: Sandbox,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relays, "MAX_PIECES", 2000)  # the cap's effect, sooner: each piece is one frame
    monkeypatch.setattr(ports, "EXCHANGE_TIMEOUT", 45.0)  # what would end it otherwise (600 s by default)
    cpu = time.process_time()
    found = fetch(door, hostile, MODES["drip"])
    cpu = time.process_time() - cpu
    assert found["status"] == 200 and found["ended"] != "whole", found
    assert found["wall"] < 40 and cpu < 15, (found, cpu)


# -- caps on connections and requests ------------------------------------------------------------------------------

def test_connections_per_sandbox_are_capped_and_given_back(door: Running, hostile: Sandbox,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "READ_TIMEOUT", 4.0)
    monkeypatch.setattr(ports, "HEAD_TIMEOUT", 4.0)
    threads = threading.active_count()
    with concurrent.futures.ThreadPoolExecutor(ports.MAX_RELAYS + 4) as pool:
        held = list(pool.map(lambda _: fetch(door, hostile, MODES["silent"]), range(ports.MAX_RELAYS + 4)))
    statuses = sorted(found["status"] for found in held)
    assert statuses.count(429) >= 4 and statuses.count(504) <= ports.MAX_RELAYS, statuses
    again = fetch(door, hostile, MODES["ok"])
    assert again["status"] == 200 and again["bytes"] == 11, again  # every place was given back
    wait_until(lambda: connections_to(hostile, MODES["silent"]) == 0, 10, "relayed connections stayed open")
    assert threading.active_count() <= threads + 2 * ports.MAX_RELAYS, "host threads grew with the relays"


def test_a_request_body_past_the_cap_is_refused(door: Running, hostile: Sandbox) -> None:
    url = f"{door.url}/e2b/sandbox/"
    declared = httpx.post(url, headers=headers(hostile, 8000), content=b"x" * (256 * 1024 + 1))
    streamed = httpx.post(url, headers=headers(hostile, 8000), content=iter([b"x" * 65536] * 8))
    assert declared.status_code == 413 and streamed.status_code == 413, (declared.text, streamed.text)


def test_a_killed_sandbox_ends_its_relays_at_once(door: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    use(door, monkeypatch)
    sandbox = Sandbox.create(timeout=120)
    serve_hostile(sandbox)
    found: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: found.append(fetch(door, sandbox, MODES["silent"])))
    reader.start()
    time.sleep(1.0)  # the request is relayed and waits for an answer (READ_TIMEOUT: 30 s)
    killed = time.monotonic()
    sandbox.kill()
    reader.join(60)
    assert found and found[0]["status"] in (502, 504), found
    outlived = found[0]["end"] - killed
    assert outlived < 10, f"the relay outlived the kill by {outlived:.1f} s"


def test_the_switch_is_off_by_default_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    config = nbexec.SandboxConfig(image=IMAGE)
    monkeypatch.delenv("NBEXEC_E2B_PORTS", raising=False)
    assert ServerSettings(config=config, tokens=(TOKEN_A,)).e2b_ports is False
    monkeypatch.setenv("NBEXEC_E2B_PORTS", "1")
    assert ServerSettings(config=config, tokens=(TOKEN_A,)).e2b_ports is True
    monkeypatch.setenv("NBEXEC_E2B_PORTS", "maybe")
    with pytest.raises(nbexec.ConfigError, match="NBEXEC_E2B_PORTS"):
        ServerSettings(config=config, tokens=(TOKEN_A,))
