"""scripts/changed.py for the tests (scripts/ is not a package): which files changed since the last landed commit.
Where the tests run without the scripts (mutmut's copy of the tree), nothing is known: every test runs."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "changed.py"
_SPEC = importlib.util.spec_from_file_location("nbexec_changed", _SCRIPT) if _SCRIPT.is_file() else None
changed: Any
if _SPEC is not None and _SPEC.loader is not None:
    changed = importlib.util.module_from_spec(_SPEC)
    _SPEC.loader.exec_module(changed)
else:
    changed = types.SimpleNamespace(VARIABLE="NBEXEC_CHANGED_SINCE", changed=lambda since=None: None,
                                    touches=lambda paths, covered: True)
