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


# -- exact edges (each one a mutant of links.py that once survived) ----------------------------------------------

def test_a_result_object_is_read_for_its_files_urls() -> None:
    from types import SimpleNamespace

    result = SimpleNamespace(files=[SimpleNamespace(name="a.png", url="https://x/a"),
                                    SimpleNamespace(name="b.png", url=None)])
    assert rewrite_links("see /mnt/data/a.png and /mnt/data/b.png", result) == "see https://x/a and /mnt/data/b.png"


def test_a_fully_percent_encoded_name_is_still_found() -> None:
    """Three characters a byte is the longest a reference to a name can be: that long, it is looked up."""
    assert rewrite_links("/mnt/data/%C3%A9", {"é": "https://x/e"}) == "https://x/e"


def test_a_name_ending_in_an_encoded_dot_keeps_the_punctuation_after_it() -> None:
    assert rewrite_links("see /mnt/data/a%2E, ok", {"a.": "https://x/a"}) == "see https://x/a, ok"


def test_the_growth_allowance_is_spent_to_the_character() -> None:
    """Two rewrites that together grow the text by exactly its own length plus GROWTH both happen; a third is left
    as written."""
    from nbexec.notebook.links import GROWTH

    text = "see /mnt/data/a /mnt/data/a /mnt/data/a"
    text = "s" * (len(text) % 2) + text  # even: the allowance halves exactly
    url = "u" * ((len(text) + GROWTH) // 2 + len("/mnt/data/a"))
    assert rewrite_links(text, {"a": url}).split(" ")[1:] == [url, url, "/mnt/data/a"]
