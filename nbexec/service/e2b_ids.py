"""The E2B sandbox ids a router's clients hold, and the router's list page tokens. Pure (hashlib and hmac only).

An id is ``<node>-<instance>-<node's id>-<client tag>-<mac>``. It holds the router's name for the node, that
node's life, the node's own sandbox id, a tag of the client, and an HMAC over all four. The tag is an HMAC of the
client's token id, so the token id is not shown. Both HMACs are keyed from the node token. So replicas of a router,
and a restarted router, read each other's ids, and no router keeps a table. Ids are lower-case letters, digits and
``-`` (the node's name aside), because E2B's SDK puts them in paths, headers and host names.

The control plane knows its caller (``X-API-KEY``), so an id must carry that caller's tag there. The data plane
knows no caller, only the sandbox's access token, which the node judges. There the mac alone must hold, which
still refuses any id this router's key did not make.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from dataclasses import dataclass

_HEX = re.compile(r"[0-9a-f]{1,64}")
_NODE_ID = re.compile(r"[0-9a-z]{1,64}")  # a node's own sandbox id, as this router accepts it from a node
_TAG, _MAC = 12, 24  # hex digits
MAX_ID = 256  # characters of an id read at all
MAX_PAGE_TOKEN = 1024


@dataclass(frozen=True)
class Named:
    """What a router id names: the node (by the router's name), its life, its sandbox id, and the client tag."""

    node: str
    instance: str
    raw: str
    tag: str


def _digest(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def client_tag(key: bytes, who: str) -> str:
    """The client's tag in its ids (the router's token id of the client, not shown as it is)."""
    return _digest(key, "nbexec-e2b-client", who)[:_TAG]


def _mac(key: bytes, tag: str, node: str, instance: str, raw: str) -> str:
    return _digest(key, "nbexec-e2b-id", tag, node, instance, raw)[:_MAC]


def public(key: bytes, who: str, node: str, instance: str, raw: str) -> str:
    """The id ``who`` holds for sandbox ``raw`` of ``node`` in its life ``instance``.

    ValueError when the node gave an id or instance this router does not pass on: a node is not trusted."""
    if not _NODE_ID.fullmatch(raw) or not _HEX.fullmatch(instance):
        raise ValueError("the node gave a sandbox id or instance that is not plain lower-case letters and digits")
    tag = client_tag(key, who)
    return f"{node}-{instance}-{raw}-{tag}-{_mac(key, tag, node, instance, raw)}"


def parse(key: bytes, given: str, who: str | None) -> Named | None:
    """What ``given`` names when this router's key made it; None for any other string.

    The tag must be ``who``'s, unless ``who`` is None (the data plane)."""
    if len(given) > MAX_ID:
        return None
    parts = given.rsplit("-", 4)
    if len(parts) != 5:
        return None
    node, instance, raw, tag, mac = parts
    if not node or not _HEX.fullmatch(instance) or not _NODE_ID.fullmatch(raw) or len(tag) != _TAG \
            or len(mac) != _MAC:
        return None
    found = hmac.compare_digest(mac, _mac(key, tag, node, instance, raw))
    if who is not None:
        found &= hmac.compare_digest(tag, client_tag(key, who))
    return Named(node, instance, raw, tag) if found else None


# -- page tokens of the merged list --------------------------------------------------------------------------------

def page_token(key: bytes, who: str, position: tuple[str, str]) -> str:
    """An opaque token for the page after ``position`` (a listed sandbox's start time and id), bound to ``who``."""
    body = base64.urlsafe_b64encode(json.dumps(list(position)).encode()).decode().rstrip("=")
    return f"{body}.{_digest(key, 'nbexec-e2b-page', who, body)[:32]}"


def read_page(key: bytes, who: str, token: str) -> tuple[str, str]:
    """The position a page token of ``who`` holds; ValueError for a token this router did not give ``who``."""
    body, _, mac = token.rpartition(".")
    if not body or len(token) > MAX_PAGE_TOKEN or not hmac.compare_digest(
            mac.encode(), _digest(key, "nbexec-e2b-page", who, body)[:32].encode()):
        raise ValueError("nextToken is not one this router gave you")
    try:
        found = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, binascii.Error):
        raise ValueError("nextToken is not one this router gave you") from None
    if not (isinstance(found, list) and len(found) == 2 and all(isinstance(p, str) for p in found)):
        raise ValueError("nextToken is not one this router gave you")
    return found[0], found[1]
