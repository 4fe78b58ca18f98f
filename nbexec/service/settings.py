"""The policy of one `nbexec serve` node: its sandbox config, tokens, caps and lifetimes (set by `nbexec serve`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nbexec.config import SandboxConfig
from nbexec.engine import snapshotblobs
from nbexec.errors import ConfigError
from nbexec.stores.storage import ArtifactStore


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The service's policy. ``tokens`` are the accepted bearer tokens (empty only with ``auth=False``)."""

    config: SandboxConfig
    tokens: tuple[str, ...] = field(default=(), repr=False)
    auth: bool = True
    store: ArtifactStore | None = None
    max_body: int = 16 * 1024**2
    max_sessions_per_token: int = 8
    max_running_per_token: int = 4
    max_batches_per_token: int = 4  # batches kept per token (running, or finished within result_ttl); 429 past it
    max_batch_items: int = 1000  # items per token not yet run, over all its batches (429 past it; 413 for one)
    session_ttl: float = 20 * 60.0
    result_ttl: float = 15 * 60.0  # seconds a one-shot result's files stay downloadable, then they are deleted
    keepalive: float = 15.0  # seconds between SSE keep-alive comments on a quiet stream
    # The longest lifetime an E2B client may give a sandbox (nbexec.service.e2b), NBEXEC_E2B_MAX_TIMEOUT.
    e2b_max_timeout: float = field(default_factory=lambda: _seconds(
        "NBEXEC_E2B_MAX_TIMEOUT", os.environ.get("NBEXEC_E2B_MAX_TIMEOUT", "")) or 3600.0)
    # Servers the code starts inside an E2B door's sandbox, reached through the sandbox URL with E2b-Sandbox-Port
    # (nbexec.service.e2b.ports): off unless the operator turns them on, NBEXEC_E2B_PORTS=1.
    e2b_ports: bool = field(default_factory=lambda: _switch("NBEXEC_E2B_PORTS", os.environ.get("NBEXEC_E2B_PORTS", "")))
    state_dir: Path | None = None  # durable sessions: kept across restarts, with this node's instance
    hibernate_after: float | None = field(default_factory=lambda: _seconds(
        "NBEXEC_HIBERNATE_AFTER", os.environ.get("NBEXEC_HIBERNATE_AFTER", "")))

    def __post_init__(self) -> None:
        if self.hibernate_after is not None and not self.hibernate_after > 0:
            raise ConfigError("NBEXEC_HIBERNATE_AFTER must be a number of seconds above 0")
        if self.auth and not self.tokens:
            raise ConfigError("no API token: give --token-file or NBEXEC_API_TOKENS (or --no-auth on loopback)")
        if any(len(t) < 16 for t in self.tokens):
            raise ConfigError("API tokens must be at least 16 characters long")
        if self.max_batches_per_token < 1 or self.max_batch_items < 1:
            raise ConfigError("max_batches_per_token and max_batch_items must be at least 1")
        if self.result_ttl <= 0 or self.keepalive <= 0 or self.e2b_max_timeout < 1:
            raise ConfigError("result_ttl and keepalive must be above 0 seconds, e2b_max_timeout at least 1")
        snapshotblobs.store_for(self.state_dir)  # a shared snapshot store without its key fails the start


def _seconds(name: str, raw: str) -> float | None:
    """A number of seconds from the environment variable ``name`` (its value ``raw``, read when settings are
    made), or None when unset."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None


def _switch(name: str, raw: str) -> bool:
    """An on/off environment variable ``name`` (its value ``raw``): off when unset."""
    found = raw.strip().lower()
    if found in ("", "0", "false", "no", "off"):
        return False
    if found in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={raw!r} is neither on (1) nor off (0)")
