"""What a handle to a sandbox on another machine shares: once its node is lost, the handle is lost for good.

A lost one-shot raises NodeLostError and a lost session SessionLostError (`errors.lost_sandbox`), naming the node;
neither is retried, since the code may have run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from nbexec.errors import lost_sandbox


class OnNode:
    """Mixed into a handle; ``losing`` names the errors of a call that mean its node is gone."""

    losing: tuple[type[Exception], ...] = ()
    where = "node"  # how the loss names the node's kind
    lost: str | None
    purpose: str
    node: str | None

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
