"""``POST /v1/batches?reuse=batch``: the judge items of one batch share a few sandboxes, reset between two items
(`judgemany.Kept`, as judge_many(reuse="batch") does; docs/judging.md says what a reset does not undo).

The batch runs its items with workers (`Batches._worker`). A worker takes one of the token's run slots before its
first item and frees it after its last, and keeps at most one sandbox between items: a batch never has more
sandboxes than it holds slots, idle or not. A sandbox is its worker's, so it never serves another batch, and so
never another token.
"""

from __future__ import annotations

import contextlib

from nbexec.config import SandboxConfig
from nbexec.engine.judgemany import Kept
from nbexec.engine.session import Session

from .tenants import Tenants

MODES = ("batch",)  # what ``reuse`` may say (absent: a sandbox per item)


class Held:
    """The sandbox one worker keeps between its judge items. It closes as a one-shot's does: its folder's clock
    starts (at once when its batch was deleted)."""

    def __init__(self, folders: Tenants) -> None:
        self._folders = folders
        self.kept = Kept(self._end)

    def take(self, config: SandboxConfig) -> Session | None:
        """The kept sandbox when it runs ``config``'s image; one of another image is closed first (a worker has one
        sandbox at most)."""
        session = self.kept.take()
        if session is not None and session.config.image != config.image:
            self._end(session)
            return None
        return session

    def drop(self) -> None:
        """Close the kept sandbox, before an item that makes one of its own (an execution)."""
        session = self.kept.take()
        if session is not None:
            self._end(session)

    def close(self) -> None:
        """At the worker's end: close the kept sandbox; one whose item ends after this is closed then."""
        self.kept.close()

    def _end(self, session: Session) -> None:
        with contextlib.suppress(Exception):  # a close that fails never keeps the slot, nor the folder's clock
            self._folders.finish_one_shot(session.id)  # its id is its first item's execution id (its folder's)
        session.close()  # one that never started a run was never recorded: closed all the same
