"""Rewrite `sandbox:/mnt/data/<x>` and `/mnt/data/<x>` references to produced files into their links. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

_REFERENCE = re.compile(r"(?:sandbox:)?/mnt/data/([^\s()\[\]<>\"'`]+)")
_TRAILING = ".,;:!?"


def url_map(result: Any) -> dict[str, str]:
    """``{relative name: url}`` for the files of an ExecutionResult that have a URL."""
    return {f.name: f.url for f in result.files if f.url}


def rewrite(text: str, urls: Mapping[str, str] | Any) -> str:
    """Replace references to produced files with their URLs; ``urls`` is a mapping or an ExecutionResult.

    Only names that were produced are rewritten; anything else (and any text around) is left as it is.
    """
    mapping = urls if isinstance(urls, Mapping) else url_map(urls)
    if not mapping or "/mnt/data/" not in text:
        return text

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        tail = ""
        while name and unquote(name) not in mapping and name[-1] in _TRAILING:
            name, tail = name[:-1], name[-1] + tail
        url = mapping.get(unquote(name))
        return url + tail if url else match.group(0)

    return _REFERENCE.sub(replace, text)
