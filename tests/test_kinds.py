"""The words of a result (`nbexec.kinds`): the docs list each Literal's words, the code makes every error kind
and only those, and a word outside the list is refused wherever a value is made or read. Pure.

mypy (scripts/check.sh) checks the rest: every field typed with these Literals refuses any other word the code
could write."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from nbformat import v4

import nbexec
from nbexec import kinds
from nbexec.config import SandboxConfig
from nbexec.engine import cells, collect, shell
from nbexec.notebook import outputs
from nbexec.result import ERROR_KINDS, CellError, ExecutionResult, json_schema

DOCS = Path(__file__).resolve().parent.parent / "docs" / "library.md"
ALIASES = {name: value for name, value in vars(kinds).items() if typing.get_origin(value) is typing.Literal}


def _docs_table() -> dict[str, list[str]]:
    """The "Words in a result" table: type name -> its words, in order."""
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$", DOCS.read_text(), re.MULTILINE)
    return {name: re.findall(r"`([^`]+)`", words) for name, words in rows}


def test_the_docs_list_each_literal_and_its_words() -> None:
    assert {name: list(typing.get_args(value)) for name, value in ALIASES.items()} == _docs_table()
    assert {name for name in ALIASES if getattr(nbexec, name, None) is ALIASES[name]} == set(ALIASES)


def _result(error: CellError | None) -> ExecutionResult:
    return ExecutionResult(ok=error is None, execution_id="e", stdout="", stderr="", text="", error=error,
                           outputs=(), images=(), files=(), skipped_files=(), notebook=v4.new_notebook(),
                           notebook_path=None, output_dir="/o", duration_s=0.0, timings={})


def _made_kinds() -> set[str]:
    """Each error kind as the code that makes it makes it."""
    made = set()
    raised = outputs.first_error([{"output_type": "error", "ename": "KeyError", "evalue": "k", "traceback": []}])
    assert raised is not None
    made.add(raised.kind)
    for status in ("timeout", *cells._KIND):  # a cell that ended otherwise than by an error output
        made.add(cells._outcome_error(cells.CellOutcome(status, message="m"), 0, SandboxConfig(), 1.0).kind)
    full = collect._as_limit(CellError("OSError", "No space left on device", ()), False, ["/mnt/data is full"])
    assert full is not None
    made.add(full.kind)
    for ename, evalue in (("ShellExit", "exit status 3"), ("ShellTimeout", "past 1 s")):  # Session.shell
        settled = shell.settle(_result(CellError(ename, evalue, ())))
        assert settled.error is not None
        made.add(settled.error.kind)
    return made


def test_the_code_makes_every_error_kind_and_no_other() -> None:
    made = _made_kinds()
    assert "exit" in made and made == set(ERROR_KINDS) == set(typing.get_args(kinds.ErrorKind))


def test_a_word_outside_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        CellError("E", "v", (), typing.cast(kinds.ErrorKind, "crashed"))
    data = _result(CellError("E", "v", (), "exit")).to_dict()
    assert ExecutionResult.from_dict(data).error == CellError("E", "v", (), "exit")
    for field, bad in (("error", {**data["error"], "kind": "crashed"}), ("restored", "magic"),
                       ("packages", [{"name": "p", "status": "stolen"}])):
        with pytest.raises(ValueError, match=f"ExecutionResult.{field}"):
            ExecutionResult.from_dict({**data, field: bad})


def test_the_schema_names_the_words() -> None:
    error = json_schema()["properties"]["error"]["anyOf"][0]
    assert error["properties"]["kind"] == {"type": "string", "enum": list(ERROR_KINDS)}
