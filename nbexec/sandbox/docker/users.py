"""Who the code of a local sandbox runs as: the one place that decides it."""

from __future__ import annotations

import os
import secrets
import threading

from nbexec.config import SandboxConfig, running_as_root

# Sandbox uids when nbexec runs as root: far above any login account (useradd stops at 60000), below 2**31 so
# tools that keep uids in a signed 32-bit integer still work.
SANDBOX_UID_BASE = 2_000_000_000
SANDBOX_UID_SPAN = 140_000_000
_ids_lock = threading.Lock()
_ids_given: set[int] = set()


def fresh_ids() -> tuple[int, int]:
    """A uid and gid that no account or group on this host has and this process has not handed out yet."""
    import grp
    import pwd

    with _ids_lock:
        while True:
            candidate = SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN)
            if candidate in _ids_given:
                continue
            try:
                pwd.getpwuid(candidate)
                continue
            except KeyError:
                pass
            try:
                grp.getgrgid(candidate)
                continue
            except KeyError:
                pass
            if len(_ids_given) > 100_000:  # a long-lived service: forget the oldest-made ones
                _ids_given.clear()
            _ids_given.add(candidate)
            return candidate, candidate


def uid_gid(config: SandboxConfig) -> tuple[int, int]:
    """The uid and gid a new sandbox runs as: ``config.user``; else yours (files in /mnt/data stay yours); else,
    when nbexec runs as root, a fresh pair per call (per sandbox) that is no account on this host, so sandboxes
    share no per-uid kernel limit with each other or with a login."""
    if config.user:
        uid, _, gid = config.user.partition(":")
        return int(uid), int(gid or uid)
    if not running_as_root():
        return os.getuid(), os.getgid()
    return fresh_ids()
