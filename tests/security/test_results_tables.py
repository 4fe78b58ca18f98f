"""A run's status survives every drop, and what is kept stays within what was charged: the cell loop against a
scripted kernel (real ZMQ on ipc:// sockets, playing ipykernel's part), one table row per way a message or an
output can be lost: over the frame limit, past the text or count budget, erased by clear_output, never sent (a
full PUB queue), sent for another request, or only the execute_reply telling. Docker adds nothing at this level;
tests/security/test_results.py runs the same attacks end to end.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
from nbformat import NotebookNode, v4

from nbexec import SandboxConfig
from nbexec.engine import budget, cells
from nbexec.result import CellError
from nbexec.sandbox.source import ContainerState

from ..test_cells import FakeSandbox, cell, stream
from ..test_kernel import FakeKernel

MIB = 1024 * 1024


@dataclass(frozen=True)
class Other:
    """A message sent with another request as its parent (the host drops it unparsed)."""

    kind: str
    content: Any


@dataclass
class Plan:
    """How the kernel answers one cell: its iopub messages, whether idle is published, and its execute_reply
    (``reply``: a dict, raw bytes, or None for no reply; "auto" is ok, or error when an error was sent)."""

    iopub: list[tuple[str, Any] | Other] = field(default_factory=list)
    idle: bool = True
    reply: Any = "auto"


class Kernel(FakeKernel):
    """Answers execute_requests by their code's Plan; a silent request (the host asking how the last cell ended)
    is answered from ``probe`` (a report dict, or None for no answer at all)."""

    def __init__(self, folder: Path, plans: dict[str, Plan], probe: dict[str, Any] | None) -> None:
        super().__init__(folder)
        self.plans, self.probe, self.count, self.asked, self.silent = plans, probe, 0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.shell, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            identity, *frames = self.shell.recv_multipart()
            header, content = json.loads(frames[2]), json.loads(frames[5])
            if header["msg_type"] != "execute_request":
                continue
            if content.get("silent"):
                self._answer_probe(identity, header["msg_id"], content)
            else:
                self.asked.append(content["code"])
                self._answer(identity, header["msg_id"], self.plans.get(content["code"], Plan()))

    def _publish(self, parent: str, messages: list[tuple[str, Any] | Other]) -> None:
        for item in messages:
            kind, content, mine = (item.kind, item.content, False) if isinstance(item, Other) else (*item, True)
            raw = content if isinstance(content, bytes) else json.dumps(content).encode()
            self.iopub.send_multipart(self.frames(kind, raw, parent=parent if mine else "someone-else"))

    def _reply(self, identity: bytes, parent: str, reply: Any) -> None:
        raw = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        self.shell.send_multipart([identity, *self.frames("execute_reply", raw, parent=parent)[1:]])

    def _answer(self, identity: bytes, parent: str, plan: Plan) -> None:
        self.count += 1
        head: list[tuple[str, Any] | Other] = [("status", {"execution_state": "busy"}),
                                               ("execute_input", {"code": "", "execution_count": self.count})]
        self._publish(parent, head + plan.iopub + ([("status", {"execution_state": "idle"})] if plan.idle else []))
        reply = plan.reply
        if reply == "auto":
            failed = any(not isinstance(m, Other) and m[0] == "error" for m in plan.iopub)
            reply = {"status": "error" if failed else "ok", "execution_count": self.count}
        if reply is not None:
            self._reply(identity, parent, reply)

    def _answer_probe(self, identity: bytes, parent: str, content: dict[str, Any]) -> None:
        self.silent += 1
        if self.probe is None:
            return
        self._publish(parent, [("status", {"execution_state": "busy"}), ("status", {"execution_state": "idle"})])
        encoded = base64.b64encode(json.dumps(self.probe).encode()).decode()
        expressions = {key: {"status": "ok", "data": {"text/plain": repr(encoded)}, "metadata": {}}
                       for key in content.get("user_expressions", {})}
        self._reply(identity, parent, {"status": "ok", "execution_count": self.count,
                                       "user_expressions": expressions, "payload": []})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        super().close()


class Sandbox(FakeSandbox):
    """The scripted kernel's sandbox with a config of the test's choosing."""

    def __init__(self, kernel: Kernel, config: SandboxConfig) -> None:
        super().__init__(kernel)  # type: ignore[arg-type]
        self.config = config

    def state(self) -> ContainerState:
        return ContainerState(running=True, exit_code=None, oom_killed=False)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Callable[..., Kernel]]:
    made: list[Kernel] = []

    def make(plans: dict[str, Plan], probe: dict[str, Any] | None = None) -> Kernel:
        made.append(Kernel(tmp_path, plans, probe))
        return made[-1]

    yield make
    for item in made:
        item.close()


SMALL = SandboxConfig(timeout=20, interrupt_grace=1, max_output="64k", max_display="1m", max_outputs=5)
TRACEBACK = ["Traceback (most recent call last)", "Cell In[1], line 2", "KeyError: 'boom'"]
ERROR = ("error", {"ename": "KeyError", "evalue": "'boom'", "traceback": TRACEBACK})
ERROR_REPLY = {"status": "error", "execution_count": 1, "ename": "KeyError", "evalue": "'boom'",
               "traceback": TRACEBACK}
PROBE_RAISED = {"raised": True, "ename": "KeyError", "evalue": "'boom'", "traceback": TRACEBACK}
# Past the fake kernel's 1 MiB frame limit: read past unkept, its size counted, as a real 40 MB exception is.
HUGE_ERROR = ("error", json.dumps({"traceback": ["x" * (2 * MIB)], "ename": "KeyError",
                                   "evalue": "y" * MIB}).encode())
HUGE_REPLY = b'{"status": "error", "traceback": ["' + b"x" * (2 * MIB) + b'"], "ename": "KeyError"}'
HUGE_OK_REPLY = b'{"status": "ok", "execution_count": 1, "payload": [{"data": "' + b"p" * (2 * MIB) + b'"}]}'
EXPECTED = "raises-exception"


def result_of(error: CellError | None) -> tuple[str | None, int | None]:
    return (error.ename, error.cell_index) if error is not None else (None, None)


# (id, plans, cells, the kernel's answer when asked how the cell ended, expected: the run's ename and cell)
Row = tuple[str, dict[str, Plan], list[NotebookNode], dict[str, Any] | None, tuple[str | None, int | None]]
DROPS: list[Row] = [
    ("error-over-the-frame-limit-kernel-asked", {"a": Plan([HUGE_ERROR], reply=HUGE_REPLY)}, [cell("a")],
     PROBE_RAISED, ("KeyError", 0)),
    ("error-over-the-frame-limit-reply-tells", {"a": Plan([HUGE_ERROR], reply=ERROR_REPLY)}, [cell("a")],
     None, ("KeyError", 0)),
    ("error-over-the-frame-limit-nobody-tells", {"a": Plan([HUGE_ERROR], reply=HUGE_REPLY)}, [cell("a")],
     None, ("UnknownError", 0)),
    ("error-message-never-sent", {"a": Plan([stream("x")], reply=ERROR_REPLY)}, [cell("a")], None,
     ("KeyError", 0)),
    ("error-and-idle-never-sent", {"a": Plan([stream("x")], idle=False, reply=ERROR_REPLY)}, [cell("a")], None,
     ("KeyError", 0)),
    ("error-sent-for-another-request", {"a": Plan([Other(*ERROR)], reply=ERROR_REPLY)}, [cell("a")], None,
     ("KeyError", 0)),
    ("reply-over-its-limit-kernel-asked", {"a": Plan([], reply=HUGE_REPLY)}, [cell("a")], PROBE_RAISED,
     ("KeyError", 0)),
    ("reply-over-its-limit-run-was-fine", {"a": Plan([stream("x")], reply=HUGE_OK_REPLY)}, [cell("a")],
     {"raised": False}, (None, None)),
    ("reply-aborted", {"a": Plan([], reply={"status": "aborted", "execution_count": 1})}, [cell("a")], None,
     ("KernelError", 0)),
    ("error-past-the-text-budget", {"a": Plan([("error", {"ename": "E", "evalue": "v" * 70000, "traceback": []})]),
                                    "b": Plan([ERROR])}, [cell("a", EXPECTED), cell("b")], None, ("KeyError", 1)),
    ("error-past-the-output-count", {"a": Plan([ERROR]), "b": Plan([stream("s"), *[("display_data", {
        "data": {"text/plain": "d"}, "metadata": {}})] * 6, ERROR])}, [cell("a", EXPECTED), cell("b")], None,
     ("KeyError", 1)),
    ("error-then-clear-output", {"a": Plan([ERROR, ("clear_output", {"wait": False})])}, [cell("a")], None,
     ("KeyError", 0)),
    ("error-then-clear-output-wait-then-output", {"a": Plan([ERROR, ("clear_output", {"wait": True}),
                                                             stream("later")])}, [cell("a")], None, ("KeyError", 0)),
    ("execute-result-then-error", {"a": Plan([("execute_result", {"data": {"text/plain": "1"}, "metadata": {},
                                                                  "execution_count": 1}), ERROR])},
     [cell("a")], None, ("KeyError", 0)),
    ("error-then-execute-result", {"a": Plan([ERROR, ("execute_result", {"data": {"text/plain": "1"},
                                                                         "metadata": {}, "execution_count": 1})])},
     [cell("a")], None, ("KeyError", 0)),
    ("unreadable-reply-error-message-kept", {"a": Plan([ERROR], reply=b"not json")}, [cell("a")], None,
     ("KeyError", 0)),
    ("expected-error-over-the-frame-limit", {"a": Plan([HUGE_ERROR], reply=HUGE_REPLY), "b": Plan([stream("on")])},
     [cell("a", EXPECTED), cell("b")], None, (None, None)),
    ("no-reply-kernel-asked", {"a": Plan([stream("x")], reply=None)}, [cell("a")], PROBE_RAISED, ("KeyError", 0)),
    ("error-after-a-clear-output-flood", {"a": Plan([("clear_output", {"wait": True})] * 4000 + [ERROR])},
     [cell("a")], None, ("KeyError", 0)),
    ("error-after-the-display-budget", {"a": Plan([("display_data", {"data": {"image/png": "p" * 900_000},
                                                                    "metadata": {}})] * 2 + [ERROR])},
     [cell("a")], None, ("KeyError", 0)),
    ("error-after-a-dropped-update", {"a": Plan([("display_data", {"data": {"text/plain": "d"}, "metadata": {},
                                                                   "transient": {"display_id": "d"}})] * 3
                                                + [("update_display_data", {"data": {"text/plain": "u" * 40_000},
                                                    "metadata": {}, "transient": {"display_id": "d"}}), ERROR])},
     [cell("a")], None, ("KeyError", 0)),
    ("error-after-dropped-widget-messages", {"a": Plan([("comm_open", {"comm_id": "c", "target_name": "jupyter.widget",
                                                                       "data": {"state": {"x": "w" * 900_000}}})] * 2
                                                       + [ERROR])}, [cell("a")], None, ("KeyError", 0)),
    ("error-then-a-malformed-message", {"a": Plan([ERROR, ("stream", b"[1, 2]")])}, [cell("a")], None,
     ("ProtocolError", 0)),
]


@pytest.mark.parametrize(("plans", "cells_", "probe", "expected"), [r[1:] for r in DROPS], ids=[r[0] for r in DROPS])
def test_the_status_survives_the_drop(kernel: Callable[..., Kernel], plans: dict[str, Plan],
                                      cells_: list[NotebookNode], probe: dict[str, Any] | None,
                                      expected: tuple[str | None, int | None]) -> None:
    fake = kernel(plans, probe)
    nb = v4.new_notebook(cells=cells_)
    error, _ = cells.run_cells(Sandbox(fake, SMALL), nb, SMALL)
    assert result_of(error) == expected, (error, [c.outputs for c in nb.cells])
    if error is not None:  # the notebook shows what ended the run, where it happened
        shown = [o for o in nb.cells[error.cell_index or 0].outputs if o.output_type == "error"]
        assert shown and shown[-1].ename == error.ename, nb.cells[error.cell_index or 0].outputs
        size = len((error.ename + error.evalue + "".join(error.traceback)).encode())
        assert size <= budget.MAX_ERROR, size


def test_a_huge_error_says_how_large_it_was_when_nobody_tells(kernel: Callable[..., Kernel]) -> None:
    fake = kernel({"a": Plan([HUGE_ERROR], reply=HUGE_REPLY)})
    nb = v4.new_notebook(cells=[cell("a")])
    error, dropped = cells.run_cells(Sandbox(fake, SMALL), nb, SMALL)
    assert error is not None and error.kind == "exception" and fake.silent == 1
    assert f"{len(HUGE_ERROR[1]) + 2:,} bytes" in error.evalue, error.evalue
    assert dropped >= len(HUGE_ERROR[1])


def test_a_sessions_later_runs_stay_honest(kernel: Callable[..., Kernel]) -> None:
    """Run by run, as a session runs them: each run's status is its own, whatever the earlier ones dropped."""
    fake = kernel({"huge": Plan([HUGE_ERROR], reply=HUGE_REPLY), "fine": Plan([stream("ok")]),
                   "lost": Plan([stream("x")], idle=False, reply=ERROR_REPLY)}, PROBE_RAISED)
    nb, displays = v4.new_notebook(cells=[]), {}
    seen = []
    for code in ("fine", "huge", "fine", "lost", "fine", "huge"):
        nb.cells.append(cell(code))
        error, _ = cells.run_cells(Sandbox(fake, SMALL), nb, SMALL, first_index=len(nb.cells) - 1,
                                   displays=displays)
        seen.append(None if error is None else error.ename)
    assert seen == [None, "KeyError", None, "KeyError", None, "KeyError"]


# -- one charge, one copy: display updates -------------------------------------------------------------------

def display(display_id: str, payload: str) -> tuple[str, Any]:
    return ("display_data", {"data": {"image/png": payload}, "metadata": {}, "transient": {"display_id": display_id}})


def update(display_id: str, payload: str) -> tuple[str, Any]:
    return ("update_display_data", {"data": {"image/png": payload}, "metadata": {},
                                    "transient": {"display_id": display_id}})


def kept_bytes(nb: NotebookNode) -> int:
    return sum(len(json.dumps(o)) for c in nb.cells for o in c.get("outputs", []))


BUDGET = SandboxConfig(timeout=20, interrupt_grace=1, max_output="64k", max_display="1m", max_outputs=500)
UPDATE = "u" * (256 * 1024)  # charged once, it would reach every output under its display id


def test_an_update_costs_its_size_for_every_output_it_reaches(kernel: Callable[..., Kernel]) -> None:
    """100 outputs under one id and one 256 KiB update: kept whole it would be 25 MiB from a 1 MiB budget."""
    fake = kernel({"a": Plan([display("d", "p")] * 100 + [update("d", UPDATE)])})
    nb = v4.new_notebook(cells=[cell("a")])
    error, dropped = cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET)
    assert error is None and dropped >= 100 * len(UPDATE)
    assert kept_bytes(nb) <= 1 * MIB + 64 * 1024 + 500 * 200, kept_bytes(nb)


def test_an_update_that_fits_reaches_every_output(kernel: Callable[..., Kernel]) -> None:
    fake = kernel({"a": Plan([display("d", "p")] * 3 + [update("d", "new")])})
    nb = v4.new_notebook(cells=[cell("a")])
    assert cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET)[0] is None
    assert [o.data["image/png"] for o in nb.cells[0].outputs] == ["new"] * 3


def test_an_update_in_a_later_run_is_charged_to_that_run(kernel: Callable[..., Kernel]) -> None:
    """A session keeps display ids across runs: each later update of the 100 earlier outputs is charged anew."""
    fake = kernel({"show": Plan([display("d", "p")] * 100), "again": Plan([update("d", UPDATE)])})
    nb, displays = v4.new_notebook(cells=[cell("show")]), {}
    cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET, displays=displays)
    sizes = []
    for _ in range(3):
        nb.cells.append(cell("again"))
        cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET, first_index=len(nb.cells) - 1, displays=displays)
        sizes.append(kept_bytes(nb))
    assert max(sizes) <= 2 * MIB, sizes  # never the 25 MiB of the update copied into every output


def test_streams_cost_what_they_take_in_json(kernel: Callable[..., Kernel]) -> None:
    """A control character is one byte of text and six in the notebook's JSON: it is charged six."""
    fake = kernel({"a": Plan([stream("\x00" * 5000)] * 20)})  # each 30 KB of JSON, 5,000 bytes of text
    nb = v4.new_notebook(cells=[cell("a")])
    cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET)
    assert kept_bytes(nb) <= 64 * 1024 + 1024, kept_bytes(nb)


def test_a_sessions_notebook_keeps_its_latest_budget(kernel: Callable[..., Kernel]) -> None:
    """Run after run of 600 KiB of displays: the session's notebook keeps one run's budgets of older outputs
    (oldest dropped first, with a marker), and the display ids of dropped outputs are forgotten."""
    fake = kernel({"show": Plan([display("d", "p" * (600 * 1024))])})
    nb, displays, limit = v4.new_notebook(cells=[]), {}, BUDGET.max_output_bytes + BUDGET.max_display_bytes
    for run in range(6):
        nb.cells.append(cell("show"))
        cells.run_cells(Sandbox(fake, BUDGET), nb, BUDGET, first_index=run, displays=displays)
        budget.keep_recent(nb, run, limit, displays)
        assert kept_bytes(nb) <= 2 * limit, (run, kept_bytes(nb))
    assert "dropped from the session's notebook" in nb.cells[0].outputs[0].text
    assert len(displays["d"]) < 6



def test_expected_errors_stay_within_the_budget(kernel: Callable[..., Kernel]) -> None:
    """`raises-exception` cells whose errors only the reply describes: their errors do not end the run, so they are
    kept within the budget like any output (only the error that ends a run is kept whatever it costs)."""
    reply = dict(ERROR_REPLY, evalue="v" * 60_000)
    fake = kernel({"a": Plan([], reply=reply), "b": Plan([stream("after")])})
    nb = v4.new_notebook(cells=[cell("a", EXPECTED) for _ in range(4)] + [cell("b")])
    error, _ = cells.run_cells(Sandbox(fake, SMALL), nb, SMALL)
    assert error is None and fake.asked == ["a"] * 4 + ["b"]
    assert kept_bytes(nb) <= SMALL.max_output_bytes + 4096, kept_bytes(nb)
