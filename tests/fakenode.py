"""A hostile node on loopback: answers the node API the way a broken or malicious `nbexec serve` might.

Tests put it behind a real router (`tests/cluster.py`) and choose, per route, how it answers: honestly (small
events, ids a router can route), with endless or enormous bodies (chunked, so no length warns the reader), with
an error body that never ends, or with a valid JSON result made of millions of tiny objects. It may lie about its
name and instance. It records every request it receives, so a test can tell which bytes reached it.

The signed ``X-Nbexec-For`` header a router adds is implemented here from its specification (docs/scale-out.md),
not imported from nbexec, so the test checks the protocol rather than the code against itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MiB = 1024 * 1024
FOR_HEADER = "X-Nbexec-For"


def for_header(method: str, target: str, client: str, node: str, token: str, *, when: float | None = None,
               nonce: str | None = None) -> dict[str, str]:
    """The header a router signs: who the request is for and its name for the node (the protocol, re-implemented)."""
    stamp = str(int(time.time() if when is None else when))
    nonce = nonce or secrets.token_hex(16)
    key = hashlib.sha256(b"nbexec-node-requests\0" + token.encode()).digest()
    message = "\n".join(["nbexec-for/1", method, target, client, node, stamp, nonce]).encode()
    signature = hmac.new(key, message, hashlib.sha256).hexdigest()
    return {FOR_HEADER: f"{client};{node};{stamp};{nonce};{signature}"}


def public_id(token: str, client: str, node: str, instance: str, raw: str) -> str:
    """The id a router hands to ``client`` for the node's ``raw`` id (the protocol, re-implemented)."""
    key = hashlib.sha256(b"nbexec-router-ids\0" + token.encode()).digest()
    signature = hmac.new(key, "\0".join((client, node, instance, raw)).encode(), hashlib.sha256).hexdigest()[:24]
    return f"{node}.{instance}.{raw}.{signature}"


def raw_id(public: str) -> str:
    """The node's own id inside a router id (or the id itself when it is not one)."""
    parts = public.split(".")
    return parts[-2] if len(parts) >= 4 else public


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Behaviour:
    """How the fake node answers. Each field names a mode for one kind of route."""

    capacity: str = "honest"  # honest | endless-json
    run: str = "honest"  # honest | endless-line | tiny-objects | endless-error | hold
    session: str = "honest"  # GET /v1/sessions/{id}: honest | endless-json
    download: str = "honest"  # GET .../files/...: honest | endless
    e2b: str = "honest"  # E2B's data plane: honest | endless-envelopes | huge-envelope | endless-lines | long-line
    # (and E2B's list: honest | list-flood; its create: id-flood, a list of sandbox ids filling the answer's cap)
    hostile_bytes: int = 256 * MiB  # how much an "endless" answer sends before it gives up


@dataclass
class FakeNode:
    """A node API on 127.0.0.1 with a chosen behaviour (see the module docstring)."""

    token: str
    name: str = "fake"
    instance: str = "0123456789ab"
    sessions: int = 0
    pool_free: int = 1
    behaviour: Behaviour = field(default_factory=Behaviour)
    seen: list[Seen] = field(default_factory=list)
    sent: dict[str, list[int]] = field(default_factory=dict)  # route kind -> bytes of each hostile answer sent

    def __post_init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeNode:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def capacity(self) -> dict[str, Any]:
        return {"node": self.name, "instance": self.instance, "sessions": self.sessions,
                "pool_free": self.pool_free, "pool_size": 1, "running": 0}

    def mint(self, raw: str, headers: dict[str, str]) -> str:
        """A new id as a node renders it: for the client and node name of a signed request, else as it is."""
        signed = headers.get(FOR_HEADER.lower(), "")
        if not signed:
            return raw
        client, node = signed.split(";")[:2]
        return public_id(self.token, client, node, self.instance, raw)

    def record(self, kind: str, sent: int) -> None:
        self.sent.setdefault(kind, []).append(sent)

    def received(self, needle: bytes) -> list[Seen]:
        """The requests that carried ``needle`` in their path, headers or body."""
        return [s for s in self.seen if needle in s.body or needle.decode() in s.path
                or any(needle.decode() in v for v in s.headers.values())]


def _handler(node: FakeNode) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            return

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while (size := int(self.rfile.readline().strip() or b"0", 16)) > 0:
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data
            return self.rfile.read(length) if length else b""

        def _dispatch(self) -> None:
            body = self._body()
            headers = {k.lower(): v for k, v in self.headers.items()}
            node.seen.append(Seen(self.command, self.path, headers, body[:65536]))
            path = self.path.split("?", 1)[0]
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                _answer(self, node, self.command, path, headers)

        do_GET = do_POST = do_PUT = do_DELETE = _dispatch

    return Handler


def _json(handler: BaseHTTPRequestHandler, status: int, data: Any) -> None:
    body = json.dumps(data).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _chunked(handler: BaseHTTPRequestHandler, status: int, content_type: str, parts: Any) -> int:
    """Send ``parts`` (an iterable of bytes) as a chunked body; return the bytes sent before the reader left."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    sent = 0
    try:
        for part in filter(None, parts):  # an empty chunk would end the body
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            sent += len(part)
        handler.wfile.write(b"0\r\n\r\n")
    except OSError:
        handler.close_connection = True
    return sent


def _endless(first: bytes, total: int, filler: bytes = b"x") -> Any:
    yield first
    chunk = filler * MiB
    for _ in range(total // MiB):
        yield chunk


def _held() -> Any:
    """A run that prints once, then only keeps the stream alive (for two minutes at most)."""
    yield b'event: output\ndata: {"cell_index": 0, "output_type": "stream", "name": "stdout", "text": "held\\n"}\n\n'
    for _ in range(600):
        time.sleep(0.2)
        yield b": keep-alive\n\n"


def _tiny_objects(prefix: bytes, size: int) -> Any:
    """A valid JSON value of ``size`` bytes made of tiny objects: cheap to send, dear to parse (about 20x)."""
    yield prefix + b'{"execution_id": "x", "ok": true, "outputs": ['
    block = b"{}," * (MiB // 3)
    for _ in range(size // len(block)):
        yield block
    yield b"{}]}\n\n"


_SESSION = re.compile(r"^/v1/sessions/([^/]+)$")
_EXECUTE = re.compile(r"^/v1/(?:execute|sessions/([^/]+)/execute)$")


def _hostile(handler: BaseHTTPRequestHandler, node: FakeNode, kind: str, mode: str) -> bool:
    """Answer a route of ``kind`` the hostile way ``mode`` names; False when the mode is honest."""
    size = node.behaviour.hostile_bytes
    answers = {
        "endless": (200, "application/octet-stream", lambda: _endless(b"", size)),
        "endless-json": (200, "application/json", lambda: _endless(b'{"id": "', size)),
        "endless-error": (500, "application/json", lambda: _endless(b'{"detail": "', size)),
        "endless-line": (200, "text/event-stream", lambda: _endless(b"event: result\ndata: ", size)),
        "tiny-objects": (200, "text/event-stream", lambda: _tiny_objects(b"event: result\ndata: ", 6 * MiB)),
        "hold": (200, "text/event-stream", _held),
    }
    if mode not in answers:
        return False
    status, content_type, parts = answers[mode]
    if kind == "capacity":
        content_type = "application/json"
    node.record(kind, _chunked(handler, status, content_type, parts()))
    return True


def _answer(handler: BaseHTTPRequestHandler, node: FakeNode, method: str, path: str, headers: dict[str, str]) -> None:
    mode = node.behaviour
    if path == "/v1/capacity":
        if not _hostile(handler, node, "capacity", mode.capacity):
            _json(handler, 200, node.capacity())
    elif method == "POST" and path == "/v1/sessions":
        _json(handler, 201, {"id": node.mint(secrets.token_hex(16), headers), "status": "new", "idle_s": 0,
                             "cells": 0})
    elif method == "POST" and (match := _EXECUTE.match(path)):
        if not _hostile(handler, node, "run", mode.run):
            _run(handler, node, match.group(1), headers)
    elif method == "GET" and (match := _SESSION.match(path)):
        if not _hostile(handler, node, "session", mode.session):
            _json(handler, 200, {"id": node.mint(match.group(1), headers), "status": "ready", "idle_s": 0,
                                 "cells": 0})
    elif method == "GET" and "/files/" in path:
        if not _hostile(handler, node, "download", mode.download):
            _chunked(handler, 200, "application/octet-stream", [b"honest bytes"])
    elif path.startswith("/e2b/"):
        _e2b(handler, node, method, path)
    elif path.startswith("/v1/sessions/") and path.endswith("/brand-new-route"):
        _json(handler, 200, {"route": "brand-new", "method": method})
    else:
        _json(handler, 404, {"detail": "Not Found"})


def _run(handler: BaseHTTPRequestHandler, node: FakeNode, session: str | None, headers: dict[str, str]) -> None:
    execution = node.mint(secrets.token_hex(8), headers) if session is None else f"{node.mint(session, headers)}-0"
    result = {"execution_id": execution, "ok": True, "stdout": "honest\n", "stderr": "", "outputs": [],
              "files": [], "images": [], "node": node.name}
    events = [b'event: output\ndata: {"cell_index": 0, "output_type": "stream", "name": "stdout", '
              b'"text": "honest\\n"}\n\n', b"event: result\ndata: " + json.dumps(result).encode() + b"\n\n"]
    _chunked(handler, 200, "text/event-stream", events)


def _e2b(handler: BaseHTTPRequestHandler, node: FakeNode, method: str, path: str) -> None:
    """E2B's door: a create (the node's own id), and the data plane as ``behaviour.e2b`` says."""
    if method == "POST" and path in ("/e2b/v2/sandboxes", "/e2b/sandboxes") and node.behaviour.e2b == "id-flood":
        _json(handler, 201, [{"sandboxID": "a"}] * (8 * MiB // 20 - 1))  # just under the router's 8 MiB cap
    elif method == "POST" and path in ("/e2b/v2/sandboxes", "/e2b/sandboxes"):
        _json(handler, 201, {"templateID": "base", "sandboxID": secrets.token_hex(16), "clientID": "fake",
                             "envdVersion": "0.5.7", "envdAccessToken": "e" * 64, "trafficAccessToken": "t" * 64})
    elif method == "GET" and path == "/e2b/v2/sandboxes":  # list-flood: pages of tiny objects, always one more
        flood = node.behaviour.e2b == "list-flood"
        body = b"[" + b"{}," * (80 * 1024) + b"{}]" if flood else b"[]"
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("X-Next-Token", "more" if flood else "")
        handler.end_headers()
        handler.wfile.write(body)
        node.record("e2b-list", len(body))
    elif path.startswith("/e2b/sandbox/"):
        node.record("e2b", _chunked(handler, 200, *_e2b_answer(node.behaviour.e2b, node.behaviour.hostile_bytes)))
    else:
        _json(handler, 404, {"code": 404, "message": "Not Found"})


def _envelope(message: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


def _e2b_answer(mode: str, size: int) -> tuple[str, Any]:
    """(content type, parts) of an answer on E2B's data plane: a Connect stream or the interpreter's JSON lines."""
    stream = "application/connect+json"
    output = _envelope(b'{"event":{"data":{"stdout":"' + b"eA==" * 16384 + b'"}}}')  # 64 KiB of "x"
    if mode == "endless-envelopes":
        return stream, (output for _ in range(size // len(output)))
    if mode == "huge-envelope":  # declares 16 MiB (under a roomy total, over any message cap), then sends them
        return stream, (b"\0\x01\x00\x00\x00" if i == 0 else b"x" * MiB for i in range(17))
    if mode == "endless-lines":
        line = b'{"type": "stdout", "text": "' + b"x" * 65536 + b'", "timestamp": "2026-01-01T00:00:00Z"}\n'
        return "application/json", (line for _ in range(size // len(line)))
    if mode == "long-line":
        return "application/json", _endless(b'{"type": "stdout", "text": "', size)
    return stream, [_envelope(b'{"event":{"start":{"pid":1}}}'), _envelope(b'{"event":{"end":{"exited":true}}}'),
                    _envelope(b"{}", 2)]
