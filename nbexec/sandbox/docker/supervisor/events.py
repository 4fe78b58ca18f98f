"""What the host takes from a sandbox's process supervisor: its errors, typed events, bounded subscriptions, and
the checks on its answers (pure). Everything here treats the supervisor's words as hostile: checked for type and
size, and a subscriber's queue is bounded."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nbexec.errors import SandboxError

MAX_TEXT = 4096  # characters of one name, path or message taken from the supervisor
MAX_ARGV = 64 * 1024  # characters of one argument or variable taken from it
MAX_ARGV_BYTES = 64 * 1024  # argv, envs (each) and cwd bytes of one spawn
MAX_ENVS = 256  # variables of one spawn
MAX_CWD_BYTES = 4096
MAX_PTY_SIZE = 1000  # columns and rows of a pty
SUBSCRIBER_BYTES = 2 << 20  # output queued per subscriber; more is dropped and counted in `lost`
SUBSCRIBER_EVENTS = 4096  # events queued per subscriber; more output or watch events are dropped and counted


class SupervisorError(SandboxError):
    """A request to the supervisor was refused."""


class SupervisorLostError(SupervisorError):
    """The supervisor died, stopped answering or broke the protocol; it is closed."""


class NotFoundError(SupervisorError):
    """No such file or folder."""


class ProcessNotFoundError(NotFoundError):
    """No running process of that pid was started by the supervisor."""


class AlreadyExistsError(SupervisorError):
    """The path exists."""


class BadArgumentError(SupervisorError, ValueError):
    """A request the supervisor cannot do as asked."""


class IsDirectoryError(BadArgumentError):
    """A folder where a file was expected."""


class NotDirectoryError(BadArgumentError):
    """A file where a folder was expected."""


class PermissionDeniedError(SupervisorError):
    """The sandbox user may not do that (a read-only or foreign path)."""


class TooLargeError(SupervisorError):
    """Over a byte cap, or the sandbox's data filesystem is full."""


class LimitError(SupervisorError):
    """A count cap is reached (processes, open files, stdin waiting)."""


ERRORS: dict[str, type[SupervisorError]] = {
    "not_found": NotFoundError, "already_exists": AlreadyExistsError, "is_a_directory": IsDirectoryError,
    "not_a_directory": NotDirectoryError, "permission_denied": PermissionDeniedError, "too_large": TooLargeError,
    "no_space": TooLargeError, "resource_exhausted": LimitError, "invalid_argument": BadArgumentError}


@dataclass(frozen=True)
class Started:
    """The first event of every subscription."""

    pid: int


@dataclass(frozen=True)
class Output:
    """A chunk of the process's output, at most OUTPUT_CHUNK bytes."""

    stream: str  # stdout, stderr or pty
    data: bytes


@dataclass(frozen=True)
class End:
    """The process ended: ``exit_code`` -1 and ``exited`` False when a signal ended it; ``status`` as Go says it."""

    exit_code: int
    exited: bool
    status: str
    error: str | None


@dataclass(frozen=True)
class FsEvent:
    """A change in a watched folder: ``name`` relative to it, ``type`` create, write, remove, rename, chmod, or
    overflow (the sandbox's kernel dropped events)."""

    name: str
    type: str


Event = Started | Output | End | FsEvent


class Violation(Exception):
    """The supervisor sent what the protocol does not allow."""


def text(value: Any, *, optional: bool = False, limit: int = MAX_TEXT) -> Any:
    """``value`` if it is a string of at most ``limit`` characters (or None when ``optional``)."""
    if optional and value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise Violation(f"a text field of type {type(value).__name__}")
    return value


def number(value: Any, kind: type = int) -> Any:
    """``value`` if it is an int (or a float when ``kind`` is float), never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise Violation(f"a number field of type {type(value).__name__}")
    return value


def entry(raw: Any) -> dict[str, Any]:
    """A checked copy of one file entry the supervisor sent."""
    if not isinstance(raw, dict):
        raise Violation("an entry that is not an object")
    entry = {name: text(raw.get(name)) for name in ("name", "path", "permissions", "owner", "group")}
    if raw.get("type") not in ("file", "dir", "symlink", "other"):
        raise Violation("an entry of an unknown type")
    return {**entry, "type": raw["type"], "size": number(raw.get("size")), "mode": number(raw.get("mode")),
            "mtime": float(number(raw.get("mtime"), float)),
            "symlink_target": text(raw.get("symlink_target"), optional=True)}


class Subscription:
    """The events of one process from now on (`Started` first), or of one watched folder (``pid`` is then the
    watch's id); bounded, so a slow reader loses output or events."""

    def __init__(self, on_close: Callable[[Subscription], None], pid: int = 0) -> None:
        self.pid = pid
        self.lost = 0  # output bytes dropped because this subscriber was behind
        self._on_close = on_close
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()
        self._bytes = 0
        self._error: SupervisorError | None = None
        self._closed = False

    def push(self, event: Event) -> None:
        """Queue ``event`` (from the supervisor's reader). Output past SUBSCRIBER_BYTES or SUBSCRIBER_EVENTS is
        dropped and counted in ``lost`` (bytes), a watch event past SUBSCRIBER_EVENTS too (events); an end never."""
        with self._cond:
            if isinstance(event, (Output, FsEvent)):
                size = len(event.data) if isinstance(event, Output) else 0
                if self._bytes + size > SUBSCRIBER_BYTES or len(self._events) >= SUBSCRIBER_EVENTS:
                    self.lost += size or 1
                    return
                self._bytes += size
            self._events.append(event)
            self._cond.notify_all()

    def fail(self, error: SupervisorError) -> None:
        """End every wait, now and later, with ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def next(self, timeout: float) -> Event | None:
        """The next event, None when none came within ``timeout`` s or after `End`; SupervisorLostError if lost."""
        with self._cond:
            self._cond.wait_for(lambda: self._events or self._error or self._closed, timeout)
            if self._events:
                event = self._events.popleft()
                if isinstance(event, Output):
                    self._bytes -= len(event.data)
                return event
            if self._error is not None:
                raise self._error
            return None

    def close(self) -> None:
        """Stop receiving; the process runs on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._on_close(self)


class Demux:
    """Docker's stream of a non-tty exec: 8-byte headers (stream, 0, 0, 0, big-endian size) before each part."""

    def __init__(self) -> None:
        self._header = b""
        self._stream = 0
        self._left = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        """The (stream, bytes) parts in ``chunk``; a header's size is counted down, never allocated."""
        view = memoryview(chunk)
        while view:
            if not self._left:
                take = 8 - len(self._header)
                self._header, view = self._header + bytes(view[:take]), view[take:]
                if len(self._header) == 8:
                    self._stream, self._left = self._header[0], int.from_bytes(self._header[4:], "big")
                    self._header = b""
                    if self._stream not in (1, 2):
                        raise Violation(f"a Docker stream header for stream {self._stream}")
                continue
            part, view = view[:self._left], view[self._left:]
            self._left -= len(part)
            yield self._stream, bytes(part)




def process(raw: dict[str, Any]) -> dict[str, Any]:
    """A checked copy of one running process the supervisor listed."""
    args, envs = raw.get("args"), raw.get("envs")
    if not isinstance(args, list) or not isinstance(envs, dict):
        raise Violation("a process with malformed args or envs")
    return {"pid": number(raw["pid"]), "tag": text(raw.get("tag"), optional=True), "cmd": text(raw.get("cmd")),
            "args": [text(a, limit=MAX_ARGV) for a in args],
            "envs": {text(k, limit=MAX_ARGV): text(v, limit=MAX_ARGV) for k, v in envs.items()},
            "cwd": text(raw.get("cwd"))}


def check_size(size: tuple[int, int]) -> None:
    """Refuse a pty size out of bounds (BadArgumentError)."""
    if len(size) != 2 or not all(isinstance(n, int) and 0 < n <= MAX_PTY_SIZE for n in size):
        raise BadArgumentError(f"a pty size is two numbers from 1 to {MAX_PTY_SIZE}")


def check_spawn(argv: list[str], cwd: str | None, envs: dict[str, str], pty: tuple[int, int] | None,
                 tag: str | None) -> None:
    """Refuse a spawn request over its caps (BadArgumentError), before it reaches the sandbox."""
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise BadArgumentError("argv is a non-empty list of strings without NUL")
    if sum(len(a.encode()) + 1 for a in argv) > MAX_ARGV_BYTES:
        raise BadArgumentError(f"argv is over {MAX_ARGV_BYTES} bytes")
    if len(envs) > MAX_ENVS or sum(len(k.encode()) + len(v.encode()) + 2 for k, v in envs.items()) > MAX_ARGV_BYTES:
        raise BadArgumentError(f"envs are over {MAX_ENVS} variables or {MAX_ARGV_BYTES} bytes")
    if any(not k or "=" in k or "\0" in k + v for k, v in envs.items()):
        raise BadArgumentError("an environment variable's name is empty or holds '=', or it holds NUL")
    if cwd is not None and (len(cwd.encode()) > MAX_CWD_BYTES or "\0" in cwd):
        raise BadArgumentError(f"cwd is over {MAX_CWD_BYTES} bytes or holds NUL")
    if tag is not None and len(tag.encode()) > MAX_TEXT:
        raise BadArgumentError(f"tag is over {MAX_TEXT} bytes")
    if pty is not None:
        check_size(pty)
