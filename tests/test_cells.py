"""The cell loop against a scripted kernel (nbclient's TestRunCell is the model): each table row is a notebook
whose cells the fake kernel answers with scripted iopub messages, and the executed notebook that results.
Docker adds nothing here; tests/test_execute.py runs the same behaviours end to end."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from nbformat import NotebookNode, v4

from nbexec import SandboxConfig
from nbexec.engine import budget, cells
from nbexec.errors import ProtocolError
from nbexec.result import CellError
from nbexec.sandbox.kernel import Execution, Message
from nbexec.sandbox.source import ContainerState

from .test_kernel import FakeKernel

Script = list[tuple[str, Any]]  # (msg_type, content) sent on iopub between execute_input and idle


@dataclass
class Framed:
    """Content followed by binary buffer frames (comm messages carry them)."""

    content: Any
    buffers: list[bytes]


ERROR = ("error", {"ename": "ValueError", "evalue": "boom", "traceback": ["ValueError: boom"]})


class ScriptedKernel(FakeKernel):
    """Answers each execute_request with busy, execute_input, the script for its code, idle, and the reply."""

    def __init__(self, folder: Path, scripts: dict[str, Script], *, execute_input: bool = True) -> None:
        super().__init__(folder)
        self.scripts, self.execute_input, self.asked = scripts, execute_input, []
        self.count = 0
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
            self.asked.append(content["code"])
            self._answer(identity, header["msg_id"], content["code"])

    def _answer(self, identity: bytes, parent: str, code: str) -> None:
        self.count += 1
        script = self.scripts.get(code, [])
        sent: Script = [("status", {"execution_state": "busy"})]
        if self.execute_input:
            sent.append(("execute_input", {"code": code, "execution_count": self.count}))
        sent += [*script, ("status", {"execution_state": "idle"})]
        for kind, content in sent:
            buffers: list[bytes] = []
            if isinstance(content, Framed):
                content, buffers = content.content, content.buffers
            raw = content if isinstance(content, bytes) else json.dumps(content).encode()
            self.iopub.send_multipart(self.frames(kind, raw, parent=parent) + buffers)
        failed = any(kind == "error" for kind, _ in script)
        reply = {"status": "error" if failed else "ok", "execution_count": self.count}
        self.shell.send_multipart([identity, *self.frames("execute_reply", json.dumps(reply).encode(),
                                                          parent=parent)[1:]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        super().close()


class FakeSandbox:
    """The sandbox around the scripted kernel: always running; ``kill`` is recorded."""

    id = "fake"
    node: str | None = None  # on this host
    language_info: dict[str, Any] = {}

    def __init__(self, kernel: ScriptedKernel) -> None:
        self.kernel, self.config, self.killed = kernel, SandboxConfig(timeout=10, interrupt_grace=1), False

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        return self.kernel.client.run(code, deadline=deadline, grace=1, on_output=on_output, alive=lambda: True,
                                      kill=self.kill)

    @property
    def kernel_lost(self) -> bool:
        return bool(self.kernel.client.lost)

    def state(self) -> ContainerState:
        return ContainerState(running=True, exit_code=None, oom_killed=False)

    def kill(self) -> None:
        self.killed = True


def cell(code: str, *tags: str) -> NotebookNode:
    made = v4.new_code_cell(code)
    if tags:
        made.metadata["tags"] = list(tags)
    return made


def display(display_id: Any, text: str) -> tuple[str, Any]:
    return ("display_data", {"data": {"text/plain": text}, "metadata": {}, "transient": display_id})


def update(display_id: Any, text: str) -> tuple[str, Any]:
    return ("update_display_data", {"data": {"text/plain": text}, "metadata": {}, "transient": display_id})


def stream(text: str) -> tuple[str, Any]:
    return ("stream", {"name": "stdout", "text": text})


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[..., ScriptedKernel]]:
    made: list[ScriptedKernel] = []

    def make(scripts: dict[str, Script], **options: Any) -> ScriptedKernel:
        kernel = ScriptedKernel(tmp_path, scripts, **options)
        made.append(kernel)
        return kernel

    yield make
    for kernel in made:
        kernel.close()


def run(kernel: ScriptedKernel, nb: NotebookNode, first: int = 0,
        displays: budget.Displays | None = None) -> CellError | None:
    error, _ = cells.run_cells(FakeSandbox(kernel), nb, FakeSandbox(kernel).config, first_index=first,
                                displays=displays)
    return error


def texts(nb: NotebookNode, index: int) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in nb.cells[index].outputs)


Check = Callable[[NotebookNode, CellError | None, ScriptedKernel], bool]
CASES: list[tuple[str, dict[str, Script], list[NotebookNode], Check]] = [
    ("an-error-stops-the-run", {"a": [ERROR], "b": [stream("after")]}, [cell("a"), cell("b")],
     lambda nb, e, k: e is not None and e.ename == "ValueError" and e.cell_index == 0 and k.asked == ["a"]),
    ("raises-exception-goes-on", {"a": [ERROR], "b": [stream("after")]}, [cell("a", "raises-exception"), cell("b")],
     lambda nb, e, k: e is None and k.asked == ["a", "b"] and nb.cells[0].outputs[0].output_type == "error"
     and texts(nb, 1) == "after"),
    ("raises-exception-without-one", {"a": [stream("fine")]}, [cell("a", "raises-exception")],
     lambda nb, e, k: e is None and texts(nb, 0) == "fine"),
    ("skip-execution", {"b": [stream("ran")]}, [cell("a", "skip-execution"), cell("b")],
     lambda nb, e, k: k.asked == ["b"] and nb.cells[0].outputs == [] and nb.cells[0].execution_count is None),
    ("execution-counts", {}, [cell("a"), cell("b")],
     lambda nb, e, k: [c.execution_count for c in nb.cells] == [1, 2]),
    ("timing-metadata", {"a": [stream("x")]}, [cell("a")],
     lambda nb, e, k: list(nb.cells[0].metadata.execution) == [
         "iopub.status.busy", "iopub.execute_input", "iopub.status.idle", "shell.execute_reply"]
     and sorted(nb.cells[0].metadata.execution.values())[0] == nb.cells[0].metadata.execution["iopub.status.busy"]),
    ("update-reaches-an-earlier-cell", {"a": [display({"display_id": "d"}, "old")], "b": [update({"display_id": "d"},
                                                                                                 "new")]},
     [cell("a"), cell("b")], lambda nb, e, k: texts(nb, 0) == "new" and nb.cells[1].outputs == []),
    ("transient-null", {"a": [display(None, "shown"), update(None, "lost")]}, [cell("a")],
     lambda nb, e, k: e is None and texts(nb, 0) == "shown"),
    ("transient-not-an-object", {"a": [display("d", "shown"), update(["d"], "lost")]}, [cell("a")],
     lambda nb, e, k: e is None and texts(nb, 0) == "shown"),
    ("unknown-types-ignored", {"a": [("nbexec_unknown", b"not even json"), ("comm_msg", b"["),
                                     ("execute_input_v2", {}), stream("ok")]}, [cell("a")],
     lambda nb, e, k: e is None and texts(nb, 0) == "ok" and len(nb.cells[0].outputs) == 1),
]


@pytest.mark.parametrize(("scripts", "cells", "check"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cells(scripted: Callable[..., ScriptedKernel], scripts: dict[str, Script], cells: list[NotebookNode],
               check: Check) -> None:
    kernel = scripted(scripts)
    nb = v4.new_notebook(cells=cells)
    error = run(kernel, nb)
    assert check(nb, error, kernel), (error, kernel.asked, [c.outputs for c in nb.cells])


def test_the_reply_gives_the_count_when_execute_input_is_missing(scripted: Callable[..., ScriptedKernel]) -> None:
    kernel = scripted({}, execute_input=False)
    nb = v4.new_notebook(cells=[cell("a"), cell("b")])
    assert run(kernel, nb) is None
    assert [c.execution_count for c in nb.cells] == [1, 2]
    assert "iopub.execute_input" not in nb.cells[0].metadata.execution


def test_an_update_reaches_a_display_of_an_earlier_run(scripted: Callable[..., ScriptedKernel]) -> None:
    """A session runs cell by cell: the display ids it keeps span its runs, as the notebook does."""
    kernel = scripted({"a": [display({"display_id": "d"}, "old")], "b": [update({"display_id": "d"}, "new")]})
    nb, displays = v4.new_notebook(cells=[cell("a")]), {}
    assert run(kernel, nb, displays=displays) is None
    nb.cells.append(cell("b"))
    assert run(kernel, nb, first=1, displays=displays) is None
    assert texts(nb, 0) == "new"


class Dying:
    """A sandbox whose container has stopped: state() answers from a script, the last answer repeating."""

    def __init__(self, *answers: ContainerState) -> None:
        self.answers, self.asked = list(answers), 0
        self.config = SandboxConfig(memory="256m")

    def state(self) -> ContainerState:
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]


KILLED = ContainerState(running=False, exit_code=137, oom_killed=False)
OOM = ContainerState(running=False, exit_code=137, oom_killed=True)


@pytest.mark.parametrize(("answers", "status", "asked"), [
    ((OOM,), "oom", 1),  # the engine knew at once: asked once
    ((KILLED, KILLED, OOM), "oom", 3),  # the OOM kill reported after the exit (gVisor): asked until it is
    ((KILLED,), "died", 0),  # never reported: a SIGKILL from the code, after OOM_NEWS
    ((ContainerState(running=False, exit_code=1, oom_killed=False),), "died", 1),  # not a kill: asked once
], ids=["oom-at-once", "oom-late", "sigkill", "exit-1"])
def test_a_kill_is_put_down_to_memory_only_when_the_engine_reports_it(
        answers: tuple[ContainerState, ...], status: str, asked: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cells, "OOM_NEWS", 0.5)
    sandbox = Dying(*answers)
    outcome = cells._check_sandbox(sandbox)  # type: ignore[arg-type]
    assert outcome is not None and outcome.status == status, outcome
    assert sandbox.asked == asked if asked else sandbox.asked > 2, sandbox.asked  # a plain kill is asked again
    assert ("256m" in outcome.message) == (status == "oom")


# -- the cell budget's pure pieces, each value as it is ------------------------------------------------------------

def _with_outputs(*sizes: int) -> NotebookNode:
    """A notebook of code cells, each with one stream output of about ``size`` characters (0: no output)."""
    made = []
    for size in sizes:
        code = v4.new_code_cell("x")
        if size:
            code.outputs = [v4.new_output("stream", name="stdout", text="a" * size)]
        made.append(code)
    return v4.new_notebook(cells=made)


def _size(cell: NotebookNode) -> int:  # compact JSON, as a large notebook is written
    return len(json.dumps(cell.get("outputs", []), ensure_ascii=False, separators=(",", ":")))


def _marker(size: int, limit: int) -> list[dict[str, Any]]:
    return [{"output_type": "stream", "name": "stderr", "text": (
        f"\n[nbexec: this cell's outputs ({size:,} bytes) were dropped from the session's notebook, which keeps "
        f"its latest {limit:,} bytes of outputs]\n")}]


def test_a_session_notebook_that_fits_exactly_is_left_whole() -> None:
    nb = _with_outputs(100, 100, 100)
    limit = sum(_size(c) for c in nb.cells)
    assert budget.keep_recent(nb, 2, limit, {}) is None
    assert [_size(c) for c in nb.cells] == [_size(c) for c in _with_outputs(100, 100, 100).cells]


def test_the_oldest_outputs_go_first_each_leaving_its_marker_and_the_note_says_how_much() -> None:
    nb = v4.new_notebook(cells=[v4.new_markdown_cell("m"), *_with_outputs(0, 300, 301, 302, 303).cells])
    sizes = [_size(c) for c in nb.cells]
    limit = sum(sizes) - sizes[2] - 1  # dropping the first output is not enough; the second is, and then it stops
    shown = nb.cells[2].outputs[0]
    kept = nb.cells[4].outputs[0]
    displays = {"d": [shown, kept], "e": [kept], "f": [shown]}
    note = budget.keep_recent(nb, 5, limit, displays)
    dropped = sizes[2] + sizes[3]
    assert note == (f"outputs of earlier cells ({dropped:,} bytes) were dropped from the session's notebook, which "
                    f"keeps its latest {limit:,} bytes of outputs")
    assert nb.cells[0].cell_type == "markdown" and "outputs" not in nb.cells[0]
    assert nb.cells[1].outputs == []  # a code cell with no outputs keeps none (no marker)
    assert [nb.cells[2].outputs, nb.cells[3].outputs] == [_marker(sizes[2], limit), _marker(sizes[3], limit)]
    assert nb.cells[4].outputs == [kept]  # within the limit once the two oldest went
    assert nb.cells[5].outputs[0]["text"] == "a" * 303  # the run's own cells are never dropped
    assert displays == {"d": [kept], "e": [kept], "f": []}
    assert [o is kept for o in displays["d"]] == [True]


@pytest.mark.parametrize(("content", "bundle"), [
    ({}, ({}, {})), ({"data": {"a": 1}}, ({"a": 1}, {})), ({"metadata": {"m": 1}}, ({}, {"m": 1})),
])
def test_a_display_without_data_or_metadata_has_empty_ones(content: dict[str, Any], bundle: Any) -> None:
    assert budget._bundle(content) == bundle


@pytest.mark.parametrize("content", [{"data": []}, {"metadata": "m"}, {"data": None}])
def test_a_display_whose_data_or_metadata_is_no_object_is_refused_in_those_words(content: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as refused:
        budget._bundle(content)
    assert str(refused.value) == "a display message whose data or metadata is not a JSON object"


def test_the_text_a_rich_output_costs_is_the_json_of_its_text_views_but_html() -> None:
    data = {"text/plain": "ab\n", "text/html": "<b>x</b>", "image/png": "iVBOR", "text/csv": ["a", 1],
            "TEXT/PLAIN": "zz"}
    assert budget._text_size(data) == len('ab\\n') + len(json.dumps(json.dumps(["a", 1]))) - 2


@pytest.mark.parametrize(("content", "found"), [
    ({"transient": {"display_id": "d"}}, "d"), ({"transient": {"display_id": 5}}, None), ({"transient": None}, None),
    ({}, None), ({"transient": "d"}, None),
])
def test_a_display_id_is_a_string_in_transient_or_none(content: dict[str, Any], found: str | None) -> None:
    assert budget._display_id(content) == found


@pytest.mark.parametrize(("text", "room", "kept"), [
    ("abcdef", 3, "abc"), ("abc", 10, "abc"), ("a\nb", 2, "a"), ("a\nb", 3, "a\n"), ("aé", 2, "a"), ("aé", 3, "aé"),
    ("\x01z", 5, ""), ("\x01z", 6, "\x01"), ("", 5, ""), ("ab", 0, ""),
])
def test_a_prefix_is_the_longest_start_whose_json_fits(text: str, room: int, kept: str) -> None:
    assert budget._prefix(text, room) == kept


def _state(text: int = 10_000, display: int = 10_000, outputs: int = 10) -> budget.CellState:
    return budget.CellState(v4.new_code_cell("x"), 0, budget.Budget(text=text, display=display, outputs=outputs), None)


def _msg(kind: str, content: dict[str, Any]) -> Message:
    raw = json.dumps(content).encode()
    return Message("iopub", kind, "m", "p", len(raw), raw)


def _texts(state: budget.CellState) -> list[str]:
    state.finish()
    return [o.get("text", "") for o in state.cell.outputs]


def test_a_clear_that_waits_takes_the_outputs_only_when_the_next_one_comes() -> None:
    state = _state()
    state.add(_msg("stream", {"name": "stdout", "text": "a"}))
    state.add(_msg("clear_output", {"wait": True}))
    assert _texts(state) == ["a"]
    state.add(_msg("stream", {"name": "stdout", "text": "b"}))
    state.add(_msg("stream", {"name": "stdout", "text": "c"}))
    assert _texts(state) == ["bc"]  # cleared once, before b: c is not taken by the same clear


def test_a_clear_that_does_not_wait_takes_the_outputs_at_once_and_once() -> None:
    state = _state()
    state.add(_msg("stream", {"name": "stdout", "text": "a"}))
    state.add(_msg("clear_output", {"wait": False}))
    assert _texts(state) == []
    state.add(_msg("stream", {"name": "stdout", "text": "b"}))
    state.add(_msg("display_data", {"data": {"text/plain": "c"}, "metadata": {}}))
    assert _texts(state) == ["b", ""]


def _shown(state: budget.CellState, display_id: str, text: str) -> None:
    content = {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}}
    state.add(_msg("display_data", content))


def test_an_update_reaching_two_displays_costs_one_more_copy_and_their_text_twice() -> None:
    state = _state()
    _shown(state, "d", "old")
    _shown(state, "d", "old")
    _shown(state, "XXXX", "other")
    before = (state.budget.display, state.budget.text)
    update = _msg("update_display_data", {"data": {"text/plain": "newer"}, "metadata": {"m": 1},
                                          "transient": {"display_id": "d"}})
    state.add(update)
    assert (state.budget.display, state.budget.text) == (before[0] - 2 * update.size, before[1] - 2 * len("newer"))
    assert [(o["data"], o["metadata"]) for o in state.cell.outputs[:2]] == [({"text/plain": "newer"}, {"m": 1})] * 2
    state.add(_msg("update_display_data", {"data": {"text/plain": "none"}, "metadata": {}}))  # no id: reaches none
    assert state.cell.outputs[2]["data"] == {"text/plain": "other"}
    assert state.budget.dropped == 0


@pytest.mark.parametrize("by_text", [False, True], ids=["display", "text"])
@pytest.mark.parametrize(("room", "dropped"), [(0, False), (-1, True)], ids=["exactly", "one-short"])
def test_an_update_of_exactly_the_room_left_is_kept(by_text: bool, room: int, dropped: bool) -> None:
    """Just enough of the display allowance (the message, and a copy for the second display), or of the text
    allowance (its text for each display), or one byte short: then the update is dropped, counted as display."""
    update = _msg("update_display_data", {"data": {"text/plain": "newer"}, "metadata": {},
                                          "transient": {"display_id": "d"}})
    state = _state()
    _shown(state, "d", "old")
    _shown(state, "d", "old")
    if by_text:
        state.budget.text = 2 * len("newer") + room
    else:
        state.budget.display = 2 * update.size + room
    state.add(update)
    if dropped:
        assert (state.budget.dropped_display, state.budget.dropped_text) == (2 * update.size, 0)
        assert state.cell.outputs[0]["data"] == {"text/plain": "old"}
    else:
        assert state.budget.dropped == 0 and state.cell.outputs[0]["data"] == {"text/plain": "newer"}


@pytest.mark.parametrize(("kind", "count", "kept"), [
    ("execute_result", 3, 3), ("execute_result", "3", None), ("execute_result", None, None)])
def test_an_execute_result_keeps_its_count_when_it_is_a_number(kind: str, count: Any, kept: int | None) -> None:
    state = _state()
    state.add(_msg(kind, {"data": {"text/plain": "r"}, "metadata": {}, "execution_count": count}))
    assert state.cell.outputs[0]["execution_count"] == kept
    display = _state()
    display.add(_msg("display_data", {"data": {"text/plain": "r"}, "metadata": {}, "execution_count": 3}))
    assert "execution_count" not in display.cell.outputs[0]


def test_a_display_whose_text_is_exactly_the_text_left_is_kept_and_one_more_is_dropped_as_text() -> None:
    state = _state(text=4)
    state.add(_msg("display_data", {"data": {"text/plain": "abcd"}, "metadata": {}}))
    assert state.budget.text == 0 and state.budget.outputs == 9 and len(state.cell.outputs) == 1
    state.add(_msg("display_data", {"data": {"text/plain": "e"}, "metadata": {}}))
    assert (state.budget.dropped_text, state.budget.dropped_display, state.budget.dropped_outputs) == (1, 0, 1)


def test_an_update_reaching_one_display_costs_only_its_message() -> None:
    state = _state()
    _shown(state, "d", "old")
    before = state.budget.display
    update = _msg("update_display_data", {"data": {"text/plain": "new"}, "metadata": {},
                                          "transient": {"display_id": "d"}})
    state.add(update)
    assert state.budget.display == before - update.size


def test_each_frame_streamed_past_is_counted() -> None:
    state = _state()
    state.drop_frame(10)
    state.drop_frame(20)
    assert (state.budget.dropped_frames, state.budget.dropped_display, state.budget.dropped_text) == (2, 30, 0)


def test_each_kept_output_is_handed_on_with_its_cell_index() -> None:
    seen: list[tuple[int, Any]] = []
    state = budget.CellState(v4.new_code_cell("x"), 7, budget.Budget(text=100, display=10_000, outputs=10),
                             lambda index, output: seen.append((index, output)))
    state.add(_msg("display_data", {"data": {"text/plain": "d"}, "metadata": {}}))
    state.add(_msg("stream", {"name": "stdout", "text": "a"}))
    assert seen == [(7, state.cell.outputs[0]), (7, {"output_type": "stream", "name": "stdout", "text": "a"})]


@pytest.mark.parametrize("content", [{"name": "stdout"}, {"text": "a"}, {"name": 1, "text": "a"}])
def test_a_stream_without_a_string_name_and_text_is_refused_in_those_words(content: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as refused:
        _state().add(_msg("stream", content))
    assert str(refused.value) == "a stream message without a string name and text"


def test_a_stream_of_exactly_the_text_left_is_kept_whole_and_the_outputs_are_counted() -> None:
    state = _state(text=3, outputs=2)
    state.add(_msg("stream", {"name": "stdout", "text": "abc"}))
    assert _texts(state) == ["abc"] and state.budget.dropped == 0 and state.budget.outputs == 1
    other = _state(outputs=2)
    other.add(_msg("stream", {"name": "stdout", "text": "a"}))
    other.add(_msg("stream", {"name": "stderr", "text": "b"}))
    other.add(_msg("stream", {"name": "stdout", "text": "c"}))  # a third output past the limit of two
    assert _texts(other)[:2] == ["a", "b"] and other.budget.outputs == 0
    assert (other.budget.dropped_text, other.budget.dropped_outputs) == (1, 1)


def test_an_error_past_the_first_is_kept_while_it_fits_and_charged() -> None:
    error = _msg("error", {"ename": "E", "evalue": "v", "traceback": ["t"]})
    state = _state(text=2 * error.size)
    state.add(error)
    state.add(error)  # exactly the text left
    assert state.budget.text == 0 and [o["output_type"] for o in state.cell.outputs] == ["error", "error"]


@pytest.mark.parametrize("content", [{"ename": 1}, {"evalue": None}, {"traceback": "t"}, {"traceback": [1]}])
def test_an_error_of_the_wrong_shape_is_refused_in_those_words(content: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as refused:
        budget._error_output(content)
    assert str(refused.value) == "an error message whose ename, evalue or traceback has the wrong type"


def test_an_error_without_fields_has_empty_ones() -> None:
    assert budget._error_output({}) == {"output_type": "error", "ename": "", "evalue": "", "traceback": []}


def test_an_error_that_could_not_be_kept_is_described_from_what_the_kernel_said() -> None:
    from nbexec.sandbox.execution import Execution as Ran
    from nbexec.sandbox.lasterror import LastError

    said = Ran(status="error", error=LastError(True, "KeyError", "'k'", ("t1", "t2")))
    assert budget._described(said) == {"ename": "KeyError", "evalue": "'k'", "traceback": ["t1", "t2"]}
    unknown = "The code raised an exception, but its error message{} was larger than the whole output allowance " \
              "and the kernel did not say what it was. Raise smaller errors, or raise max_output / max_display."
    for run, size in ((Ran(status="error", errors_dropped=5000), " (5,000 bytes)"), (Ran(status="error"), "")):
        assert budget._described(run) == {"ename": "UnknownError", "traceback": [], "evalue": unknown.format(size)}


# -- each bound at its edge, each drop counted where it belongs (what a mutant of budget.py would change) ----------

def _error(evalue: str = "v") -> Message:
    return _msg("error", {"ename": "E", "evalue": evalue, "traceback": []})


def test_the_marker_says_each_count_in_those_words() -> None:
    marker = NotebookNode(output_type="stream", name="stderr", text="")
    counts = budget.Budget(text=0, display=0, outputs=0, dropped_text=1234, dropped_display=5, markers=[marker])
    counts.finish(1000, 10)
    assert marker["text"] == "\n[nbexec: output truncated at the 1,000-byte limit; 1,239 bytes dropped]\n"
    counts.dropped_outputs = 3
    counts.finish(1000, 10)
    assert marker["text"] == ("\n[nbexec: output truncated at the 1,000-byte limit; 1,239 bytes dropped; 3 outputs "
                              "dropped past the 10-output limit]\n")
    counts.dropped_frames = 2
    counts.finish(1000, 10)
    assert marker["text"] == ("\n[nbexec: output truncated at the 1,000-byte limit; 1,239 bytes dropped; 3 outputs "
                              "dropped past the 10-output limit; 2 messages larger than the whole output allowance "
                              "dropped]\n")


@pytest.mark.parametrize(("metadata", "found"), [
    (None, []), ({}, []), ({"tags": "raises-exception"}, []), ({"tags": None}, []),
    ({"tags": ["raises-exception", 5, "skip-execution"]}, ["raises-exception", "skip-execution"]),
])
def test_tags_are_the_strings_of_a_tags_list(metadata: dict[str, Any] | None, found: list[str]) -> None:
    cell = NotebookNode(cell_type="code", source="x", outputs=[])
    if metadata is not None:
        cell["metadata"] = metadata
    assert budget.tags(cell) == found


def test_widget_messages_cost_nothing_without_a_widget_state() -> None:
    state = _state()
    state.add(_msg("comm_open", {"comm_id": "w", "target_name": "jupyter.widget", "data": {}}))
    assert (state.budget.display, state.budget.text, state.cell.outputs) == (10_000, 10_000, [])


def test_a_stream_with_one_byte_of_room_keeps_one_character() -> None:
    state = _state(text=1)
    state.add(_msg("stream", {"name": "stdout", "text": "ab"}))
    assert _texts(state)[0] == "a" and state.budget.dropped_text == 1


def test_a_clear_output_of_exactly_the_room_left_clears() -> None:
    state = _state()
    state.add(_msg("stream", {"name": "stdout", "text": "gone"}))
    clear = _msg("clear_output", {"wait": False})
    state.budget.text = clear.size
    state.add(clear)
    assert state.cell.outputs == [] and state.budget.text == 0 and state.budget.dropped_text == 0


def test_a_display_of_exactly_the_display_room_left_is_kept_and_charged() -> None:
    shown = _msg("display_data", {"data": {"image/png": "cA=="}, "metadata": {}})
    state = _state(display=shown.size)
    state.add(shown)
    assert len(state.cell.outputs) == 1 and state.budget.display == 0 and state.budget.dropped == 0


def test_an_update_past_the_display_room_drops_bytes_not_an_output() -> None:
    state = _state(display=10)
    update = _msg("update_display_data", {"data": {"text/plain": "new"}, "metadata": {},
                                          "transient": {"display_id": "d"}})
    state.add(update)
    dropped = state.budget
    assert (dropped.dropped_display, dropped.dropped_text, dropped.dropped_outputs) == (update.size, 0, 0)


def test_a_display_past_the_output_count_is_counted_as_display_bytes_and_one_output() -> None:
    state = _state(outputs=0)
    shown = _msg("display_data", {"data": {"image/png": "cA=="}, "metadata": {}})
    state.add(shown)
    assert (state.budget.dropped_display, state.budget.dropped_text, state.budget.dropped_outputs) == (shown.size, 0, 1)


def test_a_second_error_of_exactly_the_text_room_left_is_kept() -> None:
    state = _state()
    state.add(_error("first"))
    second = _error("second")
    state.budget.text = second.size
    state.add(second)
    assert [o["evalue"] for o in state.cell.outputs] == ["first", "second"] and state.budget.dropped == 0


def test_drops_of_text_add_up_and_a_frame_or_stream_dropped_is_no_output() -> None:
    state = _state(text=0)
    state.add(_msg("stream", {"name": "stdout", "text": "abc"}))
    state.add(_msg("stream", {"name": "stdout", "text": "defgh"}))
    state.drop_frame(7)
    first, second = (len(json.dumps({"name": "stdout", "text": t})) for t in ("abc", "defgh"))
    assert (state.budget.dropped_text, state.budget.dropped_display, state.budget.dropped_outputs) == (
        first + second, 7, 0)


def test_a_display_is_charged_what_holding_it_parsed_costs_not_its_bytes() -> None:
    """20 KiB of lists nested 60 deep takes 40 times its text once parsed: a 100 KiB allowance holds it by its
    bytes, not by what it costs the host. It is dropped and counted; a display of the same size in a string fits."""
    deep: list[Any] = []
    for _ in range(59):
        deep = [deep]
    dense = _msg("display_data", {"data": {"application/json": [deep] * 170}, "metadata": {}})
    plain = _msg("display_data", {"data": {"text/html": "x" * dense.size}, "metadata": {}})
    assert dense.size < 25_000 and dense.held(10**9) > 100_000
    state = _state(text=10**6, display=100_000)
    state.add(dense)
    state.add(plain)
    assert [list(o.get("data", {})) for o in state.cell.outputs] == [[], ["text/html"]]  # the marker, the html
    assert state.budget.dropped_display == dense.size and state.budget.display == 100_000 - plain.held(10**9)


def test_older_outputs_are_kept_by_what_they_hold_parsed_not_their_bytes() -> None:
    """A session keeps one run's allowance of older outputs. Counted by their JSON, 20 KiB of lists nested 60 deep
    per run fitted 40 runs of them in a 1 MiB bound: 40 MiB of objects. Counted as a message is charged, the
    older one goes."""
    deep: list[Any] = []
    for _ in range(59):
        deep = [deep]
    nb = v4.new_notebook(cells=[v4.new_code_cell("a"), v4.new_code_cell("b")])
    for code in nb.cells:
        code.outputs = [NotebookNode(output_type="display_data", metadata=NotebookNode(),
                                     data=NotebookNode({"application/json": [deep] * 170}))]
    text = sum(_size(c) for c in nb.cells)
    assert text < 50_000
    assert budget.keep_recent(nb, 1, 1024 * 1024, {}) is not None
    assert nb.cells[0].outputs[0]["output_type"] == "stream" and nb.cells[1].outputs[0]["data"]


def test_the_text_a_large_value_keeps_is_charged_too() -> None:
    """A large value keeps its text to be written as it came (`verbatim`): a second copy, charged after the parse,
    before it is kept."""
    message = _msg("display_data", {"data": {"application/json": list(range(1000, 40_000))}, "metadata": {}})
    held = message.held(10**9)
    for room, kept in ((held + 100_000, False), (held + 400_000, True)):
        state = _state(display=room)
        state.add(message)
        assert any("application/json" in o.get("data", {}) for o in state.cell.outputs) is kept, room
        assert state.budget.display < room - held if kept else state.budget.dropped_display > 0
