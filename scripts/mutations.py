#!/usr/bin/env python3
"""Prove the tests guard each guarantee: remove it with a small code change (a mutant) and see a test fail.

The register, tests/guarantees.yaml, lists every guarantee the docs and SECURITY.md make, each with the shapes of
hostile input its tests cover (``shapes``: wrong, empty, truncated, replayed... as the class has them) and one or
more mutations: a file, an exact text that must occur there exactly once, its replacement, and the tests that must
notice. For each mutation this script copies the tracked tree to a scratch folder, applies it, runs only the
mapped tests there, and reports the mutant killed (the tests failed), survived (they passed: the guarantee is
unguarded) or broken (the tests could not run: the register is wrong).

    scripts/mutations.py --check              # the register is well formed and every text is found once
    scripts/mutations.py                      # the whole register (tier "all"); exits 1 if any mutant survived
    scripts/mutations.py --tier ci            # the mutations marked for every CI run
    scripts/mutations.py --only network-on    # some mutations by id (repeatable)
    scripts/mutations.py --shapes             # each guarantee with the shapes its tests cover
    scripts/mutations.py --workers 3          # three mutations at a time (those with `alone` tests after)
    scripts/mutations.py --control --workers 3  # every mutation's tests, unmutated: each must pass
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
REGISTER = ROOT / "tests" / "guarantees.yaml"
KEEP_LINKED = (".tools",)  # installed helpers (Azurite) the tests find beside the tree; linked, not copied


@dataclass(frozen=True)
class Mutation:
    id: str
    guarantee: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    ci: bool


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    verdict: str  # killed, survived, broken
    seconds: float
    detail: str


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (a merge once left two `tests:`; the second won)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise SystemExit(f"{node.start_mark.name}: line {node.start_mark.line + 1}: {', '.join(twice)} given "
                             "twice in one entry")
        return super().construct_mapping(node, deep=deep)


def read(path: Path = REGISTER) -> list[dict]:
    """The register's entries, as written (no key given twice)."""
    return yaml.load(path.read_text(), Loader=_StrictLoader)  # a SafeLoader: no object is built


def load(path: Path = REGISTER) -> list[Mutation]:
    """Read the register and check its shape (not yet the source texts: see ``stale``)."""
    entries = read(path)
    mutations: list[Mutation] = []
    seen: set[str] = set()
    for entry in entries:
        shapes = entry.get("shapes")
        if not isinstance(shapes, list) or not shapes or not all(isinstance(s, str) and s.strip() for s in shapes):
            raise SystemExit(f"{path}: the guarantee {entry.get('guarantee')!r} needs `shapes`: the shapes of hostile "
                             "input its tests cover, a non-empty list of text")
        for item in entry["mutations"]:
            mutation = Mutation(item["id"], entry["guarantee"], item["file"], item["find"], item["replace"],
                                tuple(item["tests"]), bool(item.get("ci", False)))
            if mutation.id in seen:
                raise SystemExit(f"{path}: mutation id {mutation.id!r} is used twice")
            if mutation.find == mutation.replace or not mutation.tests:
                raise SystemExit(f"{path}: mutation {mutation.id!r} changes nothing or names no test")
            seen.add(mutation.id)
            mutations.append(mutation)
    return mutations


def stale(mutations: list[Mutation], root: Path = ROOT) -> list[str]:
    """Problems that would make a mutation meaningless: its text is missing or ambiguous, a test file is gone."""
    problems = []
    for m in mutations:
        source = root / m.file
        count = source.read_text().count(m.find) if source.is_file() else -1
        if count != 1:
            problems.append(f"{m.id}: the text to replace occurs {max(count, 0)} times in {m.file} (must be once)")
        for test in m.tests:
            if not (root / test.split("::", 1)[0]).is_file():
                problems.append(f"{m.id}: no test file {test.split('::', 1)[0]}")
    return problems


def tracked_files(root: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                            capture_output=True).stdout.decode()
    return [name for name in listed.split("\0") if name]


def scratch_copy(root: Path) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="nbexec-mutant-"))
    for name in tracked_files(root):
        source = root / name
        if not source.is_file():
            continue
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    for name in KEEP_LINKED:
        if (root / name).exists():
            (scratch / name).symlink_to(root / name)
    return scratch


def _prepared(root: Path) -> tuple[Path, dict[str, str]]:
    """A scratch copy of ``root`` and the environment its tests run in."""
    scratch = scratch_copy(root)
    # The copy's TMPDIR is reachable by others as /tmp is: the host's pip runs as an unprivileged user and makes
    # its folder there (in a private scratch every host-pip test failed, whatever the mutation).
    scratch.chmod(0o711)
    (scratch / ".tmp").mkdir()
    (scratch / ".tmp").chmod(0o1777)
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(scratch / ".tmp")}
    return scratch, env


def _discard(scratch: Path) -> None:
    _unmount_under(scratch)  # a mutant may leave a sandbox's data filesystem mounted: never delete through it
    shutil.rmtree(scratch, ignore_errors=True)


def run_one(mutation: Mutation, *, timeout: float, root: Path = ROOT) -> Outcome:
    """Apply one mutation to a scratch copy and run its tests there."""
    started = time.monotonic()
    scratch, env = _prepared(root)
    try:
        target = scratch / mutation.file
        target.write_text(target.read_text().replace(mutation.find, mutation.replace, 1))
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "",
                   *mutation.tests]
        try:
            done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome(mutation, "broken", time.monotonic() - started, f"tests ran past {timeout:g} s")
        lines = (done.stdout + done.stderr).strip().splitlines() or [""]
        # Killed means a test FAILED on the mutant; a mere error (a fixture that could not start) proves nothing.
        failed = re.search(r"\b\d+ failed\b", done.stdout) is not None
        verdict = {0: "survived", 1: "killed" if failed else "broken"}.get(done.returncode, "broken")
        tail = " | ".join(lines[-3:]) if verdict == "broken" else lines[-1]
        return Outcome(mutation, verdict, time.monotonic() - started, f"pytest exit {done.returncode}: {tail}")
    finally:
        _discard(scratch)


def _tests_of(chosen: list[Mutation]) -> list[str]:
    """The tests the mutations ``chosen`` name, each once, in order."""
    return list(dict.fromkeys(test for m in chosen for test in m.tests))


def control(chosen: list[Mutation], *, timeout: float, root: Path = ROOT, workers: int = 1) -> list[str]:
    """Run the tests of ``chosen`` once, unmutated, in a scratch copy prepared as for a mutant; the ids of the
    ones that do not pass. A test that fails there would count any mutation it judges as killed. With
    ``workers`` > 1 they are spread over that many processes, the ``alone`` tests after, by themselves (as
    scripts/test.sh runs them)."""
    tests = _tests_of(chosen)
    scratch, env = _prepared(root)
    base = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    parts = ([[*base, "-n", str(workers), "--dist", "worksteal", "-m", "not alone", *tests],
              [*base, "-p", "no:xdist", "-m", "alone", *tests]] if workers > 1 else [[*base, "-m", "", *tests]])
    failing: list[str] = []
    end = time.monotonic() + timeout
    try:
        for command in parts:
            done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, end - time.monotonic()))
            found = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
            if done.returncode not in (0, 5) and not found:  # 5: no test of this part
                found = [f"pytest exit {done.returncode}: {(done.stdout + done.stderr).strip()[-500:]}"]
            failing += found
    except subprocess.TimeoutExpired:
        return [*failing, f"the tests ran past {timeout:g} s"]
    finally:
        _discard(scratch)
    return failing


def _alone_tests(chosen: list[Mutation], root: Path = ROOT) -> set[str]:
    """The collected ids among the tests of ``chosen`` that are marked ``alone``."""
    tests = _tests_of(chosen)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-m", "alone", *tests], cwd=root, capture_output=True, text=True)
    if done.returncode not in (0, 5):
        raise SystemExit(f"could not collect the register's tests: {(done.stdout + done.stderr)[-500:]}")
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def _covers(test: str, collected: str) -> bool:
    """``test`` (a path, a test or a parametrized case, as the register names it) selects ``collected``."""
    return collected == test or collected.startswith((f"{test}[", f"{test}::"))


def _unmount_under(root: Path) -> None:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
        points = [line.split(" ")[4].encode().decode("unicode_escape") for line in table]
    for point in sorted((p for p in points if p.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def _report_control(chosen: list[Mutation], *, timeout: float, workers: int) -> int:
    started = time.monotonic()
    failing = control(chosen, timeout=timeout, workers=workers)
    for test in failing:
        named = [m.id for m in chosen if test in m.tests or any(test.startswith(f"{t}[") for t in m.tests)]
        print(f"  fails unmutated: {test} (judges {', '.join(named) or 'a mutation through its file'})")
    print(f"control: the tests of {len(chosen)} mutations, unmutated, in {time.monotonic() - started:.0f} s: "
          f"{'all pass' if not failing else f'{len(failing)} do not pass'}")
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the register against the source")
    parser.add_argument("--tier", choices=("ci", "all"), default="all", help="which mutations to run")
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="run these mutations")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one mutation's tests")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--shapes", action="store_true", help="list each guarantee with its shapes and exit")
    parser.add_argument("--control", action="store_true",
                        help="run the chosen mutations' tests once without any mutation: each must pass")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="run N mutations at a time (with --control: N test processes); the alone tests after")
    args = parser.parse_args(argv)
    if args.shapes:
        for entry in read():
            print(f"{entry['guarantee']}\n" + "".join(f"    - {shape}\n" for shape in entry.get("shapes") or []))
        return 0
    mutations = load()
    problems = stale(mutations)
    guarantees = {m.guarantee for m in mutations}
    if args.list:
        for m in mutations:
            print(f"{m.id:28} {'ci ' if m.ci else '   '}{m.file:28} {m.guarantee}")
    if problems:
        print("register problems:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    if args.check or args.list:
        print(f"register ok: {len(guarantees)} guarantees, {len(mutations)} mutations "
              f"({sum(m.ci for m in mutations)} in the ci tier)")
        return 0
    chosen = [m for m in mutations if (m.id in args.only if args.only else args.tier == "all" or m.ci)]
    if args.tier == "ci" and not args.only:
        chosen = _changed_only(chosen)
    unknown = set(args.only) - {m.id for m in mutations}
    if unknown:
        print(f"unknown mutation ids: {sorted(unknown)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.control:
        return _report_control(chosen, timeout=args.timeout * 4, workers=args.workers)
    return _run_all(chosen, timeout=args.timeout, workers=args.workers, started=started)


def _changed_only(chosen: list[Mutation]) -> list[Mutation]:
    """The ci tier in CI: only the mutations whose file or tests changed since the last landed commit
    (scripts/changed.py); all of them when that is unknown."""
    from changed import VARIABLE, changed, touches

    found = changed()
    if found is None:
        return chosen
    kept = [m for m in chosen if touches(found, [m.file, *(test.split("::")[0] for test in m.tests)])]
    print(f"{len(kept)} of {len(chosen)} ci-tier mutations cover files changed since ${VARIABLE}; the rest skipped: "
          + ", ".join(m.id for m in chosen if m not in kept), flush=True)
    return kept


def _run_all(chosen: list[Mutation], *, timeout: float, workers: int, started: float) -> int:
    """Run ``chosen``, ``workers`` at a time (those whose tests are marked alone after, one by one); 0 when every
    mutant was killed."""
    outcomes: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        outcomes.append(outcome)
        print(f"[{len(outcomes)}/{len(chosen)}] {outcome.verdict:8} {outcome.mutation.id:28} "
              f"{outcome.seconds:6.1f}s  {outcome.detail}", flush=True)

    alone = _alone_tests(chosen) if workers > 1 else set()
    lonely = [m for m in chosen if any(_covers(test, found) for test in m.tests for found in alone)]
    shared = [m for m in chosen if m not in lonely]
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for done in concurrent.futures.as_completed(
                [pool.submit(run_one, m, timeout=timeout) for m in shared]):
            report(done.result())
    for mutation in lonely:  # tests marked alone (an engine restart) never share the machine
        report(run_one(mutation, timeout=timeout))
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("killed", "survived", "broken")}
    print(f"\n{len(outcomes)} mutants: {counts['killed']} killed, {counts['survived']} survived, "
          f"{counts['broken']} broken, in {time.monotonic() - started:.0f} s")
    for outcome in outcomes:
        if outcome.verdict != "killed":
            print(f"  {outcome.verdict}: {outcome.mutation.id} ({outcome.mutation.guarantee})")
    return 0 if counts["killed"] == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
