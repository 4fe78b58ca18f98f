"""nbexec as a drop-in for papermill in CI, judged from outside: notebooks of every nbformat 4 minor version (and a
v3 one) take parameters and stay valid for their own version; sys.exit(0) and exit() end a run successfully and a
non-zero exit fails it (papermill's rule, checked against papermill's own raise_for_execution_errors); the executed
notebook carries papermill's metadata, read back with scrapbook and papermill's own reader; papermill's -r, -y, -f
and -b parameter forms; a notebook path given to the API brings its folder, as `nbexec run` does.

Real Docker and the real image. The notebooks in tests/files/notebooks are papermill's and nbformat's own test
notebooks (see ORIGIN.md there)."""

from __future__ import annotations

import base64
import datetime
import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import nbformat
import pytest
from dateutil import parser as dateparser

import nbexec
from nbexec.notebook import load, parameters

from .test_cli import nbexec as run_cli

NOTEBOOKS = Path(__file__).parent / "files" / "notebooks"


def _copy(name: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(NOTEBOOKS / name, into / name))


def _executed(path: Path) -> nbformat.NotebookNode:
    """The executed notebook as it lies on disk, in its own version (no conversion)."""
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


# -- parameters, whatever the notebook's version ---------------------------------------------------------------

VERSIONS = [
    # file, parameter options, what the code prints, exit code, (nbformat, nbformat_minor) of the executed notebook
    # nbformat's two (4.0 and v3) end in a cell that fetches an image by URL: the sandbox has no network (exit 1)
    ("test4.ipynb", ["-p", "unused", "1"], "hello\n", 1, (4, 0)),  # no `parameters` cell: injected at the top
    ("simple_execute.ipynb", ["-p", "msg", "Hello"], "Hello\n", 0, (4, 1)),
    ("report_mode_test.ipynb", ["-p", "a", "2"], "3\n", 0, (4, 2)),
    ("parameters_4.3.ipynb", ["-p", "times", "3"], "hellohellohello\n", 0, (4, 3)),
    ("nb_version_4.4.ipynb", ["-r", "var", "It works"], "It works\n", 0, (4, 4)),
    ("simple_with_tags.ipynb", ["-p", "b", "2"], "1\n", 0, (4, 5)),  # cell ids: the injected one gets one too
    ("test3_no_metadata.ipynb", ["-p", "unused", "1"], "hello\n", 1, (4, 5)),  # v3, upgraded (with ids)
]


@pytest.mark.parametrize(("name", "options", "printed", "code", "version"), VERSIONS,
                         ids=["v4.0", "v4.1", "v4.2", "v4.3", "v4.4", "v4.5", "v3"])
def test_every_notebook_version_takes_parameters(cleanup_ledger: None, tmp_path: Path, name: str,
                                                 options: list[str], printed: str, code: int,
                                                 version: tuple[int, int]) -> None:
    notebook = _copy(name, tmp_path / "project")
    done = run_cli("run", "--json", *options, "--output-dir", "out", str(notebook), cwd=tmp_path)
    assert done.returncode == code, done.stdout[-3000:] + done.stderr
    data = json.loads(done.stdout)
    assert data["stdout"] == printed
    if code:
        assert data["error"]["ename"] == "URLError" and "name resolution" in data["error"]["evalue"]
    executed = _executed(tmp_path / "out" / "notebook.ipynb")
    assert (executed.nbformat, executed.nbformat_minor) == version  # the notebook keeps its own version...
    nbformat.validate(executed)  # ...and stays valid for it (pytest turns nbformat's warnings into errors)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1
    assert ("id" in injected[0]) == (version >= (4, 5))  # a cell id only where the version has them
    assert executed.metadata.papermill.parameters == executed.metadata.nbexec.parameters


def test_a_parameterised_notebook_runs_twice_in_a_session_and_stays_valid(config: nbexec.SandboxConfig) -> None:
    """Cells appended to an older notebook follow its version too (no ids below 4.5)."""
    nb = parameters.inject(load(NOTEBOOKS / "nb_version_4.4.ipynb"), {"var": 2})
    with nbexec.Session(config) as session:
        first = session.run_notebook(nb)
        second = session.run_notebook(nbformat.from_dict(json.loads(json.dumps(nb))))
        third = session.run("print('more')")
        assert (first.ok, second.ok, third.ok) == (True, True, True), (first.error, second.error, third.error)
        assert first.stdout == second.stdout == "2\n"
        saved = _executed(session.save(Path(session.output_dir or ".") / "saved.ipynb"))
    assert saved.nbformat_minor == 4 and not any("id" in cell for cell in saved.cells)
    nbformat.validate(saved)


# -- ending a run early ------------------------------------------------------------------------------------------

EXITS = [
    # code, the run succeeds, the SystemExit value the notebook shows
    ("sys.exit(0)", True, "0"),
    ("sys.exit()", True, ""),
    ("raise SystemExit(0)", True, "0"),
    ("raise SystemExit", True, ""),
    ("exit()", True, ""),
    ("quit()", True, ""),
    ("exit(0)", True, "0"),
    ("sys.exit(1)", False, "1"),
    ("sys.exit('bye')", False, "bye"),
    ("sys.exit(False)", False, "False"),  # papermill's rule: only "" and "0" are a clean exit
    ("exit(3)", False, "3"),
    ("import os; os._exit(0)", False, None),  # the kernel died: never a success
]


@pytest.mark.parametrize(("code", "succeeds", "value"), EXITS, ids=[c for c, _, _ in EXITS])
def test_exit_ends_the_run_as_papermill_judges_it(config: nbexec.SandboxConfig, tmp_path: Path, code: str,
                                                  succeeds: bool, value: str | None) -> None:
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import raise_for_execution_errors

    cells = [nbformat.v4.new_code_cell("import sys\nprint('before')"), nbformat.v4.new_code_cell(code),
             nbformat.v4.new_code_cell("print('after')", outputs=[nbformat.v4.new_output(
                 "stream", name="stdout", text="a stale output of an earlier run\n")])]
    result = nbexec.execute_notebook(nbformat.v4.new_notebook(cells=cells), config=config)
    assert result.ok is succeeds, result.error
    assert result.stdout == "before\n"  # the rest is not run, and what an earlier run left is not reported
    last = result.notebook.cells[2]
    assert last.execution_count is None and last.outputs == []
    assert last.metadata.papermill.status == "pending"
    if succeeds:
        assert result.error is None
        assert any("ended the run at cell 1" in note and "1 cell after it was not run" in note
                   for note in result.notes), result.notes
        assert result.notebook.metadata["nbexec"]["exit"] == {"cell_index": 1, "value": value, "cells_not_run": 1}
    else:
        assert result.error is not None and result.error.cell_index == 1
        if value is not None:
            assert (result.error.ename, result.error.evalue) == ("SystemExit", value)
    shown = [o for o in result.notebook.cells[1].outputs if o.output_type == "error"]
    if value is not None:  # the notebook shows where and how the run ended, as papermill's do
        assert [(o.ename, o.evalue) for o in shown] == [("SystemExit", value)]
    # papermill's own judgement of the executed notebook agrees with nbexec's
    with open(result.notebook_path, encoding="utf-8") as handle:
        executed = nbformat.read(handle, as_version=4)
    if succeeds:
        raise_for_execution_errors(executed, str(tmp_path / "judged.ipynb"))
    else:
        with pytest.raises(PapermillExecutionError):
            raise_for_execution_errors(executed, str(tmp_path / "judged.ipynb"))


@pytest.mark.parametrize(("name", "code"), [("sysexit0.ipynb", 0), ("sysexit.ipynb", 0), ("systemexit.ipynb", 0),
                                             ("sysexit1.ipynb", 1)])
def test_papermills_exit_notebooks_give_its_exit_codes(cleanup_ledger: None, tmp_path: Path, name: str,
                                                       code: int) -> None:
    done = run_cli("run", "-q", str(_copy(name, tmp_path / "nb")), cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert "Cell should not execute." not in done.stdout + done.stderr


# -- papermill's metadata, read by papermill-aware tools -------------------------------------------------------

_SCRAP = ("from IPython.display import display\n"
          "display({'application/scrapbook.scrap.json+json': {'name': 'answer', 'data': 42, 'encoder': 'json',"
          " 'version': 1}}, raw=True, metadata={'scrapbook': {'name': 'answer', 'data': True, 'display': False}})")


def _since(start: datetime.datetime, stamp: str) -> float:
    return (dateparser.parse(stamp) - start).total_seconds()


def test_scrapbook_and_papermill_read_the_executed_notebook(cleanup_ledger: None, tmp_path: Path) -> None:
    import scrapbook
    from papermill.iorw import load_notebook_node

    notebook = _copy("simple_execute_ids.ipynb", tmp_path / "project")  # carries a 2018 papermill run's metadata
    nb = nbformat.read(notebook, as_version=nbformat.NO_CONVERT)
    nb.cells.append(nbformat.v4.new_code_cell(_SCRAP))
    nb.cells[-1].pop("id", None)  # nbformat 4.1: no cell ids
    nbformat.write(nb, notebook)
    began = datetime.datetime.now(datetime.timezone.utc)
    done = run_cli("run", "-p", "msg", "hi", "--save-notebook", "saved.ipynb", "--output-dir", "out",
                   str(notebook), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    saved = tmp_path / "saved.ipynb"
    book = scrapbook.read_notebook(str(saved))
    assert book.parameters == {"msg": "hi"}
    assert book.scraps["answer"].data == 42
    timing = book.cell_timing
    assert [t is not None for t in timing] == [True, True, True, False, True]  # by execution count
    assert all(isinstance(t, float) and t >= 0 for t in timing if t is not None)
    meta = load_notebook_node(str(saved)).metadata.papermill
    assert set(meta) >= {"parameters", "start_time", "end_time", "duration", "exception", "input_path",
                         "output_path", "default_parameters", "environment_variables", "version"}
    assert meta.exception is None and meta.parameters == {"msg": "hi"}
    assert 0 <= _since(began, meta.start_time) <= _since(began, meta.end_time)  # this run's, not 2018's
    assert abs(_since(dateparser.parse(meta.start_time), meta.end_time) - meta.duration) < 0.01
    assert meta.input_path == str(notebook) and meta.output_path == str(tmp_path / "out" / "notebook.ipynb")
    executed = _executed(saved)
    assert executed.nbformat_minor == 1
    statuses = [(c.metadata.papermill.status, c.metadata.papermill.exception) for c in executed.cells]
    assert statuses == [("completed", False)] * 5
    for cell in executed.cells:
        stamp = cell.metadata.papermill
        if cell.execution_count:
            assert 0 <= _since(began, stamp.start_time) <= _since(began, stamp.end_time)
            assert stamp.duration >= 0


def test_a_failed_run_is_marked_where_papermill_marks_it(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import raise_for_execution_errors

    cells = [nbformat.v4.new_markdown_cell("# a report"), nbformat.v4.new_code_cell("print('one')"),
             nbformat.v4.new_code_cell("1/0"), nbformat.v4.new_markdown_cell("never reached"),
             nbformat.v4.new_code_cell("print('three')")]
    result = nbexec.execute_notebook(nbformat.v4.new_notebook(cells=cells), config=config)
    assert not result.ok and result.error is not None and result.error.ename == "ZeroDivisionError"
    with open(result.notebook_path, encoding="utf-8") as handle:
        executed = nbformat.read(handle, as_version=4)
    assert executed.metadata.papermill.exception is True
    assert [(c.metadata.papermill.status, c.metadata.papermill.exception) for c in executed.cells] == [
        ("completed", False), ("completed", False), ("failed", True), ("pending", None), ("pending", None)]
    with pytest.raises(PapermillExecutionError) as raised:
        raise_for_execution_errors(executed, str(tmp_path / "judged.ipynb"))
    assert raised.value.ename == "ZeroDivisionError" and raised.value.cell_index == 2


# -- papermill's parameter forms ---------------------------------------------------------------------------------

def _printer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("a = b = c = d = e = when = num = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print(repr(dict(a=a, b=b, c=c, d=d, e=e, when=when, num=num)))")])
    nbformat.write(nb, folder / "params.ipynb")
    return folder / "params.ipynb"


def test_papermills_parameter_forms_and_their_precedence(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _printer(tmp_path / "project")
    (tmp_path / "one.yaml").write_text("b: from-file\nc: from-file\n")
    (tmp_path / "two.yaml").write_text("d: [1, 2]\n")
    encoded = base64.b64encode(b"a: 1\nb: from-base64\n").decode()
    # papermill's order, whatever the command line's: -b, then each -f, -y, -p, and -r last
    done = run_cli("run", "--json", "-r", "e", "raw", "-p", "e", "4", "-y", "c: from-yaml\ne: 3",
                   "-f", "one.yaml", "-f", "two.yaml", "-b", encoded, "-p", "when", "2024-01-31",
                   "-r", "num", "42", str(notebook), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    data = json.loads(done.stdout)
    expected: dict[str, Any] = {"a": 1, "b": "from-file", "c": "from-yaml", "d": [1, 2], "e": "raw",
                                "when": "2024-01-31", "num": "42"}
    assert data["stdout"] == repr(expected) + "\n"  # a date stays text (papermill's loader), -r is always text
    assert _executed(Path(data["notebook_path"])).metadata.papermill.parameters == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [(["-b", "!!not base64"], "-b"), (["-b", base64.b64encode(b"[1, 2]").decode()], "mapping"),
     (["-y", "[1, 2]"], "mapping"), (["-y", "a: [unclosed"], "not valid YAML"),
     (["-f", "missing.yaml"], "does not exist"), (["-r", "2bad", "x"], "not a Python identifier")],
    ids=["bad-base64", "base64-not-a-mapping", "yaml-not-a-mapping", "bad-yaml", "missing-file", "bad-raw-name"])
def test_bad_parameter_forms_exit_2(tmp_path: Path, options: list[str], message: str) -> None:
    notebook = _printer(tmp_path / "project")
    done = run_cli("run", *options, str(notebook), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


# -- the API brings a notebook's folder, as the CLI does ----------------------------------------------------------

def _png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _image_project(root: Path) -> Path:
    """A notebook that reads an image beside it by relative path and shows it (as nbclient's test files do)."""
    folder = root / "project"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)  # the sandbox's uid reads the mounted folder
    (folder / "logo.png").write_bytes(_png(3, 2))
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("data = open('logo.png', 'rb').read()\nprint(len(data), data[:4])"),
        nbformat.v4.new_code_cell("from IPython.display import Image\nImage(filename='logo.png')")])
    nbformat.write(nb, folder / "show.ipynb")
    return folder / "show.ipynb"


def test_the_api_mounts_a_notebooks_folder(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    notebook = _image_project(tmp_path)
    result = nbexec.execute_notebook(notebook, config=config)
    assert result.ok, result.error
    assert result.stdout == f"{len(_png(3, 2))} b'\\x89PNG'\n"
    assert [Path(image.path).read_bytes() for image in result.images] == [_png(3, 2)]
    assert not result.files and not result.skipped_files  # nbexec's links to the folder are not files
    assert result.notebook.metadata.papermill.input_path == str(notebook)

    alone = nbexec.execute_notebook(notebook, config=config, mount_folder=False)
    assert not alone.ok and alone.error is not None and alone.error.ename == "FileNotFoundError"


def test_the_api_mounts_nothing_for_code_or_a_notebook_object(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    notebook = _image_project(tmp_path)
    code = nbexec.execute_notebook("import os\nprint(os.path.exists('/mnt/input'))", config=config)
    assert code.ok and code.stdout == "False\n"
    loaded = nbexec.execute_notebook(load(notebook), config=config)
    assert not loaded.ok and loaded.error is not None and loaded.error.ename == "FileNotFoundError"


def test_a_notebook_of_4_5_without_cell_ids_gets_them_without_a_warning() -> None:
    """nbformat warns (an error under pytest) and will refuse such notebooks; nbexec gives the missing ids."""
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "1"},
             {"cell_type": "markdown", "id": "kept", "metadata": {}, "source": "x"}]
    nb = nbexec.notebook.from_json(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert nb.cells[1].id == "kept" and isinstance(nb.cells[0].get("id"), str) and nb.cells[0].id != "kept"
    older = nbexec.notebook.from_json(json.dumps({"cells": cells[:1], "metadata": {}, "nbformat": 4,
                                                  "nbformat_minor": 4}))
    assert "id" not in older.cells[0]


def test_metadata_of_the_wrong_shape_in_an_input_notebook_is_replaced(config: nbexec.SandboxConfig) -> None:
    """A notebook from a client (the HTTP service takes them) whose nbexec or papermill metadata, or a skipped
    cell's, has the wrong shape: the run still gives a result, with papermill's metadata written anew."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print('x')", metadata={"tags": ["skip-execution"], "nbexec": 5,
                                                          "papermill": [1]}),
        nbformat.v4.new_code_cell("print('ran')")])
    nb.metadata.update({"nbexec": "not a mapping", "papermill": {"default_parameters": [1, 2]}})
    result = nbexec.execute_notebook(nbformat.from_dict(nb), config=config)
    assert result.ok, result.error
    assert result.stdout == "ran\n"
    assert result.notebook.metadata.papermill.default_parameters == {}
    assert [c.metadata.papermill.status for c in result.notebook.cells] == ["completed", "completed"]
