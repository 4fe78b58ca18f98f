"""``network="allowlist"``: HTTP(S) to listed hosts from a sandbox that still has no network interface.

The sandbox keeps Docker's network "none" (only ``lo``). For each such sandbox nbexec runs a proxy on the host
(`nbexec.egress.proxy`) that listens on a Unix socket in the sandbox's private working folder, bind-mounted read-only at
/run/nbexec-egress. A small forwarder in the sandbox (a child of the kernel, started by a silent execution
before any code runs) listens on 127.0.0.1:3128 and carries each TCP connection to that socket unchanged;
HTTP_PROXY and HTTPS_PROXY name it, so urllib, requests, httpx, pip and curl use it. The forwarder decides
nothing: the code may stop it or talk to the socket itself. Everything is judged on the host, per connection:

- the name (and port) must match `allowed_hosts`: an exact name, or ``*.domain`` for names under it, with
  ``:port`` (default: 80 and 443; ``:*`` any port);
- the host resolves the name itself; every address it gets must be public: private, loopback, link-local
  (the cloud metadata address 169.254.169.254 among them), unique-local (fd00::/8), multicast and reserved
  addresses are refused, unless the entry names that address itself (``127.0.0.1:8080``);
- the proxy connects to the address it judged (no second lookup), so a redirect or a rebinding name meets
  the same judgement on its next CONNECT or request.

Each execution may open `max_connections` and move `max_egress` bytes; every connection, allowed or refused
(with the reason), is in ``result.connections``. A plain-http connection carries one request, framed exactly
(`nbexec.egress.request`); what the proxies hold is bounded per sandbox and per process, and tunnels keep a pace
(`nbexec.egress.budget`).

This module is pure (the rules; `resolve` is the one lookup); `proxy` is the part that touches the network.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nbexec.errors import ConfigError

PORT = 3128  # where the forwarder listens inside the sandbox (its own loopback: nothing else uses it)
MOUNT = "/run/nbexec-egress"
SOCKET = "proxy.sock"
ENVIRONMENT = {name: f"http://127.0.0.1:{PORT}" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                               "https_proxy")}
DEFAULT_PORTS = (80, 443)
MAX_OPEN = 16  # connections one sandbox holds through its proxy at once (max_open_connections)
IDLE_TIMEOUT = 60.0  # seconds a tunnel may move nothing (egress_idle_timeout); also the pace's window
MIN_RATE = 1024  # bytes per second a tunnel must average over each such window (egress_min_rate)
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True)
class Rule:
    """One allowed_hosts entry: a name, ``*.domain``, or an address; the ports it opens (None: any)."""

    host: str
    ports: tuple[int, ...] | None

    @property
    def address(self) -> Address | None:
        return _address(self.host)

    def matches(self, host: str, port: int) -> bool:
        if self.ports is not None and port not in self.ports:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host


def parse_rule(text: str) -> Rule:
    """``name``, ``*.domain``, ``1.2.3.4`` or ``[::1]``, each optionally with ``:port`` or ``:*``."""
    entry = text.strip().lower()
    host, port = entry, ""
    if entry.startswith("["):
        host, _, tail = entry[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ConfigError(f"allowed_hosts entry {text!r}: write an IPv6 address as [addr] or [addr]:port")
        port = tail[1:]
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    try:
        ports = DEFAULT_PORTS if port == "" else None if port == "*" else (int(port),)
    except ValueError:
        raise ConfigError(f"allowed_hosts entry {text!r}: the port must be a number or *") from None
    if ports and not all(0 < p < 65536 for p in ports):
        raise ConfigError(f"allowed_hosts entry {text!r}: the port is out of range")
    normal = normalise(host)
    if normal is None or (normal.startswith("*.") and _address(normal[2:]) is not None):
        raise ConfigError(f"allowed_hosts entry {text!r} is not a host name, *.domain, or an IP address")
    return Rule(normal, ports)


def normalise(host: str) -> str | None:
    """A host name lower-cased without its final dot, an address in its short form, or None when invalid."""
    host = host.strip().lower()
    address = _address(host)
    if address is not None:
        return str(address)
    host = host[:-1] if host.endswith(".") else host
    labels = host.split(".")
    wildcard = labels[0] == "*" and len(labels) > 2
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels[1 if wildcard else 0:]):
        return None
    return host


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def address_problem(address: Address) -> str | None:
    """Why the proxy does not connect to ``address`` unless it is listed by address (None: a public address)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        problem = address_problem(embedded) if embedded is not None else None
        if problem is not None:
            return f"{problem} (inside an IPv6 address)"
    checks = (("is_loopback", "a loopback address"), ("is_link_local", "a link-local address (cloud metadata)"),
              ("is_unspecified", "an unspecified address"), ("is_multicast", "a multicast address"),
              ("is_private", "a private address"), ("is_reserved", "a reserved address"),
              ("is_site_local", "a site-local address"))  # fec0::/10: deprecated, still routed inside some sites
    for attribute, reason in checks:
        if getattr(address, attribute, False):
            return reason
    return None if address.is_global else "not a public address"


def resolve(host: str, port: int) -> list[str]:
    """The host's own lookup of ``host`` (TCP addresses, in the resolver's order, each once)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in found))


class Allowlist:
    """The rules of `allowed_hosts` and the judgement of one destination."""

    def __init__(self, rules: Sequence[Rule], resolver: Resolver = resolve) -> None:
        self.rules = tuple(rules)
        self.resolver = resolver

    @classmethod
    def of(cls, entries: Sequence[str]) -> Allowlist:
        return cls([parse_rule(entry) for entry in entries])

    def match(self, host: str, port: int) -> Rule | None:
        return next((rule for rule in self.rules if rule.matches(host, port)), None)

    def judge(self, host: str, port: int) -> tuple[list[str], str | None]:
        """The addresses to connect to and None, or [] and why the destination is refused."""
        normal = normalise(host)
        if normal is None:
            return [], f"{host[:100]!r} is not a host name or an address"
        rule = self.match(normal, port)
        if rule is None:
            return [], f"{normal}:{port} is not on the allowlist (allowed_hosts)"
        if rule.address is not None:  # listed by address: the operator chose exactly this one
            return [normal], None
        try:
            addresses = self.resolver(normal, port)
        except OSError as exc:
            return [], f"{normal} does not resolve on the host ({exc.strerror or exc})"
        for text in addresses:
            address = _address(text.split("%", 1)[0])
            problem = "an unparseable address" if address is None else address_problem(address)
            if problem is not None:
                return [], (f"{normal} resolves to {text}, {problem}; such addresses are reached only when "
                            "allowed_hosts lists the address itself")
        return (list(addresses), None) if addresses else ([], f"{normal} has no address")
