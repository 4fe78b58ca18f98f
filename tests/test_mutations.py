"""The guarantee register (tests/guarantees.yaml): every mutation still applies to the source, and the mutants
that remove a guarantee are killed by the tests mapped to them (the CI tier here; all of them with -m load)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutations.py"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_register_matches_the_source() -> None:
    done = run("--check", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    count = int(done.stdout.split(" mutations")[0].rsplit(" ", 1)[-1])
    assert count >= 40, done.stdout


def test_every_guarantee_lists_the_shapes_its_tests_cover(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mutations
    finally:
        sys.path.remove(str(SCRIPT.parent))
    entries = yaml.safe_load((ROOT / "tests" / "guarantees.yaml").read_text())
    assert all(entry["shapes"] for entry in entries)
    for broken in ({"shapes": []}, {"shapes": [""]}, {"shapes": "wrong"}, {}):
        register = tmp_path / "register.yaml"
        entry = {k: v for k, v in entries[0].items() if k != "shapes"} | broken
        register.write_text(yaml.safe_dump([entry]))
        with pytest.raises(SystemExit, match="needs `shapes`"):
            mutations.load(register)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """A merge once left an entry with two `tests:` lines; YAML keeps the second, which named another guarantee's
    test, so the mutation was judged by a test that never reached it."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mutations
    finally:
        sys.path.remove(str(SCRIPT.parent))
    register = tmp_path / "register.yaml"
    register.write_text("- guarantee: g\n  shapes: [s]\n  mutations:\n    - id: m\n      file: f\n      find: a\n"
                        "      replace: b\n      tests: [tests/one.py]\n      tests: [tests/two.py]\n")
    with pytest.raises(SystemExit, match="tests given twice"):
        mutations.load(register)


@pytest.mark.long
@pytest.mark.timeout(2400)  # the suite's 600 s is a cell's worth; this is a tier (over 10 minutes under load)
def test_ci_tier_mutants_are_killed(docker_ready: None) -> None:
    done = run("--tier", "ci", timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " 0 survived, 0 broken" in done.stdout, done.stdout[-4000:]


@pytest.mark.load
def test_every_mutant_is_killed(docker_ready: None) -> None:
    done = run(timeout=5400)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
