"""Paths are paths, code is code: a one-line str ending in .ipynb or .py is a file (papermill's habit), one that
names no file is a clear error, and a model's code is never taken as a path; allow_errors runs every cell, keeps
each error and still fails the run (API, session, `nbexec run`, execute_many, HTTP one-shot, session and batch)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

import nbexec
from nbexec import notebook
from nbexec.errors import NotebookError
from nbexec.service.settings import ServerSettings

from .conftest import wait_until
from .test_cli import nbexec as run_cli
from .test_server import TOKEN_A, Running, running


def _project(tmp_path: Path, cells: list[str], name: str = "report.ipynb") -> Path:
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)  # the sandbox's uid reads the folder
    (folder / "data.txt").write_text("beside the notebook")
    (folder / "data.txt").chmod(0o644)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), folder / name)
    (folder / name).chmod(0o644)
    return folder / name


@pytest.mark.parametrize(("text", "path"), [
    ("report.ipynb", True), ("sub dir/Report.IPYNB", True), ("analysis.py", True), ("/abs/x.py", True),
    ("print(1)", False), ("x.py\n", False), ("import a.py\nprint(2)", False), ("report.ipynb.bak", False),
    ("a.pyc", False), ("", False)], ids=lambda v: repr(v))
def test_the_rule_for_a_str(text: str, path: bool) -> None:
    assert notebook.is_path(text) is path


def test_a_str_naming_no_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotebookError, match=r"'report\.ipynb' names no file .* never as code"):
        notebook.coerce("report.ipynb")


def test_execute_notebook_takes_a_str_path_with_its_folder(config: nbexec.SandboxConfig, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = _project(tmp_path, ["print(open('data.txt').read())"])
    monkeypatch.chdir(path.parent)
    result = nbexec.execute_notebook("report.ipynb", config=config)  # not run as code (a NameError)
    assert result.ok, result.error
    assert result.stdout == "beside the notebook\n"
    assert result.notebook.metadata.papermill.input_path == "report.ipynb"


def test_a_session_runs_a_notebook_by_path(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    path = _project(tmp_path, ["x = 41", "print(x + 1)"])
    with nbexec.Session(config) as session:
        result = session.run_notebook(str(path))
        assert result.ok and result.stdout == "42\n", result.error
        with pytest.raises(NotebookError, match="names no file"):
            session.run_notebook(str(tmp_path / "missing.ipynb"))


def test_a_models_code_is_never_taken_as_a_path(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    """A tool call whose code is one line naming a host file: run as code (an error), never read on the host and
    run with its folder."""
    from nbexec.integrations import toolcall

    secret = tmp_path / "private" / "steal.py"
    secret.parent.mkdir(mode=0o755)
    secret.parent.chmod(0o755)
    secret.write_text("print('HOST-' + 'SECRET', open('token.txt').read())")
    (secret.parent / "token.txt").write_text("tok-123")
    for path in (secret.parent, secret, secret.parent / "token.txt"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    result = toolcall.run({"code": str(secret)}, config=config)
    assert not isinstance(result, str) and not result.ok
    assert result.error is not None and result.error.ename in ("SyntaxError", "NameError")
    shown = json.dumps(result.to_dict()) + result.stdout
    assert "HOST-SECRET" not in shown and "tok-123" not in shown


# -- allow_errors ----------------------------------------------------------------------------------------------

CELLS = ["print('one')", "1/0", "print('three')", "{}['missing']", "print('five')"]


def test_allow_errors_runs_every_cell_and_still_fails(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import raise_for_execution_errors

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    result = nbexec.execute_notebook(nb, config=config, allow_errors=True)
    assert result.stdout == "one\nthree\nfive\n"  # every cell ran
    assert not result.ok and result.error is not None  # a flag never turns a failure into a success
    assert (result.error.ename, result.error.cell_index) == ("ZeroDivisionError", 1)  # the first error
    kept = [(o["cell_index"], o["ename"]) for o in result.outputs if o["output_type"] == "error"]
    assert kept == [(1, "ZeroDivisionError"), (3, "KeyError")]  # each error kept
    assert any("went on past 2 error(s)" in note for note in result.notes), result.notes
    executed = result.notebook
    assert executed.metadata["nbexec"]["ok"] is False and executed.metadata["papermill"]["exception"] is True
    assert [c.metadata.papermill.status for c in executed.cells] == [
        "completed", "failed", "completed", "failed", "completed"]
    with pytest.raises(PapermillExecutionError):  # papermill's judgement agrees: failed (it names the last error)
        raise_for_execution_errors(nbformat.from_dict(json.loads(json.dumps(executed))), str(tmp_path / "j.ipynb"))


def test_allow_errors_still_ends_at_sys_exit_and_in_a_session(config: nbexec.SandboxConfig) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in
                                         ["1/0", "import sys; sys.exit(0)", "print('after')"]])
    result = nbexec.execute_notebook(nb, config=config, allow_errors=True)
    assert not result.ok and result.error is not None and result.error.ename == "ZeroDivisionError"
    assert "after" not in result.stdout
    with nbexec.Session(config) as session:
        went_on = session.run_notebook(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in
                                                                        CELLS]), allow_errors=True)
        assert not went_on.ok and went_on.stdout == "one\nthree\nfive\n"
        assert session.run("print('fine')").ok  # the next run starts clean


def test_allow_errors_on_the_command_line(cleanup_ledger: None, tmp_path: Path) -> None:
    first = _project(tmp_path, CELLS)
    second = _project(tmp_path, ["print('ok')"], name="fine.ipynb")
    done = run_cli("run", "--json", "--allow-errors", str(first), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["stdout"] == "one\nthree\nfive\n" and data["error"]["ename"] == "ZeroDivisionError"
    batch = run_cli("run", "--json", "--allow-errors", str(first), str(second), cwd=tmp_path)
    assert batch.returncode == 1, batch.stderr
    statuses = {Path(r["file"]).name: (r["status"], r["result"]["stdout"]) for r in json.loads(batch.stdout)["results"]}
    assert statuses == {"report.ipynb": ("failed", "one\nthree\nfive\n"), "fine.ipynb": ("passed", "ok\n")}


def test_allow_errors_in_execute_many(config: nbexec.SandboxConfig) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    items = {item.index: item for item in nbexec.execute_many([nb, nb], config=config, concurrency=2,
                                                              allow_errors=True)}
    for item in items.values():
        assert item.result is not None and not item.ok  # every cell ran, and the item still failed
        assert item.result.stdout == "one\nthree\nfive\n" and item.result.error is not None
        assert [o["ename"] for o in item.result.outputs if o["output_type"] == "error"] == ["ZeroDivisionError",
                                                                                               "KeyError"]


# -- allow_errors over HTTP: a body's `cells` --------------------------------------------------------------------

@pytest.fixture(scope="module")
def service(docker_ready: None) -> Iterator[Running]:
    from .conftest import IMAGE

    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, interrupt_grace=2)
    with running(ServerSettings(config=config, tokens=(TOKEN_A,), max_running_per_token=2)) as served:
        yield served


def _went_on(result: dict[str, Any]) -> None:
    """Every cell ran, each error kept, and the result still failed with the first error."""
    assert result["ok"] is False and result["stdout"] == "one\nthree\nfive\n", result
    assert (result["error"]["ename"], result["error"]["cell_index"]) == ("ZeroDivisionError", 1)
    kept = [(o["cell_index"], o["ename"]) for o in result["outputs"] if o["output_type"] == "error"]
    assert kept == [(1, "ZeroDivisionError"), (3, "KeyError")]
    assert any("went on past 2 error(s)" in note for note in result["notes"]), result["notes"]


def test_allow_errors_over_http_one_shot_and_in_a_session(cleanup_ledger: None, service: Running) -> None:
    with service.client() as http:
        _went_on(http.post("/v1/execute", json={"cells": CELLS, "allow_errors": True}).json())
        stopped = http.post("/v1/execute", json={"cells": CELLS}).json()  # without it: the first error ends it
        assert stopped["ok"] is False and stopped["stdout"] == "one\n"
        session = http.post("/v1/sessions").json()["id"]
        try:
            _went_on(http.post(f"/v1/sessions/{session}/execute", json={"cells": CELLS, "allow_errors": True}
                               ).json())
            assert http.post(f"/v1/sessions/{session}/execute", json={"code": "print('next')"}).json()["ok"]
        finally:
            http.delete(f"/v1/sessions/{session}")
        for wrong in ({}, {"code": "1", "cells": ["2"]}, {"cells": []}, {"cells": ["x" * 600_000] * 2},
                      {"cells": [" ", "\n"]}, {"code": " "}):
            assert http.post("/v1/execute", json=wrong).status_code == 422, wrong


def test_allow_errors_in_an_http_batch(cleanup_ledger: None, service: Running) -> None:
    with service.client() as http:
        made = http.post("/v1/batches", json=[{"cells": CELLS, "allow_errors": True}, {"code": "print('ok')"}])
        assert made.status_code == 202, made.text
        batch = made.json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch}").json()["status"] == "done", 120, "the batch never ended")
        items = {item["index"]: item["result"] for item in http.get(f"/v1/batches/{batch}").json()["items"]}
    _went_on(items[0])
    assert items[1]["ok"] is True
