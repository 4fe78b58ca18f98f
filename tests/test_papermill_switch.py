"""papermill's command line and Python API, against nbexec, driven as papermill's users drive them: every option of
papermill's own command accepted, its warnings, exit codes and `-` for stdout; `import nbexec.papermill as pm` with
papermill's signatures, return values and exception; and `nbexec run IN OUT` never running OUT as an input.

papermill itself (the test extra) is the reference: its click command lists the options, its --prepare-only output
and warnings are compared, its inspect_notebook and PapermillExecutionError are compared with nbexec's. No local
kernel is installed, so papermill executes nothing here; nbexec runs in the real sandbox."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import nbexec.papermill as pm

from .test_cli import nbexec as run_cli

NOTEBOOKS = Path(__file__).parent / "files" / "notebooks"


def _project(tmp_path: Path, cells: list[str] | None = None, name: str = "report.ipynb") -> Path:
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)  # the sandbox's uid reads the folder
    if cells is None:
        shutil.copyfile(NOTEBOOKS / "simple_execute.ipynb", folder / name)
    else:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nb.cells[0].metadata["tags"] = ["parameters"]
        nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
        nbformat.write(nb, folder / name)
    (folder / name).chmod(0o644)
    return folder / name


def _papermill(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "papermill", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


# -- the command line ------------------------------------------------------------------------------------------------

def test_every_papermill_option_is_accepted() -> None:
    """Each option string of papermill's own command (and its --no- forms) is one of `nbexec papermill`'s."""
    import papermill.cli

    from nbexec.cli.papermill import command

    theirs = {opt for p in papermill.cli.papermill.params for opt in (*p.opts, *p.secondary_opts)}
    ours = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    assert theirs - ours == set()


@pytest.mark.parametrize("flags", [[], ["--inject-paths"]], ids=["plain", "inject-paths"])
def test_prepare_only_matches_papermill(tmp_path: Path, flags: list[str]) -> None:
    """The same command line gives the same parameters (papermill's -p typing), the same warnings, the same
    papermill metadata; papermill's own prepare-only run is the reference."""
    notebook = _project(tmp_path)
    args = ["-p", "msg", "3", "-p", "bogus", "[1,2]", "-r", "raw", "True", "-y", "year: 2025", "--prepare-only",
            *flags]
    theirs = _papermill(notebook.name, "pm.ipynb", *args, cwd=notebook.parent)
    ours = run_cli("papermill", notebook.name, "nb.ipynb", *args, cwd=notebook.parent)
    assert (ours.returncode, theirs.returncode) == (0, 0), ours.stderr + theirs.stderr
    warned = sorted(line for line in ours.stderr.splitlines() if line.startswith("Passed unknown parameter"))
    assert warned and warned == sorted(line for line in theirs.stderr.splitlines()
                                       if line.startswith("Passed unknown parameter"))
    mine = json.loads((notebook.parent / "nb.ipynb").read_text())["metadata"]["papermill"]
    reference = json.loads((notebook.parent / "pm.ipynb").read_text())["metadata"]["papermill"]
    assert mine["parameters"] == {k: v.replace("pm.ipynb", "nb.ipynb") if isinstance(v, str) else v
                                  for k, v in reference["parameters"].items()}
    assert mine["parameters"]["bogus"] == "[1,2]" and mine["parameters"]["msg"] == 3  # papermill's -p, not YAML
    assert set(reference) <= set(mine)


def test_a_run_writes_the_output_and_warns_of_an_unknown_parameter(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    done = run_cli("papermill", notebook.name, "out.ipynb", "-p", "msg", "hello", "-p", "mgs", "typo", "-k",
                   "python3", "--log-output", "--no-progress-bar", "--execution-timeout", "60", "--start-timeout",
                   "60", "--stdout-file", "printed.txt", "--report-mode", "--request-save-on-cell-execute",
                   cwd=notebook.parent)
    assert done.returncode == 0, done.stderr
    assert "Passed unknown parameter: mgs" in done.stderr
    assert "hello" in done.stderr.splitlines()  # --log-output logs what the notebook printed, as papermill
    assert (notebook.parent / "printed.txt").read_text() == "hello\n"
    executed = nbformat.read(notebook.parent / "out.ipynb", as_version=4)
    assert executed.metadata.papermill.parameters == {"msg": "hello", "mgs": "typo"}
    assert executed.metadata.papermill.output_path == "out.ipynb"
    assert all(c.metadata.jupyter.source_hidden for c in executed.cells if c.cell_type == "code")  # report mode
    assert [o.text for c in executed.cells for o in c.get("outputs", []) if o.get("name") == "stdout"] == ["hello\n"]


def test_cwd_inject_paths_and_stderr_file(cleanup_ledger: None, tmp_path: Path) -> None:
    """--cwd is the folder the code works in (copied in, never written); --inject-paths gives both paths."""
    notebook = _project(tmp_path, ["x = 1", "import sys\nprint(open('other.txt').read(), PAPERMILL_INPUT_PATH, "
                                   "PAPERMILL_OUTPUT_PATH)\nprint('to stderr', file=sys.stderr)\n"
                                   "open('other.txt', 'w').write('changed')"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    (elsewhere / "other.txt").write_text("from cwd")
    (elsewhere / "other.txt").chmod(0o644)
    done = run_cli("papermill", notebook.name, "out.ipynb", "--cwd", str(elsewhere), "--inject-paths",
                   "--stderr-file", "err.txt", cwd=notebook.parent)
    assert done.returncode == 0, done.stderr
    executed = nbformat.read(notebook.parent / "out.ipynb", as_version=4)
    printed = [o.text for c in executed.cells for o in c.get("outputs", []) if o.get("name") == "stdout"]
    assert printed == ["from cwd report.ipynb out.ipynb\n"]
    assert (notebook.parent / "err.txt").read_text() == "to stderr\n"
    assert (elsewhere / "other.txt").read_text() == "from cwd"  # the host's copy untouched


def test_dash_writes_the_notebook_to_stdout(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    done = run_cli("papermill", notebook.name, "-", "-p", "msg", "piped", cwd=notebook.parent)
    assert done.returncode == 0, done.stderr
    executed = nbformat.reads(done.stdout, as_version=4)  # stdout holds the notebook and nothing else
    assert executed.metadata.papermill.parameters == {"msg": "piped"}
    assert "Input Notebook" not in done.stderr  # papermill logs at ERROR when the notebook goes to stdout


def test_a_failing_notebook_exits_1_with_papermills_error_and_markers(cleanup_ledger: None, tmp_path: Path) -> None:
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import raise_for_execution_errors

    notebook = _project(tmp_path, ["x = 1", "print('before')", "1/0", "print('never')"])
    done = run_cli("papermill", notebook.name, "out.ipynb", cwd=notebook.parent)
    assert done.returncode == 1, done.stderr
    assert "PapermillExecutionError" in done.stderr and 'Exception encountered at "In [3]":' in done.stderr
    assert "ZeroDivisionError" in done.stderr
    executed = nbformat.read(notebook.parent / "out.ipynb", as_version=4)
    marked = [i for i, c in enumerate(executed.cells) if "papermill-error-cell-tag" in c.metadata.get("tags", [])]
    assert marked == [0, 3]  # a banner at the top and an anchor before the failed cell, as papermill writes them
    executed.cells = [c for i, c in enumerate(executed.cells) if i not in marked]
    with pytest.raises(PapermillExecutionError) as raised:  # papermill's own judgement agrees
        raise_for_execution_errors(executed, str(tmp_path / "judged.ipynb"))
    assert (raised.value.ename, raised.value.exec_count) == ("ZeroDivisionError", 3)


def test_a_dead_kernel_exits_138(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path, ["x = 1", "import os; os._exit(1)"])
    done = run_cli("papermill", notebook.name, "out.ipynb", cwd=notebook.parent)
    assert done.returncode == 138, done.stderr


@pytest.mark.parametrize(("args", "code"), [([], 2), (["in.ipynb", "out.ipynb", "--bogus"], 2),
                                            (["missing.ipynb", "out.ipynb"], 1), (["-p", "x"], 2)],
                         ids=["no-arguments", "unknown-option", "missing-input", "half-a-parameter"])
def test_usage_errors_exit_as_papermill(tmp_path: Path, args: list[str], code: int) -> None:
    ours = subprocess.run([sys.executable, "-m", "nbexec.cli", "papermill", *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert ours.returncode == _papermill(*args, cwd=tmp_path).returncode == code, ours.stderr


def test_help_notebook_lists_the_parameters_as_papermill(tmp_path: Path) -> None:
    notebook = _project(tmp_path, ["a: int = 1  # how many\nb = 'x'\nc = [1,\n     2]", "print(a)"])
    ours = run_cli("papermill", "--help-notebook", notebook.name, cwd=notebook.parent)
    theirs = _papermill("--help-notebook", notebook.name, cwd=notebook.parent)
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout.split("\n", 1)[1] == theirs.stdout.split("\n", 1)[1]  # all but the usage line


# -- the Python API --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["execute_notebook", "inspect_notebook"])
def test_the_api_has_papermills_signatures(name: str) -> None:
    import papermill

    theirs = inspect.signature(getattr(papermill, name)).parameters
    ours = inspect.signature(getattr(pm, name)).parameters
    assert [(p.name, p.kind, p.default) for p in theirs.values()] == \
        [(p.name, p.kind, p.default) for p in ours.values()]


def test_inspect_notebook_returns_what_papermill_returns(tmp_path: Path) -> None:
    import papermill

    notebook = _project(tmp_path, ["a: int = 1  # how many\nb = 'x'  # a name\nc = None\nd: 'str' = \"q\"", "1"])
    for path in (notebook, NOTEBOOKS / "simple_execute.ipynb", NOTEBOOKS / "parameters_4.3.ipynb"):
        assert pm.inspect_notebook(str(path)) == papermill.inspect_notebook(str(path))


def test_the_execution_error_is_papermills() -> None:
    from papermill.exceptions import PapermillExecutionError

    args = (2, 3, "1/0", "ZeroDivisionError", "division by zero", ["\x1b[31mTraceback\x1b[0m", "ZeroDivisionError"])
    ours, theirs = pm.PapermillExecutionError(*args), PapermillExecutionError(*args)
    assert str(ours) == str(theirs) and ours.args == theirs.args
    assert [getattr(ours, a) for a in ("cell_index", "exec_count", "source", "ename", "evalue", "traceback")] == \
        [getattr(theirs, a) for a in ("cell_index", "exec_count", "source", "ename", "evalue", "traceback")]


def test_execute_notebook_returns_the_notebook_or_raises(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    out = tmp_path / "out.ipynb"
    nb = pm.execute_notebook(str(notebook), str(out), parameters={"msg": "api"}, progress_bar=False)
    assert isinstance(nb, nbformat.NotebookNode) and nb == nbformat.read(out, as_version=4)
    assert [o.text for c in nb.cells for o in c.get("outputs", [])] == ["api\n"]
    failing = _project(tmp_path, ["x = 1", "raise KeyError('k')"], name="failing.ipynb")
    with pytest.raises(pm.PapermillExecutionError) as raised:
        pm.execute_notebook(failing, tmp_path / "failed.ipynb")
    assert (raised.value.ename, raised.value.cell_index) == ("KeyError", 1)
    assert raised.value.result is not None and not raised.value.result.ok
    assert (tmp_path / "failed.ipynb").exists()  # written before the raise, as papermill does


# -- `nbexec run IN OUT` ---------------------------------------------------------------------------------------------

def test_run_never_runs_an_intended_output_as_an_input(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    missing = run_cli("run", notebook.name, "out.ipynb", cwd=notebook.parent)
    assert missing.returncode == 2 and "nbexec papermill report.ipynb out.ipynb" in missing.stderr
    assert run_cli("papermill", notebook.name, "out.ipynb", cwd=notebook.parent).returncode == 0
    before, runs = (notebook.parent / "out.ipynb").read_bytes(), set((notebook.parent / "nbexec-output").iterdir())
    again = run_cli("run", notebook.name, "out.ipynb", cwd=notebook.parent)
    assert again.returncode == 2 and "is an executed copy of report.ipynb" in again.stderr
    assert "--save-notebook" in again.stderr
    assert (notebook.parent / "out.ipynb").read_bytes() == before
    assert set((notebook.parent / "nbexec-output").iterdir()) == runs  # nothing ran
