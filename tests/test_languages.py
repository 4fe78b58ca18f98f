"""Notebooks in R, TypeScript/JavaScript (Deno) and Bash (issue #28): the language table, how a notebook, a script
and a caller choose the language, parameters in each language's syntax (pure); then each kernel on real Docker in
the kernels image (built here from environments/jupyter/kernels.Dockerfile on the tests' runtime image when it is
missing or stale; Docker's cache makes that a second): text, errors, rich outputs, /mnt/data files, timeouts that
interrupt and leave the session alive, state across runs, and the clear errors of what is missing or Python-only.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import nbformat
import pytest

import nbexec
from nbexec import Session, languages, notebook
from nbexec.errors import ConfigError, ImageNotFoundError, NotebookError
from nbexec.notebook import assignments, parameters

from .conftest import FILES, IMAGE, KERNELS, own_containers, wait_until

# -- the table, and what chooses the language (pure) ------------------------------------------------------------


@pytest.mark.parametrize(("given", "name"), [
    ("python", "python"), ("python3", "python"), ("py", "python"), ("R", "r"), ("r", "r"), ("ir", "r"),
    ("typescript", "deno"), ("ts", "deno"), ("javascript", "deno"), ("js", "deno"), ("deno", "deno"),
    ("sh", "bash"), ("bash", "bash"), ("Bash", "bash")], ids=str)
def test_aliases_are_normalised_in_the_config(given: str, name: str) -> None:
    assert nbexec.SandboxConfig(language=given).language == name
    assert nbexec.config.from_env({"NBEXEC_LANGUAGE": given}).language == name


@pytest.mark.parametrize("bad", ["cobol", "", "python2", 3, None, ["r"], {"name": "r"}, "r\0"],
                         ids=["unknown", "empty", "python2", "int", "none", "list", "dict", "nul"])
def test_an_unknown_language_is_a_config_error_naming_the_choices(bad: Any) -> None:
    with pytest.raises(ConfigError, match="python, r, deno, bash"):
        nbexec.SandboxConfig(language=bad)


def test_other_languages_use_the_kernels_image_unless_an_image_is_chosen() -> None:
    assert nbexec.SandboxConfig().image_tag == nbexec.config.DEFAULT_IMAGE
    assert nbexec.SandboxConfig(language="r").image_tag == KERNELS
    assert nbexec.SandboxConfig(language="r", kernels_image="mine:1").image_tag == "mine:1"
    assert nbexec.SandboxConfig(language="bash", image="other:2").image_tag == "other:2"
    with pytest.raises(ConfigError, match="Docker image reference"):
        nbexec.SandboxConfig(kernels_image="not a tag!")


def test_the_allowlist_network_is_refused_for_other_languages() -> None:
    with pytest.raises(ConfigError, match="Python-only"):
        nbexec.SandboxConfig(language="r", network="allowlist", allowed_hosts=("example.com",))


@pytest.mark.parametrize(("spec", "name"), [
    ({"name": "ir", "display_name": "R", "language": "R"}, "r"),
    ({"name": "deno", "display_name": "Deno", "language": "typescript"}, "deno"),
    ({"name": "bash", "display_name": "Bash", "language": "bash"}, "bash"),
    ({"name": "python3", "display_name": "Python 3", "language": "python"}, "python"),
    ({"name": "my-conda-env", "display_name": "Py", "language": "python"}, "python"),
    (None, "python")], ids=["ir", "deno", "bash", "python3", "custom-python", "none"])
def test_a_notebooks_kernelspec_chooses_its_language(spec: Any, name: str) -> None:
    nb = _ipynb("1", spec)
    loaded = notebook.from_json(json.dumps(nb))
    assert notebook.language_of(loaded).name == name
    assert loaded.metadata.kernelspec == languages.LANGUAGES[name].spec
    assert notebook.from_json(json.dumps(nb), language="sh").metadata.kernelspec["name"] == "bash"  # the caller's


@pytest.mark.parametrize("spec", [{"name": "xcpp17", "display_name": "C++", "language": "c++"}, {"name": 7},
                                  "ir", ["ir"], 5], ids=["unknown-kernel", "name-not-text", "str", "list", "int"])
def test_a_kernelspec_nbexec_cannot_run_is_a_clear_error_and_starts_nothing(cleanup_ledger: None, spec: Any) -> None:
    before = set(own_containers())  # earlier tests' warm pools (role "pool") and teardowns are not this test's
    with pytest.raises(NotebookError, match="python, r, deno, bash"):
        notebook.from_json(json.dumps(_ipynb("1", spec)))
    with pytest.raises(NotebookError, match="python, r, deno, bash"):
        nbexec.execute_notebook(_ipynb("1", spec), pool_size=0)
    assert set(own_containers()) <= before


@pytest.mark.parametrize(("suffix", "text", "name", "sources"), [
    (".R", "x <- 1\n# %%\nprint(x)\n", "r", ["x <- 1", "print(x)"]),
    (".r", "print(1)\n", "r", ["print(1)"]),
    (".ts", "// %%\nconst a = 1\n// %% [markdown]\n// # Title\n// %%\nconsole.log(a)\n", "deno",
     ["const a = 1", "# Title", "console.log(a)"]),
    (".mjs", "console.log(1)\n", "deno", ["console.log(1)"]),
    (".sh", "echo a\n# %% tags=[\"parameters\"]\nn=1\n", "bash", ["echo a", "n=1"]),
    (".py", "# %%\nprint(1)\n", "python", ["print(1)"]),
    (".txt", "print(1)\n", "python", ["print(1)"])], ids=lambda v: v if isinstance(v, str) and v[:1] == "." else None)
def test_a_scripts_extension_chooses_its_language_and_marker(tmp_path: Path, suffix: str, text: str, name: str,
                                                           sources: list[str]) -> None:
    path = tmp_path / f"job{suffix}"
    path.write_text(text)
    nb = notebook.load(path)
    assert notebook.language_of(nb).name == name
    assert [c.source for c in nb.cells] == sources
    assert notebook.language_of(notebook.load(path, "bash")).name == "bash"  # --language wins


def test_a_deno_script_keeps_python_style_markers_as_code(tmp_path: Path) -> None:
    path = tmp_path / "a.ts"
    path.write_text("# %%\nconsole.log(1)\n")  # `#` is not a comment in TypeScript: one cell, as written
    assert [c.source for c in notebook.load(path).cells] == ["# %%\nconsole.log(1)"]


def test_parameters_in_r_syntax() -> None:
    source = assignments.render(languages.get("r"), {"n": 3, "x": 2.5, "s": 'a"b\\c\nd', "t": True, "f": False,
                                                     "none": None, "l": [1, "a"], "d": {"k": [None]}})
    assert source.splitlines() == ["# Parameters", "n = 3", "x = 2.5", 's = "a\\"b\\\\c\\x0ad"', "t = TRUE",
                                   "f = FALSE", "none = NULL", 'l = list(1, "a")', 'd = list("k" = list(NULL))']


def test_parameters_in_bash_syntax() -> None:
    source = assignments.render(languages.get("bash"), {"n": 3, "s": "it's $HOME; rm -rf /", "b": True,
                                                        "l": ["a b", 2], "e": None})
    assert source.splitlines() == ["# Parameters", "n='3'", "printf -v s %b 'it\\x27s \\x24HOME\\x3b rm -rf /'",
                                   "b='true'", "l=('a b' '2')", "e=''"]


def test_parameters_in_typescript_follow_the_parameters_cells_keyword() -> None:
    cell = "const a = 1\nlet b: number = 2\nvar c = 3\n"
    source = assignments.render(languages.get("deno"), {"a": "x", "b": 5, "c": [1], "d": {"k": "\u2028</script>"}},
                                cell)
    assert source.splitlines() == ["// Parameters", 'const a = "x";', "let b = 5;", "var c = [1];",
                                   'const d = {"k": "\\u2028</script>"};']


@pytest.mark.parametrize(("language", "values", "match"), [
    ("bash", {"m": {"k": 1}}, "mapping"), ("bash", {"m": [[1]]}, "nests"), ("r", {"s": "a\0b"}, "NUL"),
    ("bash", {"s": "a\0b"}, "NUL"), ("r", {"if": 1}, "not a name"), ("r", {"_x": 1}, "not a name"),
    ("deno", {"class": 1}, "not a name"), ("deno", {"b": b"x"}, "bytes"), ("bash", {"é": 1}, "not a name")],
    ids=["bash-dict", "bash-nested", "r-nul", "bash-nul", "r-reserved", "r-underscore", "deno-reserved",
         "deno-bytes", "bash-unicode-name"])
def test_parameters_a_language_cannot_hold_are_refused(language: str, values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        assignments.render(languages.get(language), values)


def test_inject_writes_the_notebooks_language() -> None:
    nb = notebook.from_json(json.dumps(_ipynb("let n = 1", {"name": "deno", "display_name": "Deno"},
                                              tags=["parameters"])))
    parameters.inject(nb, {"n": 7})
    assert nb.cells[1].source == "// Parameters\nlet n = 7;"


# -- on Docker: each kernel in the kernels image ---------------------------------------------------------------


def cfg(language: str, **changes: Any) -> nbexec.SandboxConfig:
    values: dict[str, Any] = {"kernels_image": KERNELS, "pool_size": 0, "warm_imports": (), "timeout": 30,
                              "interrupt_grace": 3, **changes}
    return nbexec.SandboxConfig(language=language, **values)


CASES = {  # per language: prints, raises, a rich output, writes a file, sets state, reads it, loops forever
    "r": dict(print='cat("hello from R\\n")', error='f <- function() stop("deep"); f()', ename="ERROR",
              rich="data.frame(a = 1:2, b = c('x', 'y'))", mime="text/html",
              write='writeLines("r data", "/mnt/data/out.txt")', set="kept <- 41", get="cat(kept + 1)",
              loop="repeat {}"),
    "deno": dict(print='console.log("hello from Deno")', error='throw new TypeError("deep")', ename="TypeError",
                 rich="Deno.jupyter.html`<b>bold</b>`", mime="text/html",
                 write='Deno.writeTextFileSync("/mnt/data/out.txt", "deno data")', set="const kept = 41",
                 get="console.log(kept + 1)", loop="while (true) {}"),
    "bash": dict(print="echo hello from Bash", error="ls /no/such/place", ename="",
                 rich="echo '<b>bold</b>' | displayHTML", mime="text/html",
                 write="echo bash data > /mnt/data/out.txt", set="kept=41", get="echo $((kept + 1))",
                 loop="while true; do :; done"),
}


@pytest.mark.parametrize("language", list(CASES))
def test_a_session_in_each_language(cleanup_ledger: None, kernels_image: str, language: str) -> None:
    case = CASES[language]
    with Session(cfg(language, timeout=4)) as session:
        printed = session.run(case["print"])
        assert printed.ok and printed.text.strip() == f"hello from {dict(r='R', deno='Deno', bash='Bash')[language]}"
        assert session.notebook.metadata.kernelspec == languages.get(language).spec
        raised = session.run(case["error"])
        assert not raised.ok and raised.error is not None and raised.error.kind == "exception"
        assert raised.error.ename == case["ename"]
        assert ("deep" in raised.error.evalue) if language != "bash" else raised.error.evalue == "2"
        if language == "r":  # IRkernel's "Traceback:" header dropped, the frames kept
            assert raised.error.traceback[0] == "Error in f(): deep" and "1. f()" in raised.error.traceback[1], \
                raised.error.traceback
        rich = session.run(case["rich"])
        assert rich.ok
        html = [o["data"][case["mime"]] for o in rich.outputs if case["mime"] in o.get("data", {})]
        assert html and ("<table" in html[0] if language == "r" else "<b>bold</b>" in html[0])
        wrote = session.run(case["write"])
        assert wrote.ok and [f.name for f in wrote.files] == ["out.txt"]
        assert Path(wrote.files[0].path).read_text().strip() == f"{language} data"
        assert session.run(case["set"]).ok
        stopped = session.run(case["loop"])  # past the cell's limit: interrupted, the kernel lives
        assert stopped.error is not None and stopped.error.kind == "timeout" and "interrupted" in stopped.error.evalue
        after = session.run(case["get"])
        assert after.ok and after.text.strip() == "42", after


def test_an_r_plot_comes_back_as_an_image(cleanup_ledger: None, kernels_image: str) -> None:
    result = nbexec.execute_notebook("plot(1:10)", config=cfg("r"))
    assert result.ok and len(result.images) == 1
    assert Path(result.images[0].path).read_bytes().startswith(b"\x89PNG")


def test_a_deno_await_past_the_limit_is_killed_and_said(cleanup_ledger: None, kernels_image: str) -> None:
    # V8 stops running JavaScript on an interrupt, not a pending promise: the sandbox is killed after the grace.
    with Session(cfg("deno", timeout=3, interrupt_grace=2)) as session:
        result = session.run("await new Promise((r) => setTimeout(r, 100000))")
        assert result.error is not None and result.error.kind == "timeout"
        assert "killed" in result.error.evalue
        assert session.status == "dead"


def test_parameters_reach_each_kernel(cleanup_ledger: None, kernels_image: str) -> None:
    cells = {"r": ("n <- 1; s <- 'a'", 'cat(n * 2, s, TRUE, "\\n")', "14 it's TRUE"),
             "deno": ("let n = 1; const s = 'a'", "console.log(n * 2, s)", "14 it's"),
             "bash": ("n=1; s=a", 'echo "$((n * 2)) $s"', "14 it's")}
    for language, (defaults, use, expected) in cells.items():
        nb = notebook.from_json(json.dumps(_ipynb(defaults, languages.get(language).spec, tags=["parameters"])))
        nb.cells.append(nbexec.notebook.from_script(use, language).cells[0])
        parameters.inject(nb, {"n": 7, "s": "it's"})
        result = nbexec.execute_notebook(nb, config=cfg(language))
        assert result.ok and result.text.strip() == expected, (language, result.text, result.error)


def test_a_language_the_image_lacks_is_a_clear_error_before_any_container(cleanup_ledger: None,
                                                                          kernels_image: str) -> None:
    before = set(own_containers())
    with pytest.raises(ConfigError, match=r"has only python\. Build one that has it: `nbexec image build "
                                          r"--kernels deno`"):
        nbexec.execute_notebook("console.log(1)", config=cfg("deno", kernels_image=IMAGE))
    with pytest.raises(ImageNotFoundError, match="nbexec image build --kernels r"):
        nbexec.execute_notebook("1", config=cfg("r", kernels_image="nbexec-no-such-image:never"))
    assert set(own_containers()) <= before


def test_python_only_features_are_refused_for_other_kernels(cleanup_ledger: None, kernels_image: str) -> None:
    before = set(own_containers())
    with pytest.raises(ConfigError, match=r"pip install line .* Python-only, and this notebook is r"):
        nbexec.execute_notebook("%pip install tabulate\nprint(1)", config=cfg("r"))
    with pytest.raises(ConfigError, match="Python-only"):
        nbexec.execute_notebook("echo 1", config=cfg("bash"), packages=["tabulate"])
    with pytest.raises(ConfigError, match=r"Session\.shell is Python-only"):
        Session(cfg("r")).shell("ls")
    assert set(own_containers()) <= before
    with Session(cfg("bash")) as session:
        assert session.run("echo 1").ok
        with pytest.raises(ConfigError, match="the notebook is python and this session's kernel is bash"):
            session.run_notebook(notebook.build("print(1)"))


def test_nbexec_run_picks_the_language_from_the_extension(cleanup_ledger: None, kernels_image: str,
                                                          tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nbexec.cli.main import main

    script = tmp_path / "job.sh"
    script.write_text("echo one cell\n# %%\necho $((6 * 7)) from ${BASH_VERSION%%.*}\n")
    done = CliRunner().invoke(main, ["run", "--json", str(script), "--output-dir", str(tmp_path / "out")],
                              env={"NBEXEC_KERNELS_IMAGE": KERNELS, "NBEXEC_WARM_IMPORTS": ""})
    data = json.loads(done.output)
    assert done.exit_code == 0 and data["ok"], done.output
    assert data["text"].split() == ["one", "cell", "42", "from", "5"]  # two cells, in bash 5


def _ipynb(source: str, spec: Any, *, tags: list[str] | None = None) -> dict[str, Any]:
    metadata = {} if spec is None else {"kernelspec": spec}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": metadata, "cells": [
        {"id": "c1", "cell_type": "code", "metadata": {"tags": tags or []}, "execution_count": None, "outputs": [],
         "source": source}]}


def test_nbexec_run_refuses_an_unknown_language_as_a_usage_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nbexec.cli.main import main

    script = tmp_path / "job.py"
    script.write_text("print(1)\n")
    done = CliRunner().invoke(main, ["run", "--language", "cobol", str(script)])
    assert done.exit_code == 2 and "choose one of python, r, deno, bash" in done.output


def test_a_bash_shell_that_dies_ends_the_kernel_and_says_so(cleanup_ledger: None, kernels_image: str) -> None:
    # bash_kernel alone starts a new bash and replies ok, losing the shell's state without a word; the launcher
    # ends the kernel instead, so the host reports it (an OOM kill of bash is kind "oom": test_languages_hostile).
    with Session(cfg("bash")) as session:
        assert session.run("kept=1").ok
        result = session.run("exit 3")
        assert result.error is not None and result.error.kind == "kernel_died", result.error
        assert "exit code 3" in result.error.evalue and session.status == "dead"


def test_a_deno_timer_that_keeps_printing_does_not_hold_the_run_open(cleanup_ledger: None,
                                                                     kernels_image: str) -> None:
    """Deno's late outputs are read after idle, but only for a while: a setInterval printing every 20 ms must not
    keep the cell running for ever, nor until its limit (its run ends with what it printed in about a second,
    far fewer ticks than the 20 s limit holds). Its note that the cell was still printing is not judged here: on
    a loaded machine a tick can come more than 75 ms after the last, which reads as the cell's end."""
    found: list[nbexec.ExecutionResult] = []
    with Session(cfg("deno", timeout=20)) as session:
        runner = threading.Thread(target=lambda: found.append(session.run(
            "setInterval(() => console.log('tick'), 20);\nconsole.log('set');")))
        runner.start()
        wait_until(lambda: not runner.is_alive(), 120, "the run never ended: a timer's output held it open")
        assert found and found[0].ok and found[0].stdout.startswith("set\n"), found
        ticks = found[0].stdout.count("tick")
        assert 0 < ticks < 250, f"{ticks} ticks read: the run was held open by the timer (1,000 in 20 s)"
        assert session.run("console.log('next')").ok


# -- a notebook per language, compared with its saved outputs ---------------------------------------------------

def _outputs(nb: Any) -> list[list[Any]]:
    """Each code cell's outputs as what they show: streams by name and text, rich data by type (a PNG by its
    signature alone), errors by name and value; counts and metadata left out."""
    def shown(output: Any) -> Any:
        kind = output["output_type"]
        if kind == "stream":
            return (kind, output["name"], output["text"])
        if kind == "error":
            return (kind, output["ename"], output["evalue"])
        data = {mime: ("PNG" if mime == "image/png" and str(value).startswith("iVBOR") else value)
                for mime, value in output["data"].items()}
        return (kind, data)
    return [[shown(o) for o in cell["outputs"]] for cell in nb["cells"] if cell["cell_type"] == "code"]


@pytest.mark.parametrize("language", ["r", "deno", "bash"])
def test_a_notebook_in_each_language_matches_its_saved_outputs(cleanup_ledger: None, kernels_image: str,
                                                              language: str) -> None:
    path = FILES / "notebooks" / "languages" / f"{language}.ipynb"
    saved = nbformat.read(path, as_version=4)  # multiline strings joined, as in what a run writes
    result = nbexec.execute_notebook(path, config=cfg("python", timeout=60))  # the kernelspec chooses
    assert result.ok, result.error
    assert result.notebook.metadata.kernelspec == languages.get(language).spec
    ran = nbformat.read(result.notebook_path or "", as_version=4)
    assert _outputs(ran) == _outputs(saved)
    assert {f.name for f in result.files} == {"r": {"totals.csv"}, "deno": {"orders.json"},
                                              "bash": {"access.log", "summary.txt"}}[language]
