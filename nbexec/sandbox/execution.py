"""How one execute_request ended: the record `kernel.KernelClient.run` fills in and the engine reads."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from .lasterror import LastError


@dataclass
class Execution:
    """How one execute_request ended. ``status``: ok, error (the code raised), timeout (past the deadline;
    ``stop`` is "interrupted" or "killed") or gone (the sandbox stopped under it). ``timing`` holds nbclient's
    ``cell.metadata.execution`` keys (iopub.status.busy, iopub.execute_input, shell.execute_reply,
    iopub.status.idle), stamped by the host's clock when each message arrived.

    The status is "error" when an error message arrived *or* the execute_reply said so: either is enough, and
    neither is lost to a cap (an error message past the frame limit still counts by its header). When no error
    message could be read whole, ``error`` holds what the reply, or the kernel asked afterwards, said of it."""

    status: str = "ok"
    execution_count: int | None = None
    stop: str = ""
    timing: dict[str, str] = field(default_factory=dict)
    reply: str = ""  # the execute_reply's status (ok, error); "" when none could be read
    errors_read: int = 0  # error messages handed on whole
    errors_dropped: int = 0  # bytes of error messages past the frame limit (read past unkept)
    error: LastError | None = None
    exit_value: str | None = None  # the cell called exit()/quit(): its argument as SystemExit would show it
    late_unread: bool = False  # output still came after idle when the host stopped reading (kernel.MAX_SETTLE)

    def stamp(self, key: str) -> None:
        self.timing[key] = datetime.datetime.now(datetime.timezone.utc).isoformat()
