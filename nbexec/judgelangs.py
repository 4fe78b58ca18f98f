"""The languages a program can be judged in, in one table: per language the file its source is written to, the argv
that compiles it (none for an interpreted language), the argv that runs it, and the environment both need. Pure
data and a leaf (only `errors` below it): the judge (`nbexec.engine.judge`), the judge image's build and the tests
read it, and nothing here touches Docker.

Every argv runs in the program's working folder, a folder of /mnt/data where the source was written under
``source``: the compiled program lands there too, so a huge binary meets /mnt/data's cap (``max_data``). The
compilers run inside the sandbox with its limits (memory, pids, CPU, read-only root, the capped in-memory /tmp for
their temporary files, no network).

C, C++, Java, Go and Rust come from Debian's packages (gcc, g++, default-jdk-headless, golang-go, rustc) in the judge
image, ``nbexec image build --kernels judge`` (environments/jupyter/judge.Dockerfile on the runtime image, tagged
``IMAGE``; no registry needed). Python runs in every image.

The environment: the root filesystem is read-only and HOME is a small tmpfs, so whatever a toolchain writes goes to
/tmp (Go's build cache; the standard library comes precompiled with Debian's Go, so only the program is built). Go
never fetches a module (``GOPROXY=off``: an import from outside the standard library is a compile error at once,
not a wait on a network the sandbox does not have) nor a toolchain (``GOTOOLCHAIN=local``); rustc never fetches
anything (no cargo).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

IMAGE = "nbexec-judge:latest"  # the judge image's default tag
LABEL = "io.nbexec.judge"  # the image label listing the compiled languages an image has (the table's keys)

_GO_HOME = "/tmp/nbexec-go"


@dataclass(frozen=True)
class JudgeLanguage:
    """How one language is compiled and run. ``compile`` is None for a language that is not compiled; ``output`` is
    what a successful compile leaves in the working folder (the file a run needs)."""

    name: str  # the canonical name: judge(language=...), the image label's entries
    source: str  # the file the program is written to, in the working folder
    compile: tuple[str, ...] | None
    run: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set for both the compile and the runs
    output: str | None = None
    version: tuple[str, ...] = ()  # argv that prints the toolchain's version (the image build checks it)

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def compiled(self) -> bool:
        return self.compile is not None


LANGUAGES: dict[str, JudgeLanguage] = {lang.name: lang for lang in (
    JudgeLanguage("python", "main.py", None, ("python", "main.py"), version=("python", "--version")),
    JudgeLanguage("c", "main.c", ("gcc", "-O2", "-std=gnu17", "-pipe", "-o", "main", "main.c", "-lm"), ("./main",),
                  output="main", version=("gcc", "--version")),
    JudgeLanguage("cpp", "main.cpp", ("g++", "-O2", "-std=gnu++17", "-pipe", "-o", "main", "main.cpp"), ("./main",),
                  output="main", version=("g++", "--version")),
    # Serial GC: the fewest JVM threads under the pids limit, and no perf-data file in /tmp. A 64 MiB stack for the
    # main thread, as judges give Java, so a deep recursion that is fine in C++ is fine here too.
    JudgeLanguage("java", "Main.java", ("javac", "-J-XX:+UseSerialGC", "-J-XX:-UsePerfData", "-encoding", "UTF-8",
                                        "-d", ".", "Main.java"),
                  ("java", "-XX:+UseSerialGC", "-XX:-UsePerfData", "-Xss64m", "-cp", ".", "Main"),
                  output="Main.class", version=("javac", "-version")),
    JudgeLanguage("go", "main.go", ("go", "build", "-o", "main", "main.go"), ("./main",),
                  env=(("GOCACHE", f"{_GO_HOME}/cache"), ("GOPATH", _GO_HOME), ("GOPROXY", "off"),
                       ("GOSUMDB", "off"), ("GOTOOLCHAIN", "local"), ("GOENV", "off")),
                  output="main", version=("go", "version")),
    JudgeLanguage("rust", "main.rs", ("rustc", "--edition", "2021", "-O", "-C", "debuginfo=0", "-o", "main",
                                      "main.rs"), ("./main",), output="main", version=("rustc", "--version")),
)}
ALIASES = {"py": "python", "python3": "python", "c++": "cpp", "cxx": "cpp", "golang": "go",
           "rs": "rust"}
COMPILED = tuple(name for name, lang in LANGUAGES.items() if lang.compiled)  # what the judge image adds


def get(value: object) -> JudgeLanguage:
    """The entry of ``value`` (a name or an alias, any case); ConfigError naming the choices otherwise."""
    if isinstance(value, str):
        name = ALIASES.get(value.lower(), value.lower())
        if name in LANGUAGES:
            return LANGUAGES[name]
    shown = repr(value[:60]) if isinstance(value, str) else type(value).__name__
    raise ConfigError(f"judge language {shown} is not one nbexec judges; choose one of {', '.join(LANGUAGES)} "
                      f"(or an alias: {', '.join(sorted(ALIASES))})")


def parse_label(value: object) -> tuple[str, ...]:
    """The compiled languages an image's ``io.nbexec.judge`` label lists (none without the label)."""
    if not isinstance(value, str):
        return ()
    return tuple(dict.fromkeys(part.strip().lower() for part in value.split(",") if part.strip()))
