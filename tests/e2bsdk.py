"""E2B's SDKs pointed at an nbexec server or router: its three variables, and nothing else of E2B's."""

from __future__ import annotations

import os

import pytest


def point(monkeypatch: pytest.MonkeyPatch, url: str, token: str) -> None:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY for the server at ``url``; every other E2B_ variable unset."""
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("E2B_API_URL", f"{url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", token)
