"""The E2B door's sandboxes: each is a node session (its kernel, files, hibernation and snapshots) with what E2B
adds: an owner-visible metadata map, a wall-clock end (``endAt``, moved by set_timeout), a paused flag, and two
secrets of its own that the data plane takes instead of the API key (the envd and traffic access tokens).

The tokens are kept as sha256 digests and compared in constant time; the registry finds a sandbox for the data
plane by the id a request names and then by its token, so a token of sandbox A with the id of sandbox B is refused
as a wrong token would be. Thread-safe."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbexec.engine.session import Session

SANDBOX_PORT = 49983  # envd: processes and files
INTERPRETER_PORT = 49999  # the code interpreter: /execute and /contexts


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass
class Box:
    """One sandbox of the E2B door."""

    id: str
    owner: str
    session: Session
    template: str
    metadata: dict[str, str]
    envs: dict[str, str]
    end: float  # time.time() at which it is killed (or paused, with ``on_timeout`` "pause")
    lifetime: float = 300.0  # seconds it is given again when it resumes
    started: float = field(default_factory=time.time)
    on_timeout: str = "kill"
    auto_resume: bool = False
    paused: bool = False
    internet: bool = False
    tokens: dict[str, str] = field(default_factory=dict, repr=False)  # given once, at create and connect
    digests: tuple[bytes, bytes] = field(default=(b"", b""), repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one lifecycle change at a time
    extra: dict[str, Any] = field(default_factory=dict)  # per-sandbox helpers of other modules (the supervisor)
    streams: int = 0  # open process and watch streams (each holds a host thread): capped per sandbox

    def resumed(self) -> None:
        """Awake again: its lifetime starts over (as E2B's does), so the sweeper does not pause it at once."""
        self.paused = False
        self.end = max(self.end, time.time() + self.lifetime)

    def __post_init__(self) -> None:
        envd, traffic = secrets.token_hex(32), secrets.token_hex(32)
        self.tokens = {"envdAccessToken": envd, "trafficAccessToken": traffic}
        self.digests = (_digest(envd), _digest(traffic))

    def close_extra(self, key: str) -> None:
        """Close the helper another module keeps for this sandbox under ``key`` (its contexts end on a pause)."""
        found = self.extra.pop(key, None)
        if found is not None:
            found.close()

    def abandon_extra(self, key: str) -> None:
        """Tell the helper under ``key`` that its sandbox ends, without waiting: what it starts gives up at once, so
        a kill or pause is never queued behind it on the owner's I/O threads."""
        found = self.extra.get(key)
        if found is not None:
            found.abandon()

    def accepts(self, token: str | None) -> bool:
        """Whether ``token`` is one of this sandbox's own two (constant time over both)."""
        if not token:
            return False
        given = _digest(token)
        found = hmac.compare_digest(given, self.digests[0])
        found |= hmac.compare_digest(given, self.digests[1])
        return found

    @property
    def state(self) -> str:
        return "paused" if self.paused else "running"


class Boxes:
    """The door's sandboxes by id (see the module docstring)."""

    def __init__(self) -> None:
        self._boxes: dict[str, Box] = {}
        self._lock = threading.Lock()

    def add(self, box: Box) -> None:
        with self._lock:
            self._boxes[box.id] = box

    def get(self, who: str, sandbox_id: str) -> Box | None:
        """``who``'s sandbox ``sandbox_id``; None for anyone else's, as for an id that does not exist."""
        with self._lock:
            box = self._boxes.get(sandbox_id)
        return box if box is not None and box.owner == who and box.session.status != "closed" else None

    def by_token(self, sandbox_id: str, token: str | None) -> Box | None:
        """The sandbox a data-plane request names, when its token is that sandbox's own; None otherwise."""
        with self._lock:
            box = self._boxes.get(sandbox_id)
        if box is None or not box.accepts(token) or box.session.status == "closed":
            return None
        return box

    def owned(self, who: str) -> list[Box]:
        with self._lock:
            found = [box for box in self._boxes.values() if box.owner == who]
        return [box for box in found if box.session.status != "closed"]

    def pop(self, sandbox_id: str) -> Box | None:
        with self._lock:
            return self._boxes.pop(sandbox_id, None)

    def due(self, now: float | None = None) -> list[Box]:
        """The sandboxes whose end has come (and those whose session is gone: closed elsewhere)."""
        now = time.time() if now is None else now
        with self._lock:
            return [box for box in self._boxes.values()
                    if (box.end <= now and not (box.paused and box.on_timeout == "pause"))
                    or box.session.status == "closed"]

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._boxes)

    def all(self) -> list[Box]:
        with self._lock:
            return list(self._boxes.values())


Kill = Callable[[Box], None]
