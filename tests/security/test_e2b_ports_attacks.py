"""A second attacker's look at the E2B door's port relay (#40, ports), from outside, against a real `nbexec serve`
and a real Docker sandbox whose code serves hostile HTTP: a chunked answer of one-byte chunks (the host's CPU per
byte of the wire), an answer framed by both Transfer-Encoding and a lying Content-Length, a server that takes the
request body a trickle at a time (a wait with no deadline, the owner's I/O threads held), and an echo server that
shows what the relay lets through to the sandbox (nbexec's credentials, the sandbox's tokens, smuggled requests).
Each is judged by what the client sees (status, bytes, wall time) and what the server process pays (its CPU time).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from nbexec.service.e2b import ports

from .. import e2bsdk
from ..conftest import wait_until
from ..test_server import TOKEN_A, TOKEN_B, Running
from .test_e2b_ports import connections_to, headers, use

HOSTILE = """import socket, sys, threading, time
mode, port = sys.argv[1], int(sys.argv[2])
def head(c):
    got = b""
    while b"\\r\\n\\r\\n" not in got:
        more = c.recv(65536)
        if not more:
            break
        got += more
    return got
def serve(c):
    got = head(c)
    if mode == "tiny":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n")
        block = b"1\\r\\nx\\r\\n" * 10000
        for _ in range(200):
            c.sendall(block)
        c.sendall(b"0\\r\\n\\r\\n")
    elif mode == "both":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\nContent-Length: 5\\r\\n\\r\\n"
                  b"a\\r\\n0123456789\\r\\n0\\r\\n\\r\\n")
    elif mode == "echo":
        c.settimeout(2)
        try:
            while True:
                more = c.recv(65536)
                if not more:
                    break
                got += more
        except OSError:
            pass
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(got), got))
    elif mode == "switch":
        c.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n"
                  b"\\x81\\x05hello")
        time.sleep(1)
    elif mode == "extra":
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 100\\r\\nX-First: 1\\r\\n\\r\\n"
                  b"HTTP/1.1 200 OK\\r\\nContent-Length: 8\\r\\nSet-Cookie: stolen=1\\r\\n\\r\\nSMUGGLED")
        time.sleep(1)
    elif mode == "trickle":
        while c.recv(16384):
            time.sleep(1.0)
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
    c.close()
""" + e2bsdk.SERVE_FOREVER
MODES = {"tiny": 8100, "both": 8101, "echo": 8102, "trickle": 8103, "switch": 8104, "extra": 8105}
BIG = 48 * 1024**2  # a request body past the sandbox's socket buffers and the relay's window


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door(max_body=BIG + 1024, e2b_ports=True) as service:
        yield service


@pytest.fixture(scope="module")
def hostile(door: Running) -> Iterator[Sandbox]:
    """A sandbox of token A whose code serves a hostile HTTP server on each of MODES' ports."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        use(door, monkeypatch)
        sandbox = Sandbox.create(timeout=300)
        try:
            sandbox.files.write("/home/user/hostile.py", HOSTILE)
            for mode, port in MODES.items():
                sandbox.commands.run(f"python3 /home/user/hostile.py {mode} {port}", background=True, timeout=0)
            probe = "import socket\nfor p in %r:\n    socket.create_connection(('127.0.0.1', p)).close()\nprint('up')"
            sandbox.files.write("/home/user/probe.py", probe % (sorted(MODES.values()),))
            wait_until(lambda: "up" in sandbox.commands.run("python3 /home/user/probe.py 2>/dev/null || true").stdout,
                       30, "the hostile servers did not start")
            yield sandbox
        finally:
            sandbox.kill()


def call(door: Running, sandbox: Sandbox, port: int, method: str = "GET", *, limit: float = 120,
         more: dict[str, str] | None = None, content: Any = None, path: str = "/") -> dict[str, Any]:
    """One request through the relay, read to its end or its break: status, body, wall time, how it ended."""
    start, body, status, ended = time.monotonic(), b"", 0, "whole"
    try:
        with httpx.stream(method, f"{door.url}/e2b/sandbox{path}", headers={**headers(sandbox, port), **(more or {})},
                          content=content, timeout=httpx.Timeout(limit)) as answer:
            status = answer.status_code
            for chunk in answer.iter_bytes():
                body += chunk
    except httpx.HTTPError as exc:
        ended = type(exc).__name__
    return {"status": status, "body": body, "wall": time.monotonic() - start, "ended": ended}


def test_an_answer_of_one_byte_chunks_costs_bounded_host_cpu(door: Running, hostile: Sandbox) -> None:
    """Two million one-byte chunks (12 MB on the wire, under every byte cap): the relay parsed and passed on each
    as its own piece, a host CPU cost per six bytes the sandbox wrote, on the server's event loop."""
    cpu = time.process_time()
    found = call(door, hostile, MODES["tiny"], limit=300)
    cpu = time.process_time() - cpu
    assert found["status"] == 200 and found["ended"] != "whole", {**found, "body": len(found["body"])}
    assert len(found["body"]) <= ports.MAX_CHUNKS, len(found["body"])
    assert cpu < 15, f"{cpu:.1f} s of the server's CPU for one answer"
    wait_until(lambda: connections_to(hostile, MODES["tiny"]) == 0, 10, "the relay's connection stayed open")


def test_an_answer_framed_by_chunks_never_carries_its_lying_content_length(door: Running, hostile: Sandbox) -> None:
    """Transfer-Encoding and Content-Length both: the body is read by its chunks (RFC 9112 6.3), so the sandbox's
    Content-Length must not reach the client, whose framing it would break (or a proxy's before it)."""
    with httpx.Client(timeout=30) as client:
        answer = client.get(f"{door.url}/e2b/sandbox/", headers=headers(hostile, MODES["both"]))
        assert answer.status_code == 200 and answer.content == b"0123456789", (answer.headers, answer.content)
        assert "content-length" not in answer.headers or answer.headers["content-length"] == "10", answer.headers
        again = client.get(f"{door.url}/e2b/sandbox/", headers=headers(hostile, MODES["both"]))  # the same connection
        assert again.status_code == 200 and again.content == b"0123456789"


def test_a_server_taking_the_body_by_a_trickle_ends_in_504_and_holds_no_owner_call(
        door: Running, hostile: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server reading 16 KiB a second, two 48 MiB uploads to it at once: each write of the request waits for the
    sandbox's window on one of the owner's two I/O threads, so the worry was an upload with no end and the owner's
    file calls queued behind it. Held: the window's wait passes READ_TIMEOUT (the socket frees room in bigger
    steps than the server reads), 504, and the file call is served meanwhile."""
    monkeypatch.setattr(ports, "EXCHANGE_TIMEOUT", 10.0)
    monkeypatch.setattr(ports, "READ_TIMEOUT", 5.0)
    body = b"x" * BIG
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        uploads = [pool.submit(call, door, hostile, MODES["trickle"], "POST", limit=90, content=body)
                   for _ in range(2)]
        time.sleep(3)  # both uploads are past the socket buffers and wait on the server
        start = time.monotonic()
        hostile.files.write("/home/user/note.txt", "still served")
        waited = time.monotonic() - start
        found = [upload.result() for upload in uploads]
    assert all(f["status"] == 504 for f in found), [{**f, "body": f["body"][:200]} for f in found]
    assert all(f["wall"] < 45 for f in found), [f["wall"] for f in found]
    assert waited < 8, f"a file write of the same owner waited {waited:.1f} s behind two uploads"
    wait_until(lambda: connections_to(hostile, MODES["trickle"]) == 0, 20, "the relay's connections stayed open")


def test_the_sandbox_never_sees_credentials_nor_a_second_request(door: Running, hostile: Sandbox) -> None:
    """What the server in the sandbox receives: none of nbexec's tokens (however spelled), neither of the sandbox's
    own tokens, one request on a connection that closes (nothing a smuggled or pipelined request could ride)."""
    smuggle = "0\r\n\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\n"
    sent = {"X-API-KEY": TOKEN_A, "Authorization": f"Bearer {TOKEN_A}", "X-Access-Token": hostile._envd_access_token
            or "", "Connection": "keep-alive, X-Secret", "X-Secret": "hop", "Proxy-Authorization": f"Basic {TOKEN_B}"}
    found = call(door, hostile, MODES["echo"], "POST", more={**sent, "Transfer-Encoding": "chunked"},
                 content=iter([smuggle.encode()]), path="/p%20q?x=1")
    seen = found["body"].decode("latin-1")
    assert found["status"] == 200, found
    head = seen.split("\r\n\r\n", 1)[0]
    assert head.startswith("POST /p%20q?x=1 HTTP/1.1\r\n"), seen
    for secret in (TOKEN_A, TOKEN_B, hostile.traffic_access_token or "-", hostile._envd_access_token or "-", "hop"):
        assert secret not in seen, (secret, seen)
    assert "connection: close" in head.lower(), head
    assert seen.count("HTTP/1.1") == 2 and "GET /admin" in seen.split("\r\n\r\n", 1)[1], seen  # body, not a request
    lying = call(door, hostile, MODES["echo"], "POST", more={"Content-Length": "3", "Transfer-Encoding": "chunked"},
                 content=iter([smuggle.encode()]))
    assert "GET /admin" not in lying["body"].decode("latin-1").split("\r\n\r\n", 1)[0], lying


def test_a_server_can_neither_switch_protocols_nor_answer_twice(door: Running, hostile: Sandbox) -> None:
    """A websocket handshake is refused before the relay (uvicorn's own 403); a 101 to a request that proposed none,
    then raw frames: 502, never a tunnel. A HEAD answered with a second answer behind it: the extra bytes are never
    read as the answer to the client's next request on its connection."""
    with httpx.Client(timeout=30) as client:
        url = f"{door.url}/e2b/sandbox/"
        switched = client.get(url, headers={**headers(hostile, MODES["switch"]), "Connection": "Upgrade",
                                            "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert switched.status_code in (403, 502) and b"hello" not in switched.content, switched  # 403: uvicorn's
        plain = client.get(url, headers=headers(hostile, MODES["switch"]))  # no proposal: the 101 reaches the relay
        assert plain.status_code == 502 and b"hello" not in plain.content, plain
        head = client.head(url, headers=headers(hostile, MODES["extra"]))
        after = client.get(url, headers=headers(hostile, MODES["both"]))
    assert head.status_code == 200 and head.headers.get("x-first") == "1" and "set-cookie" not in head.headers
    assert after.status_code == 200 and after.content == b"0123456789" and "set-cookie" not in after.headers
