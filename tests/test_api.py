"""The public API is what __all__ says, and importing nbexec does no I/O."""

from __future__ import annotations

import subprocess
import sys
import types

import nbexec


def test_exported_members() -> None:
    exported = set(nbexec.__all__)
    public = {name for name, value in vars(nbexec).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public == exported - {"__version__"}
    for name in exported:
        assert hasattr(nbexec, name), name


def test_import_does_nothing() -> None:
    code = ("import threading, sys; import nbexec; from nbexec.engine import session\n"
            "from nbexec.sandbox.docker import daemon, pool\n"
            "assert daemon._client is None and not pool._pools and not pool._executors\n"
            "assert threading.active_count() == 1, threading.enumerate()\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={"DOCKER_HOST": "unix:///nonexistent"})
