"""The driver's half of one call to a node's agent: a deadline on every wait, the answer sized before it is kept,
its shape checked, and Ray's ways of failing turned into nbexec's errors naming the node.

An answer is read in three steps: wait for it until the call's own deadline (``ray.wait``), ask Ray its size
(``get_object_locations``: what the node stored, before a byte of it is copied here) and refuse it past the call's
cap, then get it (``ray.get`` with what is left of the deadline). A node whose actor died, whose raylet went away
or that does not answer in time is lost: NodeLostError naming it (the handle makes that SessionLostError for a
session). An NbexecError the agent reports comes back as the same kind of error, from a fixed table.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray
import ray.exceptions
import ray.experimental

from nbexec import errors
from nbexec.errors import NbexecError, NodeError, NodeLostError, ProtocolError

SIZE_TIMEOUT_MS = 5000  # milliseconds to learn an answer's size once it is ready
ANSWER_OVERHEAD = 64 * 1024  # bytes of an answer's envelope (the dict around the value, Ray's metadata)

# The errors an agent may report, by name; anything else is a NodeError with its text.
KNOWN = {cls.__name__: cls for cls in (
    errors.ConfigError, errors.NotOfferedError, errors.SandboxError, errors.ProtocolError, errors.DiskSpaceError,
    errors.SessionLimitError, errors.FileTransferError, errors.FileTooLargeError, errors.PackageError,
    errors.DockerError, errors.DockerUnavailableError, errors.ImageNotFoundError, errors.NodeError)}
LOST = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
        ray.exceptions.WorkerCrashedError, ray.exceptions.LocalRayletDiedError, ray.exceptions.RaySystemError,
        ray.exceptions.RpcError)


class Agent:
    """One node's agent as the driver sees it: its name (for errors) and its actor."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name, self.actor = name, actor

    def __repr__(self) -> str:
        return f"<Agent {self.name}>"

    def call(self, method: str, *args: Any, timeout: float, cap: int, what: str) -> Any:
        """The value ``method`` answered (see the module docstring); NbexecError when the agent reported one."""
        try:
            ref = getattr(self.actor, method).remote(*args)
        except LOST as exc:
            raise NodeLostError(f"node {self.name} is lost ({type(exc).__name__}): {str(exc)[:300]}") from exc
        answer = fetch(ref, timeout=timeout, cap=cap + ANSWER_OVERHEAD, node=self.name, what=what)
        return unwrap(answer, self.name, what)

    def send(self, method: str, *args: Any) -> None:
        """Call ``method`` without waiting for its answer (an interrupt: safe from any thread)."""
        with contextlib.suppress(Exception):
            getattr(self.actor, method).remote(*args)


def fetch(ref: Any, *, timeout: float, cap: int, node: str, what: str) -> Any:
    """The object ``ref`` names, within ``timeout`` seconds and ``cap`` bytes (see the module docstring)."""
    deadline = time.monotonic() + max(0.0, timeout)
    try:
        ready, _ = ray.wait([ref], timeout=max(0.0, timeout), fetch_local=False)
        if not ready:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise NodeLostError(f"node {node} did not {what} within {timeout:g} s")
        size = _size(ref, node, what)
        if size > cap:
            raise ProtocolError(f"node {node} answered {what} with {size:,} bytes, over the {cap:,}-byte cap; "
                                "refused unread")
        return ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError as exc:
        raise NodeLostError(f"node {node} did not {what} within {timeout:g} s") from exc
    except LOST as exc:
        raise NodeLostError(f"node {node} is lost ({type(exc).__name__}): {str(exc)[:300]}") from exc
    except ray.exceptions.RayError as exc:  # the agent's own failure (a bug): not the sandbox's
        raise NodeError(f"node {node} could not {what}: {type(exc).__name__}: {str(exc)[:300]}") from exc


def _size(ref: Any, node: str, what: str) -> int:
    """The answer's size as Ray stored it. Ray knows no size for an error it stored (a dead actor, a lost
    node): such an answer is in this process's own memory store (no node holds a copy), where Ray keeps only
    errors and answers under its inline limit, so it is read (as 0) to learn which error it is."""
    found = ray.experimental.get_object_locations([ref], timeout_ms=SIZE_TIMEOUT_MS).get(ref) or {}
    size = found.get("object_size")
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    if found.get("node_ids") == []:
        return 0
    raise ProtocolError(f"node {node}'s answer to {what} has no size Ray knows; refused unread")


def unwrap(answer: Any, node: str, what: str) -> Any:
    """The value of an agent's ``{"ok": value}``; its reported error raised as nbexec's own kind."""
    if isinstance(answer, dict) and set(answer) == {"ok"}:
        return answer["ok"]
    if isinstance(answer, dict) and set(answer) == {"error", "detail"} and isinstance(answer["error"], str) \
            and isinstance(answer["detail"], str):
        kind: type[NbexecError] = KNOWN.get(answer["error"], NodeError)
        detail = answer["detail"][:4000]
        if kind is errors.DiskSpaceError:  # the agent sent its reason alone (no path of the node)
            raise errors.DiskSpaceError(f"node {node} lacks the free disk for a sandbox: {detail}", detail)
        raise kind(f"{detail} (on node {node})")
    raise ProtocolError(f"node {node} answered {what} with something else")
