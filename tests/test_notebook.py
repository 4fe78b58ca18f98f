"""Building notebooks from code, scripts and .ipynb files (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from nbexec import NotebookError, notebook


def test_code_becomes_one_valid_cell() -> None:
    nb = notebook.build("print(1)")
    nbformat.validate(nb)
    assert [c.source for c in nb.cells] == ["print(1)"]
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.parametrize("code", ["", "   \n\t", "\n"], ids=["empty", "blank", "newline"])
def test_empty_code_is_refused(code: str) -> None:
    with pytest.raises(NotebookError, match="no code to run"):
        notebook.build(code)


def test_percent_script_splits_cells_with_markdown_and_tags() -> None:
    nb = notebook.from_script(
        "import os\n"
        "# %% [markdown]\n# # Title\n# some *text*\n"
        '# %% tags=["parameters"]\nx = 1\n'
        "# %% A titled cell\nprint(x)\n"
    )
    nbformat.validate(nb)
    assert [c.cell_type for c in nb.cells] == ["code", "markdown", "code", "code"]
    assert nb.cells[1].source == "# Title\nsome *text*"
    assert nb.cells[2].metadata.tags == ["parameters"]
    assert nb.cells[3].source == "print(x)"


def test_script_without_markers_is_one_cell() -> None:
    nb = notebook.from_script("a = 1\n\nb = 2\n")
    assert len(nb.cells) == 1 and nb.cells[0].source == "a = 1\n\nb = 2"


def test_bad_tags_are_reported() -> None:
    with pytest.raises(NotebookError, match="Bad cell tags"):
        notebook.from_script("# %% tags=[oops]\nx = 1\n")


def test_ipynb_is_loaded_as_is(tmp_path: Path) -> None:
    source = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1"), nbformat.v4.new_markdown_cell("m")])
    path = tmp_path / "in.ipynb"
    nbformat.write(source, path)
    nb = notebook.load(path)
    assert [c.source for c in nb.cells] == ["1 + 1", "m"]
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.ipynb", b"{not json", "not valid notebook JSON"),
        ("wrong.ipynb", json.dumps({"cells": 3}).encode(), "is not a notebook"),
        ("latin1.py", "caf\u00e9 = 1".encode("latin-1"), "not UTF-8"),
        ("empty.py", b"", "no code to run"),
    ],
    ids=["invalid-json", "invalid-notebook", "non-utf8", "empty-file"],
)
def test_bad_files_give_clear_errors(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(NotebookError, match=message):
        notebook.load(path)


def test_missing_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(NotebookError, match="does not exist"):
        notebook.load(tmp_path / "missing.py")
    with pytest.raises(NotebookError, match="is a directory"):
        notebook.load(tmp_path)


def test_coerce_accepts_code_paths_and_notebooks(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("x = 2\n")
    assert notebook.coerce("x = 1").cells[0].source == "x = 1"
    assert notebook.coerce(script).cells[0].source == "x = 2"
    assert notebook.coerce(dict(notebook.build("x = 3"))).cells[0].source == "x = 3"
    with pytest.raises(NotebookError, match="Cannot run a int"):
        notebook.coerce(3)


def test_a_small_notebook_is_written_indented_and_a_large_one_compact() -> None:
    """Indenting runs json's encoder in Python per container: a notebook of many (deep display data) is written
    compact, read back the same."""
    small = notebook.build("print(1)")
    assert b'\n "cells": [' in notebook.dumps(small)
    large = notebook.build("print(1)")
    deep: list[object] = []
    for _ in range(59):
        deep = [deep]
    large.cells[0].outputs = [nbformat.from_dict({"output_type": "display_data", "metadata": {},
                                                   "data": {"application/json": [deep] * 400}})]
    written = notebook.dumps(large)
    assert b"\n" not in written[:-1] and written.endswith(b"\n")
    assert nbformat.reads(written.decode(), as_version=4) == large
