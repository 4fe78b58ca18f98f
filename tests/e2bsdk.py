"""E2B's SDKs pointed at an nbexec server or router: its three variables, and nothing else of E2B's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

# The end of a hostile server a test runs in a sandbox: ``serve(conn)`` for each connection, on ``port``.
SERVE_FOREVER = """server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(128)
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""


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


@contextlib.contextmanager
def door(config: dict[str, Any] | None = None, **settings: Any) -> Iterator[Any]:
    """A running server for E2B's SDKs: the two test tokens, three sessions and two runs each, sandboxes of the
    test image (``config`` over one warm sandbox, no warm imports, 30 s and a 2 s interrupt grace); ``settings``
    over those of ServerSettings."""
    import nbexec
    from nbexec.service.settings import ServerSettings

    from .conftest import IMAGE
    from .test_server import TOKEN_A, TOKEN_B, running

    made = nbexec.SandboxConfig(**{"image": IMAGE, "pool_size": 1, "warm_imports": (), "timeout": 30,
                                   "interrupt_grace": 2, **(config or {})})
    chosen = {"tokens": (TOKEN_A, TOKEN_B), "max_sessions_per_token": 3, "max_running_per_token": 2, **settings}
    with running(ServerSettings(config=made, **chosen)) as service:
        yield service
