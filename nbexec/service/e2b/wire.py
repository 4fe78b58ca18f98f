"""The E2B door's shapes, as pure functions: its error answers, times, bounded JSON bodies, the list query's
metadata filter and signed page tokens, and the checks on what a client may give a sandbox (metadata, envs).

Every answer under /e2b is ``{"code": <int>, "message": <text>}`` on error, never nbexec's ``{"detail"}``: E2B's
SDKs read ``message`` and map ``code`` to their exceptions (docs/design/e2b-server.md, 1.2)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote

MAX_JSON = 256 * 1024  # bytes of a control-plane body: these carry names, not data
MAX_METADATA = 64  # entries per sandbox
MAX_METADATA_BYTES = 16 * 1024  # keys and values together
MAX_ENVS = 128
MAX_ENV_BYTES = 64 * 1024
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
NOT_FOUND = "The sandbox was not found"  # the SDKs look for "was not found" on the data plane


class E2bError(Exception):
    """An answer in E2B's error shape. ``retry``: False sends ``Should-Retry: false`` (the SDKs retry 429 and 503
    on their own, with back-off: a cap that will not clear by itself must say so, or a create hangs for minutes)."""

    def __init__(self, status: int, message: str, *, retry: bool | None = None, after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry, self.after = status, message, retry, after

    def headers(self) -> dict[str, str]:
        found: dict[str, str] = {}
        if self.retry is not None:
            found["Should-Retry"] = "true" if self.retry else "false"
        if self.after is not None:
            found["Retry-After"] = str(self.after)
        return found

    def body(self) -> bytes:
        return json.dumps({"code": self.status, "message": self.message}).encode()


def rfc3339(seconds: float) -> str:
    """A wall-clock time as the SDKs parse it (UTC, with a Z)."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_json(raw: bytes, *, limit: int = MAX_JSON) -> dict[str, Any]:
    """A request body that must be one JSON object, sized before parsing (400 otherwise; an empty body is {})."""
    if len(raw) > limit:
        raise E2bError(413, f"the request body is over {limit} bytes")
    if not raw.strip():
        return {}
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError):
        raise E2bError(400, "the request body is not JSON") from None
    if not isinstance(found, dict):
        raise E2bError(400, "the request body must be a JSON object")
    return found


def strings(found: Any, what: str, *, count: int, size: int, names: re.Pattern[str] | None = None) -> dict[str, str]:
    """A client's map of strings (metadata, envVars), within ``count`` entries and ``size`` bytes; 400 otherwise."""
    if found is None:
        return {}
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise E2bError(400, f"{what} must be an object of strings")
    if len(found) > count:
        raise E2bError(400, f"{what} has {len(found)} entries; at most {count}")
    if sum(len(k.encode()) + len(v.encode()) for k, v in found.items()) > size:
        raise E2bError(400, f"{what} is over {size} bytes")
    bad = [k for k in found if "\x00" in k or "\x00" in found[k] or (names is not None and not names.fullmatch(k))]
    if bad:
        raise E2bError(400, f"{what} has a name it cannot take: {bad[0][:64]!r}")
    return dict(found)


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The list call's ``metadata`` parameter: a query string whose keys and values were each quoted once more by
    the SDK (so: split as a query string, then unquote each)."""
    if not raw:
        return {}
    if len(raw) > MAX_METADATA_BYTES * 3:
        raise E2bError(400, "the metadata filter is too long")
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, max_num_fields=MAX_METADATA)
    except ValueError:
        raise E2bError(400, f"the metadata filter has more than {MAX_METADATA} fields") from None
    return {unquote(key): unquote(value) for key, value in pairs}


def states(raw: str | None) -> frozenset[str]:
    """The list call's ``state`` filter (comma-joined); both states when absent."""
    if not raw:
        return frozenset({"running", "paused"})
    asked = frozenset(part.strip() for part in raw.split(",") if part.strip())
    if not asked <= {"running", "paused"}:
        raise E2bError(400, "state must be running, paused or both")
    return asked


class Pages:
    """Opaque page tokens bound to their owner: a token made for one owner is refused for another (400)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)  # per process: a token does not outlive the server that made it

    def _mac(self, owner: str, position: str) -> str:
        return hmac.new(self._key, f"{owner}\n{position}".encode(), hashlib.sha256).hexdigest()[:32]

    def make(self, owner: str, position: str) -> str:
        return f"{position}.{self._mac(owner, position)}"

    def read(self, owner: str, token: str | None) -> str | None:
        if not token:
            return None
        position, _, mac = token.rpartition(".")
        if not position or len(token) > 256 or not hmac.compare_digest(mac, self._mac(owner, position)):
            raise E2bError(400, "nextToken is not one this server gave you")
        return position


def digits(raw: str | None, most: int) -> bool:
    """Whether ``raw`` is 1 to ``most`` ASCII digits (str.isdigit() takes "²", which int() refuses)."""
    return raw is not None and re.fullmatch(f"[0-9]{{1,{most}}}", raw) is not None


def limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return 100
    if not digits(raw, 3) or not 1 <= int(raw) <= 100:
        raise E2bError(400, "limit must be between 1 and 100")
    return int(raw)


def matches(metadata: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(metadata.get(key) == value for key, value in wanted.items())
