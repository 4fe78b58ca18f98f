"""JSON values that keep the text they were parsed from, and the encoder that writes that text back.

A large value a kernel sends in a display (a deep `application/json`, a big metadata entry) is parsed once, for the
result. Encoding it again, to measure the notebook and to write it, cost the host as much per container as the
parse did (about 145 ns each: 0.08 s per MiB of nested lists, twice). Its text is already the JSON: the encoder
here writes it as it came. The values stay a list or a dict for everyone who reads them."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

# Spans shorter than this are parsed and encoded like any value: a placeholder costs more than they do.
LARGE = 1024


class VerbatimList(list[Any]):
    """A list parsed from ``text``, its JSON: written back as that text."""

    __slots__ = ("text",)

    def __init__(self, value: list[Any], text: str) -> None:
        super().__init__(value)
        self.text = text


class VerbatimDict(dict[str, Any]):
    """A dict parsed from ``text``, its JSON: written back as that text."""

    __slots__ = ("text",)

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text


KEPT = (VerbatimList, VerbatimDict)
_HUGE = re.compile(r"[eE][+-]?0*[0-9]{3}|[0-9]{309}")  # a number that may parse as an infinity (1e400)


def kept(value: Any, text: str) -> Any:
    """``value`` parsed from ``text``, made verbatim when it is a large list or object; else as it is."""
    if len(text) < LARGE:
        return value
    if type(value) is list:
        return VerbatimList(value, text)
    if type(value) is dict:
        return VerbatimDict(value, text)
    return value


def encode(value: Any, *, levels: int, sort_keys: bool = False, ensure_ascii: bool = False,
           finite: bool = False) -> str:
    """Compact JSON of ``value`` with each verbatim value found in its top ``levels`` levels written as its text
    (a notebook's display values are 6 levels down: cells, a cell, its outputs, an output, its data). Nothing
    deeper is walked, so a large plain value costs one pass in C. With ``finite``, ValueError for NaN or an
    infinity anywhere, as JSON has neither (a text that may hold one counts: it is never read in Python)."""
    texts: list[str] = []
    nonce = secrets.token_hex(16)  # a placeholder's text: no string from a sandbox can be one
    skeleton = json.dumps(_swapped(value, texts, nonce, levels), sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                          separators=(",", ":"), check_circular=False, allow_nan=not finite)
    if not texts:
        return skeleton
    if finite and any("NaN" in text or "Infinity" in text or _HUGE.search(text) for text in texts):
        raise ValueError("a verbatim value may hold NaN or an infinity")
    return re.sub(f'"\\\\u0000{nonce}(\\d+)"', lambda found: texts[int(found.group(1))], skeleton)


def _swapped(value: Any, texts: list[str], nonce: str, levels: int) -> Any:
    if isinstance(value, KEPT):
        texts.append(value.text)
        return f"\x00{nonce}{len(texts) - 1}"
    if levels <= 0:
        return value
    if isinstance(value, dict):
        return {key: _swapped(item, texts, nonce, levels - 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_swapped(item, texts, nonce, levels - 1) for item in value]
    return value
