"""E2B's home folder in nbexec's sandbox.

E2B's user works in /home/user; nbexec's sandbox writes to its capped data filesystem at /mnt/data. The container
mounts that filesystem at both (`HOME_ALIAS`). Through this door relative paths are below /home/user and processes
start there. So E2B's paths work in API calls and commands alike, and every byte written is still capped. Other
paths are the sandbox's own view (/tmp its tmpfs, / read-only), resolved inside the sandbox, never on the host."""

from __future__ import annotations

import posixpath

from nbexec.sandbox.source import DATA_MOUNT, HOME_ALIAS

HOME = HOME_ALIAS


def inward(path: str) -> str:
    """A path as the sandbox resolves it: a relative one is below /home/user."""
    return path if path.startswith("/") else posixpath.join(HOME, path)


def outward(path: str) -> str:
    """A path as E2B's clients name it: /mnt/data is /home/user."""
    if path == DATA_MOUNT or path.startswith(DATA_MOUNT + "/"):
        return HOME + path[len(DATA_MOUNT):]
    return path
