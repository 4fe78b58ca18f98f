"""Durations, sizes and counts as a person writes them ("1 minute", "1 GB", "1,000 files"), for what a model
reads. Pure."""

from __future__ import annotations

from nbexec.config import parse_size

_UNITS = ((1024**4, "TB"), (1024**3, "GB"), (1024**2, "MB"), (1024, "KB"))
_TIMES = ((3600, "hour"), (60, "minute"), (1, "second"))


def _number(value: float) -> str:
    return f"{value:,.1f}".removesuffix(".0")


def duration(seconds: float) -> str:
    """``60`` -> "1 minute", ``90`` -> "90 seconds", ``7200`` -> "2 hours", ``0.5`` -> "0.5 seconds"."""
    for size, name in _TIMES:
        if seconds >= size and (seconds % size == 0 or size == 1):
            count = seconds / size
            return f"{_number(count)} {name}{'' if count == 1 else 's'}"
    return f"{_number(seconds)} seconds"


def size(value: str | int) -> str:
    """A size ("1g", "200k" or bytes) as "1 GB", "200 KB", "1.5 MB" (binary units, as nbexec counts them)."""
    count = parse_size(value)
    for unit, name in _UNITS:
        if count >= unit:
            return f"{_number(count / unit)} {name}"
    return f"{count:,} bytes"


def count(number: int, noun: str) -> str:
    """``1000, "file"`` -> "1,000 files"."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
