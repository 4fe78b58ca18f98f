#!/usr/bin/env python3
"""Machine-made mutants of the pure hostile-input modules (mutmut), judged by the fast tests alone (no Docker).

mutmut mutates every function of the files ``[tool.mutmut] only_mutate`` lists (pyproject.toml) and runs, for each
mutant, the fast tests that reach that function. SCOPE below names the functions judged in each module: the ones
that parse, size, check or clean what the sandbox or a client sends. A mutant is *caught* when its tests did not
pass (failed, timed out, crashed, or could not even be collected); every other mutant in scope (survived, or no
fast test reaches it) must be listed in tests/mutants-equivalent.yaml with why it cannot be told apart from the
original. The run happens in a scratch copy of the tree, so the work tree gets no ``mutants/`` folder.

    scripts/mutants.py                   # every mutant in scope (the full run; docs/development.md has its time)
    scripts/mutants.py --tier ci         # a fixed-seed sample of the stable modules' mutants (tests/test_mutants.py)
    scripts/mutants.py --module zmtp     # one module's mutants (repeatable)
    scripts/mutants.py --keep            # keep the scratch folder (then `mutmut browse` or `mutmut show` there)
    scripts/mutants.py --again DIR       # in a kept folder: take the tree's tests again, run what was not caught (yet)

Exits 1 when the stable modules' score (caught / (mutants - equivalent)) is under 90 %, and with --strict also
when a survivor is neither caught nor listed as equivalent (the survivors left open are printed either way).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import ROOT, scratch_copy, tracked_files

EQUIVALENT = ROOT / "tests" / "mutants-equivalent.yaml"
TARGET = 0.90
SEED = 24  # the ci tier's sample: the same mutants on every run
SAMPLE = 60
# module: (file, functions judged ("*": all), stable). A module marked provisional (being rewritten on another
# branch) has its figures reported, not held to the target; none is at present.
SCOPE: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "messages": ("nbexec/sandbox/messages.py", ("*",), True),
    "kernel": ("nbexec/sandbox/kernel.py", ("KernelClient._verify", "KernelClient._signed", "KernelClient._remember",
                                            "KernelClient.recv",
                                            "dispatch", "_object"), True),
    "zmtp": ("nbexec/sandbox/zmtp.py", ("Connection._handshake", "Connection._command", "Connection.send",
                                        "Connection.receive", "Connection._fill", "Connection._advance",
                                        "Connection._start_frame", "Connection._end_frame", "Connection._fail",
                                        "command", "properties"), True),
    "lasterror": ("nbexec/sandbox/lasterror.py", ("*",), True),
    "egress": ("nbexec/egress/__init__.py", ("Rule.*", "parse_rule", "normalise", "_address", "address_problem",
                                             "Allowlist.*"), True),
    "request": ("nbexec/egress/request.py", ("*",), True),
    "egress-budget": ("nbexec/egress/budget.py", ("*",), True),
    "outputs": ("nbexec/notebook/outputs.py", ("*",), True),
    "links": ("nbexec/notebook/links.py", ("*",), True),
    "viewer": ("nbexec/notebook/viewer.py", ("*",), True),
    "widgets": ("nbexec/engine/widgets.py", ("*",), True),
    "cell-budget": ("nbexec/engine/budget.py", ("*",), True),
    "wheelinstall": ("nbexec/packages/wheelinstall.py", ("target", "_dist_info", "unpack", "checked",
                                                         "CheckedWheel.*", "NoFollowDestination.*", "_put",
                                                         "_scripts"), True),
    "resolver": ("nbexec/packages/resolver.py", ("*",), True),
    "identity": ("nbexec/service/identity.py", ("*",), True),
    "sse": ("nbexec/service/sse.py", ("*",), True),
    "paths": ("nbexec/sandbox/remote/paths.py", ("*",), True),
    "envfile": ("nbexec/cli/envfile.py", ("*",), True),
    "transfer": ("nbexec/files/transfer.py", ("valid_name", "relative_parts"), True),
    "node_files": ("nbexec/sandbox/remote/files.py", ("_parts",), True),
    "serving": ("nbexec/stores/serving.py", ("*",), True),
}
SPINNER = tuple("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")  # mutmut's progress frames, dropped from what a failure shows
NOT_CAUGHT = ("survived", "no tests", "not checked", "skipped")


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's: nbexec.sandbox.kernel.xǁKernelClientǁ_verify__mutmut_12
    module: str  # SCOPE's key
    function: str  # KernelClient._verify
    status: str


def function_of(name: str, module_path: str) -> str:
    """``KernelClient._verify`` of ``nbexec.sandbox.kernel.xǁKernelClientǁ_verify__mutmut_12``."""
    dotted = module_path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    local = name.removeprefix(dotted + ".").rsplit("__mutmut_", 1)[0]
    return local.removeprefix("xǁ").replace("ǁ", ".") if local.startswith("xǁ") else local.removeprefix("x_")


def in_scope(module: str, function: str) -> bool:
    return any(fnmatch.fnmatchcase(function, pattern) for pattern in SCOPE[module][1])


def mutants(scratch: Path, modules: list[str]) -> list[Mutant]:
    """Every mutant mutmut made (with its status so far) in the scope of ``modules``."""
    from mutmut.stats import status_by_exit_code

    found = []
    for module in modules:
        path = SCOPE[module][0]
        meta = scratch / "mutants" / f"{path}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
        for name, code in codes.items():
            function = function_of(name, path)
            if in_scope(module, function):
                found.append(Mutant(name, module, function, status_by_exit_code[code]))
    return sorted(found, key=lambda m: m.name)


def mutmut(scratch: Path, names: list[str], children: int) -> None:
    command = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(children), *names]
    done = subprocess.run(command, cwd=scratch, capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_PROFILE": "mutants"})
    if done.returncode:
        said = "\n".join(line for line in (done.stdout + done.stderr).replace("\r", "\n").splitlines()
                         if line.strip() and not line.lstrip().startswith(SPINNER))
        if "failed to collect stats" in said:
            said += "\n" + stats_failure(scratch)
        raise SystemExit(f"mutmut failed (exit {done.returncode}):\n{said[-8000:]}")


def stats_failure(scratch: Path) -> str:
    """mutmut's first run of the tests (its stats) failed, and it ran them in a child whose output it lost: run the
    same tests once more on the scratch copy's unmutated code, to name what fails (or to say it passed this time)."""
    import tomllib

    settings = tomllib.loads((scratch / "pyproject.toml").read_text())["tool"]["mutmut"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-rfE", "--tb=short",
               *settings["pytest_add_cli_args"], *settings["pytest_add_cli_args_test_selection"]]
    done = subprocess.run(command, cwd=scratch, capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_PROFILE": "mutants"})
    if done.returncode == 0:
        return ("the same tests passed when run again on the unmutated code: one of them fails only at times "
                "(look for a race or a timing it depends on)")
    return f"the same tests on the unmutated code (exit {done.returncode}):\n{done.stdout[-5000:]}{done.stderr[-1000:]}"


def only_mutate(scratch: Path, files: set[str]) -> None:
    """Keep only ``files`` in the scratch copy's [tool.mutmut] only_mutate (mutmut mutates every file listed)."""
    config = scratch / "pyproject.toml"
    lines = config.read_text().splitlines(keepends=True)
    listed = {path for path, _, _ in SCOPE.values()}
    config.write_text("".join(line for line in lines if not any(f'"{path}"' in line and path not in files
                                                                 for path in listed)))


def glob_of(module: str, function: str) -> str:
    dotted = SCOPE[module][0].removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    if function == "*":
        return f"{dotted}.*"
    local = "xǁ" + function.replace(".", "ǁ") if "." in function else "x_" + function
    return f"{dotted}.{local}__mutmut_*"


def mutated_line(scratch: Path, mutant: Mutant) -> str:
    """The line as the mutant has it (the diff's added lines, joined), to match an equivalence entry."""
    done = subprocess.run([str(Path(sys.executable).with_name("mutmut")), "show", mutant.name], cwd=scratch,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    added = [line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:].strip() for line in lines if line.startswith("-") and not line.startswith("---")]
    return " / ".join(added) or "removed: " + " / ".join(removed)


def equivalents() -> list[dict[str, str]]:
    entries = yaml.safe_load(EQUIVALENT.read_text()) or [] if EQUIVALENT.is_file() else []
    for entry in entries:
        if not {"function", "mutant", "why"} <= set(entry):
            raise SystemExit(f"{EQUIVALENT}: each entry needs function, mutant (the mutated line) and why: {entry}")
    return entries


def report(scratch: Path, chosen: list[Mutant], *, strict: bool) -> int:
    """Print the figures per module; the exit code (1: the stable modules' score under the target, or a survivor
    not listed as equivalent). Score: caught / (mutants - equivalent)."""
    listed = equivalents()
    unexplained: list[tuple[Mutant, str]] = []
    totals = {"mutants": 0, "caught": 0, "equivalent": 0}
    print(f"\n{'module':14} {'mutants':>8} {'caught':>7} {'equivalent':>11} {'unexplained':>12} {'score':>7}")
    for module in dict.fromkeys(m.module for m in chosen):
        mine = [m for m in chosen if m.module == module]
        caught = sum(m.status not in NOT_CAUGHT for m in mine)
        left = []
        for mutant in (m for m in mine if m.status in NOT_CAUGHT):
            line = mutated_line(scratch, mutant)
            if not any(e["function"] == f"{module}:{mutant.function}" and e["mutant"].strip() == line for e in listed):
                left.append((mutant, line))
        equivalent = len(mine) - caught - len(left)
        score = caught / max(len(mine) - equivalent, 1)
        stable = SCOPE[module][2]
        if stable:
            totals = {"mutants": totals["mutants"] + len(mine), "caught": totals["caught"] + caught,
                      "equivalent": totals["equivalent"] + equivalent}
            unexplained += left
        print(f"{module:14} {len(mine):8} {caught:7} {equivalent:11} {len(left):12} {score:7.1%}"
              f"{'' if stable else '  (provisional: being rewritten; not held to the target)'}")
        for mutant, line in left:
            print(f"    {mutant.status}: {mutant.name}\n        {module}:{mutant.function}: {line}")
    score = totals["caught"] / max(totals["mutants"] - totals["equivalent"], 1)
    print(f"{'stable':14} {totals['mutants']:8} {totals['caught']:7} {totals['equivalent']:11} "
          f"{len(unexplained):12} {score:7.1%}  (target {TARGET:.0%}, and every survivor explained)")
    return 0 if score >= TARGET and not (strict and unexplained) else 1


def refresh(scratch: Path, modules: list[str]) -> None:
    """Bring a kept folder up to the tree: its tests, settings and every file mutmut did not mutate (in the folder
    and in mutmut's copy). A changed file of ``modules`` makes their mutants stale: refused. Another mutated file
    that changed is copied in as it is now and its results are forgotten: mutmut makes its mutants anew, not run."""
    mutated = {SCOPE[m][0] for m in SCOPE}
    changed = {name for name in mutated if (ROOT / name).read_bytes() != (scratch / name).read_bytes()}
    stale = sorted(changed & {SCOPE[m][0] for m in modules})
    if stale:
        raise SystemExit(f"{', '.join(stale)} changed since the mutants in {scratch} were made: run afresh")
    for name in sorted(changed):
        print(f"{name} changed: its mutants in this folder are made anew (not run yet)")
        (scratch / "mutants" / f"{name}.meta").unlink(missing_ok=True)
    shutil.copytree(ROOT / "tests", scratch / "tests", dirs_exist_ok=True)
    shutil.copy2(ROOT / "pyproject.toml", scratch / "pyproject.toml")
    for name in tracked_files(ROOT):
        if name.startswith("nbexec/") and (name not in mutated or name in changed) and (ROOT / name).is_file():
            for folder in (scratch, scratch / "mutants"):
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, folder / name)


def _changed(modules: list[str]) -> bool:
    """Whether the ci tier must run: a judged module, this script, the equivalents or the fast tests changed since
    the last landed commit (scripts/changed.py); True when that is unknown."""
    from changed import VARIABLE, changed, touches

    found = changed()
    covered = [SCOPE[m][0] for m in modules] + ["scripts/mutants.py", "scripts/mutations.py", "pyproject.toml",
                                                   "tests/mutants-equivalent.yaml"]
    fast_tests = ("tests/test_fuzz", "tests/test_edges", "tests/test_mutants.py")  # what kills the sample
    if found is None or touches(found, covered) or any(path.startswith(fast_tests) for path in found):
        return True
    print(f"stable: no judged module, nor its fast tests, changed since ${VARIABLE}: the ci sample is skipped")
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=("ci", "all"), default="all")
    parser.add_argument("--module", action="append", choices=sorted(SCOPE), default=[])
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder and print where it is")
    parser.add_argument("--again", type=Path, metavar="DIR", help="a kept scratch folder: new tests, run the rest")
    parser.add_argument("--strict", action="store_true", help="also fail on a survivor not listed as equivalent")
    parser.add_argument("--report", type=Path, metavar="DIR", help="a kept scratch folder: only print its figures")
    args = parser.parse_args(argv)
    modules = args.module or [m for m in SCOPE if args.tier == "all" or SCOPE[m][2]]
    if args.tier == "ci" and not args.module and not _changed(modules):
        return 0
    started = time.monotonic()
    scratch = args.report or args.again or scratch_copy(ROOT)
    try:
        if args.report:
            chosen = mutants(scratch, modules)
        elif args.again:
            # The tree's tests and unmutated code replace the folder's (mutmut copies the tests in again); the test
            # map is made anew.
            refresh(scratch, modules)
            (scratch / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
            left = [m.name for m in mutants(scratch, modules) if m.status in NOT_CAUGHT]  # survivors, and the unrun
            if left:
                mutmut(scratch, left, args.children)
            chosen = mutants(scratch, modules)
        elif args.tier == "ci":
            # Mutate the stable files only, make the mutants (and the test map) with one small run, then test a
            # fixed sample of them.
            only_mutate(scratch, {SCOPE[m][0] for m in modules})
            mutmut(scratch, [glob_of("paths", "bad_segment")], args.children)
            population = mutants(scratch, modules)
            # Ranked by a hash of each mutant's name: code added elsewhere leaves this sample as it was (a seeded
            # random.sample drew a new one whenever the population's size changed).
            sample = sorted(population, key=lambda m: hashlib.sha256(f"{SEED}:{m.name}".encode()).digest())[:SAMPLE]
            mutmut(scratch, [m.name for m in sample], args.children)
            chosen = [m for m in mutants(scratch, modules) if m.name in {s.name for s in sample}]
        else:
            mutmut(scratch, [glob_of(module, f) for module in modules for f in SCOPE[module][1]], args.children)
            chosen = mutants(scratch, modules)
        code = report(scratch, chosen, strict=args.strict)
        print(f"\n{len(chosen)} mutants judged in {time.monotonic() - started:.0f} s")
        return code
    finally:
        if args.keep or args.again or args.report:
            print(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
