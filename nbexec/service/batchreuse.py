"""``POST /v1/batches?reuse=batch``: the judge items of one batch share a few sandboxes, reset between two items
(`judgemany.Kept`, as judge_many(reuse="batch") does; docs/judging.md says what a reset does not undo).

A batch's sandboxes are its own: never handed to another batch, and so never to another token. Each is held by
one of the batch's workers (`Batches._worker`), and the worker holds one of the token's run slots for as long as
it runs items: the sandboxes a batch keeps are counted in the token's caps, idle or not. A worker that ends closes
one idle sandbox before it frees its slot, so a batch never keeps more sandboxes than it holds slots.
"""

from __future__ import annotations

import threading

from nbexec.engine.judgemany import Kept
from nbexec.engine.session import Session

from .tenants import Tenants

MODES = ("batch",)  # what ``reuse`` may say (absent: a sandbox per item)


class Reuse:
    """The sandboxes one batch keeps between its judge items: a Kept per image (a sandbox of one image is never
    handed to an item that asked for another). A sandbox that closes goes as a one-shot's does: its folder's
    clock starts."""

    def __init__(self, folders: Tenants) -> None:
        self._folders = folders
        self._kept: dict[str | None, Kept] = {}
        self._lock = threading.Lock()
        self._closed = False

    def kept(self, image: str | None) -> Kept:
        with self._lock:
            found = self._kept.get(image)
            if found is None:
                found = self._kept[image] = Kept(self._end)
                if self._closed:
                    found.close()
            return found

    def take(self, image: str | None) -> Session | None:
        """An idle sandbox of ``image``'s (reset and clean), or None."""
        return self.kept(image).take()

    def close_one(self) -> None:
        """Close one idle sandbox, of whichever image (a worker that ends: what it kept goes with its slot)."""
        with self._lock:
            kepts = list(self._kept.values())
        for kept in kepts:
            session = kept.take()
            if session is not None:
                self._end(session)
                return

    def close(self) -> None:
        """Close every idle sandbox; one that ends its item after this is closed then."""
        with self._lock:
            self._closed = True
            kepts = list(self._kept.values())
        for kept in kepts:
            kept.close()

    def _end(self, session: Session) -> None:
        self._folders.finish_one_shot(session.id)  # one_shot sessions are named by their first item's execution
        session.close()  # one that never started a run was never recorded: closed all the same
