"""An independent attacker's read of the E2B door (#40), from outside, against a real `nbexec serve` and real
Docker sandboxes. Each test is an attack that worked when it was written; it is judged by what a client or the
other tenant sees: the status and shape of an answer, the host threads, CPU and memory of the server process, and
how long a sandbox outlives the end it was given."""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import nbexec
from nbexec.service.settings import ServerSettings

from .. import e2bsdk
from ..conftest import IMAGE, settle, wait_until
from ..test_server import TOKEN_A, TOKEN_B, Running, running

ENVD = "49983"
STREAM_THREAD = "nbexec-e2b-stream"  # the door's per-stream reader thread (nbexec.service.e2b.envd.pump)


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door({"timeout": 20, "max_output": "64k", "max_display": "64k"}, max_body=256 * 1024,
                     e2b_max_timeout=120, keepalive=2.0) as service:
        yield service


def control(door: Running, token: str = TOKEN_A) -> httpx.Client:
    return httpx.Client(base_url=f"{door.url}/e2b", headers={"X-API-KEY": token}, timeout=60)


def create(door: Running, token: str = TOKEN_A, **body: Any) -> dict[str, Any]:
    with control(door, token) as client:
        answer = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60, **body})
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made


def kill(door: Running, made: dict[str, Any], token: str = TOKEN_A) -> None:
    with control(door, token) as client:
        client.delete(f"/sandboxes/{made['sandboxID']}")


@pytest.fixture
def made(door: Running) -> Iterator[dict[str, Any]]:
    """A sandbox of token A, as the create answer gives it."""
    found = create(door)
    yield found
    kill(door, found)


def envd_headers(made: dict[str, Any], **more: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": ENVD,
            "X-Access-Token": made["envdAccessToken"], **more}


def envelope(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def start_message(command: str, tag: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"process": {"cmd": "/bin/sh", "args": ["-c", command]}, "stdin": False}
    if tag:
        found["tag"] = tag
    return found


def raw_post(door: Running, path: str, headers: dict[str, str], body: bytes, *, rcvbuf: int | None = None,
             chunked: bool = False) -> socket.socket:
    """A request on a socket of its own whose answer is never read (a client that stalls)."""
    host, port = door.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/connect+json",
             *(f"{k}: {v}" for k, v in headers.items()),
             "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    sock.sendall(head + (b"%x\r\n" % len(body) + body + b"\r\n" if chunked and body else body))
    return sock


def stream_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == STREAM_THREAD)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def latin1(headers: dict[str, str]) -> dict[bytes, bytes]:
    """Headers as bytes: a header value may be any latin-1 byte ("\xb2" is "²", a str.isdigit() digit)."""
    return {k.encode(): v.encode("latin-1") for k, v in headers.items()}


def alive(door: Running, made: dict[str, Any], token: str = TOKEN_A) -> bool:
    with control(door, token) as client:
        return client.get(f"/sandboxes/{made['sandboxID']}").status_code == 200


# -- error shapes: a hostile value is a 400 in E2B's shape, never an unhandled 500 ---------------------------------

@pytest.mark.parametrize("method,path,params,body", [
    ("GET", "/v2/sandboxes", {"limit": "\u00b2"}, None),  # str.isdigit() is True for "²", int() is not
    ("GET", "/v2/sandboxes", {"metadata": "&".join(f"k{i}=v" for i in range(65))}, None),  # parse_qsl's field cap
    ("POST", "/v2/sandboxes", None, {"templateID": "base", "network": "open"}),  # not an object: .get() on a str
    ("POST", "/v2/sandboxes", None, {"templateID": "base", "timeout": 10**400}),  # isfinite() of a huge int
], ids=["limit-superscript-digit", "metadata-65-fields", "network-a-string", "timeout-huge-int"])
def test_hostile_control_values_are_400_not_500(door: Running, method: str, path: str, params: Any,
                                               body: Any) -> None:
    with control(door) as client:
        answer = client.request(method, path, params=params, content=None if body is None else json.dumps(body))
        if answer.status_code == 201:  # a lifetime past the operator's maximum may be clamped to it instead
            client.delete(f"/sandboxes/{answer.json()['sandboxID']}")
            return
    assert answer.status_code == 400 and answer.json()["code"] == 400, (answer.status_code, answer.text[:200])


@pytest.mark.parametrize("method,message,extra", [
    ("Start", {"process": {"cmd": "true", "envs": {"A": 1}}}, {}),  # a number where a string goes
    ("Start", {"process": {"cmd": "true", "cwd": 5}}, {}),
    ("Start", {"process": {"cmd": "true"}, "pty": {"size": [80, 24]}}, {}),
    ("Start", {"process": {"cmd": "true"}, "tag": 5}, {}),
    ("Start", {"process": {"cmd": "true"}}, {"Connect-Timeout-Ms": "\u00b2"}),
    ("Start", {"process": {"cmd": "true"}}, {"Keepalive-Ping-Interval": "\u00b2"}),
    ("SendSignal", {"process": {"pid": 1}, "signal": [9]}, {}),  # unhashable: dict.get raises
    ("Update", {"process": {"pid": 1}, "pty": {"size": [1, 2]}}, {}),
], ids=["envs-number", "cwd-number", "pty-size-list", "tag-number", "timeout-ms-superscript",
        "keepalive-superscript", "signal-list", "update-size-list"])
def test_hostile_process_messages_are_refused_not_500(door: Running, made: dict[str, Any], method: str,
                                                      message: dict[str, Any], extra: dict[str, str]) -> None:
    streaming = method == "Start"
    body = envelope(message) if streaming else json.dumps(message).encode()
    kind = "application/connect+json" if streaming else "application/json"
    headers = envd_headers(made, **{"Content-Type": kind}, **extra)
    url = f"{door.url}/e2b/sandbox/process.Process/{method}"
    answer = httpx.post(url, content=body, headers=latin1(headers), timeout=30)
    if answer.status_code == 200 and streaming:  # a header it cannot read may be ignored instead
        return
    assert answer.status_code in (400, 404, 429), (answer.status_code, answer.text[:200])
    assert answer.json()["code"] in ("invalid_argument", "not_found", "resource_exhausted"), answer.text[:200]


def test_a_port_header_of_a_unicode_digit_is_400_not_500(door: Running, made: dict[str, Any]) -> None:
    headers = envd_headers(made)
    headers["E2b-Sandbox-Port"] = "\u00b2"
    answer = httpx.get(f"{door.url}/e2b/sandbox/health", headers=latin1(headers), timeout=30)
    assert answer.status_code == 400 and answer.json()["code"] == 400, (answer.status_code, answer.text[:200])


# -- host threads and CPU: what one sandbox token costs the server ---------------------------------------------------

def test_connect_streams_to_one_process_hold_bounded_host_threads(door: Running, made: dict[str, Any]) -> None:
    """Every Connect stream holds a host thread of its own (envd.pump) and nothing caps the subscribers of one
    process: one leaked sandbox token opens as many threads on the server as it opens connections."""
    before = stream_threads()
    path = "/e2b/sandbox/process.Process/"
    chatty = start_message("while :; do echo x; sleep 0.5; done", "held")  # never quiet past the keepalive
    socks = [raw_post(door, path + "Start", envd_headers(made), envelope(chatty))]
    try:
        wait_until(lambda: stream_threads() > before, 30, "the process did not start")
        socks += [raw_post(door, path + "Connect", envd_headers(made), envelope({"process": {"tag": "held"}}))
                  for _ in range(120)]
        time.sleep(5)  # every connection is in; count what it holds
        held = stream_threads() - before
    finally:
        for sock in socks:
            sock.close()
    assert held <= 65, f"{held} host threads for one process of one sandbox (at most 64 processes run in one)"


def test_a_stalled_stream_of_a_killed_sandbox_gives_its_thread_back(docker_ready: None) -> None:
    """A client that stops reading a chatty process's stream, then the sandbox is killed: the host thread must
    end with the sandbox, not when the client's connection does (the operator's default allowance, 33 MB,
    is far more than the sockets' buffers: the stream's writer blocks on the client, its reader on the queue)."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=20)
    with running(ServerSettings(config=config, tokens=(TOKEN_A,), e2b_max_timeout=120)) as door:
        _stalled_then_killed(door)


def _stalled_then_killed(door: Running) -> None:
    made = create(door)
    before = stream_threads()
    sock = raw_post(door, "/e2b/sandbox/process.Process/Start", envd_headers(made),
                    envelope(start_message("yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")), rcvbuf=4096)
    try:
        wait_until(lambda: stream_threads() > before, 30, "the process did not start")
        time.sleep(2)
        kill(door, made)
        assert not alive(door, made)
        deadline = time.monotonic() + 20
        while stream_threads() > before and time.monotonic() < deadline:
            time.sleep(0.2)
        left = stream_threads() - before
    finally:
        sock.close()
    assert left == 0, f"{left} stream thread(s) still held 20 s after the sandbox was killed"


def test_output_past_the_allowance_does_not_keep_costing_the_host(door: Running, made: dict[str, Any]) -> None:
    """Output past a stream's allowance is dropped by the host, but it still crosses from the sandbox and through
    two host threads and the event loop, for as long as the process prints: a sandbox burns the host's CPU
    (not only its own cgroup's) by printing to a stream that has nothing more to give its client."""
    headers = envd_headers(made, **{"Content-Type": "application/connect+json"})
    body = envelope(start_message("yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"))
    got, seen = [0], bytearray()

    def read() -> None:
        try:
            with httpx.stream("POST", f"{door.url}/e2b/sandbox/process.Process/Start", content=body,
                              headers=headers, timeout=60) as answer:
                seen.extend(f"{answer.status_code} ".encode())
                for chunk in answer.iter_bytes():
                    got[0] += len(chunk)
                    seen.extend(chunk[:max(0, 2000 - len(seen))])
        except httpx.HTTPError as exc:
            seen.extend(repr(exc).encode())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    settle(lambda: got[0] > 50_000, 90)  # 64 KiB kept: about 87 KB of base64
    assert got[0] > 50_000, f"no output came in 90 s: {bytes(seen)!r}"
    last = -1
    while got[0] - last > 1000:  # until the allowance is spent: only keepalives come after it
        last = got[0]
        time.sleep(3)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(6)
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert reader.is_alive(), "the stream ended (the process prints forever)"
    assert share < 0.25, f"the server process used {share:.0%} of a core on output it drops"


# -- honesty: a quiet command or watch is not a sandbox that ended ---------------------------------------------------

def envelopes(raw: bytes) -> list[tuple[int, dict[str, Any]]]:
    found, at = [], 0
    while at + 5 <= len(raw):
        flag, length = struct.unpack(">BI", raw[at:at + 5])
        found.append((flag, json.loads(raw[at + 5:at + 5 + length])))
        at += 5 + length
    return found


def test_a_command_quiet_for_longer_than_the_keepalive_ends_with_its_own_exit(door: Running,
                                                                             made: dict[str, Any]) -> None:
    """`sleep 5; echo done` with the server's keepalive at 2 s: the keepalive's wait_for cancels the pump's
    generator, and the stream then says "the sandbox ended" while the sandbox and the command run on (E2B's SDK
    raises; `commands.run("sleep 20")` fails so with the default 15 s keepalive)."""
    headers = envd_headers(made, **{"Content-Type": "application/connect+json"})
    answer = httpx.post(f"{door.url}/e2b/sandbox/process.Process/Start", headers=headers,
                        content=envelope(start_message("sleep 5; echo done")), timeout=60)
    found = envelopes(answer.content)
    ended = [m for f, m in found if f == 2]
    data = b"".join(base64.b64decode(m["event"]["data"]["stdout"]) for f, m in found
                    if f == 0 and "data" in m.get("event", {}))
    assert ended == [{}] and data == b"done\n", (ended, data)
    assert alive(door, made)


def test_a_watch_quiet_for_longer_than_the_keepalive_still_sees_events(door: Running, made: dict[str, Any]) -> None:
    headers = envd_headers(made, **{"Content-Type": "application/connect+json"})
    sock = raw_post(door, "/e2b/sandbox/filesystem.Filesystem/WatchDir", envd_headers(made),
                    envelope({"path": "/home/user", "recursive": False}))
    try:
        time.sleep(5)  # two keepalive periods with nothing to say
        wrote = httpx.post(f"{door.url}/e2b/sandbox/files", params={"path": "/home/user/late.txt"},
                           headers={**headers, "Content-Type": "application/octet-stream"}, content=b"x", timeout=30)
        assert wrote.status_code == 200, wrote.text
        sock.settimeout(5)
        raw = b""
        with contextlib.suppress(TimeoutError):
            while b"late.txt" not in raw and (chunk := sock.recv(65536)):
                raw += chunk
    finally:
        sock.close()
    assert b"late.txt" in raw and b"the sandbox ended" not in raw, raw[-300:]


# -- waits without deadlines: an upload that stops -----------------------------------------------------------------

def test_an_upload_that_stops_does_not_stop_the_expiry_of_other_tokens_sandboxes(door: Running) -> None:
    """Two raw uploads to POST /files whose bodies stop after one chunk: each holds one of token A's two I/O
    threads in `write_file` (a queue.get() with no timeout, fed by a body read with no deadline). The one
    sweeper of the whole server then waits behind A's lane to expire A's sandbox, and token B's sandbox, given
    2 s to live, lives on; A cannot kill its own sandboxes either."""
    mine = create(door, timeout=2)
    socks = [raw_post(door, "/e2b/sandbox/files?path=/home/user/slow.bin",
                      {**envd_headers(mine), "Content-Type": "application/octet-stream"}, b"x", chunked=True)
             for _ in range(2)]
    try:
        theirs = create(door, TOKEN_B, timeout=2)
        time.sleep(12)  # both are due after 2 s; the sweeper runs each second
        b_left = alive(door, theirs, TOKEN_B)
        if b_left:
            kill(door, theirs, TOKEN_B)
    finally:
        for sock in socks:
            sock.close()
        kill(door, mine)
        wait_until(lambda: not alive(door, mine), 60, "token A's sandbox was not killed")
    assert not b_left, "token B's sandbox outlived its 2 s end by 10 s while token A's uploads hung"


# -- caps: fork spends the owner's snapshots -------------------------------------------------------------------------

def test_forks_do_not_use_up_the_owner_s_snapshots(door: Running, made: dict[str, Any]) -> None:
    """Each fork takes a snapshot of the sandbox and never deletes it: after seven forks (each fork killed at
    once) the token's eight snapshot places are gone, fork is refused, and so is every snapshot of its own."""
    with control(door) as client:
        kept = {s["snapshotID"] for s in client.get("/snapshots").json()}
        statuses = []
        try:
            for _ in range(9):
                answer = client.post(f"/sandboxes/{made['sandboxID']}/fork", json={"count": 1})
                found = answer.json()
                statuses.append(found[0].get("error", {}).get("code", 201) if answer.status_code == 201
                                else answer.status_code)
                for fork in found:
                    if "sandbox" in fork:
                        client.delete(f"/sandboxes/{fork['sandbox']['sandboxID']}")
            left = {s["snapshotID"] for s in client.get("/snapshots").json()} - kept
        finally:
            for snapshot in client.get("/snapshots").json():
                if snapshot["snapshotID"] not in kept:
                    client.delete(f"/templates/{snapshot['snapshotID']}")
    assert statuses == [201] * 9 and not left, (statuses, f"{len(left)} snapshots made by forks were kept")


# -- the expiry sweeper ---------------------------------------------------------------------------------------------

def test_a_sandbox_woken_by_auto_resume_is_not_paused_again_at_once(door: Running) -> None:
    """autoPause + autoResume: a data-plane call wakes the paused sandbox, but its end stays in the past, so the
    sweeper puts it back to sleep within a second: every call pays a full wake (its cells replayed), and the
    sandbox flaps between asleep and awake for as long as it is used."""
    made = create(door, timeout=4, autoPause=True, autoResume=True)
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": "49999",
               "X-Access-Token": made["envdAccessToken"]}
    try:
        with control(door) as client:
            def state() -> str:
                return str(client.get(f"/sandboxes/{made['sandboxID']}").json()["state"])
            wait_until(lambda: state() == "paused", 30, "the sandbox never paused")
            sent = time.time()
            woke = httpx.post(f"{door.url}/e2b/sandbox/execute", json={"code": "1 + 1"}, headers=headers,
                              timeout=60)
            assert woke.status_code == 200 and '"text": "2"' in woke.text, woke.text[-300:]
            info = client.get(f"/sandboxes/{made['sandboxID']}").json()
    finally:
        kill(door, made)
    # Judged by the end it was given, not by a sleep: a loaded machine may take seconds to wake it.
    end = datetime.datetime.fromisoformat(info["endAt"].replace("Z", "+00:00")).timestamp()
    assert end >= sent + 4 - 0.01, f"woken at {sent:.3f}, its end stays at {end:.3f}"
    assert info["state"] == "running" or time.time() > end, info["state"]


# -- host disk: multipart uploads are spooled on the host before the sandbox sees a byte ----------------------------

def spooled_bytes(folder: str) -> int:
    """Bytes of the deleted temporary files the server process holds open in ``folder`` (Starlette's spool)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(folder) and target.endswith("(deleted)"):
                total += os.stat(f"/proc/self/fd/{fd}").st_size
    return total


def test_concurrent_multipart_uploads_do_not_spool_without_bound_on_the_host(docker_ready: None) -> None:
    """`POST /files` parses a multipart body with Starlette's form parser, which spools each part past 1 MiB
    into a temporary file on the HOST until the whole body has come; nothing caps how many such uploads one
    sandbox token holds open. Ten uploads of 15 MiB that never send their last bytes: 150 MiB of the host's
    temporary folder, held for as long as the connections stay open."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=20)
    with running(ServerSettings(config=config, tokens=(TOKEN_A,), e2b_max_timeout=120)) as door:
        made = create(door)
        boundary = "nbexecattack"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode()
        sent = 15 * 1024**2
        headers = {**envd_headers(made), "Content-Type": f"multipart/form-data; boundary={boundary}"}
        before, socks = spooled_bytes(tempfile.gettempdir()), []
        try:
            for _ in range(10):  # each sends 15 MiB of its part, short of its Content-Length, and waits
                host, port = door.url.removeprefix("http://").split(":")
                sock = socket.create_connection((host, int(port)))
                lines = ["POST /e2b/sandbox/files HTTP/1.1", f"Host: {host}:{port}",
                         *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {16 * 1024**2 - 1024}"]
                sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + head + b"x" * sent)
                socks.append(sock)
            time.sleep(3)
            held = spooled_bytes(tempfile.gettempdir()) - before
        finally:
            for sock in socks:
                sock.close()
            kill(door, made)
    assert held < 64 * 1024**2, f"{held // 1024**2} MiB spooled on the host by one sandbox token's uploads"


def test_sandboxes_asleep_on_a_long_cell_do_not_stop_other_tokens_expiry(docker_ready: None) -> None:
    """autoPause sandboxes whose end comes during a long cell: the sweeper's hibernate waits for the cell (the
    session's lock), on asyncio's default executor, which has min(32, cores + 4) threads (6 here). Two tokens with
    three such sandboxes each hold all six for the cell's length, and a third token's sandbox, given 2 s to
    live, lives on (so does every other use of that executor: the MCP door's snapshots, for one)."""
    token_c = "token-c-" + "c" * 24
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=40)
    settings = ServerSettings(config=config, tokens=(TOKEN_A, TOKEN_B, token_c), max_sessions_per_token=3,
                              max_running_per_token=3, e2b_max_timeout=120)
    made: list[tuple[str, dict[str, Any]]] = []
    socks: list[socket.socket] = []
    with running(settings) as door:
        try:
            for token in (TOKEN_A, TOKEN_B):
                for _ in range(3):
                    made.append((token, create(door, token, timeout=60, autoPause=True)))
            for _, box in made:  # a cell that outlasts the sandbox's end; its answer is never read
                socks.append(raw_post(door, "/e2b/sandbox/execute",
                                      {"E2b-Sandbox-Id": box["sandboxID"], "E2b-Sandbox-Port": "49999",
                                       "X-Access-Token": box["envdAccessToken"], "Content-Type": "application/json"},
                                      json.dumps({"code": "import time; time.sleep(35)"}).encode()))
            time.sleep(3)  # the cells run; now their sandboxes' ends come, all at once
            for token, box in made:
                with control(door, token) as client:
                    client.post(f"/sandboxes/{box['sandboxID']}/timeout", json={"timeout": 1})
            time.sleep(3)  # the sweeper is hibernating them, each waiting on its cell
            victim = create(door, token_c, timeout=2)
            made.append((token_c, victim))
            time.sleep(12)
            left = alive(door, victim, token_c)
        finally:
            for sock in socks:
                sock.close()
            for token, box in made:
                kill(door, box, token)
    assert not left, "token C's sandbox outlived its 2 s end by 10 s behind other tokens' sleeping sandboxes"



def test_a_start_refused_for_the_stream_cap_does_not_run_its_command(door: Running, made: dict[str, Any]) -> None:
    """With the sandbox's streams all open, Start spawns the command first and only then finds no stream place:
    the client is told 429 resource_exhausted (an SDK may retry it), yet the command ran, unseen."""
    path = "/e2b/sandbox/process.Process/Start"
    before = stream_threads()
    socks = [raw_post(door, path, envd_headers(made), envelope(start_message("sleep 60"))) for _ in range(16)]
    try:
        wait_until(lambda: stream_threads() - before >= 16, 30, "the streams did not open")
        refused = httpx.post(f"{door.url}{path}", headers=envd_headers(made, **{
            "Content-Type": "application/connect+json"}), content=envelope(start_message(
                "echo ran >> /home/user/refused")), timeout=30)
        assert refused.status_code == 429, (refused.status_code, refused.content[:200])
        time.sleep(1)
        ran = httpx.get(f"{door.url}/e2b/sandbox/files", params={"path": "/home/user/refused"},
                        headers=envd_headers(made), timeout=30)
    finally:
        for sock in socks:
            sock.close()
    assert ran.status_code == 404, f"the refused command ran: {ran.content!r}"
