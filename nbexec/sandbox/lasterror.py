"""Ask a kernel how its last cell ended, when its own messages could not tell.

That happens when the error message, or the execute_reply, was larger than the whole output allowance. This module
is pure: it builds the request and reads the answer; `kernel.KernelClient.last_error` sends it.

The request is a silent execute_request: no history, no execution count, no output kept. Its code reads IPython's
record of the previous cell (``last_execution_result``), which the silent run replaces only after its own code.
It leaves a report on the shell object, and a user expression takes it. The sandbox trims the report (the name,
the head and tail of the value and of a plain traceback), so the answer is small whatever the exception was.
The answer is base64 of JSON, read with the strict parser every message gets, and trimmed again here. Nothing is
bound in the user's namespace.

The answer is the kernel's word, as the error message would have been. Code that rewrites IPython's record can
make it say anything, as it can forge any message. It cannot make a run pass whose reply or messages said
"error": the answer only fills in details, or tells whether a cell with an unreadable reply raised.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from nbexec.errors import ProtocolError

from .messages import parse

KEY = "nbexec_last_error"
_SOURCE = r'''
import base64, json, traceback
import IPython
shell = IPython.get_ipython()
done = getattr(shell, "last_execution_result", None)
error = None if done is None else (done.error_before_exec or done.error_in_exec)
def clip(text, limit):
    if len(text) <= limit:
        return text
    return "%s\n[nbexec: %d characters trimmed]\n%s" % (text[:limit * 3 // 4], len(text) - limit, text[-(limit // 4):])
report = {"raised": error is not None}
data = json.dumps(report).encode()
if error is not None:
    try:
        value = str(error)
    except BaseException:
        value = "<the exception could not be shown>"
    frames = error.__traceback__  # IPython's own frames (run_code) are left out, as IPython leaves them out
    while frames is not None and "/IPython/" in frames.tb_frame.f_code.co_filename.replace("\\", "/"):
        frames = frames.tb_next
    try:
        lines = list(traceback.TracebackException(type(error), error, frames).format())
    except BaseException:
        lines = []
    if len(lines) > 32:
        lines = lines[:8] + ["[nbexec: %d traceback entries trimmed]\n" % (len(lines) - 31)] + lines[-23:]
    limit = 8192
    while True:
        report.update(ename=clip(type(error).__name__, 1024), evalue=clip(value, 4 * limit),
                      traceback=[clip(line, limit) for line in lines])
        data = json.dumps(report, ensure_ascii=False).encode("utf-8", "replace")
        if len(data) <= 600000 or limit <= 64:
            break
        limit //= 2
shell.__dict__["_nbexec_last_error"] = base64.b64encode(data).decode()
'''
CODE = f"__import__('builtins').exec({_SOURCE!r}, {{}})"
EXPRESSION = "__import__('IPython').get_ipython().__dict__.pop('_nbexec_last_error', '')"
_BASE64 = re.compile(r"'([A-Za-z0-9+/=]*)'")


@dataclass(frozen=True)
class LastError:
    """How the previous cell ended, by the kernel's own record: whether it raised, and if so what."""

    raised: bool
    ename: str = ""
    evalue: str = ""
    traceback: tuple[str, ...] = ()


def read(reply: dict[str, Any]) -> LastError | None:
    """The report in an execute_reply's content, or None when there is none or it is malformed."""
    found = reply.get("user_expressions")
    found = found.get(KEY) if isinstance(found, dict) else None
    data = found.get("data") if isinstance(found, dict) and found.get("status") == "ok" else None
    text = data.get("text/plain") if isinstance(data, dict) else None
    matched = _BASE64.fullmatch(text) if isinstance(text, str) else None
    if matched is None or not matched[1]:
        return None
    try:
        report = parse(base64.b64decode(matched[1], validate=True), "last error report")
    except (binascii.Error, ValueError, ProtocolError):
        return None
    return _checked(report)


def from_reply(content: dict[str, Any]) -> LastError | None:
    """The error a failed execute_reply describes; None when it does not say, so the kernel is asked.

    ipykernel repeats the error message's ename, evalue and traceback in the reply."""
    status = content.get("status")
    if status == "abort":  # bash_kernel and IRkernel after an interrupt (SIGINT): no error message is sent
        return LastError(True, "KeyboardInterrupt", "The cell was interrupted (the kernel answered 'abort').")
    if status != "error":  # "aborted", or anything else a kernel makes up: the cell did not end well
        return LastError(True, "KernelError", f"The kernel answered the cell with status {str(status)[:100]!r}.")
    return _checked({**content, "raised": True})


def _checked(report: Any) -> LastError | None:
    if not isinstance(report, dict) or not isinstance(report.get("raised"), bool):
        return None
    if not report["raised"]:
        return LastError(False)
    ename, evalue, lines = report.get("ename"), report.get("evalue"), report.get("traceback")
    if not isinstance(ename, str) or not isinstance(evalue, str) or not isinstance(lines, list) \
            or not all(isinstance(line, str) for line in lines):
        return None
    return LastError(True, ename, evalue, tuple(line.rstrip("\n") for line in lines))
