"""The parameters a notebook declares: the assignments of its cell tagged `parameters`, as papermill's
`inspect_notebook` reports them (name, inferred_type_name, default, help). Pure.

Python cells are read with Python's own parser, so a value over several lines or a string holding `#` or `=` is
read whole; papermill's reader matches each line against a pattern. The type is the annotation (`a: int = 1`), else
a `# type: int` comment, else "None" (papermill's word for unknown); the help is the comment after the value. Other
languages report nothing, as papermill's translators for them do.
"""

from __future__ import annotations

import ast
import io
import tokenize
from typing import Any, NamedTuple

from nbformat import NotebookNode

from . import language_of

PARAMETERS_TAG = "parameters"


class Parameter(NamedTuple):
    """One declared parameter, in papermill's shape (its `_asdict()` is what inspect_notebook returns)."""

    name: str
    inferred_type_name: str
    default: str
    help: str


def parameters_cell(nb: NotebookNode) -> NotebookNode | None:
    """The first cell tagged `parameters`, or None."""
    return next((c for c in nb.cells if PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])), None)


def declared(nb: NotebookNode) -> list[Parameter]:
    """The parameters ``nb`` declares, in order (none without a parameters cell, or in a language other than
    Python, or when the cell does not parse)."""
    cell = parameters_cell(nb)
    if cell is None or not language_of(nb).is_python:
        return []
    source = str(cell.get("source", ""))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    comments = _comments(source)
    found = []
    for statement in tree.body:
        name, annotation, value = _parts(statement)
        if name is None or value is None:
            continue
        comment = comments.get(statement.end_lineno or statement.lineno, "")
        kind, help_text = _type_comment(comment)
        found.append(Parameter(name, annotation or kind or "None", _flat(ast.get_source_segment(source, value) or ""),
                               help_text))
    return found


def _flat(text: str) -> str:
    """A value written over several lines on one, as papermill shows it: each line stripped (and its comment
    dropped), then joined."""
    lines = text.splitlines() or [""]
    return "".join(line.split("#", 1)[0].strip() for line in lines[:-1]) + lines[-1].strip()


def _parts(statement: ast.stmt) -> tuple[str | None, str | None, ast.expr | None]:
    """(name, annotation source, value) of ``name = value`` or ``name: type = value``; Nones otherwise."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0],
                                                                                        ast.Name):
        return statement.targets[0].id, None, statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id, ast.unparse(statement.annotation).strip("'\""), statement.value
    return None, None, None


def _comments(source: str) -> dict[int, str]:
    """The comment on each line (its text after `#`, stripped), by line number."""
    found: dict[int, str] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found[token.start[0]] = token.string[1:].strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def _type_comment(comment: str) -> tuple[str | None, str]:
    """A `type: X rest` comment as (X, rest); any other as (None, the comment)."""
    if not comment.startswith("type:"):
        return None, comment
    kind, _, rest = comment[len("type:"):].strip().partition(" ")
    return kind or None, rest.strip()


def as_dict(parameters: list[Parameter]) -> dict[str, dict[str, Any]]:
    """papermill's inspect_notebook value: name -> the parameter as a dict."""
    return {p.name: p._asdict() for p in parameters}
