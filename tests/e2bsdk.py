"""E2B's SDKs pointed at an nbexec server or router: its three variables, and nothing else of E2B's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest


def point(monkeypatch: pytest.MonkeyPatch, url: str, token: str) -> None:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY for the server at ``url``; every other E2B_ variable unset."""
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("E2B_API_URL", f"{url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", token)


@contextlib.contextmanager
def sandbox(monkeypatch: pytest.MonkeyPatch, url: str, token: str) -> Iterator[Any]:
    """A code-interpreter sandbox made with E2B's SDK through the server at ``url``; killed after."""
    from e2b_code_interpreter import Sandbox  # E2B's SDK, imported only by the tests that make one

    point(monkeypatch, url, token)
    made = Sandbox.create(timeout=120)
    try:
        yield made
    finally:
        made.kill()
