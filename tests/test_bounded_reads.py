"""Every loop that reads what a sandbox, a node or a client controls ends by a deadline and a budget (issue #36).

A structural rule, checked on the source: each ``while`` loop in the kernel wire, the sandbox sources and the
service that calls a read (recv, receive, read, _fill...) either names a deadline in its own test expression
(``deadline``, ``end``, ``give_up``) or is listed in REGISTER with what bounds it. A new unlisted loop fails this
test: write its deadline into its condition, or add it here with the name of its deadline and its budget.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCOPE = ("nbexec/sandbox/kernel.py", "nbexec/sandbox/zmtp.py", "nbexec/sandbox/docker/*.py",
         "nbexec/sandbox/remote/*.py", "nbexec/service/*.py")
READS = frozenset({"recv", "receive", "read", "recv_into", "recvfrom", "readline", "readinto", "_fill", "tail"})
DEADLINES = frozenset({"deadline", "end", "give_up"})  # a name in the loop's test that is a time.monotonic() bound

# (file, function, n-th while loop in it) -> its deadline; its budget. Each says what ends the loop.
REGISTER: dict[tuple[str, str, int], str] = {
    ("nbexec/sandbox/kernel.py", "wait_ready", 0):
        "deadline: check() raises past the start-up deadline; budget: one kernel_info request per 0.5 s try",
    ("nbexec/sandbox/kernel.py", "wait_subscribed", 0):
        "deadline: check() raises past the start-up deadline; budget: it ends at the first iopub message",
    ("nbexec/sandbox/kernel.py", "run", 0):
        "deadline: the run's ``deadline`` (then _stop's grace); budget: others' messages dropped by parent "
        "unparsed, the cell's own charged to the output allowance by the engine",
    ("nbexec/sandbox/kernel.py", "recv", 0):
        "deadline: ``end`` (the call's timeout); budget: ``budget`` messages when given (``most``)",
    ("nbexec/sandbox/zmtp.py", "_handshake", 0): "deadline: ``deadline`` (raises past it); budget: a greeting",
    ("nbexec/sandbox/zmtp.py", "_handshake", 1):
        "deadline: ``deadline`` (raises past it); budget: commands before READY, each within the frame cap",
    ("nbexec/sandbox/zmtp.py", "receive", 0):
        "deadline: ``end`` (the caller's timeout counts even while data keeps coming); budget: max_message bytes",
    ("nbexec/sandbox/docker/checkpointfiles.py", "_copy_file", 0):
        "deadline: none, a regular file of the host's disk read to its end; budget: ``limit`` + 1 bytes",
    ("nbexec/sandbox/docker/inputcopy.py", "_chunks", 0):
        "deadline: none, a regular file of the caller's input folder (fstat'ed, opened no-follow); budget: ``size``",
    ("nbexec/sandbox/docker/leftovers.py", "_digest", 0):
        "deadline: none, a regular file checked to be ``size`` bytes at fstat; budget: its size",
    ("nbexec/service/batchrecord.py", "item", 0):
        "deadline: none, a regular file of the node's own state folder (opened no-follow); budget: one line, read "
        "past in 1 MiB chunks and never held",
    ("nbexec/service/batchrecord.py", "load", 0):
        "deadline: none, a regular file of the node's own state folder (opened no-follow); budget: ``total`` lines "
        "(a repeated or out-of-range index ends it), each within RESULT_LINE",
    ("nbexec/service/streaming.py", "disconnected", 0):
        "deadline: the guarded task (first_or_gone cancels this wait when it ends); budget: one ASGI event a turn",
}


def _reading_loops() -> dict[tuple[str, str, int], ast.While]:
    found: dict[tuple[str, str, int], ast.While] = {}
    for pattern in SCOPE:
        for path in sorted(ROOT.glob(pattern)):
            name = str(path.relative_to(ROOT))
            for function in ast.walk(ast.parse(path.read_text())):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                loops = [n for n in ast.walk(function) if isinstance(n, ast.While)]
                for index, loop in enumerate(loops):
                    if _called(loop) & READS:
                        found[(name, function.name, index)] = loop
    return found


def _called(node: ast.AST) -> set[str]:
    calls = (n.func for n in ast.walk(node) if isinstance(n, ast.Call))
    return {f.attr if isinstance(f, ast.Attribute) else f.id for f in calls if isinstance(f, (ast.Attribute, ast.Name))}


def _names_a_deadline(loop: ast.While) -> bool:
    return any(isinstance(n, ast.Name) and n.id in DEADLINES for n in ast.walk(loop.test))


def test_every_reading_loop_has_a_deadline_or_a_register_entry() -> None:
    loops = _reading_loops()
    unbounded = [f"{file}:{loop.lineno} {function} (while {ast.unparse(loop.test)[:80]})"
                 for (file, function, index), loop in loops.items()
                 if not _names_a_deadline(loop) and (file, function, index) not in REGISTER]
    assert not unbounded, ("reading loops with no deadline in their condition and no REGISTER entry (name the "
                           "deadline in the condition, or register its deadline and budget):\n" + "\n".join(unbounded))


def test_the_register_names_only_loops_that_exist() -> None:
    loops = _reading_loops()
    stale = [key for key in REGISTER if key not in loops or _names_a_deadline(loops[key])]
    assert not stale, f"REGISTER entries for loops that are gone or name their deadline themselves: {stale}"
    assert all("deadline:" in said and "budget:" in said for said in REGISTER.values())


def test_the_rule_catches_the_old_drain() -> None:
    """The loop that held a silent request forever (issue #36) is what this rule refuses."""
    old = ast.parse("def run_silent(self):\n    while self.recv('iopub', 0.01) is not None:\n        pass\n")
    (loop,) = [n for n in ast.walk(old) if isinstance(n, ast.While)]
    assert _called(loop) & READS and not _names_a_deadline(loop)
