"""The result's one shape (`nbexec.result`): every field round-trips through its JSON, the JSON schema is read off
the same fields, the public shape carries no host path, and a value of the wrong kind is refused by name. Pure."""

from __future__ import annotations

import dataclasses
import json
import typing

import jsonschema
import pytest
from nbformat import v4

from nbexec import result as values
from nbexec.result import CellError, Connection, ExecutionResult, File, Image, Package, SkippedFile, Upload


def full() -> ExecutionResult:
    """A result with every field set to something other than its default."""
    return ExecutionResult(
        ok=False, execution_id="e1", stdout="out", stderr="err", text="text",
        error=CellError("KeyError", "'k'", ("Traceback", "KeyError: 'k'"), "timeout", 3),
        outputs=({"output_type": "stream", "name": "stdout", "text": "out"},),
        images=(Image("image/png", "/o/images/cell0-1.png", 0, 67, "file:///o/images/cell0-1.png"),),
        files=(File("a.csv", "/o/data/a.csv", 4, "text/csv", "ab" * 32, "https://store/a.csv"),),
        skipped_files=(SkippedFile("link", "symbolic link (not followed)"),), notebook=v4.new_notebook(),
        notebook_path="/o/notebook.ipynb", output_dir="/o", duration_s=1.2345678,
        timings={"run_s": 0.5, "total_s": 1.2},
        truncated_bytes=7, uploads=(Upload("a.csv", "file", "uploaded", "https://store/a.csv", None, "run/a.csv"),),
        notes=("note",), packages=(Package("p", "installed", "1.0", "cd" * 32, "p-1.0-py3-none-any.whl", 10, False,
                                            "why"),),
        connections=(Connection("example.org", 443, "CONNECT", False, "refused", "1.2.3.4", 1, 2, True),), node="n1")


def test_every_field_round_trips() -> None:
    made = full()
    data = json.loads(made.to_json())
    again = ExecutionResult.from_dict(data)
    assert again.to_dict() == data
    assert dataclasses.replace(again, notebook=made.notebook, duration_s=made.duration_s) == made
    json_fields = {f.name for f in dataclasses.fields(ExecutionResult) if f.name != "notebook"}
    assert set(data) == json_fields  # every field but the notebook (it is at notebook_path)


def test_the_schema_is_read_off_the_same_fields() -> None:
    schema = values.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(full().to_dict(), schema)
    for cls in (ExecutionResult, CellError, Image, File, SkippedFile, Upload, Package, Connection):
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True)}
        assert names <= set(values.json_schema(cls)["properties"]), cls


def test_the_public_shape_has_no_host_path() -> None:
    public = full().to_dict(public=True)
    text = json.dumps(public)
    assert "/o/" not in text.replace("file:///o/", "")
    assert "output_dir" not in public and "notebook_path" not in public
    assert public["images"][0]["name"] == "cell0-1.png" and "path" not in public["files"][0]
    jsonschema.validate(public, values.json_schema(public=True))
    back = ExecutionResult.from_dict(public)
    assert back.output_dir == "" and back.files[0].path == "" and back.files[0].sha256 == "ab" * 32


@pytest.mark.parametrize(("change", "named"), [
    ({"ok": "yes"}, "ExecutionResult.ok"),
    ({"error": {"ename": 1, "evalue": "", "traceback": [], "kind": "exception", "cell_index": None}},
     "ExecutionResult.error.ename"),
    ({"files": [{"name": "a", "size": "big", "mime": "", "sha256": "", "url": None}]}, "ExecutionResult.files[0].size"),
    ({"timings": {"run_s": "fast"}}, "ExecutionResult.timings.run_s"),
    ({"stdout": None}, "ExecutionResult.stdout"),
], ids=["bool", "nested", "in-a-list", "in-a-mapping", "missing-value"])
def test_a_value_of_the_wrong_kind_is_refused_by_name(change: dict[str, typing.Any], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        ExecutionResult.from_dict({**full().to_dict(), **change})
