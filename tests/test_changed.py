"""scripts/changed.py: which slow tiers CI runs (pure parts, and git on this repository)."""

from __future__ import annotations

import pytest

from .changes import changed


@pytest.mark.parametrize("paths,covered,expected", [
    ({"nbexec/sandbox/kernel.py"}, ("nbexec/sandbox/",), True),
    ({"nbexec/sandbox/kernel.py"}, ("nbexec/sandbox/kernel.py",), True),
    ({"nbexec/sandboxes.py"}, ("nbexec/sandbox/",), False),  # a folder is a folder, not a prefix of a name
    ({"nbexec/sandbox/kernel.py"}, ("nbexec/sandbox",), False),
    ({"README.md"}, ("nbexec/", "tests/conftest.py"), False),
    (set(), ("nbexec/",), False),
])
def test_a_path_touches_a_file_or_a_folder_it_lies_in(paths: set[str], covered: tuple[str, ...],
                                                      expected: bool) -> None:
    assert changed.touches(paths, covered) is expected


def test_an_unknown_or_missing_base_runs_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(changed.VARIABLE, raising=False)
    assert changed.changed() is None
    assert changed.changed("0" * 40) is None and changed.changed("no such ref") is None
    monkeypatch.setenv(changed.VARIABLE, "HEAD")
    assert isinstance(changed.changed(), set)  # a clean clone at the base: empty; a work tree: its changes
