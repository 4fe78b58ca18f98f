"""The kernel's messages as nbexec keeps them: verified, sized, their content still raw bytes until asked for,
and the one JSON parser that turns hostile bytes into values (strict UTF-8, nesting capped). Pure: no I/O."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from nbexec.errors import ProtocolError

MAX_CONTROL = 1024 * 1024  # content of the messages nbexec reads whatever the budget (status, replies)
MAX_DEPTH = 64  # nesting of parsed content: deeper is refused (later encoders would recurse past the stack)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Message:
    """A verified message whose content is still raw bytes: ``size`` is what keeping it costs."""

    channel: str
    msg_type: str
    msg_id: str
    parent_id: str
    size: int  # bytes of the metadata, content and buffer frames
    raw_content: bytes | bytearray = field(repr=False)  # the received frame: not copied
    complete: bool = True  # False: past the frame limit, its content was read and dropped, never kept or checked
    buffers: tuple[bytes | bytearray | None, ...] = field(default=(), repr=False)  # binary frames (None: dropped)

    def content(self, limit: int | None = None) -> dict[str, Any]:
        """The parsed content; ProtocolError when it is larger than ``limit`` or not a JSON object."""
        if not self.complete or (limit is not None and len(self.raw_content) > limit):
            raise ProtocolError(f"a {self.msg_type} message of {self.size:,} bytes is over its "
                                f"{limit or 0:,}-byte limit")
        content = parse(self.raw_content, self.msg_type)
        if not isinstance(content, dict):
            raise ProtocolError(f"the content of a {self.msg_type} message is not a JSON object")
        return content


def parse(raw: bytes | bytearray | memoryview, what: str) -> Any:
    """Strict UTF-8 JSON, nesting capped; lone surrogates (from \\ud800-style escapes) become U+FFFD."""
    try:
        text = str(raw, "utf-8")
        value = json.loads(text)
    except RecursionError as exc:
        raise ProtocolError(f"a {what} message is nested too deeply") from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"a {what} message is not valid UTF-8 JSON: {str(exc)[:200]}") from exc
    surrogates = "\\ud" in text or "\\uD" in text
    if not surrogates and text.count("{") + text.count("[") <= MAX_DEPTH:  # cannot be too deep: skip the walk
        return value
    return _clean(value, surrogates, what)


def _clean(value: Any, surrogates: bool, what: str) -> Any:
    """Walk the parsed value without recursion: refuse deep nesting, replace lone surrogates."""
    fix = _fix_text if surrogates else (lambda s: s)
    root: list[Any] = [value]
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"a {what} message is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            if surrogates:
                items = [(fix(k), v) for k, v in node.items()]
                node.clear()
                node.update(items)
            pairs: Any = node.items()
        else:
            pairs = enumerate(node)
        for key, child in list(pairs):
            if isinstance(child, str):
                node[key] = fix(child)
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return root[0]


def _fix_text(text: str) -> str:
    # In a Python str every surrogate is a lone one (escaped pairs were joined by the decoder).
    return _SURROGATE.sub("\ufffd", text)


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
