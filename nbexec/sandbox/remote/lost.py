"""What a handle to a sandbox on another machine shares: once its node is lost, the handle is lost for good; and
the node's report on /mnt/data is read the same way whatever carried it.

A lost one-shot raises NodeLostError and a lost session SessionLostError (`errors.lost_sandbox`), naming the node;
neither is retried, since the code may have run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nbexec.errors import ProtocolError, lost_sandbox


class OnNode:
    """Mixed into a handle; ``losing`` names the errors of a call that mean its node is gone."""

    losing: tuple[type[Exception], ...] = ()
    where = "node"  # how the loss names the node's kind
    lost: str | None
    purpose: str
    node: str | None
    _input_notes: list[str]

    def _lost_error(self) -> Exception:
        assert self.lost is not None
        return lost_sandbox(self.lost, self.purpose)

    @contextlib.contextmanager
    def _on_node(self) -> Iterator[None]:
        """A call to the node; one of ``losing`` makes this handle lost."""
        if self.lost is not None:
            raise self._lost_error()
        try:
            yield
        except self.losing as exc:
            self.lost = f"the sandbox on {self.where} {self.node} is lost: {exc}"
            raise self._lost_error() from exc

    def _noted(self, data: Any) -> tuple[list[str], bool]:
        """The node's report on /mnt/data: its notes and whether the data limit stopped the code; the input notes
        are kept for `input_notes`."""
        data = data if isinstance(data, dict) else {}
        notes, stopped, inputs = texts(data.get("data_notes")), data.get("stopped"), texts(data.get("input_notes"))
        if notes is None or not isinstance(stopped, bool) or inputs is None:
            raise ProtocolError(f"node {self.node} reported on /mnt/data with something else")
        self._input_notes = inputs
        return notes, stopped

    def input_notes(self) -> list[str]:
        return list(self._input_notes)  # nothing of this host is mounted; the node's own, read with data_notes


def texts(value: Any) -> list[str] | None:
    """``value`` when it is a list of at most 1,000 strings, else None."""
    if isinstance(value, list) and len(value) <= 1000 and all(isinstance(v, str) for v in value):
        return list(value)
    return None
