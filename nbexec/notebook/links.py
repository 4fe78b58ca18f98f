"""Rewrite `sandbox:/mnt/data/<x>` and `/mnt/data/<x>` references to produced files into their links. Pure.

Linear in the text whatever it holds: each reference is looked up once, trailing punctuation by the lengths the
produced names end with (never one character at a time), and the rewritten text grows by at most its own length
plus 1 MiB (a reference costs a dozen characters, its URL may cost hundreds; references past that stay as written).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

_REFERENCE = re.compile(r"(?:sandbox:)?/mnt/data/([^\s()\[\]<>\"'`]+)")
_TRAILING = ".,;:!?"
GROWTH = 1024 * 1024  # characters a text may grow by beyond its own length (a thousand files' long SAS links)


def url_map(result: Any) -> dict[str, str]:
    """``{relative name: url}`` for the files of an ExecutionResult that have a URL."""
    return {f.name: f.url for f in result.files if f.url}


class _Index:
    """The produced names by their stem (the name without its trailing punctuation): the endings each stem has,
    and their lengths, longest first; and the longest a reference to any of them can be (3 characters a byte)."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        found: dict[str, tuple[set[str], set[int]]] = {}
        for name in mapping:
            stem = name.rstrip(_TRAILING)
            endings, lengths = found.setdefault(stem, (set(), set()))
            endings.add(name[len(stem):])
            lengths.add(len(name) - len(stem))
        self.groups = {stem: (endings, sorted(lengths, reverse=True)) for stem, (endings, lengths) in found.items()}
        self.longest = 3 * max((len(name.encode("utf-8", "surrogatepass")) for name in mapping), default=0)

    def lookup(self, name: str) -> tuple[str, str] | None:
        """(the produced name ``name`` refers to, the punctuation after it), or None. Trailing punctuation belongs
        to the name when a produced name has it, the longest such (``/mnt/data/a.csv.`` is ``a.csv`` then ``.``)."""
        stem = name.rstrip(_TRAILING)
        if len(stem) > self.longest:  # longer than any produced name, however it is quoted
            return None
        base = unquote(stem)  # punctuation has no percent signs: unquoting the stem alone is unquoting the name
        bare = base.rstrip(_TRAILING)
        group = self.groups.get(bare)
        if group is None:
            return None
        endings, lengths = group
        own = len(base) - len(bare)  # punctuation the unquoted stem ends with (%2E)
        run = base[len(bare):] + name[len(stem):len(stem) + lengths[0]]
        for length in lengths:
            if own <= length <= len(run) and run[:length] in endings:
                return bare + run[:length], name[len(stem) + length - own:]
        return None


def rewrite(text: str, urls: Mapping[str, str] | Any) -> str:
    """Replace references to produced files with their URLs; ``urls`` is a mapping or an ExecutionResult.

    Only names that were produced are rewritten; anything else (and any text around) is left as it is.
    """
    mapping = urls if isinstance(urls, Mapping) else url_map(urls)
    if not mapping or "/mnt/data/" not in text:
        return text
    index = _Index(mapping)
    room = [len(text) + GROWTH]  # characters the rewritten text may still grow by

    def replace(match: re.Match[str]) -> str:
        found = index.lookup(match.group(1))
        if found is None:
            return match.group(0)
        url = mapping[found[0]] + found[1]
        if len(url) - len(match.group(0)) > room[0]:
            return match.group(0)
        room[0] -= len(url) - len(match.group(0))
        return url

    return _REFERENCE.sub(replace, text)
