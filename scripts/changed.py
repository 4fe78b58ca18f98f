#!/usr/bin/env python3
"""Which files changed since a commit: CI runs its slow, narrow tiers (the register's and mutmut's mutants, the
gVisor re-runs) only when files they cover changed since the last landed commit (NBEXEC_CHANGED_SINCE, which
.ci/run sets from .ci/landed). Unset, unknown or unreadable: every tier runs (None below means "run it all").

    scripts/changed.py                 # the files changed since NBEXEC_CHANGED_SINCE, one per line
    scripts/changed.py REV             # since REV
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = "NBEXEC_CHANGED_SINCE"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def changed(since: str | None = None) -> set[str] | None:
    """The paths changed since ``since`` (default: NBEXEC_CHANGED_SINCE), committed or not, and the untracked
    ones; None when there is no base or git cannot tell (then everything runs)."""
    since = since if since is not None else os.environ.get(VARIABLE, "").strip()
    if not since or _git("cat-file", "-e", f"{since}^{{commit}}") is None:
        return None
    diff, untracked = _git("diff", "--name-only", since), _git("ls-files", "--others", "--exclude-standard")
    if diff is None or untracked is None:
        return None
    return {line for line in (diff + untracked).splitlines() if line}


def touches(paths: Iterable[str], covered: Iterable[str]) -> bool:
    """Whether any of ``paths`` is, or lies under, one of ``covered`` (files or folders ending in /)."""
    prefixes = tuple(covered)
    return any(path == prefix or (prefix.endswith("/") and path.startswith(prefix))
               for path in paths for prefix in prefixes)


def main(argv: list[str]) -> int:
    found = changed(argv[0] if argv else None)
    if found is None:
        print(f"no base to compare with ({VARIABLE} unset or unknown): every tier runs", file=sys.stderr)
        return 0
    print("\n".join(sorted(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
