"""The judge image: the compilers of `nbexec.judgelangs` from Debian's packages on a runtime image
(environments/jupyter/judge.Dockerfile), built by `nbexec image build --kernels judge`, and which languages an image
has (its ``io.nbexec.judge`` label).

The build proves the image against the table: as the sandbox's user, each compiled language compiles and runs a
program with the table's own argv and environment, and Go's standard library must be precompiled (else each program
would rebuild it, tens of seconds on one core), or the build fails."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import docker.errors

from nbexec import judgelangs
from nbexec.errors import ConfigError, ImageNotFoundError

from . import daemon, image

FLAVOUR = "judge"  # the `--kernels` value that builds this image
_EXPECTED = "judge ok"
# Programs that print _EXPECTED: the build's check that each compiler and its runtime work as the table runs them.
HELLO = {
    "c": '#include <stdio.h>\nint main(void) { puts("judge ok"); return 0; }',
    "cpp": '#include <iostream>\nint main() { std::cout << "judge ok" << std::endl; }',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("judge ok"); } }',
    "go": 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("judge ok") }',
    "rust": 'fn main() { println!("judge ok"); }',
}
# The standard packages a judged Go program imports most; none may be stale (rebuilt per program).
_GO_STD = ("fmt", "bufio", "os", "strconv", "strings", "sort", "math", "container/heap")


def wants_judge(text: str) -> bool:
    """Whether `--kernels` names the judge image; ConfigError when it names it with kernels (a separate image)."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if FLAVOUR not in names:
        return False
    if names != [FLAVOUR]:
        raise ConfigError("--kernels judge builds the judge image on its own (the compilers on the runtime image); "
                          "build the kernels (r, deno, bash) with a separate --kernels")
    return True


def _env(lang: judgelangs.JudgeLanguage) -> str:
    return f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in lang.env)} " if lang.env else ""


def check_script() -> str:
    """The shell script the build runs in an empty folder (judge.Dockerfile's JUDGE_CHECK)."""
    lines = []
    for name in judgelangs.COMPILED:
        lang, env = judgelangs.LANGUAGES[name], _env(judgelangs.LANGUAGES[name])
        lines += [f"mkdir {name} && cd {name}", f"printf '%s\\n' {shlex.quote(HELLO[name])} > {lang.source}",
                  f"{env}{shlex.join(lang.version)} 2>&1 | head -n 1", f"{env}{shlex.join(lang.compile or ())}",
                  f'test "$({env}{shlex.join(lang.run)})" = {shlex.quote(_EXPECTED)}', "cd .."]
    go = _env(judgelangs.LANGUAGES["go"])
    template = "{{if .Stale}}{{.ImportPath}} is stale: {{.StaleReason}}{{end}}"
    lines += [f"stale=\"$({go}go list -f {shlex.quote(template)} {' '.join(_GO_STD)})\"",
              'if [ -n "$stale" ]; then echo "Go would rebuild its standard library for each program: $stale" >&2; '
              "exit 1; fi",
              f"echo 'judge check passed: {','.join(judgelangs.COMPILED)}'"]
    return "\n".join(lines)


def build(*, base: str, tag: str, progress: Callable[[str], None], options: image.BuildOptions) -> str:
    """Build the judge image ``tag`` on the runtime image ``base`` (which must be here: nothing is pulled); return
    its id."""
    with daemon.translated(f"look up the runtime image {base}"):
        try:
            daemon.connect().images.get(base)
        except docker.errors.ImageNotFound:
            raise ImageNotFoundError(f"the runtime image {base} that the compilers are added to is missing: build it "
                                     "first with `nbexec image build`") from None
    args = {"BASE_IMAGE": base, "JUDGE_LANGUAGES": ",".join(judgelangs.COMPILED), "JUDGE_CHECK": check_script()}
    return image.run_build(image.BuildOptions(tag=tag, ca_bundle=options.ca_bundle, no_cache=options.no_cache),
                           progress, dockerfile="judge.Dockerfile", buildargs=args, base=base)


def languages_of(tag: str) -> tuple[str, ...]:
    """The compiled languages the image ``tag`` has, by its label (none without one); ImageNotFoundError when the
    image is missing."""
    with daemon.translated(f"look up image {tag}"):
        labels = daemon.connect().images.get(tag).labels or {}
    return judgelangs.parse_label(labels.get(judgelangs.LABEL))
