"""What a model is told across the calls of one session: only the files new or changed since its last call, and
a kernel that died is replaced at the next call (the model has no restart tool; it is told what was lost)."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable

from nbexec.engine.session import Session
from nbexec.errors import SessionDeadError
from nbexec.result import ExecutionResult

REVIVED = ("[The kernel had died in an earlier call, so this call ran in a fresh one: variables and imports from "
           "before are gone; files in /mnt/data are kept.]\n")
_seen: weakref.WeakKeyDictionary[Session, dict[str, str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def only_changed(session: Session, result: ExecutionResult) -> ExecutionResult:
    """``result`` with only the files new or changed (by content) since ``session``'s last call listed, and a line
    saying how many were left out; the first call of a session lists them all."""
    with _lock:
        seen = _seen.setdefault(session, {})
        fresh = tuple(f for f in result.files if seen.get(f.name) != f.sha256)
        seen.clear()
        seen.update({f.name: f.sha256 for f in result.files})
    same = len(result.files) - len(fresh)
    if not same:
        return result
    note = (f"\n[{same} file{'s' if same != 1 else ''} in /mnt/data unchanged since the last call "
            f"{'is' if same == 1 else 'are'} not listed again]")
    return dataclasses.replace(result, files=fresh, text=result.text + note)


def revived(session: Session, call: Callable[[], ExecutionResult]) -> ExecutionResult:
    """``call()``; when the session's kernel had died, restart it first and say so at the top of the result."""
    try:
        return call()
    except SessionDeadError:
        session.restart()
    result = call()
    return dataclasses.replace(result, text=REVIVED + result.text)
