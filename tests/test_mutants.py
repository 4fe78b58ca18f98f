"""Machine-made mutants of the hostile-input modules (scripts/mutants.py runs mutmut with the fast tests): the list
of equivalent mutants is well formed and names functions in scope; a fixed-seed sample of the stable modules'
mutants is caught or explained on every test run; all of them with -m load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutants.py"


def scope() -> dict[str, tuple[str, tuple[str, ...], bool]]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mutants
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mutants.SCOPE


def test_every_equivalent_mutant_is_in_scope_and_says_why() -> None:
    import fnmatch

    entries = yaml.safe_load((ROOT / "tests" / "mutants-equivalent.yaml").read_text())
    known = scope()
    for entry in entries:
        module, _, function = entry["function"].partition(":")
        assert module in known and any(fnmatch.fnmatchcase(function, p) for p in known[module][1]), entry
        source = (ROOT / known[module][0]).read_text()
        assert function.rsplit(".", 1)[-1] in source, entry
        assert entry["mutant"].strip() and len(entry["why"]) > 20, entry
    pairs = [(e["function"], e["mutant"]) for e in entries]
    assert len(pairs) == len(set(pairs)), "an equivalent mutant is listed twice"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.long
@pytest.mark.mutants  # minutes of CPU: after the fast tier, with the Docker tier
@pytest.mark.timeout(2400)  # the suite's 600 s is a cell's worth; this is the whole tier (about 7 minutes here)
def test_a_fixed_sample_of_mutants_is_caught_or_explained() -> None:
    done = run("--tier", "ci", timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert "stable" in done.stdout


@pytest.mark.load
@pytest.mark.timeout(5400)
def test_every_mutant_is_caught_or_explained() -> None:
    done = run("--strict", timeout=5400)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
