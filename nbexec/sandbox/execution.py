"""How one execute_request ended: the record `kernel.KernelClient.run` fills in and the engine reads."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

from .lasterror import LastError
from .messages import MAX_CONTROL, Message

OUTPUT_KINDS = frozenset({"stream", "display_data", "execute_result", "error", "update_display_data", "clear_output"})
COMM_KINDS = frozenset({"comm_open", "comm_msg"})  # widget state is built from them (engine.widgets)


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


def dispatch(msg: Message, run: Execution, on_output: Callable[[Message], None]) -> bool:
    """Apply one iopub message of the running cell to ``run`` (outputs and comm messages go to ``on_output``,
    unparsed); True once the kernel is idle. Kinds nbexec does not know are ignored unparsed."""
    kind = msg.msg_type
    if kind == "status":
        state = msg.content(MAX_CONTROL).get("execution_state")
        if state in ("busy", "idle"):
            run.stamp(f"iopub.status.{state}")
        return state == "idle"
    if kind == "execute_input":
        run.stamp("iopub.execute_input")
        count = msg.content(MAX_CONTROL).get("execution_count")
        run.execution_count = count if isinstance(count, int) else None
    elif kind in OUTPUT_KINDS or kind in COMM_KINDS:
        if kind == "error":  # known by its header: an error past the frame limit still fails the cell
            run.status = "error"
            run.errors_read += msg.complete
            run.errors_dropped += 0 if msg.complete else msg.size
        on_output(msg)
    return False
