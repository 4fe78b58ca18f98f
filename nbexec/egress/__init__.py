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
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nbexec.names import host_rule, ip_address, normal_host

PORT = 3128  # where the forwarder listens inside the sandbox (its own loopback: nothing else uses it)
MOUNT = "/run/nbexec-egress"
SOCKET = "proxy.sock"
ENVIRONMENT = {name: f"http://127.0.0.1:{PORT}" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                               "https_proxy")}
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True)
class Rule:
    """One allowed_hosts entry: a name, ``*.domain``, or an address; the ports it opens (None: any)."""

    host: str
    ports: tuple[int, ...] | None

    @property
    def address(self) -> Address | None:
        return ip_address(self.host)

    def matches(self, host: str, port: int) -> bool:
        if self.ports is not None and port not in self.ports:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host


def parse_rule(text: str) -> Rule:
    """``name``, ``*.domain``, ``1.2.3.4`` or ``[::1]``, each optionally with ``:port`` or ``:*`` (the grammar is
    the config's: `nbexec.names.host_rule`)."""
    return Rule(*host_rule(text))


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
        normal = normal_host(host)
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
            address = ip_address(text.split("%", 1)[0])
            problem = "an unparseable address" if address is None else address_problem(address)
            if problem is not None:
                return [], (f"{normal} resolves to {text}, {problem}; such addresses are reached only when "
                            "allowed_hosts lists the address itself")
        return (list(addresses), None) if addresses else ([], f"{normal} has no address")
