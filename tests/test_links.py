"""Rewriting sandbox:/mnt/data references (pure)."""

from __future__ import annotations

import pytest

from nbexec import rewrite_links

URLS = {"report.csv": "https://x/report.csv?sig=1", "my file.png": "https://x/my%20file.png", "a/b.txt": "file:///b"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[download](sandbox:/mnt/data/report.csv)", "[download](https://x/report.csv?sig=1)"),
        ("saved to /mnt/data/report.csv.", "saved to https://x/report.csv?sig=1."),
        ("![chart](sandbox:/mnt/data/my%20file.png)", "![chart](https://x/my%20file.png)"),
        ("see /mnt/data/a/b.txt, then", "see file:///b, then"),
        ("[other](sandbox:/mnt/data/missing.csv)", "[other](sandbox:/mnt/data/missing.csv)"),
        ("no references here", "no references here"),
    ],
    ids=["markdown-link", "trailing-period", "percent-encoded", "nested-path", "unknown-file", "plain-text"],
)
def test_rewrite(text: str, expected: str) -> None:
    assert rewrite_links(text, URLS) == expected
