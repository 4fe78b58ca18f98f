"""The language table of judging (`nbexec.judgelangs`) and the judge image's build inputs, without Docker: each
language names its source, compile and run argv and environment; the build's check runs them as the table says;
`--kernels judge` is an image of its own. tests/test_judge_image.py runs them in the real image."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from nbexec import judgelangs
from nbexec.cli.main import main
from nbexec.errors import ConfigError
from nbexec.sandbox.docker import judgeimage

from . import judging


def test_the_table_names_a_source_a_compile_and_a_run_for_each_language() -> None:
    assert judgelangs.COMPILED == ("c", "cpp", "java", "go", "rust")
    for name, lang in judgelangs.LANGUAGES.items():
        assert lang.name == name and lang.run and lang.version and "/" not in lang.source
        if lang.compiled:
            assert lang.compile is not None and lang.source in lang.compile and lang.output
            if "-o" in lang.compile:  # the file the judge looks for is the one the compiler writes
                assert lang.compile[lang.compile.index("-o") + 1] == lang.output, lang.compile
        for key, value in lang.env:  # what a toolchain writes goes to /tmp: the root filesystem is read-only
            assert key.isupper() and (not value.startswith("/") or value.startswith("/tmp/")), (key, value)
    assert judgelangs.LANGUAGES["go"].environment["GOPROXY"] == "off"


@pytest.mark.parametrize(("given", "name"), [("C++", "cpp"), ("golang", "go"), ("RS", "rust"), ("java", "java"),
                                             ("python3", "python")])
def test_names_and_aliases(given: str, name: str) -> None:
    assert judgelangs.get(given).name == name


@pytest.mark.parametrize("given", ["cobol", "", None, 3, "c" * 500])
def test_an_unknown_language_names_the_choices(given: object) -> None:
    with pytest.raises(ConfigError, match="not one nbexec judges; choose one of python, c, cpp, java, go, rust") as e:
        judgelangs.get(given)
    assert len(str(e.value)) < 300


def test_the_label_lists_the_compiled_languages() -> None:
    assert judgelangs.parse_label("c, CPP,java,,go,rust,c") == ("c", "cpp", "java", "go", "rust")
    assert judgelangs.parse_label(None) == () and judgelangs.parse_label("") == ()


def test_the_build_check_runs_every_language_as_the_table_says() -> None:
    script = judgeimage.check_script()
    for name in judgelangs.COMPILED:
        lang = judgelangs.LANGUAGES[name]
        assert judging.command(lang, lang.compile or ()) in script and judging.command(lang, lang.run) in script
    assert "go list" in script and "is stale" in script


@pytest.mark.parametrize("value", ["judge,r", "r,judge", "judge,judge,bash"])
def test_judge_is_built_on_its_own(value: str) -> None:
    done = CliRunner().invoke(main, ["image", "build", "--kernels", value])
    assert done.exit_code == 2 and "--kernels judge builds the judge image on its own" in done.output, done.output
    assert judgeimage.wants_judge(" Judge ") and not judgeimage.wants_judge("r,deno")
