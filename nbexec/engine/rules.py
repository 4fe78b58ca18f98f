"""A running session's egress rules (network="allowlist"): `Session.allow_hosts` and `Session.deny_hosts`.

The change is checked against the session's policy (`nbexec.egress.check_change`: the grammar of allowed_hosts,
and within the hosts the session started with unless ``egress_widen``) before anything changes, then made through
the seam (`SandboxHandle.change_egress`): the local proxy or the sandbox's node judges every new request by it and
closes the open connections it no longer allows; the next run's ``result.connections`` logs it (method ``RULES``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbexec import egress

if TYPE_CHECKING:
    from nbexec.config import SandboxConfig
    from nbexec.sandbox.source import SandboxHandle


class LiveRules:
    """The egress half of `nbexec.engine.session.Session` (a mixin: it uses the session's lock and sandbox)."""

    if TYPE_CHECKING:
        _lock: threading.RLock
        _sandbox: SandboxHandle | None
        last_activity: float

        @property
        def config(self) -> SandboxConfig: ...

        def start(self) -> Any: ...

    def allow_hosts(self, *entries: str) -> None:
        """Let the running sandbox reach ``entries`` too (the grammar of allowed_hosts): within the hosts it
        started with unless the config sets ``egress_widen``. ConfigError, nothing changed, when not allowed."""
        self.change_hosts(allow=entries)

    def deny_hosts(self, *entries: str) -> None:
        """Stop the running sandbox reaching ``entries``: new requests to them are refused and open connections
        to them closed. ConfigError, nothing changed, for a bad entry."""
        self.change_hosts(deny=entries)

    def change_hosts(self, *, allow: Sequence[str] = (), deny: Sequence[str] = ()) -> None:
        """Both at once, checked whole before anything changes: ``allow`` appended, then ``deny`` (the newest
        rule that matches a destination decides). Safe from another thread: a run in progress meets the change
        on its next request."""
        config = self.config
        egress.check_change(config.network, config.allowed_hosts, allow, deny, widen=config.egress_widen)
        sandbox = self._sandbox  # a started one changes now, even while a run holds the session (as interrupt)
        if sandbox is None:
            with self._lock:
                self.start()
                sandbox = self._sandbox
        assert sandbox is not None
        sandbox.change_egress(list(allow), list(deny))
        self.last_activity = time.monotonic()
