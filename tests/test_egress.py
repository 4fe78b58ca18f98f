"""network="allowlist": the rules (pure), the real host proxy against loopback servers, and the real sandbox
reaching an allowed loopback server while every other way out stays shut, judged from the host side."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbexec
from nbexec import egress
from nbexec.config import from_env
from nbexec.egress.proxy import Limits, Proxy
from nbexec.errors import ConfigError
from nbexec.files.folders import socket_address
from nbexec.sandbox.docker import daemon

from .conftest import IMAGE


class Server:
    """A loopback HTTP(S) server that records every request it gets (path and Host header)."""

    def __init__(self, tls: Path | None = None) -> None:
        self.seen: list[tuple[str, str]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the name http.server calls
                seen.append((self.path, self.headers.get("Host", "")))
                body = b"x" * 200_000 if self.path == "/big" else b"hello from the allowed server"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # the base class's names
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls / "cert.pem", tls / "key.pem")
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tls = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tls / "key.pem"),
                    "-out", str(tls / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    found = {"allowed": Server(), "refused": Server(), "tls": Server(tls)}
    yield found
    for server in found.values():
        server.close()


# -- pure: the rules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("entry", "host", "ports"), [
    ("api.example.com", "api.example.com", (80, 443)),
    ("API.Example.com.:8443", "api.example.com", (8443,)),
    ("*.example.com:*", "*.example.com", None),
    ("127.0.0.1:8080", "127.0.0.1", (8080,)),
    ("[::1]:9000", "::1", (9000,)),
])
def test_rules_parse(entry: str, host: str, ports: tuple[int, ...] | None) -> None:
    assert egress.parse_rule(entry) == egress.Rule(host, ports)


@pytest.mark.parametrize("entry", ["exa mple.com", "example.com:http", "example.com:70000", "*.1.2.3.4", "-x.com",
                                   "[::1]x", "[api.example.com]", "[1.2.3.4]:80", "[*.example.org]:443", "[]:80"])
def test_bad_rules_are_config_errors(entry: str) -> None:
    with pytest.raises(ConfigError):
        egress.parse_rule(entry)


def test_brackets_hold_an_ipv6_address_only() -> None:
    with pytest.raises(ConfigError, match="brackets hold an IPv6 address only"):
        egress.parse_rule("[api.example.com]:443")
    assert egress.parse_rule("[fe80::1%eth0]:80") == egress.Rule("fe80::1%eth0", (80,))


def test_a_rule_is_written_as_the_grammar_reads_it() -> None:
    assert egress.describe_change(["[::1]:8080", "a.example"], ["*.b.example:*"]) == (
        "allow [::1]:8080, a.example:80,a.example:443; deny *.b.example:*")
    for entry in ("[::1]:8080", "a.example", "*.b.example:*", "127.0.0.1:9", "[2001:db8::1]:*"):
        for part in str(egress.parse_rule(entry)).split(","):
            assert str(egress.parse_rule(part)) == part  # each part parses back to itself


@pytest.mark.parametrize(("address", "problem"), [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.1.1", "private"), ("172.17.0.1", "private"),
    ("169.254.169.254", "link-local"), ("fd00:ec2::254", "private"), ("::ffff:127.0.0.1", "loopback"),
    ("100.64.0.1", "not a public"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("::1", "loopback"),
    ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_addresses_that_are_not_public_are_refused(address: str, problem: str | None) -> None:
    import ipaddress

    found = egress.address_problem(ipaddress.ip_address(address))
    assert (found is None) if problem is None else (problem in (found or "")), found


def _resolver(table: dict[str, list[str]]) -> egress.Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]
    return resolve


@pytest.mark.parametrize(("host", "port", "verdict"), [
    ("api.example.com", 443, "93.184.216.34"),
    ("api.example.com", 22, "not on the allowlist"),
    ("files.example.org", 443, "93.184.216.35"),
    ("example.org", 443, "not on the allowlist"),  # *.domain is for names under it
    ("evil.example.org", 443, "resolves to 10.0.0.5, a private address"),
    ("meta.example.org", 80, "resolves to 169.254.169.254, a link-local"),
    ("gone.example.org", 443, "does not resolve"),
    ("127.0.0.1", 8080, "127.0.0.1"),
    ("127.0.0.1", 8081, "not on the allowlist"),
    ("169.254.169.254", 80, "not on the allowlist"),
    ("bad name", 80, "not a host name"),
])
def test_judgement(host: str, port: int, verdict: str) -> None:
    rules = egress.Allowlist([egress.parse_rule(e) for e in ("api.example.com", "*.example.org", "127.0.0.1:8080")],
                             _resolver({"api.example.com": ["93.184.216.34"], "files.example.org": ["93.184.216.35"],
                                        "evil.example.org": ["93.184.216.36", "10.0.0.5"],
                                        "meta.example.org": ["169.254.169.254"]}))
    addresses, reason = rules.judge(host, port)
    assert verdict in (reason or addresses[0]), (addresses, reason)


@pytest.mark.parametrize(("address", "verdict"), [
    ("fe80::1%eth0", "a link-local address (cloud metadata)"),  # the zone is read with its address
    ("::ffff:127.0.0.1%2", "a loopback address (inside an IPv6 address)"),
    ("8.8.8.8%x", "an unparseable address"),  # an IPv4 address has no zone: refused, not judged as 8.8.8.8
    ("8.8.8.8%x%y", "an unparseable address"),
    ("fe80::1%a%b", "an unparseable address"),  # two zones: no address, whatever its start says
    ("2606:4700::1111%a%b", "an unparseable address"),
    ("2001:4860:4860::8888%1", None),
])
def test_each_address_a_name_resolves_to_is_judged_whole(address: str, verdict: str | None) -> None:
    rules = egress.Allowlist.of(["api.example.com:443"])
    rules.resolver = _resolver({"api.example.com": ["93.184.216.34", address]})
    addresses, reason = rules.judge("api.example.com", 443)
    if verdict is None:
        assert (addresses, reason) == (["93.184.216.34", address], None)
    else:
        assert addresses == [] and reason == (f"api.example.com resolves to {address}, {verdict}; such addresses are "
                                              "reached only when allowed_hosts lists the address itself")


def test_a_change_allows_what_it_allows_and_keeps_the_resolver() -> None:
    table = {"a.example.com": ["93.184.216.34"], "b.example.org": ["93.184.216.35"]}
    first = egress.Allowlist([egress.parse_rule("*.example.com")], _resolver(table))
    changed = first.changed(["b.example.org:443"], ["a.example.com:443"])
    assert changed.judge("b.example.org", 443) == (["93.184.216.35"], None)
    assert changed.judge("a.example.com", 443) == ([], "a.example.com:443 is not on the allowlist (allowed_hosts)")
    assert changed.judge("a.example.com", 80) == (["93.184.216.34"], None)  # the deny named 443 only
    again = changed.changed(["a.example.com:443"], [])  # a rule given again moves to the end: the newest decides
    assert again.judge("a.example.com", 443) == (["93.184.216.34"], None)
    assert [str(rule) for rule in again.rules] == ["*.example.com:80,*.example.com:443", "b.example.org:443",
                                                   "a.example.com:443"]
    assert again.verdicts == (True, True, True)


def test_a_sandbox_holds_at_most_max_rules_rules() -> None:
    names = [f"h{i}.example:443" for i in range(egress.MAX_RULES + 1)]
    full = egress.Allowlist.of(names[:1]).changed(names[1:egress.MAX_RULES], [])
    assert len(full.rules) == egress.MAX_RULES  # exactly the cap: kept
    with pytest.raises(ConfigError) as refused:
        full.changed([names[-1]], [])
    assert str(refused.value) == (f"a sandbox holds at most {egress.MAX_RULES} allowlist rules (its first ones and "
                                  "every change)")
    kept = full.to_json()
    assert len(egress.Allowlist.from_json(kept, names, widen=False).rules) == egress.MAX_RULES
    with pytest.raises(ConfigError, match=f"not a list of at most {egress.MAX_RULES} rules"):
        egress.Allowlist.from_json([*kept, kept[0]], names, widen=True)


def test_kept_rules_of_every_kind_come_back_as_they_were() -> None:
    first = ["api.example.com", "*.example.org:*", "127.0.0.1:8080", "[::1]:9000"]
    rules = egress.Allowlist.of(first).changed(["x.example.org:443"], ["api.example.com:80"])
    again = egress.Allowlist.from_json(json.loads(json.dumps(rules.to_json())), first, widen=False)
    assert (again.rules, again.verdicts) == (rules.rules, rules.verdicts)


def test_a_kept_rule_past_the_first_ones_is_named_in_its_refusal() -> None:
    host = f"{'a' * 60}.{'b' * 60}.example"  # 129 characters: the refusal shows the first 100
    with pytest.raises(ConfigError) as refused:
        egress.Allowlist.from_json([{"host": host, "ports": [443], "allow": True}], ["other.example"], widen=False)
    assert str(refused.value) == f"the kept allowlist reaches past the hosts the sandbox started with ({host[:100]})"


def test_rules_and_verdicts_that_do_not_pair_up_are_refused_not_paired_wrongly() -> None:
    rules = [egress.parse_rule("a.example:443"), egress.parse_rule("b.example:443")]
    for verdicts in ([False], [True, False, True], []):
        with pytest.raises(ValueError, match=f"2 rules and {len(verdicts)} verdicts"):
            egress.Allowlist(rules, verdicts=verdicts)
    assert egress.Allowlist(rules).verdicts == (True, True)  # no verdicts: every rule allows


def test_allows_judges_the_name_as_asked_before_any_lookup() -> None:
    rules = egress.Allowlist.of(["api.example.com:443", "*.example.org"])
    assert rules.allows("API.Example.com.", 443) and rules.allows("x.example.org", 80)
    assert not rules.allows("api.example.com", 80) and not rules.allows("example.org", 80)
    assert not rules.allows("x.example.org", 1)  # a rule without a port means 80 and 443
    assert not rules.allows("bad name", 443) and not rules.allows("", 443)


def test_config_fields_and_variables() -> None:
    config = from_env({"NBEXEC_NETWORK": "allowlist", "NBEXEC_ALLOWED_HOSTS": "api.example.com, *.example.org:443",
                       "NBEXEC_MAX_EGRESS": "1m", "NBEXEC_MAX_CONNECTIONS": "5"})
    assert (config.network, config.allowed_hosts) == ("allowlist", ("api.example.com", "*.example.org:443"))
    paced = from_env({"NBEXEC_MAX_OPEN_CONNECTIONS": "4", "NBEXEC_EGRESS_IDLE_TIMEOUT": "2.5",
                      "NBEXEC_EGRESS_MIN_RATE": "10"})
    assert (paced.max_open_connections, paced.egress_idle_timeout, paced.egress_min_rate) == (4, 2.5, 10)
    for field, value in (("max_open_connections", 0), ("egress_idle_timeout", 0.0), ("egress_min_rate", 0)):
        with pytest.raises(ConfigError, match=field):
            nbexec.SandboxConfig(**{field: value})
    assert from_env({"NBEXEC_NETWORK": "1"}).network is True
    with pytest.raises(ConfigError, match="needs allowed_hosts"):
        nbexec.SandboxConfig(network="allowlist")
    with pytest.raises(ConfigError, match="network must be"):
        nbexec.SandboxConfig(network="everywhere")
    from nbexec.cli.main import build_config

    built = build_config({"allowed_hosts": ("127.0.0.1:8080",), "network": None})
    assert (built.network, built.allowed_hosts) == ("allowlist", ("127.0.0.1:8080",))


# -- the real proxy on the host, driven over its Unix socket -------------------------------------------------

def _ask(path: Path, request: bytes, then: bytes = b"") -> bytes:
    with _connect(path) as client:
        client.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = client.recv(65536)
            if not chunk:
                return answer
            answer += chunk
        if then:
            client.sendall(then)
        while chunk := client.recv(65536):
            answer += chunk
        return answer


def _ask_over_tls(path: Path, head: bytes, request: bytes) -> bytes:
    """CONNECT with ``head``, then ``request`` over TLS inside the tunnel: the proxy's answer and the server's."""
    with _connect(path) as client:
        client.sendall(head)
        answer = client.recv(65536)
        if not answer.startswith(b"HTTP/1.1 200"):
            return answer
        with ssl._create_unverified_context().wrap_socket(client) as tls:
            tls.sendall(request)
            while chunk := tls.recv(65536):
                answer += chunk
        return answer


@pytest.fixture
def proxy(tmp_path: Path, servers: dict[str, Server]) -> Iterator[tuple[Proxy, Path]]:
    path = tmp_path / "proxy.sock"
    rules = egress.Allowlist.of([f"127.0.0.1:{servers['allowed'].port}", f"localhost:{servers['refused'].port}",
                                 f"127.0.0.1:{servers['tls'].port}"])
    started = Proxy.start(path, rules, Limits(max_bytes=100_000, max_connections=4))
    yield started, path
    started.close()


def test_the_proxy_forwards_allowed_requests_and_logs_every_connection(
        proxy: tuple[Proxy, Path], servers: dict[str, Server]) -> None:
    gate, path = proxy
    allowed, refused = servers["allowed"].port, servers["refused"].port
    before = len(servers["refused"].seen)
    plain = _ask(path, f"GET http://127.0.0.1:{allowed}/plain HTTP/1.1\r\nHost: evil.example\r\n"
                       "Proxy-Authorization: x\r\n\r\n".encode())
    assert plain.startswith(b"HTTP/1.0 200") and plain.endswith(b"hello from the allowed server")
    assert ("/plain", f"127.0.0.1:{allowed}") in servers["allowed"].seen  # the URL's host, not the one claimed
    tls = servers["tls"].port
    tunnel = _ask_over_tls(path, f"CONNECT 127.0.0.1:{tls} HTTP/1.1\r\n\r\n".encode(), b"GET /tunnel HTTP/1.0\r\n\r\n")
    assert tunnel.startswith(b"HTTP/1.1 200 Connection established") and b"hello from" in tunnel
    by_name = _ask(path, f"CONNECT localhost:{refused} HTTP/1.1\r\n\r\n".encode())
    assert by_name.startswith(b"HTTP/1.1 403") and b"a loopback address" in by_name
    unlisted = _ask(path, f"GET http://127.0.0.1:{refused}/x HTTP/1.1\r\n\r\n".encode())
    assert unlisted.startswith(b"HTTP/1.1 403") and b"not on the allowlist" in unlisted
    assert len(servers["refused"].seen) == before, "a refused destination was reached"
    shown, notes = gate.take()
    assert [(c.method, c.port, c.allowed) for c in shown] == [
        ("GET", allowed, True), ("CONNECT", tls, True), ("CONNECT", refused, False), ("GET", refused, False)]
    assert shown[0].bytes_down > 0 and shown[1].bytes_up > len(b"GET /tunnel HTTP/1.0\r\n\r\n")
    assert "a loopback address" in (shown[2].reason or "") and notes == []
    assert gate.take() == ((), []), "take hands the log over once"


def test_the_proxy_caps_connections_and_bytes(proxy: tuple[Proxy, Path], servers: dict[str, Server]) -> None:
    gate, path = proxy
    allowed = servers["allowed"].port
    big = _ask(path, f"GET http://127.0.0.1:{allowed}/big HTTP/1.1\r\n\r\n".encode())
    assert len(big) < 110_000, "the byte cap did not stop the download"
    for _ in range(30):
        _ask(path, b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n")
    shown, notes = gate.take()
    assert "byte cap" in (shown[0].reason or "")
    assert sum(1 for c in shown if "connection cap" in (c.reason or "")) == len(shown) - 4
    assert len(shown) == 4 + 16 and any("11 more connections" in note for note in notes), notes
    assert not _ask(path, b"not http at all\r\n\r\n").startswith(b"HTTP/1.1 200")


@pytest.fixture
def silent_upstream() -> Iterator[int]:
    """A loopback server that answers one request and then holds its connection open, saying nothing (an HTTP
    keep-alive server): only the client's side can end such a connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                held.append(conn)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in held:
        conn.close()


def test_a_connection_the_sandbox_closed_is_logged_closed_at_once(tmp_path: Path, silent_upstream: int) -> None:
    """The log says what the code did: a connection it closed before its cell ended is not "open" (nor logged
    again with the next run), whether or not the far end has let go; one it still holds is open, and carried."""
    path = tmp_path / "proxy.sock"
    gate = Proxy.start(path, egress.Allowlist.of([f"127.0.0.1:{silent_upstream}"]),
                       Limits(max_bytes=100_000, max_connections=4))
    try:
        request = f"GET http://127.0.0.1:{silent_upstream}/x HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        closed = _connect(path)
        closed.sendall(request)
        assert _answer(closed).endswith(b"ok")
        closed.close()
        held = _connect(path)
        held.sendall(request)
        assert _answer(held).endswith(b"ok")
        shown, _ = gate.take()
        assert [c.open for c in shown] == [False, True], shown
        again, _ = gate.take()
        assert [c.open for c in again] == [True], "only the connection still held is logged again"
        held.close()
    finally:
        gate.close()


def _answer(client: socket.socket) -> bytes:
    """The silent upstream's whole answer, however the relay splits it (it never closes: read up to the body)."""
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        chunk = client.recv(65536)
        assert chunk, f"the connection ended after {answer!r}"
        answer += chunk
    return answer


def _connect(path: Path) -> socket.socket:
    """A client of the proxy's socket, reached by its folder: a nested TMPDIR outgrows a socket address's 107
    bytes (mutmut's copy of the suite runs inside the suite's own TMPDIR)."""
    client = socket.socket(socket.AF_UNIX)
    client.settimeout(10)
    with socket_address(path) as address:
        client.connect(address)
    return client


# -- the real sandbox ----------------------------------------------------------------------------------------

class Gateway:
    """TCP and UDP listeners on Docker's bridge gateway (an address of this machine), recording what arrives."""

    def __init__(self) -> None:
        network = daemon.connect().networks.get("bridge")
        self.host = network.attrs["IPAM"]["Config"][0].get("Gateway") or "172.17.0.1"
        self.tcp, self.udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.tcp.bind((self.host, 0))
        self.udp.bind((self.host, 0))
        self.tcp.listen(8)
        self.received: list[bytes] = []
        threading.Thread(target=self._tcp, daemon=True).start()
        threading.Thread(target=self._udp, daemon=True).start()

    def _tcp(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            self.received.append(b"tcp connection")
            conn.close()

    def _udp(self) -> None:
        while True:
            try:
                self.received.append(self.udp.recvfrom(4096)[0])
            except OSError:
                return

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


ESCAPES = """
import socket, urllib.request
def attempt(name, func):
    try:
        func()
        print(name, 'open')
    except Exception as exc:
        print(name, 'shut', type(exc).__name__)
attempt('tcp-gateway', lambda: socket.create_connection(('{gateway}', {tcp}), timeout=3).sendall(b'escaped'))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
attempt('udp-gateway', lambda: udp.sendto(b'escaped', ('{gateway}', {udp})))
attempt('dns', lambda: socket.getaddrinfo('example.com', 80))
attempt('direct-refused', lambda: socket.create_connection(('127.0.0.1', {refused}), timeout=3))
attempt('metadata', lambda: socket.create_connection(('169.254.169.254', 80), timeout=3))
attempt('proxy-metadata', lambda: urllib.request.urlopen('http://169.254.169.254/latest/meta-data/', timeout=5))
attempt('proxy-gateway', lambda: urllib.request.urlopen('http://{gateway}:{tcp}/', timeout=5))
attempt('proxy-other-host', lambda: urllib.request.urlopen('https://pypi.org/simple/', timeout=5))
attempt('replace-socket', lambda: __import__('os').unlink('/run/nbexec-egress/proxy.sock'))
print(sorted(name for _, name in socket.if_nameindex()))
"""


def test_the_sandbox_reaches_an_allowed_server_and_nothing_else(
        servers: dict[str, Server], cleanup_ledger: None) -> None:
    gateway = Gateway()
    try:
        allowed, refused, tls = servers["allowed"].port, servers["refused"].port, servers["tls"].port
        config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                                      allowed_hosts=(f"127.0.0.1:{allowed}", f"127.0.0.1:{tls}"))
        code = ("import ssl, urllib.request, urllib.error\n"
                f"print(urllib.request.urlopen('http://127.0.0.1:{allowed}/from-sandbox', timeout=10).read())\n"
                f"print(urllib.request.urlopen('https://127.0.0.1:{tls}/tls', timeout=10,\n"
                "      context=ssl._create_unverified_context()).read())\n"
                "try:\n"
                f"    urllib.request.urlopen('http://127.0.0.1:{refused}/never', timeout=10)\n"
                "except urllib.error.HTTPError as exc:\n"
                "    print('refused', exc.code, exc.headers['X-Nbexec-Refused'])\n"
                + ESCAPES.format(gateway=gateway.host, tcp=gateway.tcp.getsockname()[1],
                                 udp=gateway.udp.getsockname()[1], refused=refused))
        before = len(servers["refused"].seen)
        result = nbexec.execute_notebook(code, config=config)
        assert result.ok, result.error
        out = result.stdout
        assert "b'hello from the allowed server'\nb'hello from the allowed server'" in out
        assert f"refused 403 127.0.0.1:{refused} is not on the allowlist" in out
        assert " open" not in out and out.count(" shut ") == 9, out
        assert "['lo']" in out
        assert ("/from-sandbox", f"127.0.0.1:{allowed}") in servers["allowed"].seen
        assert servers["tls"].seen[-1][0] == "/tls"
        assert len(servers["refused"].seen) == before, "the refused server got a request"
        assert gateway.received == [], "something reached the host's bridge address"
        log = {(c.host, c.port): c for c in result.connections}
        assert log[("127.0.0.1", allowed)].allowed and log[("127.0.0.1", allowed)].bytes_down > 0
        assert log[("127.0.0.1", tls)].method == "CONNECT" and log[("127.0.0.1", tls)].bytes_up > 0
        for key in (("127.0.0.1", refused), ("169.254.169.254", 80), (gateway.host, gateway.tcp.getsockname()[1]),
                    ("pypi.org", 443)):
            assert not log[key].allowed and "not on the allowlist" in (log[key].reason or ""), key
        assert json.loads(result.to_json())["connections"][0]["host"] == "127.0.0.1"
    finally:
        gateway.close()


def test_a_session_logs_each_run_and_installs_stay_offline(
        servers: dict[str, Server], tmp_path: Path, cleanup_ledger: None) -> None:
    from .pyindex import Index

    index = Index(tmp_path / "index")
    try:
        index.add("nbexec-tiny", "1.0", "VALUE = 42\n")
        allowed = servers["allowed"].port
        config = nbexec.SandboxConfig(image=IMAGE, pool_size=1, warm_imports=(), timeout=60, network="allowlist",
                                      allowed_hosts=(f"127.0.0.1:{allowed}",), packages="any",
                                      package_index=index.url, package_cache=str(tmp_path / "cache"))
        fetch = f"import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:{allowed}/{{}}').read())"
        with nbexec.Session(config) as session:
            first = session.run("%pip install nbexec-tiny\nimport nbexec_tiny\n" + fetch.format("one"))
            second = session.run(fetch.format("two") + "\nprint(nbexec_tiny.VALUE)")
        assert first.ok and second.ok, (first.error, second.error)
        assert "42" in second.stdout and {p.name for p in first.packages} == {"nbexec-tiny"}
        assert [(c.host, c.allowed, c.open) for c in first.connections] == [("127.0.0.1", True, False)]
        assert len(second.connections) == 1, "a run's log holds only its own connections"
        assert [path for path, _ in servers["allowed"].seen][-2:] == ["/one", "/two"]
    finally:
        index.close()
