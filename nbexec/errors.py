"""Failures of nbexec itself. Errors in the user's code are never raised: they are data in the result.

    NbexecError
    ├── ConfigError              a bad option or environment variable
    │   └── CellTooLargeError        a cell over the size one cell may have; refused before a sandbox starts (413)
    ├── NotebookError            input that is not a runnable notebook (missing, not UTF-8, invalid JSON)
    ├── DockerError              the Docker engine failed or could not be reached
    │   ├── DockerUnavailableError   no engine answers
    │   └── ImageNotFoundError       the runtime image is not built
    ├── SandboxError             a sandbox could not be started or was lost
    │   ├── ProtocolError            the kernel broke the protocol (unsigned, replayed, oversized, malformed)
    │   └── DiskSpaceError           the host lacks the free disk a new sandbox may use (HTTP 503)
    ├── SessionError
    │   ├── SessionDeadError         the session's kernel died or was killed; start a new session
    │   ├── SessionClosedError       the session was closed (or reaped after its idle TTL)
    │   ├── SessionLimitError        too many live sessions
    │   ├── SessionNotFoundError     no session with that id
    │   ├── SessionLostError         the node that held the session died or restarted (HTTP 410)
    │   ├── SessionPendingError      a restarted node is still finding the kept session again (HTTP 503)
    │   └── SnapshotError            a snapshot that is not yours, not there, tampered with, or over its caps
    ├── NodeError                a remote node (NBEXEC_NODES) failed
    │   ├── NodeUnavailableError     no node could be reached; nothing ran
    │   └── NodeLostError            the node was lost during the call; the code may have run (never retried)
    ├── FileTransferError        an upload or download into /mnt/data was refused
    │   └── FileTooLargeError        the file is over the cap (max_data, or the caller's); nothing was read (HTTP 413)
    ├── PackageError             packages could not be resolved or provided (reported in results, raised elsewhere)
    │   ├── PackageRefusedError      the policy refused a dependency (a direct reference, one off the allowlist)
    │   └── PackageLimitError        the execution's package budget or time limit ran out (not remembered)
    └── StorageError             an artifact store failed (reported per file in results, raised elsewhere)
"""

from __future__ import annotations


class NbexecError(Exception):
    """Base of every error nbexec raises."""


class ConfigError(NbexecError, ValueError):
    """An option or environment variable has a bad value."""


class CellTooLargeError(ConfigError):
    """A cell is larger than one cell may be, so it was refused before a sandbox started.

    The limit exists because the kernel echoes a cell back, within the frame limit. The message is for the
    caller (an HTTP 413, a tool error)."""


class NotOfferedError(ConfigError):
    """A caller asked for what this policy does not offer: a language not offered, or what only Python has in
    another language. Its message is for the caller (an HTTP 400, a tool error); it names nothing of the host."""


class NotebookError(NbexecError):
    """The input cannot be turned into a runnable notebook."""


class DockerError(NbexecError):
    """The Docker engine failed."""


class DockerUnavailableError(DockerError):
    """No Docker engine answers."""


class ImageNotFoundError(DockerError):
    """The runtime image is missing."""


class SandboxError(NbexecError):
    """A sandbox could not be started, or was lost while in use."""


class ProtocolError(SandboxError):
    """The sandbox's kernel sent something the protocol does not allow; the sandbox is not trusted any more."""


class DiskSpaceError(SandboxError):
    """The host lacks the free disk one more sandbox may write, plus ``disk_margin``; it was not started.

    Free disk here means less what admitted sandboxes may still write. ``reason`` says so without host paths."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class SessionError(NbexecError):
    """A session cannot serve the request."""


class SessionDeadError(SessionError):
    """The session's kernel died or was killed."""


class SessionBusyError(SessionError):
    """The session stayed busy (another call, or a sleep under way) for the whole time limit of a run."""


class WakeStoppedError(SessionBusyError):
    """A run's wake from a checkpoint was interrupted, or ran out of time, before the kernel was back.

    Nothing ran. The session sleeps on with its memory and files, and the next call wakes it again."""


class SessionClosedError(SessionError):
    """The session was closed."""


class SessionLimitError(SessionError):
    """The cap on live sessions is reached."""


class ShuttingDownError(SessionLimitError):
    """The node is shutting down: nothing new starts on it. Try again, on another node."""


class SessionNotFoundError(SessionError, KeyError):
    """No session has that id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class SessionLostError(SessionError):
    """The node that held the session died, restarted or cannot be reached: its kernel state is gone (files
    already downloaded stay). Start a new session."""


class SessionPendingError(SessionError):
    """A restarted process is still finding this kept session again (`nbexec.engine.adoption`): retry after
    ``retry_after`` seconds, by which it is found or lost."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SnapshotError(SessionError):
    """A snapshot cannot be made (over its owner's caps) or restored (unknown, another owner's, tampered with)."""


class NodeError(NbexecError):
    """A remote node failed."""


class NodeUnavailableError(NodeError):
    """No node answered; the call never reached one, so nothing ran."""


class ClusterFullError(NodeUnavailableError):
    """Every node holds as many of this caller's sandboxes as it takes; nothing ran. Retry after
    ``retry_after`` seconds, or once a sandbox of yours is released."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NodeLostError(NodeError):
    """The node was lost while it ran the call. The code may have run, so it is not retried."""


def lost_sandbox(detail: str, purpose: str) -> NbexecError:
    """What a call on a far sandbox whose node went away raises: a session's state is gone; a one-shot's run may
    have happened, so it is not retried."""
    if purpose == "session":
        return SessionLostError(f"{detail}. Files already downloaded stay; start a new session.")
    return NodeLostError(f"{detail}; the execution is not retried, since it may have run")


class FileTransferError(NbexecError):
    """A file could not be put into or fetched from /mnt/data."""


class FileTooLargeError(FileTransferError):
    """A file is larger (by its apparent size at fstat, or by what a node sent) than the cap; it was not read."""


class PackageError(NbexecError):
    """Packages asked for could not be resolved, downloaded or provided to the sandbox."""


class PackageRefusedError(PackageError):
    """The package policy refused something the resolution reached; nothing of the request was provided.

    For example a direct reference, or a dependency that is not on the allowlist."""


class PackageLimitError(PackageError):
    """The execution's package budget (max_packages, max_package_download) or its time limit ran out; another
    execution may fit, so the failure is not remembered."""


class StorageError(NbexecError):
    """An artifact store could not store a file."""
