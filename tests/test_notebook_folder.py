"""What real notebooks assume: files next to them readable by relative path, IPython history, widgets."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

import nbexec

from .test_cli import nbexec as run_cli


def write_project(root: Path) -> Path:
    """A notebook in a folder with a data file and a sub-folder, as a project checkout has them."""
    folder = root / "project"
    (folder / "inputs").mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)  # the sandbox's uid reads the mounted folder
    (folder / "table.csv").write_text("a,b\n1,2\n")
    (folder / "inputs" / "note.txt").write_text("from a sub-folder")
    cells = [nbformat.v4.new_code_cell("import pandas as pd\nprint(pd.read_csv('table.csv').b.sum())"),
             nbformat.v4.new_code_cell("print(open('inputs/note.txt').read())"),
             nbformat.v4.new_code_cell("pd.DataFrame({'x': [1]}).to_csv('result.csv')\nimport os\n"
                                       "print(os.getcwd(), os.path.isfile('/mnt/data/result.csv'))")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), folder / "analysis.ipynb")
    return folder / "analysis.ipynb"


def test_files_next_to_the_notebook_are_read_by_relative_path(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = write_project(tmp_path)
    done = run_cli("run", "--json", str(notebook), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    data = json.loads(done.stdout)
    assert data["stdout"] == "2\nfrom a sub-folder\n/mnt/data True\n"
    assert [f["name"] for f in data["files"]] == ["result.csv"]  # new files land in /mnt/data, and only they
    assert data["skipped_files"] == []  # the links nbexec made to the folder are not reported
    assert not (notebook.parent / "result.csv").exists()  # the folder is read-only to the code

    alone = run_cli("run", "--json", "--no-mount-folder", str(notebook), cwd=tmp_path)
    assert alone.returncode == 1 and "FileNotFoundError" in json.loads(alone.stdout)["error"]["ename"]


def test_history_is_kept_in_memory(config: nbexec.SandboxConfig) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell(
        "print(len(_ih), _ih[1])\n%history -n 1\nmanager = get_ipython().history_manager\n"
        "print(manager.enabled, manager.hist_file, list(manager.search('x = *'))[0][2])")])
    result = nbexec.execute_notebook(nb, config=config)
    assert result.ok, result.error
    assert result.stdout.startswith("3 x = 1\n") and "1: x = 1" in result.stdout
    assert result.stdout.endswith("True :memory: x = 1\n")  # searchable, and no sqlite file in the sandbox


def test_widgets_and_notebook_progress_bars_run(config: nbexec.SandboxConfig) -> None:
    code = ("import ipywidgets as widgets\nfrom tqdm.notebook import tqdm\n"
            "display(widgets.IntSlider(value=3))\nprint(sum(tqdm(range(5))))")
    result = nbexec.execute_notebook(code, config=config)
    assert result.ok, result.error
    assert "10" in result.stdout
    views = [o for o in result.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views, result.outputs
