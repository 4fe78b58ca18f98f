"""The body of ``POST /v1/batches``: a JSON array of items (/v1/execute bodies and judge items), read one item at
a time, and each item as the line its batch's record keeps."""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from fastapi import HTTPException
from pydantic import ValidationError

from nbexec.errors import ConfigError

from . import judgeitems
from .judgeitems import JudgeBody
from .schemas import ExecuteBody

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
Item = ExecuteBody | JudgeBody  # what a batch runs: an execution, or a program judged against tests


def parse(raw: bytes, most: int) -> list[Item]:
    """The items of a batch body (a JSON array of /v1/execute bodies), read one item at a time: 413 past ``most``
    items, 400 for what is not JSON (too deep a nesting too), 422 for an item that is not a valid body."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPException(400, "the body is not UTF-8 JSON") from None
    at = _skip(text, 0)
    if text[at:at + 1] != "[":
        raise HTTPException(422, "a batch is a JSON array of items, each a POST /v1/execute body")
    at = _skip(text, at + 1)
    items: list[Item] = []
    while text[at:at + 1] != "]" or items:
        if len(items) >= most:
            raise HTTPException(413, f"a batch holds at most {most} items")
        try:
            value, at = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            raise HTTPException(400, f"item {len(items)} is not JSON (or nests too deep)") from None
        items.append(_item(value, len(items)))
        at = _skip(text, at)
        if text[at:at + 1] == "]":
            break
        if text[at:at + 1] != ",":
            raise HTTPException(400, f"expected , or ] after item {len(items) - 1}")
        at = _skip(text, at + 1)
    if not items:
        raise HTTPException(422, "a batch needs at least one item")
    if _skip(text, at + 1) != len(text):
        raise HTTPException(400, "the body goes on after the array")
    return items


def _skip(text: str, at: int) -> int:
    found = _SPACE.match(text, at)
    return found.end() if found else at


def _item(value: Any, index: int) -> Item:
    if not isinstance(value, dict):
        raise HTTPException(422, f"item {index} is not an object")
    try:
        if judgeitems.is_judge(value):  # a judge item (judgeitems): checked as judge() checks it
            judged = JudgeBody.model_validate(value)
            judgeitems.check(judged, 86_400)
            return judged
        item = ExecuteBody.model_validate(value)
    except ConfigError as exc:
        raise HTTPException(422, {"item": index, "errors": [{"loc": [], "msg": str(exc)[:300]}]}) from None
    except ValidationError as exc:
        raise HTTPException(422, {"item": index, "errors": judgeitems.problems(exc)}) from None
    try:
        for content in (item.files or {}).values():
            base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(422, f"item {index}: files must map names to base64 content") from None
    return item


def load(line: bytes) -> Item:
    """The item a batch kept as ``line`` (ValidationError for a record tampered with)."""
    return judgeitems.load(line) or ExecuteBody.model_validate_json(line)


def parsed(body: bytes, most: int) -> tuple[list[Item], list[bytes]]:
    """The body's items, and each as the line kept for it (on a worker thread: the checks cost CPU)."""
    items = parse(body, most)
    return items, [item.model_dump_json().encode() for item in items]
