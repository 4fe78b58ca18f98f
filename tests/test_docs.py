"""Every code block of the README and the documentation is checked, so examples never drift from the code.

Python blocks are type-checked with mypy against the installed package and SDKs; `nbexec ...` lines of shell
blocks are parsed by the real command line (nothing runs); repository paths they name must exist; JSON blocks
parse; TypeScript blocks compile with the pinned TypeScript in `.tools/`. The README's session example runs for
real in the Docker tier. The site itself is built strictly by scripts/check.sh (`mkdocs build --strict`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

import nbexec
from nbexec.cli.main import main as cli

ROOT = Path(__file__).resolve().parent.parent
TSC = ROOT / ".tools" / "node_modules" / ".bin" / "tsc"
# The top folders of the repository: a path in a shell block that starts with one of them must exist.
REPO_DIRS = ("scripts/", "benchmarks/", "examples/", "deploy/", "environments/", "tests/", ".ci/", "docs/", "nbexec/")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)")
_SHELL_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", ">", ">>", "<", "2>", "&>"}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and its text (dedented)."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """The README and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file (a block indented in a list is dedented)."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    start, lang, indent, opened = 0, "", "", False
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if not opened and fence:
            opened, start, lang, indent, body = True, number, fence["lang"], fence["indent"], []
        elif opened and line.strip() == "```":
            opened = False
            found.append(Block(path, start, lang, textwrap.dedent("\n".join(body)) + "\n"))
        elif opened:
            body.append(line[len(indent):] if line.startswith(indent) else line)
    assert not opened, f"{path}: a code block opened at line {start} is never closed"
    return found


def all_blocks(*langs: str) -> list[Block]:
    return [block for path in documents() for block in blocks(path) if block.lang in langs]


def test_every_block_has_a_language_the_checks_know() -> None:
    """A block is checked by its language: an unknown one would be checked by nothing."""
    known = {"", "python", "sh", "bash", "console", "json", "ts", "ini", "yaml", "text"}
    odd = [f"{b.name}: {b.lang}" for path in documents() for b in blocks(path) if b.lang not in known]
    assert not odd, "blocks in a language no test checks:\n" + "\n".join(odd)


# --- the site ---------------------------------------------------------------------------------------------------

def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly_and_a_broken_link_fails_it(tmp_path: Path) -> None:
    """The documentation site builds with every link and anchor resolved; the same tree with one link to a
    missing anchor does not (so the check in scripts/check.sh can fail)."""
    built = _build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "security" / "attacks" / "index.html").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copy(ROOT / ".env.example", copy / ".env.example")
    page = copy / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the policy](configuration.md#no-such-section).\n")
    broken = _build(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "no-such-section" in broken.stderr, broken.stderr


def test_every_page_is_in_the_nav() -> None:
    """A page of docs/ that the nav leaves out is a page nobody finds."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages and not {p for p in pages if f": {p}" not in nav}, sorted(p for p in pages if f": {p}" not in nav)


# --- Python: type-checked ---------------------------------------------------------------------------------------

def _module_name(block: Block) -> str:
    return "block_" + re.sub(r"\W", "_", block.name)


def test_python_blocks_type_check(tmp_path: Path) -> None:
    """Each Python block is a complete program that mypy accepts against the installed nbexec and SDKs."""
    python = all_blocks("python")
    assert len(python) > 10, "the documentation's Python blocks were not found"
    for block in python:
        (tmp_path / f"{_module_name(block)}.py").write_text(block.text)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--check-untyped-defs",
         "--disable-error-code=top-level-await", "--no-error-summary", "--hide-error-context",
         # the SDKs' types are read once, then cached (.mypy_cache/ is git-ignored)
         "--cache-dir", str(ROOT / ".mypy_cache" / "docs-blocks"), "--config-file", str(tmp_path / "mypy.ini"),
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    names = {_module_name(block): block.name for block in python}
    report = re.sub(r"\S*(block_\w+)\.py:(\d+)", lambda m: f"{names[m[1]]} (+{int(m[2]) - 1})", checked.stdout)
    assert checked.returncode == 0, "documentation blocks that do not type-check:\n" + report + checked.stderr


# --- shell: nbexec lines parse, scripts exist --------------------------------------------------------------------

def commands(block: Block) -> list[list[str]]:
    """The simple commands of a shell block: `console` blocks by their `$ ` lines; continuation lines joined,
    comments dropped, split at shell operators."""
    text = block.text
    if block.lang == "console":
        kept, taking = [], False
        for line in text.splitlines():
            if line.startswith("$ "):
                kept.append(line[2:])
                taking = line.endswith("\\")
            elif taking:
                kept.append(line)
                taking = line.endswith("\\")
        text = "\n".join(kept)
    text = text.replace("\\\n", " ")
    found: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in _SHELL_OPERATORS or set(token) <= set(";&|()<>"):
                found.append(current)
                current = []
            else:
                current.append(token)
        found.append(current)
    return [command for command in found if command]


def _without_assignments(command: list[str]) -> list[str]:
    words = list(command)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    if words[:1] == ["export"]:
        return []
    return words


def dry_parse(args: list[str]) -> None:
    """Parse an nbexec command line as the CLI would, down to its subcommand, running nothing."""
    command: click.Command = cli
    context: click.Context | None = None
    name = "nbexec"
    while True:
        context = command.make_context(name, list(args), parent=context)
        if not isinstance(command, click.Group):
            return
        rest = [*getattr(context, "_protected_args", []), *context.args]
        found, sub, args = command.resolve_command(context, rest)
        assert sub is not None and found is not None, f"no such command: {rest}"
        command, name = sub, found


def _nbexec_lines() -> list[tuple[str, list[str]]]:
    lines = []
    for block in all_blocks("sh", "bash", "console"):
        for command in commands(block):
            words = _without_assignments(command)
            if words and Path(words[0]).name == "nbexec" and len(words) > 1:
                lines.append((block.name, words[1:]))
    return lines


def test_nbexec_lines_parse_with_the_real_cli() -> None:
    """Every `nbexec ...` line in a shell block has options and arguments the CLI accepts (a user's own file
    that does not exist here is the only thing let through)."""
    lines = _nbexec_lines()
    assert len(lines) > 20, "the documentation's nbexec lines were not found"
    wrong = []
    for where, args in lines:
        if "--help" in args or "-h" in args:
            continue
        try:
            dry_parse(args)
        except click.BadParameter as exc:
            if "does not exist" not in exc.format_message():
                wrong.append(f"{where}: nbexec {shlex.join(args)}: {exc.format_message()}")
        except click.ClickException as exc:
            wrong.append(f"{where}: nbexec {shlex.join(args)}: {exc.format_message()}")
    assert not wrong, "documented command lines the CLI refuses:\n" + "\n".join(wrong)


def test_the_dry_parse_refuses_what_the_cli_refuses() -> None:
    """The check above can fail: an unknown option, a missing value and an unknown command are refused."""
    for args in (["run", "x.py", "--no-such-option"], ["run", "x.py", "--timeout"], ["nosuchcommand"],
                 ["run", "x.py", "--store", "ftp"]):
        with pytest.raises(click.ClickException):
            dry_parse(args)
    dry_parse(["run", "x.py", "--timeout", "5", "--json"])


_RUN_ROUTES = ((r"/v1/execute$", False), (r"/v1/sessions/[^/]+/execute$", False), (r"/v1/batches$", True))


def test_request_bodies_in_shell_blocks_are_valid() -> None:
    """Each JSON body a `curl -d` of the documentation sends to a run route (an execution, a session's, a batch)
    is one the service's own request model accepts."""
    from nbexec.service.schemas import ExecuteBody

    checked, wrong = 0, []
    for block in all_blocks("sh", "bash", "console"):
        for command in commands(block):
            if command[:1] != ["curl"] or "-d" not in command:
                continue
            path = next((word for word in command if "/v1/" in word), "").split("?")[0]
            many = next((listed for route, listed in _RUN_ROUTES if re.search(route, path)), None)
            if many is None:
                continue
            try:
                body = json.loads(command[command.index("-d") + 1])
                for item in body if many else [body]:
                    ExecuteBody.model_validate(item)  # a session's body is the same without the one-shot fields
            except ValueError as exc:
                wrong.append(f"{block.name}: {path}: {exc}")
            checked += 1
    assert checked >= 6, "the documentation's curl lines were not found"
    assert not wrong, "request bodies the service refuses:\n" + "\n".join(wrong)


def test_paths_in_shell_blocks_exist() -> None:
    """A script, example or folder of this repository that a shell block names exists."""
    missing = []
    for block in all_blocks("sh", "bash", "console"):
        for command in commands(block):
            if _without_assignments(command)[:1] == ["kubectl"]:
                continue  # deploy/NAME there is a Kubernetes resource, not a path
            for word in command:
                word = word.split("=", 1)[-1] if word.startswith("--") else word
                named = word.startswith(REPO_DIRS) and "$" not in word and "*" not in word
                if named and not (ROOT / word.rstrip("/")).exists():
                    missing.append(f"{block.name}: {word}")
    assert not missing, "paths named in shell blocks that do not exist:\n" + "\n".join(missing)


def test_the_readme_set_up_is_the_ci_commands() -> None:
    """The README's two set-up commands are first-class: CI runs the same scripts, and the test command is
    the one `.ci/run` runs."""
    readme = (ROOT / "README.md").read_text()
    setup = next(b for b in blocks(ROOT / "README.md") if "scripts/setup.sh" in b.text)
    assert setup.text.splitlines()[:2] == [
        "scripts/setup.sh && .venv/bin/nbexec run examples/analysis.py      # run a data analysis end to end",
        "scripts/setup.sh --test && scripts/test.sh                         # run the tests (real Docker, Azurite)",
    ], setup.text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh --test" in ci and "scripts/test.sh" in ci
    assert readme.index("pip install nbexec-sandbox") < 1200, "the PyPI name is not on the first screen"
    assert len(readme.splitlines()) <= 200, "the README is a front door: at most about 200 lines"


def test_links_outside_the_site_resolve() -> None:
    """The README's, SECURITY.md's and the MCP example's relative links name files that exist (the site's own
    links are checked by its strict build)."""
    broken = []
    for page in (ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "examples" / "mcp" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


# --- JSON and TypeScript ----------------------------------------------------------------------------------------

def test_json_blocks_parse() -> None:
    bad = []
    for block in all_blocks("json"):
        try:
            json.loads(block.text)
        except ValueError as exc:
            bad.append(f"{block.name}: {exc}")
    assert not bad, "\n".join(bad)


def _typescript_folder(tmp_path: Path) -> Path:
    """A folder where tsc finds the pinned packages (.tools/node_modules) and ES modules (top-level await)."""
    assert TSC.exists() and shutil.which("node"), "needs Node.js and TypeScript in .tools/ (scripts/setup.sh --test)"
    (tmp_path / "node_modules").symlink_to(ROOT / ".tools" / "node_modules")
    (tmp_path / "package.json").write_text('{"type": "module"}\n')
    return tmp_path


@pytest.mark.tools
def test_typescript_blocks_compile(tmp_path: Path) -> None:
    """Each TypeScript block of the documentation type-checks with the pinned TypeScript."""
    folder = _typescript_folder(tmp_path)
    typescript = all_blocks("ts")
    assert typescript, "the documentation's TypeScript blocks were not found"
    names = []
    for number, block in enumerate(typescript):
        (folder / f"block{number}.ts").write_text(block.text)
        names.append(f"block{number}.ts")
    compiled = subprocess.run([str(TSC), "--noEmit", "--strict", "--target", "es2022", "--module", "nodenext",
                               "--types", "node", "--skipLibCheck", *names],
                              capture_output=True, text=True, timeout=300, cwd=folder)
    report = re.sub(r"block(\d+)\.ts", lambda m: typescript[int(m[1])].name, compiled.stdout)
    assert compiled.returncode == 0, "TypeScript blocks that do not compile:\n" + report


@pytest.mark.tools
def test_the_typescript_example_compiles_with_its_own_command(tmp_path: Path) -> None:
    """examples/typescript/client.ts compiles, without a type error, in a folder holding only the packages its
    header installs, with the command its header gives."""
    source = ROOT / "examples" / "typescript" / "client.ts"
    header = source.read_text()
    installed = re.search(r"npm install --no-save ([^&\n]*?)\s*&&", header)
    command = re.search(r"npx (tsc [^&\n]*?)\s*&&", header)
    assert installed and command, "client.ts no longer says how to compile it"
    assert TSC.exists(), "needs TypeScript in .tools/ (scripts/setup.sh --test)"
    modules = tmp_path / "node_modules"
    for package in [re.sub(r"(?<=.)@[^@/]*$", "", spec) for spec in installed[1].split()]:
        (modules / package).parent.mkdir(parents=True, exist_ok=True)
        (modules / package).symlink_to(ROOT / ".tools" / "node_modules" / package)
        dependencies = json.loads((modules / package / "package.json").read_text()).get("dependencies", {})
        for dependency in dependencies:  # what npm would install with it (@types/node needs undici-types)
            (modules / dependency).symlink_to(ROOT / ".tools" / "node_modules" / dependency)
    shutil.copy(source, tmp_path / "client.ts")
    compiled = subprocess.run([str(modules / ".." / "node_modules" / "typescript" / "bin" / "tsc"),
                               *shlex.split(command[1])[1:]], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
    assert compiled.returncode == 0, compiled.stdout
    assert (tmp_path / "build" / "client.js").is_file()


# --- Docker tier: the README's example runs ---------------------------------------------------------------------

def test_the_readme_session_example_runs(docker_ready: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's session example, executed as written: it prints what its comment says."""
    example = next(b for b in blocks(ROOT / "README.md") if b.lang == "python" and "nbexec.Session()" in b.text)
    promised = re.search(r"# (\S+)\s*$", example.text.strip())
    assert promised, example.text
    exec(compile(example.text, example.name, "exec"), {"__name__": "readme", "nbexec": nbexec})
    assert capsys.readouterr().out.strip() == promised[1]
