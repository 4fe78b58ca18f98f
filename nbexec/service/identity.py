"""Who a call through a router is for, and the ids a router's clients hold. Pure (hashlib and hmac only).

A router calls a node with the node token (its bearer token) and signs, with a key derived from that token, whom
the call is for and the router's name for the node::

    X-Nbexec-For: <client>;<node>;<unix seconds>;<nonce: 32 hex digits>;<signature: 64 hex digits>
    signature = HMAC-SHA256(SHA256("nbexec-node-requests\\0" + token),
                            "\\n".join(["nbexec-for/1", method, target, client, node, seconds, nonce]))

``target`` is the path and query exactly as sent (percent-encoded). A node accepts the header within ``WINDOW``
seconds of its own clock, each nonce once, and then keeps that client's sessions, results and caps apart from
every other client's (and from calls without the header). So even a router tricked into asking for client A's
session on client B's behalf gets a 404, and a path rewritten on the way no longer matches its signature.

A session or result id a router's client holds is ``<node>.<instance>.<node's id>.<24 hex digits>``: the HMAC
(keyed from the node token) binds it to the client, the router's name for the node and that node's life. The node
renders these ids itself for the client and name a call was signed for (see ``View``), so the router relays a
node's answers byte for byte and never parses them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

FOR_HEADER = "x-nbexec-for"
WINDOW = 60.0  # seconds a signed call stays acceptable (clock skew between router and node included)
MAX_HEADER = 512  # bytes of the header; anything longer is refused unread
NONCES = 200_000  # nonces remembered at most (those older than twice the window are forgotten first)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # a node's name, as the operator gives it
_CLIENT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_STAMP = re.compile(r"[0-9]{1,12}")
_HEX = re.compile(r"[0-9a-f]{1,64}")


class SignatureError(ValueError):
    """A signed header that is malformed, stale, replayed or does not verify."""


def _request_key(token: bytes) -> bytes:
    return hashlib.sha256(b"nbexec-node-requests\0" + token).digest()


def id_key(token: bytes) -> bytes:
    """The key of router ids, from the node token."""
    return hashlib.sha256(b"nbexec-router-ids\0" + token).digest()


def _mac(key: bytes, method: str, target: str, client: str, node: str, stamp: str, nonce: str) -> str:
    message = "\n".join(["nbexec-for/1", method, target, client, node, stamp, nonce]).encode("latin-1")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(token: bytes, method: str, target: str, client: str, node: str) -> str:
    """The X-Nbexec-For value for one call (a fresh nonce each time)."""
    stamp, nonce = str(int(time.time())), secrets.token_hex(16)
    return ";".join((client, node, stamp, nonce, _mac(_request_key(token), method, target, client, node, stamp,
                                                      nonce)))


@dataclass(frozen=True)
class For:
    """Whom a node's caller said a call is for: the client, the router's name for this node, the ids' key."""

    client: str
    node: str
    key: bytes = field(repr=False)


class Verifier:
    """Checks X-Nbexec-For headers and remembers their nonces (replays are refused). Not thread-safe: one per
    event loop, as the gateway holds it."""

    def __init__(self, window: float = WINDOW, capacity: int = NONCES) -> None:
        self.window = window
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it was accepted

    def verify(self, token: bytes, method: str, target: str, header: bytes, now: float | None = None) -> For:
        """Whom the call is for; SignatureError saying why not."""
        now = time.time() if now is None else now
        if len(header) > MAX_HEADER:
            raise SignatureError(f"the header is over {MAX_HEADER} bytes")
        fields = header.decode("latin-1").split(";")
        if len(fields) != 5:
            raise SignatureError("the header needs five fields: client;node;time;nonce;signature")
        client, node, stamp, nonce, signature = fields
        for value, pattern, what in ((client, _CLIENT, "client"), (node, NAME, "node name"), (stamp, _STAMP, "time"),
                                     (nonce, _NONCE, "nonce"), (signature, _SIGNATURE, "signature")):
            if not pattern.fullmatch(value):
                raise SignatureError(f"the {what} is malformed")
        if abs(now - int(stamp)) > self.window:
            raise SignatureError("the call is stale or from the future (are the clocks of router and node set?)")
        expected = _mac(_request_key(token), method, target, client, node, stamp, nonce)
        if not hmac.compare_digest(signature, expected):
            raise SignatureError("the signature does not match the call")
        self._remember(nonce, now)
        return For(client, node, id_key(token))

    def _remember(self, nonce: str, now: float) -> None:
        horizon = now - 2 * self.window  # older nonces are stale anyway: forget them
        while self._seen and next(iter(self._seen.values())) < horizon:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise SignatureError("the call was replayed")
        if len(self._seen) >= self.capacity:
            raise SignatureError("too many signed calls at once; try again shortly")
        self._seen[nonce] = now


# -- ids ------------------------------------------------------------------------------------------------------

def _id_mac(key: bytes, who: str, node: str, instance: str, raw: str) -> str:
    return hmac.new(key, "\0".join((who, node, instance, raw)).encode(), hashlib.sha256).hexdigest()[:24]


def public_id(key: bytes, who: str, node: str, instance: str, raw: str) -> str:
    """The id ``who`` holds for the node's ``raw`` id."""
    return f"{node}.{instance}.{raw}.{_id_mac(key, who, node, instance, raw)}"


def parse_id(key: bytes, who: str, public: str) -> tuple[str, str, str] | None:
    """(node, instance, the node's id) of an id issued to ``who`` under ``key``; None for any other string."""
    parts = public.rsplit(".", 3)
    if len(parts) != 4 or not NAME.fullmatch(parts[0]) or not all(_HEX.fullmatch(p) for p in parts[1:]):
        return None
    node, instance, raw, signature = parts
    if not hmac.compare_digest(signature, _id_mac(key, who, node, instance, raw)):
        return None
    return node, instance, raw


@dataclass(frozen=True)
class View:
    """How a node shows its ids to the caller of one call: as they are, or as the ids the router's client holds."""

    signed: For | None
    instance: str

    def id(self, raw: str) -> str:
        if self.signed is None:
            return raw
        return public_id(self.signed.key, self.signed.client, self.signed.node, self.instance, raw)

    def outward(self, data: dict[str, Any], raw: str) -> dict[str, Any]:
        """A session description or result as this caller sees it: ``id`` and ``execution_id`` (which start with
        the node's id ``raw``) as the caller's, ``node`` as the router names this node."""
        if self.signed is None:
            return data
        for key in ("id", "execution_id"):
            value = data.get(key)
            if isinstance(value, str) and value.startswith(raw):
                data[key] = self.id(raw) + value[len(raw):]
        if "node" in data:
            data["node"] = self.signed.node
        return data
