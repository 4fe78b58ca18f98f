"""A hostile node on loopback for library clients: answers the node protocol of /v1/sandboxes (docs/scale-out.md)
the way a broken or malicious `nbexec serve` might, route by route.

Each answer is a function of the request (method, path after ``/v1/sandboxes/<id>``, query, body) returning a
``Reply``: status, headers, and a body given as an iterator of chunks, so a test can send bodies that never end,
frames that lie about their sizes, answers about another sandbox. Unset routes answer honestly enough for a run to
complete (an empty listing, no notes, no connections). The run stream's frames are written here byte by byte from
the protocol's description, not with nbexec's encoder, except where a test asks for nbexec's own.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

MiB = 1024 * 1024
SANDBOX = "5eed"  # the id the fake node gives its one sandbox


@dataclass
class Reply:
    status: int = 200
    body: Iterable[bytes] = ()
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = True


def json_reply(data: Any, status: int = 200) -> Reply:
    raw = json.dumps(data).encode()
    return Reply(status, [raw], {"Content-Type": "application/json", "Content-Length": str(len(raw))}, False)


def frame(kind: str, header: dict[str, Any], payload: bytes = b"") -> bytes:
    """One frame as the protocol describes it: ``<kind> <JSON header>\\n`` then ``length`` bytes."""
    return kind.encode() + b" " + json.dumps({**header, "length": header.get("length", len(payload))}).encode() \
        + b"\n" + payload


def stream_message(text: str, *, size: int | None = None, sandbox: str = SANDBOX) -> bytes:
    content = json.dumps({"name": "stdout", "text": text}).encode()
    return frame("M", {"type": "stream", "channel": "iopub", "id": "m", "parent": "p",
                       "size": len(content) if size is None else size, "complete": True, "content": len(content),
                       "buffers": []}, content)


def end(status: str = "ok", sandbox: str = SANDBOX, **fields: Any) -> bytes:
    body = json.dumps({"status": status, "execution_count": 1, "stop": "", "timing": {}, "reply": "ok",
                       "errors_read": 0, "errors_dropped": 0, "error": None, "exit_value": None, **fields}).encode()
    return frame("E", {"sandbox": sandbox}, body)


def begin(sandbox: str = SANDBOX) -> bytes:
    return frame("B", {"sandbox": sandbox})


def zeros(total: int) -> Iterator[bytes]:
    chunk = bytes(MiB)
    for _ in range(total // MiB):
        yield chunk


Answer = Callable[[str, str, dict[str, list[str]], bytes], Reply]


def honest(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> Reply | None:
    """What an honest node answers (enough for a run to complete); None for routes it does not know."""
    if rest == "/run":
        return Reply(200, [begin(), stream_message("hi\n"), end()], {"Content-Type": "application/x-nbexec-frames"})
    if rest == "/state":
        return json_reply({"sandbox": SANDBOX, "running": True, "exit_code": None, "oom_killed": False,
                           "kernel_lost": False})
    if rest == "/files" and method == "GET":
        return json_reply({"sandbox": SANDBOX, "files": [], "skipped_files": [], "notes": []})
    if rest == "/notes":
        return json_reply({"sandbox": SANDBOX, "data_notes": [], "stopped": False, "input_notes": [],
                           "input_links": []})
    if rest == "/connections":
        return json_reply({"sandbox": SANDBOX, "connections": [], "notes": []})
    if rest in ("/freeze", "/kill", "/interrupt", "") or rest.startswith("/files/"):
        return Reply(204, [], {"Content-Length": "0"}, False)
    return None


class SeamNode(http.server.ThreadingHTTPServer):
    """The fake node (see the module docstring). ``answers`` maps a route (the path after the sandbox's, "" for
    the sandbox itself, "/run", "/files/<name>" or "/files/*" for any, ...) to an Answer; ``seen`` records (method,
    path) of each call."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answers: dict[str, Answer] = {}
        self.seen: list[tuple[str, str]] = []
        self.sandbox_answer: dict[str, Any] = {"id": SANDBOX, "node": "hostile", "language_info": {}}
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> SeamNode:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SeamNode

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, reply: Reply) -> None:
        self.send_response(reply.status)
        for key, value in reply.headers.items():
            self.send_header(key, value)
        if reply.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with contextlib.suppress(OSError):
            for chunk in reply.body:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if reply.chunked else chunk)
            if reply.chunked:
                self.wfile.write(b"0\r\n\r\n")

    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        body = self._body()
        self.server.seen.append((method, parts.path))
        if parts.path == "/v1/capacity":
            return self._reply(json_reply({"node": "hostile", "instance": "i1", "sessions": 0, "pool_free": 9,
                                           "pool_size": 9, "running": 0}))
        if parts.path == "/v1/sandboxes" and method == "POST":
            return self._reply(json_reply(self.server.sandbox_answer, 201))
        prefix = f"/v1/sandboxes/{self.server.sandbox_answer['id']}"
        if not parts.path.startswith(prefix):
            return self._reply(json_reply({"detail": "no such sandbox"}, 404))
        rest = parts.path[len(prefix):]
        wildcard = "/".join(rest.split("/")[:2]) + "/*" if rest.count("/") >= 2 else None
        answer = self.server.answers.get(rest) or (self.server.answers.get(wildcard) if wildcard else None)
        reply = answer(method, rest, parse_qs(parts.query), body) if answer else honest(method, rest, {}, body)
        return self._reply(reply or json_reply({"detail": "no such route"}, 404))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if not size:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")
