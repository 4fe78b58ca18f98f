"""A sandbox's process supervisor: processes, a pty and file operations inside the sandbox, as its user, for the
E2B door (`nbexec.service.e2b`).

    wire        frames and caps, shared by both sides (pure, stdlib)
    agent       the supervisor INSIDE the sandbox (stdlib, Python 3.9+): processes, their output, stdin, signals
    agentfiles  its file operations, through descriptors, as the sandbox user
    agentwatch  its folder watches (inotify through ctypes), bounded
    agentports  its connections to ports inside the sandbox (loopback only), windowed both ways
    client      the host's `Supervisor`, started by `docker exec`: every answer sized and checked, every wait bounded
    files       the host's `Supervisor.files`
    ports       the host's `Supervisor.ports`: relays to those ports, every frame checked against its window
    events      the host's errors, typed events, bounded subscriptions and checks on the supervisor's answers

Limits: at most `MAX_PROCESSES` running processes per sandbox, `MAX_STDIN_CALL` bytes per input, pty sizes up to
`MAX_PTY_SIZE`, argv/envs/cwd bytes capped, frames of `wire.MAX_JSON` + `wire.MAX_DATA` bytes, `SUBSCRIBER_BYTES`
of output queued per subscriber (more is dropped and counted in `Subscription.lost`).

May import: nbexec's errors, the seam's mount points and the Docker engine (`..daemon`).
"""

from .client import MAX_PROCESSES, MAX_STDIN_CALL, Supervisor
from .events import (
    MAX_ARGV_BYTES,
    MAX_CWD_BYTES,
    MAX_ENVS,
    MAX_PTY_SIZE,
    SUBSCRIBER_BYTES,
    SUBSCRIBER_EVENTS,
    AlreadyExistsError,
    BadArgumentError,
    End,
    Event,
    FsEvent,
    IsDirectoryError,
    LimitError,
    NotDirectoryError,
    NotFoundError,
    Output,
    PermissionDeniedError,
    ProcessNotFoundError,
    Started,
    Subscription,
    SupervisorError,
    SupervisorLostError,
    TooLargeError,
)
from .files import Files
from .ports import Relay, RelayEndedError

__all__ = ["MAX_ARGV_BYTES", "MAX_CWD_BYTES", "MAX_ENVS", "MAX_PROCESSES", "MAX_PTY_SIZE", "MAX_STDIN_CALL",
           "SUBSCRIBER_BYTES", "SUBSCRIBER_EVENTS", "AlreadyExistsError", "BadArgumentError", "End", "Event", "Files",
           "FsEvent", "IsDirectoryError", "LimitError", "NotDirectoryError", "NotFoundError", "Output",
           "PermissionDeniedError", "ProcessNotFoundError", "Relay", "RelayEndedError", "Started", "Subscription",
           "Supervisor", "SupervisorError",
           "SupervisorLostError", "TooLargeError"]
