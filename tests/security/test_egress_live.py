"""A live allowlist: a running sandbox's egress rules change (`Session.allow_hosts` / `deny_hosts`, the service's
POST /v1/sessions/{id}/egress, a node's /v1/sandboxes/{id}/egress), judged from outside: which loopback server a
request reaches, a tunnel already open that stops carrying bytes, the log of the next run, the answer another
client gets, and what stays unchanged after a refused change."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import socket
import ssl
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import egress
from nbexec.egress.proxy import Limits, Proxy
from nbexec.errors import ConfigError

from .. import cluster
from ..conftest import IMAGE, wait_until


@functools.cache
def _tls() -> ssl.SSLContext:
    """A server context with a self-signed certificate (a tunnel carries TLS only)."""
    folder = Path(tempfile.mkdtemp())
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return context


class KeepAlive:
    """A loopback HTTP/1.1 server that keeps connections open and records each path it is asked for; a
    connection that starts with a TLS handshake (a tunnel's) is served over TLS."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:  # the name socketserver calls
                if self.request.recv(1, socket.MSG_PEEK) == b"\x16":
                    self.request = _tls().wrap_socket(self.request, server_side=True)
                super().setup()

            def finish(self) -> None:  # the server closes the socket it accepted, not the TLS one made of it
                super().finish()
                self.request.close()

            def do_GET(self) -> None:  # the name http.server calls
                seen.append(self.path)
                body = f"hello {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # the base class's names
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.rule = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[KeepAlive]]:
    found = [KeepAlive(), KeepAlive(), KeepAlive()]
    yield found
    for server in found:
        server.close()


def _answer(sock: socket.socket) -> bytes:
    """One HTTP answer (head and a Content-Length body), or what came before the connection ended."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


# -- pure: the rules and the policy --------------------------------------------------------------------------------

@pytest.mark.parametrize(("outer", "inner", "covered"), [
    ("api.example.com", "api.example.com:443", True),
    ("api.example.com:443", "api.example.com", False),  # 80 and 443 reach past 443
    ("*.example.com", "a.b.example.com:80", True),
    ("*.example.com", "*.b.example.com", True),
    ("*.example.com", "example.com", False),
    ("*.example.com", "evilexample.com", False),
    ("api.example.com", "zpi.example.com", False),  # a name covers itself only, not the names ending like it
    ("*.example.com:*", "x.example.com:*", True),
    ("x.example.com:443", "x.example.com:*", False),
    ("127.0.0.1:*", "127.0.0.1:8080", True),
    ("127.0.0.1:8080", "127.0.0.2:8080", False),
    ("[::1]:*", "[::1]:9", True),
], ids=lambda value: str(value))
def test_what_a_rule_covers(outer: str, inner: str, covered: bool) -> None:
    assert egress.parse_rule(outer).covers(egress.parse_rule(inner)) is covered


@pytest.mark.parametrize(("network", "allow", "deny", "widen", "problem"), [
    (False, (), ("a.example",), False, "network='allowlist'"),
    (True, ("a.example",), (), True, "network='allowlist'"),
    ("allowlist", (), (), False, "at least one"),
    ("allowlist", ("",), (), False, "is not a host name"),
    ("allowlist", ("a.example:99999",), (), False, "out of range"),
    ("allowlist", (), ("a b.example",), False, "is not a host name"),
    ("allowlist", ("a.example:x",), (), False, "must be a number"),
    ("allowlist", (7,), (), False, "must be a string"),
    ("allowlist", ("evil.example",), (), False, "reach past"),
    ("allowlist", ("*.example.org",), (), False, "reach past"),  # a wildcard over the listed name
    ("allowlist", ("api.example.org:*",), (), False, "reach past"),  # more ports than listed
    ("allowlist", ("a.example",) * 300, (), True, "at most"),  # over MAX_RULES (256)
    ("allowlist", ("api.example.org:443", "x.example.net"), ("api.example.org",), False, None),
    ("allowlist", ("evil.example",), (), True, None),  # the operator let clients widen
], ids=lambda value: str(value)[:30])
def test_a_change_is_checked_whole_before_anything_changes(
        network: Any, allow: tuple[Any, ...], deny: tuple[str, ...], widen: bool, problem: str | None) -> None:
    first = ("api.example.org", "*.example.net")
    if problem is None:
        egress.check_change(network, first, allow, deny, widen=widen)
        return
    with pytest.raises(ConfigError, match=problem):
        egress.check_change(network, first, allow, deny, widen=widen)


def test_the_newest_matching_rule_decides_and_rules_stay_bounded() -> None:
    rules = egress.Allowlist.of(["*.example.com"])
    denied = rules.changed([], ["api.example.com"])
    assert denied.match("api.example.com", 443) is None and denied.match("www.example.com", 443) is not None
    again = denied.changed(["api.example.com:443"], [])
    assert again.match("api.example.com", 443) is not None and again.match("api.example.com", 80) is None
    same = again.changed(["api.example.com:443"], [])
    assert len(same.rules) == len(again.rules), "a rule given again moves, it is not copied"
    assert rules.match("api.example.com", 443) is not None, "a change makes new rules; the old ones are unchanged"
    with pytest.raises(ConfigError, match="at most"):
        rules.changed([f"h{i}.example.com" for i in range(egress.MAX_RULES)], [])


# -- the real proxy, loopback servers ----------------------------------------------------------------------------

@pytest.fixture
def gate(hosts: list[KeepAlive]) -> Iterator[tuple[Proxy, Path]]:
    folder = Path(tempfile.mkdtemp(prefix="nbx-", dir="/tmp"))  # short: a Unix socket's path has 107 bytes at most
    path = folder / "proxy.sock"
    started = Proxy.start(path, egress.Allowlist.of([hosts[0].rule, hosts[1].rule]),
                          Limits(max_bytes=1_000_000, max_connections=32))
    yield started, path
    started.close()
    path.unlink()
    folder.rmdir()


def _tunnel(path: Path, rule: str) -> tuple[socket.socket, bytes]:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(f"CONNECT {rule} HTTP/1.1\r\n\r\n".encode())
    answer = _answer(sock)
    return (ssl._create_unverified_context().wrap_socket(sock) if answer.startswith(b"HTTP/1.1 200") else sock,
            answer)


def test_an_open_tunnel_to_a_host_denied_is_closed(gate: tuple[Proxy, Path], hosts: list[KeepAlive]) -> None:
    proxy, path = gate
    denied, kept = hosts[0], hosts[1]
    one, opened = _tunnel(path, denied.rule)
    two, opened_too = _tunnel(path, kept.rule)
    assert opened.startswith(b"HTTP/1.1 200") and opened_too.startswith(b"HTTP/1.1 200")
    with one, two:
        for sock, name in ((one, "/first"), (two, "/kept-first")):
            sock.sendall(f"GET {name} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert _answer(sock).endswith(f"hello {name}".encode())
        before = len(denied.seen)
        proxy.change(proxy.allowlist.changed([], [denied.rule]), egress.describe_change([], [denied.rule]))
        with contextlib.suppress(OSError):  # a reset while sending is the tunnel closed too
            one.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer_or_reset(one) == b"", "the tunnel to a host no longer allowed still carried an answer"
        assert denied.seen[before:] == [], "a request reached a host after it was denied"
        two.sendall(b"GET /kept-second HTTP/1.1\r\nHost: x\r\n\r\n")  # a tunnel still allowed goes on
        assert _answer(two).endswith(b"hello /kept-second")
    shown, _ = proxy.take()
    change = [c for c in shown if c.method == "RULES"]
    assert len(change) == 1 and f"deny {denied.rule}" in (change[0].reason or "")
    closed = next(c for c in shown if c.method == "CONNECT" and c.port == denied.port)
    assert "the allowlist changed" in (closed.reason or "") and not closed.open


def test_a_new_request_is_judged_by_the_rules_of_the_moment(gate: tuple[Proxy, Path],
                                                            hosts: list[KeepAlive]) -> None:
    proxy, path = gate
    added = hosts[2]
    sock, refused = _tunnel(path, added.rule)
    sock.close()
    assert refused.startswith(b"HTTP/1.1 403")
    proxy.change(proxy.allowlist.changed([added.rule], []), egress.describe_change([added.rule], []))
    sock, opened = _tunnel(path, added.rule)
    with sock:
        assert opened.startswith(b"HTTP/1.1 200"), "a host added did not become reachable"
        sock.sendall(b"GET /added HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(sock).endswith(b"hello /added")
    proxy.change(proxy.allowlist.changed([], [added.rule]), egress.describe_change([], [added.rule]))
    sock, again = _tunnel(path, added.rule)
    sock.close()
    assert again.startswith(b"HTTP/1.1 403") and b"not on the allowlist" in again


def _answer_or_reset(sock: socket.socket) -> bytes:
    try:
        return _answer(sock)
    except OSError:
        return b""


def test_a_proxy_in_a_folder_with_a_long_name_serves(tmp_path: Path, hosts: list[KeepAlive]) -> None:
    """A long TMPDIR (a Unix socket's address holds 107 bytes): the proxy still binds, and serves."""
    folder = tmp_path / ("long-" * 30)
    folder.mkdir()
    started = Proxy.start(folder / "proxy.sock", egress.Allowlist.of([hosts[1].rule]),
                          Limits(max_bytes=100_000, max_connections=4))
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock, opened = _tunnel(Path(f"/proc/self/fd/{handle}/proxy.sock"), hosts[1].rule)
        sock.close()
        assert opened.startswith(b"HTTP/1.1 200")
        assert (folder / "proxy.sock").is_socket()
    finally:
        os.close(handle)
        started.close()


# -- the real sandbox: Session.allow_hosts / deny_hosts ------------------------------------------------------------

_SETUP = """
import http.client, socket, ssl
conn = http.client.HTTPConnection('127.0.0.1', 3128, timeout=10)
def get(port, path, again=True):
    try:
        conn.request('GET', f'http://127.0.0.1:{port}{path}')
        answer = conn.getresponse()
        return answer.status, answer.read()[-12:]
    except http.client.RemoteDisconnected:  # the proxy carries one request per connection: retry, as requests does
        conn.close()
        return get(port, path, False) if again else ('RemoteDisconnected', b'')
    except Exception as exc:
        return type(exc).__name__, b''
def ask(sock, request):
    try:
        sock.sendall(request)
        data = b''
        while b'hello' not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data[-9:]
    except OSError as exc:
        return type(exc).__name__
tunnel = socket.create_connection(('127.0.0.1', 3128), timeout=10)
print('open', tunnel.sendall(b'CONNECT 127.0.0.1:{a} HTTP/1.1\\r\\n\\r\\n') or tunnel.recv(1000)[:12])
tunnel = ssl._create_unverified_context().wrap_socket(tunnel)  # a tunnel carries TLS only
print('t1', ask(tunnel, b'GET /t1 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'))
print('k1', get({a}, '/k1'))
"""


def _get(port: int, path: str) -> str:
    return f"print({path!r}, get({port}, {'/' + path!r}))"


def test_a_running_session_changes_its_allowlist(hosts: list[KeepAlive], cleanup_ledger: None) -> None:
    first, second, outside = hosts
    reached = len(outside.seen)  # what earlier tests asked of it
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                                  allowed_hosts=(first.rule, second.rule))
    with nbexec.Session(config) as session:
        opened = session.run(_SETUP.replace("{a}", str(first.port)))
        assert opened.ok and "t1 b'hello /t1'" in opened.stdout and "k1 (200, b'hello /k1')" in opened.stdout, \
            opened.stdout
        seen = len(first.seen)
        session.deny_hosts(first.rule)
        denied = session.run("print('t2', ask(tunnel, b'GET /t2 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'))\n"
                             + _get(first.port, "k2") + "\n" + _get(first.port, "k2b") + "\n"
                             + _get(second.port, "b1"))
        assert denied.ok, denied.error
        assert any(f"t2 {end}" in denied.stdout for end in ("b''", "Connection", "Broken", "SSL")), \
            denied.stdout
        # The proxy carries one request per connection: the keep-alive's second request is not carried (the
        # client sees the connection closed), and its retry, on a new connection, meets the new rules.
        assert "k2 (403," in denied.stdout and "k2b (403," in denied.stdout, denied.stdout
        assert "b1 (200, b'hello /b1')" in denied.stdout, denied.stdout
        assert first.seen[seen:] == [], "a request reached a host after it was denied"
        rules = [c for c in denied.connections if c.method == "RULES"]
        assert len(rules) == 1 and f"deny {first.rule}" in (rules[0].reason or "")
        assert "the allowlist changed at 20" in (rules[0].reason or "")
        closed = [c for c in denied.connections if c.method == "CONNECT" and c.port == first.port]
        assert closed and "the allowlist changed" in (closed[0].reason or "")

        for bad in ((first.rule, "not a host!"), (first.rule, outside.rule), ("",), (f"{first.rule}:x",)):
            with pytest.raises(ConfigError):
                session.allow_hosts(*bad)  # none of them changes anything, the good entry included
        with pytest.raises(ConfigError, match="at least one"):
            session.allow_hosts()
        still = session.run(_get(first.port, "k3") + "\n" + _get(outside.port, "c1"))
        assert "k3 (403," in still.stdout and "c1 (403," in still.stdout, still.stdout
        assert first.seen[seen:] == [] and outside.seen[reached:] == [], "a refused change let a request through"
        assert [c for c in still.connections if c.method == "RULES"] == [], "a refused change was logged"

        session.allow_hosts(first.rule)  # back within the hosts it started with
        again = session.run(_get(first.port, "k4"))
        assert "k4 (200, b'hello /k4')" in again.stdout, again.stdout
        assert next(c.reason or "" for c in again.connections if c.method == "RULES").endswith(f"allow {first.rule}")


_LOOP = ("import time, urllib.request, urllib.error\n"
         "for attempt in range(50):\n"  # within the 64 connections of an execution (max_connections)
         "    try:\n"
         "        urllib.request.urlopen('http://127.0.0.1:{port}/loop', timeout=10).read()\n"
         "    except urllib.error.HTTPError as exc:\n"
         "        print('refused', exc.code, exc.headers['X-Nbexec-Refused'])\n"
         "        break\n"
         "    time.sleep(0.2)\n"
         "else:\n"
         "    print('never refused')\n")


def test_a_change_reaches_a_run_in_progress(hosts: list[KeepAlive], cleanup_ledger: None) -> None:
    """A deny made while a cell runs (from another thread, as the HTTP route does) does not wait for the run: the
    cell's next request is refused."""
    first, second, _ = hosts
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=120, network="allowlist",
                                  allowed_hosts=(first.rule, second.rule))
    code = _LOOP.format(port=first.port)
    results: list[nbexec.ExecutionResult] = []
    with nbexec.Session(config) as session:
        seen = len(first.seen)
        running = threading.Thread(target=lambda: results.append(session.run(code)))
        running.start()
        wait_until(lambda: len(first.seen) > seen, 60, "the run never reached the server")
        session.deny_hosts(first.rule)
        running.join(300)
    assert results, "the run did not end"
    assert f"refused 403 127.0.0.1:{first.port} is not on the allowlist" in results[0].stdout, results[0].stdout


def test_an_operator_may_let_a_session_widen(hosts: list[KeepAlive], cleanup_ledger: None) -> None:
    first, _, outside = hosts
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                                  allowed_hosts=(first.rule,), egress_widen=True)
    with nbexec.Session(config) as session:
        session.run(_SETUP.replace("{a}", str(first.port)))
        session.allow_hosts(outside.rule)
        widened = session.run(_get(outside.port, "c2"))
        assert "c2 (200, b'hello /c2')" in widened.stdout, widened.stdout
        assert "/c2" in outside.seen


def test_a_session_without_an_allowlist_refuses_a_change_and_starts_nothing() -> None:
    for network in (False, True):
        session = nbexec.Session(nbexec.SandboxConfig(image=IMAGE, network=network))
        with pytest.raises(ConfigError, match="network='allowlist'"):
            session.allow_hosts("api.example.com")
        with pytest.raises(ConfigError, match="network='allowlist'"):
            session.deny_hosts("api.example.com")
        assert session.status == "new", "a refused change started a sandbox"
        session.close()


# -- the service: POST /v1/sessions/{id}/egress, and a node's /v1/sandboxes/{id}/egress ----------------------------

@pytest.fixture(scope="module")
def egress_node(hosts: list[KeepAlive], docker_ready: None) -> Iterator[cluster.Server]:
    """One real node whose policy is network=allowlist to the first two loopback servers, with two client tokens."""
    with cluster.running_node("e", {
            "NBEXEC_NETWORK": "allowlist", "NBEXEC_ALLOWED_HOSTS": f"{hosts[0].rule},{hosts[1].rule}",
            "NBEXEC_POOL_SIZE": "0", "NBEXEC_API_TOKENS": f"{cluster.NODE_TOKEN},{cluster.OTHER_TOKEN}"},
            running=2, sessions=4) as server:
        yield server


def _fetch(port: int, path: str) -> str:
    return ("import urllib.request, urllib.error\ntry:\n"
            f"    print({path!r}, urllib.request.urlopen('http://127.0.0.1:{port}/{path}', timeout=10).status)\n"
            f"except urllib.error.HTTPError as exc:\n    print({path!r}, exc.code)\n")


def test_the_egress_route_changes_only_the_owners_session(egress_node: cluster.Server,
                                                         hosts: list[KeepAlive]) -> None:
    first, second, outside = hosts
    reached = len(outside.seen)  # what earlier tests asked of it
    with cluster.client(egress_node, cluster.NODE_TOKEN, timeout=120) as owner, \
            cluster.client(egress_node, cluster.OTHER_TOKEN) as other:
        made = owner.post("/v1/sessions")
        assert made.status_code == 201, made.text
        route = f"/v1/sessions/{made.json()['id']}"

        def run(code: str) -> dict[str, Any]:
            answer = owner.post(f"{route}/execute", json={"code": code})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        assert "s1 200" in run(_fetch(first.port, "s1"))["stdout"]
        for body in ({"deny": [first.rule]}, {"allow": [first.rule]}):  # another client: as if it did not exist
            refused = other.post(f"{route}/egress", json=body)
            assert refused.status_code == 404, refused.text
        for body, status in (({"deny": ["not a host!"]}, 400), ({"allow": [], "deny": []}, 400),
                             ({"allow": [outside.rule]}, 400), ({"allow": [first.rule, "*.evil.example"]}, 400),
                             ({"deny": [7]}, 422), ({"allow": "x"}, 422),
                             ({"deny": ["a.example"] * 300}, 422)):
            answer = owner.post(f"{route}/egress", json=body)
            assert answer.status_code == status, (body, answer.text)
        many = [f"h{i}.example.com" for i in range(200)]
        assert owner.post(f"{route}/egress", json={"deny": many}).status_code == 204
        more = owner.post(f"{route}/egress", json={"deny": [f"g{i}.example.com" for i in range(100)]})
        assert more.status_code == 400 and "at most 256" in more.text, more.text  # the rules stay bounded
        unchanged = run(_fetch(first.port, "s2") + _fetch(outside.port, "c1"))
        assert "s2 200" in unchanged["stdout"] and "c1 403" in unchanged["stdout"], unchanged["stdout"]
        assert outside.seen[reached:] == []
        logged = [c["reason"] for c in unchanged["connections"] if c["method"] == "RULES"]
        assert len(logged) == 1 and "deny h0.example.com:80" in logged[0], "only the change that was made is logged"
        assert len(logged[0]) <= 2000

        assert owner.post(f"{route}/egress", json={"deny": [first.rule]}).status_code == 204
        seen = len(first.seen)
        denied = run(_fetch(first.port, "s3") + _fetch(second.port, "s4"))
        assert "s3 403" in denied["stdout"] and "s4 200" in denied["stdout"], denied["stdout"]
        assert first.seen[seen:] == []
        rules = [c for c in denied["connections"] if c["method"] == "RULES"]
        assert len(rules) == 1 and f"deny {first.rule}" in rules[0]["reason"]
        assert owner.post("/v1/sessions/nope/egress", json={"deny": [first.rule]}).status_code == 404
        owner.delete(route)


def test_a_remote_session_changes_its_rules_on_the_node_within_the_nodes_policy(
        egress_node: cluster.Server, hosts: list[KeepAlive], monkeypatch: pytest.MonkeyPatch) -> None:
    from nbexec.sandbox.remote import source as remote

    first, second, outside = hosts
    reached = len(outside.seen)  # what earlier tests asked of it
    monkeypatch.setenv("NBEXEC_NODES", egress_node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    # The client's own config would let it widen; the node's policy (its allowlist, no egress_widen) holds.
    config = nbexec.SandboxConfig(image=IMAGE, source="remote", timeout=60, network="allowlist",
                                  allowed_hosts=(first.rule, second.rule, outside.rule), egress_widen=True)
    try:
        with nbexec.Session(config) as session:
            assert "r1 200" in session.run(_fetch(first.port, "r1")).stdout
            session.deny_hosts(first.rule)
            with pytest.raises(nbexec.NbexecError):
                session.allow_hosts(outside.rule)
            after = session.run(_fetch(first.port, "r2") + _fetch(second.port, "r3") + _fetch(outside.port, "r4"))
            assert "r2 403" in after.stdout and "r3 200" in after.stdout and "r4 403" in after.stdout, after.stdout
            assert [c.reason for c in after.connections if c.method == "RULES"] != []
            assert outside.seen[reached:] == [], "the node let a client widen past its policy"
            seen = len(second.seen)  # a change through the node while a run is in progress there
            results: list[nbexec.ExecutionResult] = []
            running = threading.Thread(target=lambda: results.append(session.run(_LOOP.format(port=second.port))))
            running.start()
            wait_until(lambda: len(second.seen) > seen, 60, "the remote run never reached the server")
            session.deny_hosts(second.rule)
            running.join(300)
            assert results and f"refused 403 127.0.0.1:{second.port} is not on" in results[0].stdout, results
    finally:
        remote.forget_all()
