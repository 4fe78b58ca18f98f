"""``network="allowlist"``: HTTP(S) to listed hosts from a sandbox that still has no network interface.

The sandbox keeps Docker's network "none" (only ``lo``). For each such sandbox nbexec runs a proxy on the host
(`nbexec.egress.proxy`). It listens on a Unix socket in the sandbox's private working folder, bind-mounted
read-only at /run/nbexec-egress. A small forwarder in the sandbox listens on 127.0.0.1:3128 and carries each TCP
connection to that socket unchanged. It is a child of the kernel, started by a silent execution before any code
runs. HTTP_PROXY and HTTPS_PROXY name it, so urllib, requests, httpx, pip and curl use it. The forwarder decides
nothing: the code may stop it or talk to the socket itself. Everything is judged on the host, per connection:

- the name and port must match `allowed_hosts`: an exact name, or ``*.domain`` for names under it, with
  ``:port`` (default: 80 and 443; ``:*`` any port);
- the host resolves the name itself, and every address it gets must be public. Private, loopback, link-local
  (169.254.169.254 among them), unique-local, multicast and reserved addresses are refused, unless the entry
  names that address itself (``127.0.0.1:8080``);
- the proxy connects to the address it judged, with no second lookup. A redirect or a rebinding name meets the
  same judgement on its next CONNECT or request.

Each execution may open `max_connections` and move `max_egress` bytes. Every connection, allowed or refused (with
the reason), is in ``result.connections``. A plain-http connection carries one request, framed exactly
(`nbexec.egress.request`). What the proxies hold is bounded per sandbox and per process, and tunnels keep a pace
(`nbexec.egress.budget`).

A running sandbox's rules can change (`Session.allow_hosts` / `deny_hosts`, `Allowlist.changed`). Each change is
appended, and the newest rule that matches a destination decides; with none, it is refused. The rules the sandbox
started with bound what a change may allow (`widening`), unless the operator set ``egress_widen``. The proxy
judges each new connection by the rules of the moment, and closes open ones the new rules no longer allow.

This module is pure (the rules; `resolve` is the one lookup); `proxy` is the part that touches the network.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nbexec.errors import ConfigError
from nbexec.names import host_rule, ip_address, normal_host

PORT = 3128  # where the forwarder listens inside the sandbox (its own loopback: nothing else uses it)
MOUNT = "/run/nbexec-egress"
SOCKET = "proxy.sock"
ENVIRONMENT = {name: f"http://127.0.0.1:{PORT}" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                               "https_proxy")}
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]
MAX_RULES = 256  # rules one sandbox may hold, its first ones and every change together


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

    def covers(self, other: Rule) -> bool:
        """Whether every destination ``other`` matches is one this rule matches too."""
        if self.ports is not None and (other.ports is None or not set(other.ports) <= set(self.ports)):
            return False
        if self.host.startswith("*.") and self.address is None:
            return other.host.endswith(self.host[1:]) and other.address is None
        return other.host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:*" if self.ports is None else ",".join(f"{host}:{port}" for port in self.ports)


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


def widening(first: Sequence[str], allow: Sequence[str]) -> list[str]:
    """The entries of ``allow`` that reach past every rule of ``first`` (the rules a sandbox started with)."""
    rules = [parse_rule(entry) for entry in first]
    return [entry for entry in allow if not any(rule.covers(parse_rule(entry)) for rule in rules)]


class Allowlist:
    """The rules of `allowed_hosts`, then every change (the newest match decides), and the judgement of one
    destination."""

    def __init__(self, rules: Sequence[Rule], resolver: Resolver = resolve,
                 verdicts: Sequence[bool] | None = None) -> None:
        self.rules = tuple(rules)
        self.verdicts = tuple(verdicts) if verdicts is not None else (True,) * len(self.rules)
        if len(self.verdicts) != len(self.rules):  # a verdict paired with the wrong rule would decide for it
            raise ValueError(f"{len(self.rules)} rules and {len(self.verdicts)} verdicts do not pair up")
        self.resolver = resolver

    @classmethod
    def of(cls, entries: Sequence[str]) -> Allowlist:
        return cls([parse_rule(entry) for entry in entries])

    def changed(self, allow: Sequence[str], deny: Sequence[str]) -> Allowlist:
        """These rules with ``allow`` then ``deny`` appended; a rule given again moves to the end.

        ConfigError for a bad entry or past MAX_RULES, before anything changes."""
        added = [(parse_rule(entry), True) for entry in allow] + [(parse_rule(entry), False) for entry in deny]
        kept = [(rule, verdict) for rule, verdict in zip(self.rules, self.verdicts, strict=True)
                if all(rule != new for new, _ in added)]
        pairs = kept + list(dict(added).items())
        if len(pairs) > MAX_RULES:
            raise ConfigError(f"a sandbox holds at most {MAX_RULES} allowlist rules (its first ones and every change)")
        return Allowlist([rule for rule, _ in pairs], self.resolver, [verdict for _, verdict in pairs])

    def to_json(self) -> list[dict[str, object]]:
        """The rules and their verdicts, for `from_json` (what a sandbox keeps across a sleep or its owner's death)."""
        return [{"host": rule.host, "ports": None if rule.ports is None else list(rule.ports), "allow": verdict}
                for rule, verdict in zip(self.rules, self.verdicts, strict=True)]

    @classmethod
    def from_json(cls, data: object, first: Sequence[str], *, widen: bool) -> Allowlist:
        """The rules `to_json` wrote, each checked by the grammar again; ConfigError for anything else.

        Unless ``widen``, every allowing rule must fall within ``first``, the rules the sandbox started with."""
        if not isinstance(data, list) or len(data) > MAX_RULES:
            raise ConfigError(f"the kept allowlist is not a list of at most {MAX_RULES} rules")
        rules, verdicts = [], []
        for item in data:
            host, ports, verdict = (item.get(k) for k in ("host", "ports", "allow")) if isinstance(item, dict) \
                else (None, None, None)
            if not isinstance(host, str) or not isinstance(verdict, bool) or not (ports is None or (
                    isinstance(ports, list) and ports and all(type(p) is int for p in ports))):
                raise ConfigError("the kept allowlist holds a rule nbexec did not write")
            shown = f"[{host}]" if ":" in host else host
            texts = [f"{shown}:*"] if ports is None else [f"{shown}:{port}" for port in ports]
            parsed = [parse_rule(text) for text in texts]
            if verdict and not widen and widening(first, texts):
                raise ConfigError(f"the kept allowlist reaches past the hosts the sandbox started with ({host[:100]})")
            kept = None if ports is None else tuple(port for rule in parsed for port in rule.ports or ())
            rules.append(Rule(parsed[0].host, kept))
            verdicts.append(verdict)
        return cls(rules, verdicts=verdicts)

    def match(self, host: str, port: int) -> Rule | None:
        """The newest rule that matches, when it allows (None: no rule matches, or the newest denies)."""
        for rule, verdict in zip(reversed(self.rules), reversed(self.verdicts), strict=True):
            if rule.matches(host, port):
                return rule if verdict else None
        return None

    def allows(self, host: str, port: int) -> bool:
        """Whether the rules let ``host`` (as asked, normalised here) and ``port`` through, before any lookup."""
        normal = normal_host(host)
        return normal is not None and self.match(normal, port) is not None

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
            address = ip_address(text)  # an IPv6 zone (%eth0) is parsed with it; an IPv4 address has none
            problem = "an unparseable address" if address is None else address_problem(address)
            if problem is not None:
                return [], (f"{normal} resolves to {text}, {problem}; such addresses are reached only when "
                            "allowed_hosts lists the address itself")
        return (list(addresses), None) if addresses else ([], f"{normal} has no address")


def check_change(network: object, first: Sequence[str], allow: Sequence[str], deny: Sequence[str], *,
                 widen: bool) -> None:
    """Refuse (ConfigError) a change of a running sandbox's rules that may not be made, before anything changes.

    Refused: a sandbox without network="allowlist", no entry, a bad entry, too many entries. Unless ``widen``,
    so is an allowed entry that reaches past every rule the sandbox started with (``first``)."""
    if network != "allowlist":
        raise ConfigError("allow_hosts/deny_hosts change the rules of network='allowlist'; this sandbox has "
                          f"network={network!r}")
    if not allow and not deny:
        raise ConfigError("name at least one host to allow or deny")
    if len(allow) + len(deny) > MAX_RULES:
        raise ConfigError(f"at most {MAX_RULES} entries per change")
    for entry in (*allow, *deny):
        if not isinstance(entry, str):
            raise ConfigError(f"an allowlist entry must be a string, got {type(entry).__name__}")
        parse_rule(entry)
    wider = [] if widen else widening(first, allow)
    if wider:
        raise ConfigError(f"{', '.join(repr(e[:100]) for e in wider[:5])} reach past the hosts this sandbox started "
                          "with (allowed_hosts); a change may only narrow them unless the operator sets "
                          "egress_widen (NBEXEC_EGRESS_WIDEN=1)")


def describe_change(allow: Sequence[str], deny: Sequence[str]) -> str:
    """A change as the log shows it: ``allow a.example:443; deny b.example:80,b.example:443``."""
    parts = [f"{word} {', '.join(str(parse_rule(e)) for e in entries)}" for word, entries in
             (("allow", allow), ("deny", deny)) if entries]
    return "; ".join(parts)
