"""The request a sandbox sends its egress proxy, judged before a byte goes on (pure: no I/O).

A head is one of the two proxy forms: ``CONNECT host:port`` (a tunnel) or an absolute ``http://`` URI. A
plain-http connection carries exactly one request. Its head is rebuilt for the upstream: the URL's own ``Host``,
no hop-by-hop header (nor any header ``Connection`` names), one framing header nbexec writes itself and
``Connection: close``. Its body is framed by what the head declares (`Length` or `Chunked`), and nothing the
sandbox sends after that body is passed on: a pipelined second request, whatever its ``Host``, never reaches an
upstream. ``CONNECT`` to port 80 is refused: a tunnel there would carry plain requests with any ``Host``, unread.
On any other port a tunnel carries TLS only (`TlsStart`): its first bytes must be a ClientHello, so a port that
speaks plain http (``host:8080``) meets a handshake, never a request the proxy did not judge. Heads that could be
read two ways are refused: a bare CR or LF, a control character in a header, ``Transfer-Encoding`` together with
``Content-Length``, a coding other than ``chunked``, two lengths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

MAX_LINE = 4096  # a chunk-size line or a trailer line
MAX_TRAILERS = 16 * 1024  # all the trailer lines of a chunked body (read, then dropped)
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"host",
        b"te", b"trailer", b"upgrade", b"content-length", b"transfer-encoding"}  # the last two: written anew
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # used with fullmatch, as every pattern here
_VALUE = re.compile(rb"[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*")  # CR and LF are refused before
_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;[\x20-\x7e\t]*)?")  # chunk-size [ chunk-ext ]
_DIGITS = re.compile(rb"[0-9]{1,18}")
_VERSIONS = (b"HTTP/1.0", b"HTTP/1.1")
PLAIN_PORTS = frozenset({80})  # plain http's port: no tunnel to it (a tunnel's requests are never read)
_TLS_START, _MAX_RECORD = 9, 16384 + 2048  # bytes judged of a tunnel's start; the longest TLS record
_MIN_HELLO = 38  # the shortest ClientHello body: version, random, and empty session id, suites and methods
_HELLO = re.compile(rb"(?:\x16(?:\x03[\x00-\x04]?)?)?")  # a prefix of a TLS handshake record's first bytes


class Body(Protocol):
    """What of the client's bytes after a head is the request's body, in the form the upstream gets."""

    done: bool  # the declared body has passed: whatever follows is never sent
    problem: str | None  # the body is malformed: stop here (nothing of it or after it is sent)

    def feed(self, data: bytes) -> bytes:
        """The part of ``data`` to send upstream (b"" once done or malformed)."""
        ...


class Length:
    """A body of ``Content-Length`` bytes."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.done = size == 0
        self.problem: str | None = None

    def feed(self, data: bytes) -> bytes:
        taken = data[:self.left]
        self.left -= len(taken)
        self.done = self.left == 0
        return taken


class Chunked:
    """A chunked body, re-framed: sizes written anew, data passed through, extensions and trailers dropped
    (RFC 9112 7.1 lets a recipient ignore both); the first malformed byte stops it."""

    def __init__(self) -> None:
        self.done = False
        self.problem: str | None = None
        self._state = "size"  # size, data, end (the CRLF after data), trailer
        self._line = bytearray()  # grows in place: a line dripped byte by byte costs linear time
        self._left = 0
        self._trailers = 0

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        at = 0
        while at < len(data) and not self.done and self.problem is None:
            if self._state == "data":
                piece = data[at:at + self._left]
                out.append(piece)
                at += len(piece)
                self._left -= len(piece)
                self._state = "data" if self._left else "end"
                continue
            newline = data.find(b"\n", at)
            stop = len(data) if newline < 0 else newline + 1
            self._line += data[at:stop]
            at = stop
            if len(self._line) > (2 if self._state == "end" else MAX_LINE):
                self.problem = "an overlong line in a chunked body"
            elif newline >= 0:
                line, self._line = bytes(self._line), bytearray()
                out.append(self._take(line))
        return b"" if self.problem else b"".join(out)

    def _take(self, line: bytes) -> bytes:
        """Handle one whole line (it ends with LF); what to send for it."""
        text = line[:-2]  # no LF in it: feed cuts lines at the first
        if not line.endswith(b"\r\n") or b"\r" in text:
            self.problem = "a bare CR or LF in a chunked body"
            return b""
        if self._state == "end":  # the line is CRLF: a longer one was refused as overlong (data past its size)
            self._state = "size"
            return b"\r\n"
        if self._state == "trailer":
            return self._trailer(text)
        found = _SIZE.fullmatch(text)
        if found is None:
            self.problem = "a chunk size that is not 1 to 16 hex digits"
            return b""
        self._left = int(found.group(1), 16)
        self._state = "data" if self._left else "trailer"
        return b"%x\r\n" % self._left if self._left else b""

    def _trailer(self, text: bytes) -> bytes:
        if not text:
            self.done = True
            return b"0\r\n\r\n"
        self._trailers += len(text)
        name, colon, value = text.partition(b":")
        if not colon or not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(value) or self._trailers > MAX_TRAILERS:
            self.problem = "a malformed trailer in a chunked body"
        return b""


class TlsStart:
    """A tunnel's bytes from the client: held until the first nine show a TLS record holding a ClientHello (type
    22, version 3.x, a length, handshake type 1 and a length that fits the record), then passed on as they come;
    anything else is refused whole. The hello's own fields are not parsed (SECURITY.md: allowlist TLS ports)."""

    done = False  # a tunnel has no end of its own

    def __init__(self) -> None:
        self.held = b""
        self.problem: str | None = None
        self.passed = False

    def feed(self, data: bytes) -> bytes:
        if self.problem is not None or self.passed:
            return b"" if self.problem is not None else data
        self.held += data
        start = self.held[:_TLS_START]
        record = int.from_bytes(start[3:5], "big")
        # The handshake's own length must fit its record: a line ending planted in the lengths (\r\n) is refused.
        if not _HELLO.fullmatch(start[:3]) or (len(start) == _TLS_START and (
                start[5] != 1 or not 0 < record <= _MAX_RECORD
                or not _MIN_HELLO <= int.from_bytes(start[6:9], "big") <= record - 4)):
            self.problem, self.held = "a tunnel carries TLS only: its first bytes were not a TLS ClientHello", b""
            return b""
        if len(start) < _TLS_START:
            return b""
        self.passed, held, self.held = True, self.held, b""
        return held


@dataclass(frozen=True)
class Request:
    """A judged head: where to, and for plain http the head to send and how its body is framed."""

    method: str
    host: str
    port: int
    forward: bytes | None = None  # the head for the upstream; None: a CONNECT tunnel
    length: int | None = 0  # the body's Content-Length, or None when it is chunked

    def body(self) -> Body:
        if self.forward is None:
            return TlsStart()
        return Chunked() if self.length is None else Length(self.length)


def parse(head: bytes) -> Request | str:
    """The request in ``head`` (without its final blank line), or why the proxy refuses it."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if not head or len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or parts[2] not in _VERSIONS:
        return "not an HTTP/1.x proxy request"
    if any(b"\r" in line or b"\n" in line for line in lines):  # a bare CR or LF would start a line upstream
        return "a bare CR or LF in the request head"
    method, target = parts[0].decode(), parts[1].decode("ascii", "replace")
    if method == "CONNECT":
        host, _, digits = target.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or not digits.isdigit() or not 0 < int(digits) < 65536:
            return "CONNECT needs host:port"
        if int(digits) in PLAIN_PORTS:
            return (f"CONNECT to port {int(digits)} is refused: it speaks plain http, which goes through this proxy "
                    "as http:// requests, each judged; a tunnel would carry any request unjudged")
        return Request(method, host, int(digits))
    return _absolute(method, target, parts[2], lines[1:])


def _absolute(method: str, target: str, version: bytes, lines: list[bytes]) -> Request | str:
    url = urlsplit(target)
    try:
        port = 80 if url.port is None else url.port  # an explicit :0 is refused, never taken for the default
    except ValueError:
        port = 0
    if url.scheme != "http" or not url.hostname or not 0 < port < 65536 or url.username or url.password:
        return "only CONNECT and http:// URLs without credentials go through this proxy"
    fields = _fields(lines)
    if fields is None:
        return "a header line that is not name: value (or one with a control character)"
    length = _framing([(name, value) for name, value, _ in fields], version)
    if isinstance(length, str):
        return length
    named = {token.strip() for name, value, _ in fields if name == b"connection" for token in value.split(b",")}
    kept = [line for name, _, line in fields if name not in _HOP and name not in named]
    if length is None:
        kept.append(b"Transfer-Encoding: chunked")
    elif any(name == b"content-length" for name, _, _ in fields):
        kept.append(b"Content-Length: %d" % length)
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    authority = url.netloc.rsplit("@", 1)[-1].encode()
    forward = b"\r\n".join([f"{method} {path} ".encode() + version, b"Host: " + authority, *kept,
                            b"Connection: close"]) + b"\r\n\r\n"
    return Request(method, url.hostname, port, forward, length)


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes, bytes]] | None:
    """(lower-case name, trimmed lower-case value, the line) of each header line; None if one is malformed."""
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(value):
            return None
        fields.append((name.lower(), value.strip(b" \t").lower(), line))
    return fields


def _framing(fields: list[tuple[bytes, bytes]], version: bytes) -> int | str | None:
    """The body's length (0: none), None for chunked, or why the framing is refused."""
    lengths = [value for name, value in fields if name == b"content-length"]
    codings = [value for name, value in fields if name == b"transfer-encoding"]
    if lengths and codings:
        return "Transfer-Encoding and Content-Length together (a request-smuggling pattern)"
    if codings:
        if len(codings) > 1 or codings[0] != b"chunked" or version != b"HTTP/1.1":
            return "only one Transfer-Encoding: chunked, in HTTP/1.1, is relayed"
        return None
    if len(lengths) > 1:
        return "more than one Content-Length"
    if lengths and not _DIGITS.fullmatch(lengths[0]):
        return "a Content-Length that is not a number of at most 18 digits"
    return int(lengths[0]) if lengths else 0
