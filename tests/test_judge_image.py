"""The judge image (`nbexec image build --kernels judge`) and the language table it is built from: each language
compiles and runs a hello-world and a program that reads stdin, in a sandbox with the default limits (read-only
root, capped /tmp and /mnt/data, no network, memory and pids limits), with the table's own argv and environment.
Real Docker, the real image (built once per test session: the `judge_image` fixture)."""

from __future__ import annotations

import pytest

import nbexec
from nbexec import judgelangs
from nbexec.engine.session import Session
from nbexec.sandbox.docker import judgeimage

from . import judging
from .judging import HELLO, SUM, compile_program, run_program

pytestmark = pytest.mark.timeout(judging.TIMEOUT_S)


@pytest.mark.long  # the first to ask for the image, so its build starts the run, not ends it
def test_the_image_has_its_label_and_stays_apart_from_the_default(judge_image: str) -> None:
    assert judgeimage.languages_of(judge_image) == judgelangs.COMPILED
    assert judgeimage.languages_of(nbexec.SandboxConfig().image_tag) == ()  # the default image is left as it was


@pytest.mark.parametrize("name", list(judgelangs.LANGUAGES))
def test_hello_world_and_a_stdin_program_compile_and_run(name: str, judge_config: nbexec.SandboxConfig) -> None:
    lang = judgelangs.LANGUAGES[name]
    assert (judge_config.network, judge_config.memory, judge_config.pids) == (False, "1g", 256)  # the defaults
    with Session(judge_config) as session:
        built, seconds = compile_program(session, lang, HELLO[name])
        assert built.ok, built.stderr + built.stdout
        # A fresh sandbox, the toolchain's first run: generous for a loaded 2-core machine, yet far below what a Go
        # that rebuilt its standard library, or a compiler stuck on a read-only root, would take.
        assert seconds < 60, f"{name} took {seconds:.1f} s to compile hello-world"
        ran = run_program(session, lang)
        assert (ran.ok, ran.stdout) == (True, "hello, judge\n"), ran.stderr
        built, _ = compile_program(session, lang, SUM[name])
        assert built.ok, built.stderr + built.stdout
        ran = run_program(session, lang, "3 4\n35\n-10 10\n")
        assert (ran.ok, ran.stdout) == (True, "42 5\n"), ran.stderr
        ran = run_program(session, lang, "")
        assert (ran.ok, ran.stdout) == (True, "0 0\n"), ran.stderr
        print(f"{name}: compiled hello-world in {seconds:.1f} s")


def test_go_builds_only_the_program(judge_config: nbexec.SandboxConfig) -> None:
    """Debian's Go ships its standard library compiled: a sandbox's build compiles one package, so a judged Go
    program costs a second, not the tens of seconds of rebuilding fmt, os and the runtime on one core."""
    lang = judgelangs.LANGUAGES["go"]
    with Session(judge_config) as session:
        session.upload(SUM["go"].encode(), lang.source)
        listed = session.shell(judging.command(lang, ("go", "build", "-x", "-o", "main", "main.go")) + " 2>&1")
        assert listed.ok, listed.stdout
        compiled = [line for line in listed.stdout.splitlines() if "/compile " in line or "/compile\t" in line]
        assert len(compiled) == 1 and "-p main " in compiled[0], compiled
