"""Who the code of a local sandbox runs as: the one place that decides it."""

from __future__ import annotations

import os
import secrets
import threading

from nbexec.config import SandboxConfig, running_as_root

# Sandbox uids when nbexec runs as root. They lie far above any login account (useradd stops at 60000). They stay
# below 2**31 because some tools keep uids in a signed 32-bit integer.
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
    """The uid and gid a new sandbox runs as.

    ``config.user`` comes first. Else yours, so files in /mnt/data stay yours. When nbexec runs as root, each call
    gets a fresh pair that is no account on this host: sandboxes then share no per-uid kernel limit."""
    if config.user:
        uid, _, gid = config.user.partition(":")
        return int(uid), int(gid or uid)
    if not running_as_root():
        return os.getuid(), os.getgid()
    return fresh_ids()
