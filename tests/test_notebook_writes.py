"""Writing next to the notebook, as under papermill, while the host's files stay untouched: a notebook overwrites
an input CSV, writes into an existing sub-folder and a new one; the host's folder is byte-identical afterwards,
the writes are the result's files (in its output folder), a note names the inputs shadowed, and unchanged inputs
are not files of the result. The copy never reads through a link on the host and never shows the sandbox what
it could not read through the read-only mount."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nbformat

import nbexec

from .test_cli import nbexec as run_cli

WRITER = [
    "import pandas as pd\ndf = pd.read_csv('table.csv')\nprint(df.b.sum())",
    "df.assign(b=df.b * 10).to_csv('table.csv', index=False)",  # overwrite an input
    "open('figures/plot.txt', 'w').write('a plot')",  # into an existing sub-folder
    "import os\nos.makedirs('results/deep', exist_ok=True)\nopen('results/deep/r.txt', 'w').write('r')",
    "open('inputs/notes.txt', 'a').write(' and more')",  # append to a file in a sub-folder
    "try:\n    open('/mnt/input/table.csv', 'w')\nexcept OSError as e:\n    print('mount:', e.strerror)",
    "print(open('table.csv').read().splitlines()[1])",  # reads back its own version
]


def _project(root: Path) -> Path:
    folder = root / "project"
    for sub in ("figures", "inputs", "unused"):
        (folder / sub).mkdir(parents=True, mode=0o755)
    (folder / "table.csv").write_text("a,b\n1,2\n3,4\n")
    (folder / "figures" / "old.txt").write_text("kept")
    (folder / "inputs" / "notes.txt").write_text("notes")
    (folder / "unused" / "big.bin").write_bytes(os.urandom(4096))
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in WRITER]),
                   folder / "analysis.ipynb")
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the sandbox's uid reads the folder
    return folder / "analysis.ipynb"


def _tree(folder: Path) -> dict[str, tuple[int, str]]:
    """Every entry below ``folder``: its mode and, for a file, its sha256 (links not followed)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
        found[str(path.relative_to(folder))] = (st.st_mode, digest)
    return found


def test_writing_next_to_the_notebook_leaves_the_host_untouched(config: nbexec.SandboxConfig,
                                                                tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    before = _tree(notebook.parent)
    result = nbexec.execute_notebook(notebook, config=config, output_dir=tmp_path / "out")
    assert result.ok, result.error
    assert result.stdout == "6\nmount: Read-only file system\n1,20\n"
    assert _tree(notebook.parent) == before  # the host's files byte-identical, nothing added
    data = tmp_path / "out" / "data"
    assert {f.name for f in result.files} == {"table.csv", "figures/plot.txt", "results/deep/r.txt",
                                              "inputs/notes.txt"}  # unchanged inputs are not the code's files
    assert (data / "table.csv").read_text() == "a,b\n1,20\n3,40\n"
    assert (data / "figures" / "plot.txt").read_text() == "a plot"
    assert (data / "inputs" / "notes.txt").read_text() == "notes and more"
    assert not (data / "unused").exists() and not (data / "figures" / "old.txt").exists()
    shadowed = [n for n in result.notes if "wrote over 2 file(s) of the notebook's folder" in n]
    assert shadowed and "inputs/notes.txt" in shadowed[0] and "table.csv" in shadowed[0], result.notes
    assert not result.skipped_files  # nbexec's own copies and links are not the code's leftovers


def test_the_command_line_writes_next_to_the_notebook(cleanup_ledger: None, tmp_path: Path) -> None:
    notebook = _project(tmp_path)
    before = _tree(notebook.parent)
    done = run_cli("run", str(notebook), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Read-only file system" not in done.stderr.replace("mount: Read-only file system", "")
    assert _tree(notebook.parent) == before
    assert (tmp_path / "out" / "data" / "table.csv").read_text() == "a,b\n1,20\n3,40\n"


def test_the_copy_never_follows_a_link_or_widens_what_the_sandbox_reads(config: nbexec.SandboxConfig,
                                                                        tmp_path: Path) -> None:
    """A link in the folder to a host file outside it, and a file the sandbox user cannot read (0600, the host's):
    neither's bytes reach the sandbox, as with the read-only mount alone."""
    outside = tmp_path / "outside.txt"
    outside.write_text("HOST-ONLY-BYTES")
    outside.chmod(0o644)
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    (folder / "link.txt").symlink_to(outside)
    (folder / "private.txt").write_text("PRIVATE-BYTES")
    (folder / "private.txt").chmod(0o600)
    (folder / "run.py").write_text(
        "import os\nfor name in ('link.txt', 'private.txt'):\n"
        "    try:\n        print(name, open(name).read())\n    except OSError as e:\n        print(name, e.strerror)\n"
        "print(os.readlink('link.txt'))\n")
    (folder / "run.py").chmod(0o644)
    result = nbexec.execute_notebook(folder / "run.py", config=config)
    assert result.ok, result.error
    assert "HOST-ONLY-BYTES" not in result.stdout
    if os.geteuid() == 0:  # the sandbox runs as a uid of its own; without root it is the host user, who may read it
        assert "PRIVATE-BYTES" not in result.stdout and "private.txt Permission denied" in result.stdout
    assert result.stdout.splitlines()[-1] == str(outside)  # the link as it is, resolved in the sandbox's tree


def test_an_earlier_runs_output_folder_is_linked_not_copied(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    from nbexec.files.folders import mark

    folder = tmp_path / "project"
    (folder / "nbexec-output" / "run-1").mkdir(parents=True)
    mark(folder / "nbexec-output")
    (folder / "nbexec-output" / "run-1" / "big.csv").write_text("x" * 1000)
    (folder / "run.py").write_text("import os\nprint(os.path.islink('nbexec-output'), os.path.isdir('nbexec-output'))")
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    result = nbexec.execute_notebook(folder / "run.py", config=config)
    assert result.ok and result.stdout == "True True\n", (result.error, result.stdout)
