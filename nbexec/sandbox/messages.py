"""The kernel's messages as nbexec keeps them: verified, sized, their content still raw bytes until asked for,
and the one JSON parser that turns hostile bytes into values (strict UTF-8, nesting capped). Pure: no I/O."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import itertools
import json
import operator
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbexec.errors import ProtocolError
from nbexec.notebook import verbatim

MAX_CONTROL = 1024 * 1024  # content of the messages nbexec reads whatever the budget (status, replies)
HEADER_CONTAINERS = 16  # brackets in a header, in strings too: an honest kernel's header has one
MAX_MEMBERS = 64  # of a display's data or metadata (kernels send a few); read one by one, more is refused
FREE_OBJECTS = 4096  # bytes of objects a kept message holds uncharged: an honest display's few dicts and strings
MAX_DEPTH = 64  # nesting of parsed content: deeper is refused (later encoders would recurse past the stack)
_HIGH, _LOW = "[89abAB][0-9a-fA-F]{2}", "[c-fC-F][0-9a-fA-F]{2}"  # a surrogate's escape after its \\ud
# A surrogate's escape not in a pair; both branches start with \u, so the search skips ahead in C.
_LONE = re.compile(rf"\\u[dD](?:{_HIGH}(?!\\u[dD]{_LOW})|(?<!\\u[dD]{_HIGH}\\u[dD]){_LOW})")
_NOT_QUOTE_OR_BRACKET = bytes(set(range(256)) - set(b'"[]{}'))
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'"[]{},'))
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_RUN = re.compile(rb"\[+|\]+")
_MANY = 4096  # containers in a parse past which its objects skip the young collections (see _collector_paused)
_PASSES = 8  # times the innermost bracket pairs are removed at most before the depth is summed


@dataclass(frozen=True)
class Message:
    """A verified message whose content is still raw bytes: ``size`` is what keeping it costs."""

    channel: str
    msg_type: str
    msg_id: str
    parent_id: str
    size: int  # bytes of the metadata, content and buffer frames, and of the headers past kernel.HEADER_ALLOWANCE
    raw_content: bytes | bytearray = field(repr=False)  # the received frame: not copied
    complete: bool = True  # False: past the frame limit, its content was read and dropped, never kept or checked
    buffers: tuple[bytes | bytearray | None, ...] = field(default=(), repr=False)  # binary frames (None: dropped)

    def held(self, room: int) -> int:
        """What keeping this message parsed costs the host: its size, and what its JSON takes parsed beyond its
        text (`objects`) past a small allowance; once past ``room``, a figure past it (the count stops there).
        Kept displays and widget state are charged this, not their bytes; the allowance is held at most once per
        output or model (`max_outputs` of each)."""
        return self.size + max(0, objects(self.raw_content, room + FREE_OBJECTS) - FREE_OBJECTS)

    def content(self, limit: int | None = None) -> dict[str, Any]:
        """The parsed content; ProtocolError when it is larger than ``limit`` or not a JSON object."""
        if not self.complete or (limit is not None and len(self.raw_content) > limit):
            raise ProtocolError(f"a {self.msg_type} message of {self.size:,} bytes is over its "
                                f"{limit or 0:,}-byte limit")
        content = parse(self.raw_content, self.msg_type)
        if not isinstance(content, dict):
            raise ProtocolError(f"the content of a {self.msg_type} message is not a JSON object")
        return content

    def bundle(self) -> dict[str, Any]:
        """The parsed content of a display (display_data, execute_result, update_display_data): as `content`,
        its ``data`` and ``metadata`` values each kept with its text when large (`verbatim`)."""
        content = parse(self.raw_content, self.msg_type, bundle=True)
        if not isinstance(content, dict):
            raise ProtocolError(f"the content of a {self.msg_type} message is not a JSON object")
        return content


def signature(key: bytes, parts: Sequence[bytes | bytearray]) -> bytes:
    """The hex HMAC-SHA256 of ``parts`` in order under ``key``: a Jupyter message's signature."""
    if sum(map(len, parts)) <= _JOINED:  # most: one call in C costs less than an HMAC object and its updates
        digest = hmac.digest(key, b"".join(parts), "sha256")
    else:  # a large message is hashed where it lies, never copied
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        digest = mac.digest()
    return digest.hex().encode("ascii")


_JOINED = 64 * 1024  # signed bytes a message may be joined by (past it: hashed in place)


def parse_header(frame: bytes | bytearray, what: str) -> dict[str, Any]:
    """A message's header or parent header: a JSON object. Read before any budget is known (what is past a
    small allowance is charged later), so it costs the host no more than content does: `parse` runs no Python
    code per value. A header is flat (strings and null): one with many containers is refused unparsed."""
    if frame.count(b"[") + frame.count(b"{") > HEADER_CONTAINERS:
        raise ProtocolError(f"a message's {what} holds more than {HEADER_CONTAINERS} brackets (a Jupyter header is a "
                            "flat object)")
    value = parse(frame, what)
    if not isinstance(value, dict):
        raise ProtocolError(f"a message's {what} is not a JSON object")
    return value


def parse(raw: bytes | bytearray | memoryview, what: str, *, bundle: bool = False) -> Any:
    """Strict UTF-8 JSON, nesting capped; lone surrogates (from \\ud800-style escapes) become U+FFFD. With
    ``bundle``, a large display's ``data`` and ``metadata`` values keep their text (`_bundle`).

    Every step runs in C, so a costly shape (a million empty lists, deep nesting, surrogates) costs the host
    about what plain text does: no Python code runs per value."""
    try:
        text = str(raw, "utf-8")
        if "\\ud" in text or "\\uD" in text:
            text = _lone_surrogates_replaced(text)
        containers = text.count("{") + text.count("[")
        load = _bundle if bundle and len(text) >= verbatim.LARGE else _loads
        if containers <= _FEW:  # too few to set off a collection: no pause to pay for
            value = load(text)
        else:
            with _collector_paused(containers > _MANY):
                value = load(text)
        del text  # the host's peak: the depth check's copies come after the text is gone
    except RecursionError as exc:
        raise ProtocolError(f"a {what} message is nested too deeply") from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"a {what} message is not valid UTF-8 JSON: {str(exc)[:200]}") from exc
    if containers > MAX_DEPTH and _too_deep(raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)):
        raise ProtocolError(f"a {what} message is nested more than {MAX_DEPTH} levels deep")
    return value


def _loads(text: str) -> Any:
    """json.loads without its wrappers: the C scanner straight on the text (a header's parse cost a third more
    through them). Text with whitespace around the value goes the long way; it is valid, and rare."""
    if not text or text[0] in _SPACE or text[-1] in _SPACE:
        return json.loads(text)
    try:
        value, end = _SCAN(text, 0)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _bundle(text: str) -> Any:
    """A display's content, its ``data`` and ``metadata`` members read one by one (at most MAX_MEMBERS each, the
    rest of the text in C) so each value's text is known: a large one is kept with it. Any other shape is
    parsed whole, as `_loads` does."""
    try:
        top = _members(text, 0)
        if top is not None:
            content, end = top
            if _skip(text, end) == len(text):
                return content
    except (ValueError, StopIteration):  # malformed: the whole parse says how
        pass
    return _loads(text)


def _members(text: str, at: int, depth: int = 0) -> tuple[dict[str, Any], int] | None:
    """The object at ``at`` and where it ends, its ``data`` and ``metadata`` (at depth 0) read member by member
    and their values kept with their text; None for anything else (more than MAX_MEMBERS members, not an object)."""
    at = _skip(text, at)
    if text[at:at + 1] != "{":
        return None
    members: dict[str, Any] = {}
    at, count = _skip(text, at + 1), 0
    if text[at:at + 1] == "}":
        return members, at + 1
    while count < MAX_MEMBERS and text[at:at + 1] == '"':
        key, at = _STRING(text, at + 1, True)
        if key in members:  # kernels never repeat one; each repeat would cost a parse kept nowhere
            raise ProtocolError(f"a display message repeats the key {key[:100]!r}")
        at = _skip(text, at)
        if text[at:at + 1] != ":":
            return None
        at = _skip(text, at + 1)
        if depth == 0 and key in ("data", "metadata"):
            inner = _members(text, at, 1)
            if inner is None:
                return None
            value, end = inner
        else:
            value, end = _SCAN(text, at)
            if depth == 1:
                value = verbatim.kept(value, text[at:end])
        members[key], count = value, count + 1
        at = _skip(text, end)
        if text[at:at + 1] == "}":
            return members, at + 1
        if text[at:at + 1] != ",":
            return None
        at = _skip(text, at + 1)
    return None


def _skip(text: str, at: int) -> int:
    return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]  # matches the empty string


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING: Any = json.decoder.scanstring  # type: ignore[attr-defined]  # C, not typed
_SCAN: Any = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set in __init__, not typed
_SPACE = " \t\n\r"


def _lone_surrogates_replaced(text: str) -> str:
    """The JSON text with each escape of a lone surrogate written as one of U+FFFD (escaped pairs are kept)."""
    if "\x00" in text:  # not JSON (a raw NUL): left for json.loads to refuse
        return text
    # Escaped backslashes out of the way (as NUL, never in JSON text), every backslash left starts an escape.
    return _LONE.sub(r"\\ufffd", text.replace("\\\\", "\x00")).replace("\x00", "\\\\")


@contextlib.contextmanager
def _collector_paused(many: bool) -> Iterator[None]:
    """Pause the cyclic garbage collector while a parse allocates; with ``many`` containers made, move them
    past the young generations. A parse makes no cycles, yet the collections its containers set off (each
    scanned as young, then again as older) cost more than the parse: 0.1-0.3 s per MiB of empty lists. Left
    alone when the process froze objects itself (unfreezing would undo that)."""
    global _pausing, _was_enabled
    with _pause_lock:  # counted: concurrent parses (threads) pause it once and the last one out restores it
        if _pausing == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausing += 1
    try:
        yield
    finally:
        with _pause_lock:
            if many and gc.get_freeze_count() == 0:
                gc.freeze()  # everything tracked goes to the permanent generation...
                gc.unfreeze()  # ...and back into the oldest, unscanned until its next full collection
            _pausing -= 1
            if _pausing == 0 and _was_enabled:
                gc.enable()


_FEW = 64  # containers a parse may make without pausing the collector (a young collection needs 700)
_pause_lock = threading.Lock()
_pausing = 0  # parses under way that paused the collector
_was_enabled = True  # whether it was on when the first of them began


def objects(data: bytes | bytearray, room: int | None = None) -> int:
    """Bytes parsing ``data`` (JSON) takes beyond its text, over-estimated in C: its strings widened to their
    widest character (a character past U+00FF makes every character of its string take 2 or 4 bytes), and each
    list 96 bytes, object 200, item (after a comma: its pointer and a number) 40, string 80. Charged by their
    bytes, lists nested 60 deep took 40 times their text (a run's display allowance held 1.5 GB of them). Counted
    a chunk at a time, at most a few MiB of objects made, and only until past ``room``: a message dropped for
    what it would hold costs a bounded scan."""
    if not data:
        return 0
    total = len(data) * (_width(data) - 1)
    for outside, quotes in _outside_strings(data, _NOT_STRUCTURE):
        total += 96 * outside.count(b"[") + 200 * outside.count(b"{") + 40 * outside.count(b",") + 40 * quotes
        if room is not None and total > room:
            break
    return total


def _width(data: bytes | bytearray) -> int:
    """Bytes a character of ``data``'s widest string takes parsed (1, 2 or 4): by its UTF-8 lead bytes and its
    escapes, in C. An escaped backslash before a ``u`` may count as an escape: charged more, never less."""
    escaped = b"\\u" in data
    if not escaped and data.isascii():  # most: one pass in C, a word at a time
        return 1
    if data.translate(None, _NOT_ASTRAL) or (escaped and _ASTRAL_ESCAPE.search(data)):
        return 4
    if data.translate(None, _NOT_WIDE) or (escaped and _WIDE_ESCAPE.search(data)):
        return 2
    return 1


_CHUNK = 64 * 1024  # bytes of structure split at a time: at most 64 Ki pieces made
_NOT_ASTRAL = bytes(set(range(256)) - set(range(0xF0, 0xF5)))  # all but the lead bytes of U+10000 and up
_NOT_WIDE = bytes(set(range(256)) - set(range(0xC4, 0xF0)))  # all but the lead bytes of U+0100 to U+FFFF
_ASTRAL_ESCAPE = re.compile(rb"\\u[dD][89abAB]")
_WIDE_ESCAPE = re.compile(rb"\\u(?!00)")


def flat(data: bytes | bytearray) -> bool:
    """Whether ``data`` is a JSON object whose members hold no list or object (a stream message's content, a
    header): judged on the bytes outside its strings, in C, before any parse; it stops at the first container."""
    seen = b""
    for outside, _ in _outside_strings(data, _NOT_QUOTE_OR_BRACKET):
        seen += outside
        if len(seen) > 2:
            return False
    return seen == b"{}"


def _outside_strings(data: bytes | bytearray, dropped: bytes) -> Iterator[tuple[bytes, int]]:
    """``data`` (JSON) without its strings and the bytes in ``dropped``, a chunk at a time, each with how many
    quotes it had: escaped backslashes, then escaped quotes, gone (C, one copy each, no object per match); then
    every other part between quotes is a string's. At most _CHUNK bytes are split at once: a chunk of quotes
    makes a piece each, so a whole message split at once took 0.5-0.9 GiB."""
    plain = (data.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in data else data).translate(None, dropped)
    inside = False  # whether the chunk starts in a string
    for start in range(0, len(plain), _CHUNK):
        pieces = plain[start:start + _CHUNK].split(b'"')
        yield b"".join(pieces[1::2] if inside else pieces[::2]), len(pieces) - 1
        inside ^= len(pieces) % 2 == 0


def _too_deep(data: bytes | bytearray) -> bool:
    """Whether valid JSON nests more than MAX_DEPTH levels, with no Python code per value: strings cut out and
    brackets kept; the innermost pairs removed a level at a time while that shrinks them fast (a wide value is
    soon gone); then the depth of what is left summed run by run (a deep value has long runs)."""
    brackets = b"".join(outside for outside, _ in _outside_strings(data, _NOT_QUOTE_OR_BRACKET))
    brackets, levels = brackets.translate(_AS_SQUARE), 0
    while brackets and levels < _PASSES:
        shorter = brackets.replace(b"[]", b"")
        brackets, levels, slow = shorter, levels + 1, len(shorter) * 8 > len(brackets) * 7
        if slow:
            break
    runs = map(len, _RUN.findall(brackets))
    return max(itertools.accumulate(map(operator.mul, runs, itertools.cycle((1, -1)))), default=0) \
        > MAX_DEPTH - levels


def exit_asked(reply: Message, limit: int) -> str | None:
    """What the cell passed to exit() or quit(), when it called one, as SystemExit would show it ("" for none),
    else None. ipykernel's exit() raises nothing: it puts an `ask_exit` payload in the execute reply (its
    `keepkernel` is the argument) for the frontend to act on. A reply nbexec cannot read asks for nothing."""
    if b"ask_exit" not in reply.raw_content:  # most replies: not parsed at all
        return None
    try:
        payloads = reply.content(limit).get("payload")
    except ProtocolError:
        return None
    asked = [p for p in payloads if isinstance(p, dict) and p.get("source") == "ask_exit"] \
        if isinstance(payloads, list) else []
    if not asked:
        return None
    value = asked[-1].get("keepkernel")
    return "" if value is None or value is False else str(value)[:200]
