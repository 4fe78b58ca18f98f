"""Which SandboxSource a config names (``config.source``): this host's Docker engine, or the nodes of
NBEXEC_NODES. One source of each kind per process (the local one holds the warm pools; a remote one is kept per
node list and token, see `nbexec.sandbox.remote.source`)."""

from __future__ import annotations

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError
from nbexec.sandbox.docker.local import LocalSource
from nbexec.sandbox.remote.source import RemoteSource
from nbexec.sandbox.source import SandboxSource

_LOCAL = LocalSource()


def for_config(config: SandboxConfig) -> SandboxSource:
    """The source ``config.source`` names."""
    if config.source == "local":
        return _LOCAL
    if config.source == "remote":
        return RemoteSource.from_env()
    raise ConfigError(f"unknown sandbox source {config.source!r}: use local or remote")
