"""Measure how long the sentences of comments and docstrings are, per module.

STYLE.md asks for short sentences that say why; httpx, nbclient and papermill average 10-14 words a sentence.
This prints the mean over the whole tree and the worst modules, so a change can be measured before and after:

    .venv/bin/python scripts/prose.py                # nbexec/: the mean and the worst 20 modules
    .venv/bin/python scripts/prose.py --worst 40 nbexec/engine
    .venv/bin/python scripts/prose.py --sentences nbexec/config.py   # the longest sentences of one module

A sentence ends at ". ", "? " or "! " before a capital, a digit or a quote, at a blank line and at the end of a
comment block. Code is left out: doctest lines, fenced and indented blocks, and pragmas (noqa, type: ignore).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A full stop after one of these does not end the sentence.
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "no.")
PRAGMA = re.compile(r"^\s*(noqa|type:\s*ignore|pragma|mypy:|ruff:|fmt:|pylint:)", re.I)
END = re.compile(r"(?<=[.?!])[)\"']?\s+(?=[A-Z0-9`\"'(\[*])")
WORD = re.compile(r"[\w`'\"(\[]")  # a token that holds a letter, digit or a quoted name counts as a word


@dataclass
class Module:
    path: str
    sentences: list[str] = field(default_factory=list)

    @property
    def words(self) -> int:
        return sum(count_words(s) for s in self.sentences)

    @property
    def mean(self) -> float:
        return self.words / len(self.sentences) if self.sentences else 0.0


def count_words(sentence: str) -> int:
    return sum(1 for token in sentence.split() if WORD.search(token))


def split(text: str) -> list[str]:
    """Cut prose into sentences; a blank line always ends one."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        for abbreviation in ABBREVIATIONS:
            flat = flat.replace(abbreviation + " ", abbreviation.replace(".", "\0") + " ")
        sentences += [s.replace("\0", ".") for s in END.split(flat) if count_words(s)]
    return sentences


def prose_of_docstring(text: str) -> str:
    """Drop the code a docstring shows (doctests, fences, indented blocks): only its prose is measured."""
    kept, fenced = [], False
    for line in text.expandtabs().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        if fenced or stripped.startswith((">>>", "...", "$ ")) or line.startswith("    " * 2):
            kept.append("")
            continue
        kept.append(stripped)
    return "\n".join(kept)


def docstrings(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text:
                found.append(prose_of_docstring(text))
    return found


def comment_blocks(source: str) -> list[str]:
    """Consecutive comment lines form one block; a comment after code is a block of its own."""
    blocks: list[str] = []
    current: list[str] = []
    last_row = -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if not text or PRAGMA.match(text) or text.startswith("!"):
            continue
        text = PRAGMA.split(text)[0]
        alone = token.line.strip().startswith("#")
        if alone and token.start[0] == last_row + 1 and current:
            current.append(text)
        else:
            if current:
                blocks.append(" ".join(current))
            current = [text]
        last_row = token.start[0] if alone else -2
    if current:
        blocks.append(" ".join(current))
    return blocks


def measure(path: Path) -> Module:
    source = path.read_text()
    module = Module(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    for text in docstrings(ast.parse(source)) + comment_blocks(source):
        module.sentences += split(text)
    return module


def modules(paths: list[Path]) -> list[Module]:
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    return [measure(f) for f in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "nbexec"])
    parser.add_argument("--worst", type=int, default=20, help="how many modules to list, worst first")
    parser.add_argument("--least", type=int, default=5, help="sentences a module needs to be listed")
    parser.add_argument("--sentences", action="store_true", help="print each module's ten longest sentences")
    args = parser.parse_args(argv)
    found = modules([p.resolve() for p in args.paths])
    sentences = sum(len(m.sentences) for m in found)
    words = sum(m.words for m in found)
    if not sentences:
        print("no prose found")
        return 1
    print(f"{len(found)} modules, {sentences} sentences, {words} words: "
          f"{words / sentences:.1f} words per sentence (comments and docstrings)")
    ranked = sorted((m for m in found if len(m.sentences) >= args.least), key=lambda m: -m.mean)
    for module in ranked[:args.worst]:
        print(f"{module.mean:5.1f}  {len(module.sentences):4d}  {module.path}")
        if args.sentences:
            for sentence in sorted(module.sentences, key=count_words, reverse=True)[:10]:
                print(f"         {count_words(sentence):3d}  {sentence[:160]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader (head) has what it wanted
        sys.exit(0)
