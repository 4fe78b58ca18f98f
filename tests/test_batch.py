"""`nbexec run` over many files: JUnit XML, HTML, parameters, exit codes, nothing left behind."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from nbexec import NotebookError
from nbexec.cli.batch import discover
from nbexec.notebook import parameters

from .conftest import unaccounted_containers
from .test_cli import nbexec


def write_batch(folder: Path) -> None:
    folder.mkdir()
    (folder / "plot.py").write_text(
        '# %% tags=["parameters"]\nscale = 1\nlabel = "x"\n'
        "# %%\nimport matplotlib.pyplot as plt\nprint('scale', scale, 'label', label)\n"
        "plt.plot([0, scale]); plt.show()\n")
    (folder / "broken.py").write_text("print('partial')\nraise RuntimeError('nope')\n")
    (folder / "forever.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(open('/mnt/input/data.txt').read())")])
    nbformat.write(nb, folder / "reads_input.ipynb")


def test_batch_reports_everything(cleanup_ledger: None, tmp_path: Path) -> None:
    write_batch(tmp_path / "nb")
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "data.txt").write_text("from the host")
    started = time.monotonic()
    # 15 s: forever.py's limit, and room for plot.py's matplotlib on a loaded machine (4 s was not)
    done = nbexec("run", "nb", "-j", "2", "--timeout", "15", "-p", "scale", "3", "-p", "label", "'y'",
                  "--mount-input", "input", "--junit-xml", "out/junit.xml", "--html-dir", "out/html",
                  "--output-dir", "out/runs", cwd=tmp_path)
    assert time.monotonic() - started < 120
    assert done.returncode == 1, done.stderr
    assert "PASSED" in done.stdout and "TIMEOUT" in done.stdout and "2 passed, 2 failed" in done.stdout
    # the failed files' tracebacks follow the progress lines, one section each
    assert "--- nb/broken.py: FAILED ---" in done.stderr and "RuntimeError: nope" in done.stderr
    assert "--- nb/forever.py: TIMEOUT ---" in done.stderr and "\x1b" not in done.stderr
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "2", "0")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    broken = cases["nb/broken.py"].find("failure")
    assert broken is not None and broken.get("type") == "RuntimeError" and "nope" in (broken.text or "")
    assert "\x1b" not in (broken.text or "")
    timeout = cases["nb/forever.py"].find("failure")
    assert timeout is not None and timeout.get("type") == "timeout"
    assert "scale 3 label y" in (cases["nb/plot.py"].findtext("system-out") or "")
    assert "from the host" in (cases["nb/reads_input.ipynb"].findtext("system-out") or "")
    html = (tmp_path / "out" / "html" / "plot.html").read_text()
    assert html.count("data:image/png;base64") >= 2  # the plot is embedded (the page has one icon too)
    executed = json.loads((tmp_path / "out" / "runs" / "plot" / "notebook.ipynb").read_text())
    assert executed["metadata"]["nbexec"]["parameters"] == {"scale": 3, "label": "y"}
    assert unaccounted_containers() == []


def test_fail_fast_skips_the_rest(cleanup_ledger: None, tmp_path: Path) -> None:
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "a_fails.py").write_text("1/0\n")
    for n in range(3):
        (folder / f"b{n}.py").write_text("print('ok')\n")
    done = nbexec("run", "nb", "--fail-fast", "--json", cwd=tmp_path)
    assert done.returncode == 1
    statuses = [r["status"] for r in json.loads(done.stdout)["results"]]
    assert statuses == ["failed", "skipped", "skipped", "skipped"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "missing.py", "other.py"], "does not exist"),
        (["run", "empty_dir"], "no .py or .ipynb"),
        (["run", "nb/*.txt"], "matches no"),
        (["run", "nb", "-p", "2bad", "1"], "not a Python identifier"),
        (["run", "nb", "--parameters-file", "params.yaml"], "not valid YAML"),
    ],
    ids=["missing-file", "empty-folder", "empty-glob", "bad-parameter-name", "bad-parameters-file"],
)
def test_bad_batch_input_exits_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "a.py").write_text("1\n")
    (tmp_path / "params.yaml").write_text("a: [unclosed\n")
    done = nbexec(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


@pytest.mark.parametrize(
    ("raw", "value"),
    [("3", 3), ("2.5", 2.5), ("'text'", "text"), ("[1, 2]", [1, 2]), ("true", True), ("{a: 1}", {"a": 1}),
     ("plain words", "plain words"), ("None", None)],
    ids=["int", "float", "quoted", "list", "yaml-bool", "yaml-map", "bare-string", "none"],
)
def test_parameter_values(raw: str, value: object) -> None:
    assert parameters.parse_value(raw) == value


def test_injection_replaces_and_positions() -> None:
    from nbexec.notebook import from_script

    nb = from_script('# %%\nimport os\n# %% tags=["parameters"]\nx = 1\n# %%\nprint(x)\n')
    parameters.inject(nb, {"x": 2})
    parameters.inject(nb, {"x": 3})
    sources = [c.source for c in nb.cells]
    assert sources == ["import os", "x = 1", "# Parameters\nx = 3", "print(x)"]
    nbformat.validate(nb)


def test_discover_orders_and_deduplicates(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("1")
    (tmp_path / "a.ipynb").write_text("{}")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.py").write_text("1")
    (tmp_path / "notes.txt").write_text("x")
    found = discover([str(tmp_path), str(tmp_path / "b.py")])
    assert [p.name for p in found] == ["a.ipynb", "b.py"]
    with pytest.raises(NotebookError):
        discover([str(tmp_path / "nothing")])
