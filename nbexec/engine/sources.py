"""Which SandboxSource a config names (``config.source``): this host's Docker engine, or the nodes of
NBEXEC_NODES. One source of each kind per process (the local one holds the warm pools; a remote one is kept per
node list and token, see `nbexec.sandbox.remote.source`).

This module and the CLI are the only places that import a backend package (scripts/layers.py checks it): the
rest of nbexec knows sandboxes through the seam (`nbexec.sandbox.source`). Tests add a source under a name of
their own (`register_for_tests`, the fake's way in); no config or environment variable can name one otherwise.
"""

from __future__ import annotations

from nbexec import config as config_module
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError
from nbexec.sandbox.docker.local import LocalSource
from nbexec.sandbox.remote.source import RemoteSource
from nbexec.sandbox.source import SandboxSource

_LOCAL = LocalSource()
_FOR_TESTS: dict[str, SandboxSource] = {}


def for_config(config: SandboxConfig) -> SandboxSource:
    """The source ``config.source`` names."""
    if config.source == "local":
        return _LOCAL
    if config.source == "remote":
        return RemoteSource.from_env()
    if config.source == "ray":  # imported here: Ray is an extra, and joining a cluster is the caller's choice
        from nbexec.sandbox.ray.source import RaySource

        return RaySource.from_env()
    if config.source in _FOR_TESTS:
        return _FOR_TESTS[config.source]
    raise ConfigError(f"unknown sandbox source {config.source!r}: use local, remote or ray")


def register_for_tests(name: str, source: SandboxSource | None) -> None:
    """Make ``name`` a valid ``config.source`` naming ``source`` (None: forget it again). For tests only: the
    fake source runs code in this process (`nbexec.sandbox.fake`), so nothing but a test may make it reachable."""
    if name in config_module.SANDBOX_SOURCES:
        raise ValueError(f"{name!r} names a real source")
    if source is None:
        _FOR_TESTS.pop(name, None)
        config_module.TEST_SOURCES.discard(name)
    else:
        _FOR_TESTS[name] = source
        config_module.TEST_SOURCES.add(name)
