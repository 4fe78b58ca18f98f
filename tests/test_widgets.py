"""Widget state in the executed notebook (nbclient's handle_comm_msg and set_widgets_metadata): scripted comm
messages against the fake kernel, table by table, then one real widget end to end in Docker."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbformat import NotebookNode, v4

import nbexec
from nbexec import SandboxConfig
from nbexec.engine import cells, widgets
from nbexec.errors import ProtocolError
from nbexec.result import CellError
from nbexec.sandbox.messages import Message

from .test_cells import FakeSandbox, Framed, Script, ScriptedKernel, cell, display, stream

MIME = "application/vnd.jupyter.widget-state+json"
VIEW = "application/vnd.jupyter.widget-view+json"
SLIDER = {"_model_name": "IntSliderModel", "_model_module": "@jupyter-widgets/controls",
          "_model_module_version": "2.0.0", "value": 3, "layout": "IPY_MODEL_l1"}


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[..., ScriptedKernel]]:
    made: list[ScriptedKernel] = []

    def make(scripts: dict[str, Script]) -> ScriptedKernel:
        made.append(ScriptedKernel(tmp_path, scripts))
        return made[-1]

    yield make
    for kernel in made:
        kernel.close()


def opened(comm_id: Any, state: dict[str, Any] | None = None, *, target: str = "jupyter.widget",
           paths: list[Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"state": SLIDER if state is None else state, "buffer_paths": paths or []}
    return {"comm_id": comm_id, "target_name": target, "data": data, "metadata": {"version": "2.1.0"}}


def updated(comm_id: Any, state: Any, *, method: str = "update", paths: list[Any] | None = None) -> dict[str, Any]:
    return {"comm_id": comm_id, "data": {"method": method, "state": state, "buffer_paths": paths or []}}


def run(kernel: ScriptedKernel, nb: NotebookNode, config: SandboxConfig | None = None, first: int = 0,
        state: widgets.WidgetState | None = None) -> tuple[CellError | None, widgets.WidgetState]:
    state = widgets.WidgetState() if state is None else state
    config = config or FakeSandbox(kernel).config
    error, _ = cells.run_cells(FakeSandbox(kernel), nb, config, first_index=first, widget_state=state)
    return error, state


def models(nb: NotebookNode) -> dict[str, Any]:
    return nb.metadata["widgets"][MIME]["state"]


GOOD: list[tuple[str, Script, Callable[[dict[str, Any]], bool]]] = [
    ("open-then-update", [("comm_open", opened("m1")), ("comm_msg", updated("m1", {"value": 7}))],
     lambda m: m["m1"]["state"]["value"] == 7 and m["m1"]["model_name"] == "IntSliderModel"
     and m["m1"]["model_module"] == "@jupyter-widgets/controls" and m["m1"]["model_module_version"] == "2.0.0"
     and m["m1"]["state"]["layout"] == "IPY_MODEL_l1"),
    ("other-targets-ignored", [("comm_open", opened("m1")), ("comm_open", opened("c2", target="plotly")),
                               ("comm_msg", updated("c2", {"value": 1}))],
     lambda m: list(m) == ["m1"]),
    ("custom-messages-ignored", [("comm_open", opened("m1")), ("comm_msg", updated("m1", {"value": 9},
                                                                                  method="custom"))],
     lambda m: m["m1"]["state"]["value"] == 3),
    ("update-of-an-unopened-comm-ignored", [("comm_open", opened("m1")), ("comm_msg", updated("m9", {"value": 1}))],
     lambda m: list(m) == ["m1"]),
    ("an-empty-view-version", [("comm_open", opened("m1", {**SLIDER, "_view_module_version": ""}))],
     lambda m: m["m1"]["state"]["_view_module_version"] == ""),  # a model without a view (see viewer.widget_state)
    ("a-model-without-a-name-is-left-out", [("comm_open", opened("m1")), ("comm_open", opened("m2", {"x": 1}))],
     lambda m: list(m) == ["m1"]),
    ("buffers-base64", [("comm_open", Framed(opened("m1", paths=[["data"]]), [b"\x00\x01\xff"])),
                        ("comm_msg", Framed(updated("m1", {}, paths=[["data"]]), [b"new"]))],
     lambda m: m["m1"]["buffers"] == [{"data": base64.b64encode(b"new").decode(), "encoding": "base64",
                                       "path": ["data"]}]),
    ("comm-close-keeps-the-model", [("comm_open", opened("m1")), ("comm_close", {"comm_id": "m1", "data": {}})],
     lambda m: list(m) == ["m1"]),
]


@pytest.mark.parametrize(("script", "check"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_widget_state(scripted: Callable[..., ScriptedKernel], script: Script,
                      check: Callable[[dict[str, Any]], bool]) -> None:
    kernel = scripted({"a": [*script, display(None, "shown")]})
    nb = v4.new_notebook(cells=[cell("a")])
    error, state = run(kernel, nb)
    assert error is None and not state.notes and not state.dropped
    assert nb.metadata["widgets"][MIME]["version_major"] == 2 and nb.metadata["widgets"][MIME]["version_minor"] == 0
    assert check(models(nb)), models(nb)
    nbformat.validate(nb)  # the executed notebook stays valid nbformat
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "shown"


BAD: list[tuple[str, Script, str]] = [
    ("not-json", [("comm_msg", b"{not json")], "not valid UTF-8 JSON"),
    ("not-an-object", [("comm_open", b"[1, 2]")], "not a JSON object"),
    ("comm-id-not-a-string", [("comm_open", opened(["m2"]))], "comm_id is not a string"),
    ("comm-id-too-long", [("comm_open", opened("m" * 1000))], "comm_id is not a string of 1 to 256"),
    ("comm-id-empty", [("comm_open", opened(""))], "comm_id is not a string of 1 to 256"),
    ("module-too-long", [("comm_msg", updated("m1", {"_model_module": "x" * 257}))],
     "_model_module is not a string of 0 to 256"),
    ("data-not-an-object", [("comm_open", {"comm_id": "m2", "target_name": "jupyter.widget", "data": "x"})],
     "data is not a JSON object"),
    ("state-not-an-object", [("comm_msg", updated("m1", [1, 2]))], "state is not a JSON object"),
    ("model-name-not-a-string", [("comm_msg", updated("m1", {"_model_name": {"deep": 1}}))],
     "_model_name is not a string"),
    ("more-buffer-paths-than-buffers", [("comm_msg", Framed(updated("m1", {}, paths=[["a"], ["b"]]), [b"x"]))],
     "names more buffers than it carries"),
    ("buffer-path-not-a-list", [("comm_msg", Framed(updated("m1", {}, paths=["a"]), [b"x"]))],
     "buffer path that is not a short list"),
    ("nested-too-deeply", [("comm_msg", b'{"comm_id": "m1", "data": ' + b"[" * 100 + b"]" * 100 + b"}")],
     "nested more than"),
]


@pytest.mark.parametrize(("script", "reason"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_malformed_message_drops_the_state_with_a_note(scripted: Callable[..., ScriptedKernel], script: Script,
                                                         reason: str) -> None:
    """A partial state would show wrong values: the whole state goes, the run and its outputs do not."""
    kernel = scripted({"a": [("comm_open", opened("m1")), *script, stream("after")]})
    nb = v4.new_notebook(cells=[cell("a")])
    nb.metadata["widgets"] = {MIME: {"state": {"old": {}}, "version_major": 2, "version_minor": 0}}
    error, state = run(kernel, nb)
    assert error is None and nb.cells[0].outputs[0]["text"] == "after"
    assert "widgets" not in nb.metadata  # not even the state the notebook came with
    assert len(state.notes) == 1 and reason in state.notes[0], state.notes
    assert state.notes[0].startswith("The widget state was not saved in the notebook: ")


def test_widget_messages_are_charged_before_parsing(scripted: Callable[..., ScriptedKernel]) -> None:
    """Charged by raw size against the display allowance: one past it is dropped unparsed (its bad JSON is never
    seen), and what was charged is gone for the displays that follow."""
    config = SandboxConfig(timeout=10, interrupt_grace=1, max_display="4k")
    big = ("comm_open", opened("m1", {**SLIDER, "pad": "x" * 3000}))
    kernel = scripted({"a": [big, display(None, "fits")], "b": [big, display(None, "dropped")],
                       "c": [("comm_msg", b"{" + b" " * 5000)]})
    nb = v4.new_notebook(cells=[cell("a")])
    error, state = run(kernel, nb, config)
    assert error is None and not state.notes and models(nb)["m1"]["state"]["pad"] == "x" * 3000
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "fits"
    nb.cells.append(cell("c"))
    error, state = run(kernel, nb, config, first=1, state=state)
    assert error is None and "widgets" not in nb.metadata
    assert state.notes == ["The widget state was not saved in the notebook: a comm_msg message of 5,003 bytes "
                           "came past the display allowance."]


def test_a_display_after_widget_messages_that_used_the_allowance_is_dropped(
        scripted: Callable[..., ScriptedKernel]) -> None:
    config = SandboxConfig(timeout=10, interrupt_grace=1, max_display="4k")
    overhead = len(json.dumps(opened("m1", {**SLIDER, "pad": ""}))) + len(b"{}")  # content and metadata frames
    pad = "x" * (4096 - overhead - 10)  # 10 bytes left: less than any display
    kernel = scripted({"a": [("comm_open", opened("m1", {**SLIDER, "pad": pad})), display(None, "late")]})
    nb = v4.new_notebook(cells=[cell("a")])
    error, _ = run(kernel, nb, config)
    assert error is None and models(nb)["m1"]["state"]["pad"] == pad
    assert all("late" not in json.dumps(o) for o in nb.cells[0].outputs)
    assert "truncated" in nb.cells[0].outputs[-1]["text"]


def test_models_are_capped_in_number(scripted: Callable[..., ScriptedKernel]) -> None:
    config = SandboxConfig(timeout=10, interrupt_grace=1, max_outputs=3)
    kernel = scripted({"a": [("comm_open", opened(f"m{i}")) for i in range(4)]})
    nb = v4.new_notebook(cells=[cell("a")])
    error, state = run(kernel, nb, config)
    assert error is None and "widgets" not in nb.metadata
    assert state.notes == ["The widget state was not saved in the notebook: more than 3 widget models "
                           "(the max_outputs limit)."]


def test_the_kept_state_is_capped_in_bytes_across_runs(scripted: Callable[..., ScriptedKernel]) -> None:
    """Each run has a fresh display allowance; the state a session keeps never grows past one allowance."""
    config = SandboxConfig(timeout=10, interrupt_grace=1, max_display="8k")
    kernel = scripted({"a": [("comm_open", opened("m1", {**SLIDER, "a": "x" * 5000}))],
                       "b": [("comm_msg", updated("m1", {"a": "y" * 5000}))],  # replaces: still fits
                       "c": [("comm_msg", updated("m1", {"b": "z" * 5000}))]})  # adds: too much
    nb, state = v4.new_notebook(cells=[cell("a")]), widgets.WidgetState()
    for index, code in enumerate("abc"):
        if index:
            nb.cells.append(cell(code))
        error, state = run(kernel, nb, config, first=index, state=state)
        assert error is None
        assert ("widgets" in nb.metadata) == (code != "c"), code
    assert state.take_notes() == ["The widget state was not saved in the notebook: the widget state grew past "
                                  "8,192 bytes (the max_display limit)."]


def test_the_state_spans_the_runs_of_a_session(scripted: Callable[..., ScriptedKernel]) -> None:
    """A model opened in one run and updated in a later one: both runs' models are in the notebook."""
    kernel = scripted({"a": [("comm_open", opened("m1"))],
                       "b": [("comm_open", opened("m2")), ("comm_msg", updated("m1", {"value": 7}))]})
    nb, state = v4.new_notebook(cells=[cell("a")]), widgets.WidgetState()
    run(kernel, nb, state=state)
    assert models(nb)["m1"]["state"]["value"] == 3
    nb.cells.append(cell("b"))
    error, _ = run(kernel, nb, first=1, state=state)
    assert error is None and models(nb)["m1"]["state"]["value"] == 7 and set(models(nb)) == {"m1", "m2"}


def test_once_dropped_later_messages_are_neither_parsed_nor_charged(scripted: Callable[..., ScriptedKernel]) -> None:
    config = SandboxConfig(timeout=10, interrupt_grace=1, max_display="4k")
    kernel = scripted({"a": [("comm_msg", b"{bad"), ("comm_open", opened("m1", {**SLIDER, "pad": "x" * 3000})),
                             display(None, "kept")]})
    nb = v4.new_notebook(cells=[cell("a")])
    error, state = run(kernel, nb, config)
    assert error is None and "widgets" not in nb.metadata and len(state.notes) == 1
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "kept"  # the 3 kB open was not charged


def test_a_slider_end_to_end(config: nbexec.SandboxConfig) -> None:
    """The real ipywidgets in the image: the state saved is the model's last value, and the view is an output."""
    result = nbexec.execute_notebook(
        "import ipywidgets as w\ns = w.IntSlider(value=3)\ndisplay(s)\ns.value = 7", config=config)
    assert result.ok, result.error
    view = next(o["data"][VIEW] for o in result.outputs if VIEW in o.get("data", {}))
    saved = json.loads(Path(result.notebook_path).read_text())
    state = saved["metadata"]["widgets"][MIME]
    assert (state["version_major"], state["version_minor"]) == (2, 0)
    slider = state["state"][view["model_id"]]
    assert slider["model_name"] == "IntSliderModel" and slider["model_module"] == "@jupyter-widgets/controls"
    assert slider["state"]["value"] == 7
    layout = slider["state"]["layout"].removeprefix("IPY_MODEL_")
    assert state["state"][layout]["model_name"] == "LayoutModel"
    assert not result.notes
    nbformat.validate(nbformat.reads(Path(result.notebook_path).read_text(), as_version=4))


def test_a_session_saves_a_model_updated_in_a_later_run(config: nbexec.SandboxConfig) -> None:
    with nbexec.Session(config) as session:
        first = session.run("import ipywidgets as w\ns = w.IntSlider(value=3)\ndisplay(s)")
        assert first.ok, first.error
        later = session.run("s.value = 11")
        assert later.ok, later.error
        view = next(o["data"][VIEW] for o in first.outputs if VIEW in o.get("data", {}))
        assert session.notebook.metadata.widgets[MIME]["state"][view["model_id"]]["state"]["value"] == 11


def test_save_writes_each_models_module_and_version_as_its_state_says() -> None:
    """``WidgetState.save`` called directly: the module and its version come from the model's own keys."""
    from nbexec.engine.widgets import WidgetState

    state = WidgetState()
    state.models["m1"] = dict(SLIDER)
    state.models["m2"] = {"_model_name": "LayoutModel", "_model_module": "@jupyter-widgets/base",
                          "_model_module_version": "2.0.0"}
    nb = v4.new_notebook()
    state.save(nb)
    saved = models(nb)
    assert (saved["m1"]["model_module"], saved["m1"]["model_module_version"]) == ("@jupyter-widgets/controls", "2.0.0")
    assert (saved["m2"]["model_module"], saved["m2"]["model_name"]) == ("@jupyter-widgets/base", "LayoutModel")


# -- the pieces, each value as it is (what a mutant of widgets.py would change) -----------------------------------

def _message(kind: str, content: dict[str, Any], *frames: bytes | None, size: int | None = None,
             complete: bool = True) -> Message:
    raw = json.dumps(content).encode()
    return Message("iopub", kind, "m", "p", len(raw) + sum(len(f or b"") for f in frames) if size is None else size,
                   raw, complete, tuple(frames))


def _state(models: int = 10, size: int = 100_000) -> widgets.WidgetState:
    return widgets.WidgetState().limit(SandboxConfig(max_outputs=models, max_display=f"{size}"))


def test_add_charges_the_message_and_the_base64_its_buffers_cost() -> None:
    state = _state()
    msg = _message("comm_open", opened("w1", paths=[["b"]]), b"\x00" * 30)
    assert state.add(msg, 10_000) == msg.size + (40 - 30)  # 30 bytes are 40 in base64
    assert state.buffers["w1"][("b",)] == {"data": base64.b64encode(b"\x00" * 30).decode(), "encoding": "base64",
                                           "path": ["b"]}


def test_a_message_of_exactly_the_room_left_is_kept() -> None:
    state = _state()
    msg = _message("comm_open", opened("w1"))
    assert state.add(msg, msg.size) == msg.size and "w1" in state.models and not state.dropped


def test_a_message_past_the_room_or_incomplete_is_charged_nothing_and_drops_the_state() -> None:
    for msg, room in ((_message("comm_open", opened("w1")), 10), (_message("comm_open", {}, complete=False), 10**6)):
        state = _state()
        assert state.add(msg, room) == 0 and state.dropped.startswith("a comm_open message of ")
        assert state.add(_message("comm_open", opened("w2")), 10**6) == 0  # given up: nothing more is charged


def test_base64_past_the_room_drops_the_state_in_those_words() -> None:
    state = _state()
    msg = _message("comm_open", opened("w1", paths=[["b"]]), b"\x00" * 300)
    assert state.add(msg, msg.size + 99) == msg.size  # the base64 costs 100 more: one byte too many
    assert state.dropped == "the widget buffers, base64-encoded, came past the display allowance"
    exact = _state()
    assert exact.add(msg, msg.size + 100) == msg.size + 100 and not exact.dropped


def test_a_state_of_exactly_the_byte_limit_is_kept() -> None:
    probe = _state()
    probe.add(_message("comm_open", opened("w1")), 10**6)
    assert probe.kept == sum(len(key) + len(json.dumps(value)) for key, value in SLIDER.items())  # from nothing
    exact, short = _state(size=probe.kept), _state(size=probe.kept - 1)
    exact.add(_message("comm_open", opened("w1")), 10**6)
    short.add(_message("comm_open", opened("w1")), 10**6)
    assert exact.kept == probe.kept and not exact.dropped
    assert short.dropped == f"the widget state grew past {probe.kept - 1:,} bytes (the max_display limit)"


def test_an_update_of_a_key_charges_only_what_it_adds() -> None:
    state = _state()
    state.add(_message("comm_open", opened("w1", {**SLIDER, "value": 1})), 10**6)
    before = state.kept
    state.add(_message("comm_msg", updated("w1", {"value": 2})), 10**6)
    assert state.kept == before  # the same key, a value of the same length
    state.add(_message("comm_msg", updated("w1", {"new": 1})), 10**6)
    assert state.kept == before + len("new") + 1


def test_a_message_that_is_not_an_update_of_a_model_seen_open_charges_only_itself() -> None:
    state = _state()
    msg = _message("comm_msg", updated("w9", {"value": 1}))
    assert state.add(msg, 10**6) == msg.size and state.models == {}


@pytest.mark.parametrize(("paths", "frames", "kept", "raw"), [
    (None, (), [], 0), ([], (b"x",), [], 0),
    ([["a"]], (b"xy", b"z"), [{"data": "eHk=", "encoding": "base64", "path": ["a"]}], 2),  # a frame more: unread
    ([["a"], [0, "b"]], (b"xy", b"z"), [{"data": "eHk=", "encoding": "base64", "path": ["a"]},
                                        {"data": "eg==", "encoding": "base64", "path": [0, "b"]}], 3),
    ([["k"] * 64], (b"",), [{"data": "", "encoding": "base64", "path": ["k"] * 64}], 0),
    ([["k" * widgets.MAX_NAME]], (b"",), [{"data": "", "encoding": "base64", "path": ["k" * widgets.MAX_NAME]}], 0),
])
def test_buffers_are_kept_as_nbclient_keeps_them(paths: Any, frames: tuple[bytes, ...], kept: list[Any],
                                                 raw: int) -> None:
    assert widgets._buffers(paths, frames) == (kept, raw)


@pytest.mark.parametrize(("paths", "frames", "words"), [
    ([["a"], ["b"]], (b"x",), "a widget message names more buffers than it carries"),
    ("a", (b"x",), "a widget message names more buffers than it carries"),
    ([[]], (b"x",), "a widget message with a buffer path that is not a short list of keys"),
    ([["k"] * 65], (b"x",), "a widget message with a buffer path that is not a short list of keys"),
    ([["k" * (widgets.MAX_NAME + 1)]], (b"x",), "a widget message with a buffer path that is not a short list of keys"),
    ([[1.5]], (b"x",), "a widget message with a buffer path that is not a short list of keys"),
    ([["a"]], (None,), "a widget message whose buffers came past the message size limit"),
])
def test_bad_buffers_are_refused_in_those_words(paths: Any, frames: tuple[bytes | None, ...], words: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        widgets._buffers(paths, frames)
    assert str(refused.value) == words


def test_a_name_is_a_string_of_at_most_max_name_characters() -> None:
    assert widgets._name("n" * widgets.MAX_NAME, "model id") == "n" * widgets.MAX_NAME
    assert widgets._name("", "version", empty=True) == ""
    for value, empty, least in (("n" * (widgets.MAX_NAME + 1), False, 1), (5, True, 0), ("", False, 1)):
        with pytest.raises(ProtocolError) as refused:
            widgets._name(value, "model id", empty=empty)
        assert str(refused.value) == (f"a widget message whose model id is not a string of {least} to "
                                      f"{widgets.MAX_NAME} characters")


def test_saving_no_models_into_a_notebook_without_widgets_leaves_it_so() -> None:
    nb = v4.new_notebook()
    _state().save(nb)
    assert "widgets" not in nb.metadata
    state = _state()
    state.add(_message("comm_open", opened("w1", {"value": 1})), 10**6)  # no model name: nothing a viewer shows
    state.save(nb)
    assert "widgets" not in nb.metadata


def test_a_model_never_described_is_passed_over_and_the_next_one_kept() -> None:
    state = _state()
    state.add(_message("comm_open", opened("w0", {"value": 1})), 10**6)  # opened first, never described
    state.add(_message("comm_open", opened("w1")), 10**6)
    nb = v4.new_notebook()
    state.save(nb)
    assert list(models(nb)) == ["w1"]


@pytest.mark.parametrize("held", [[], "widgets", 7, None, {"other/mime": {}}],
                         ids=["a-list", "a-string", "a-number", "null", "another-mime"])
def test_a_widgets_entry_of_any_shape_in_the_input_is_cleared_without_failing(held: Any) -> None:
    """An input notebook's metadata.widgets is the input's (any JSON): a run without models, or one whose state
    was dropped, leaves no widget state a viewer would load, and never fails on the shape."""
    for dropped in (False, True):
        nb = v4.new_notebook()
        nb.metadata["widgets"] = held
        state = _state()
        if dropped:
            state.add(_message("comm_open", {}, complete=False), 10**6)
            assert state.dropped
        state.save(nb)
        kept = nb.metadata.get("widgets")
        assert not (isinstance(kept, dict) and MIME in kept), kept
        if dropped and isinstance(held, dict):
            assert kept == held  # only the widget state is taken out


def test_a_model_this_run_made_that_is_dropped_is_named_in_the_note() -> None:
    state = _state()
    state.add(_message("comm_open", opened("w1", {**SLIDER, "_model_module": "evil-module"})), 10**6)
    nb = v4.new_notebook()
    state.save(nb)
    assert "widgets" not in nb.metadata
    [note] = state.take_notes()
    assert "'w1' ('IntSliderModel': its model module 'evil-module'" in note, note


def test_a_state_of_dense_json_is_charged_what_holding_it_parsed_costs() -> None:
    """Lists nested 60 deep take 40 times their text once parsed: charged by bytes, 20 KiB of them fitted a
    100 KiB room. Charged what they hold, they do not, and the state is dropped."""
    deep: list[Any] = []
    for _ in range(59):
        deep = [deep]
    msg = _message("comm_open", opened("w1", {**SLIDER, "pad": [deep] * 170}))
    assert msg.size < 25_000 and msg.held(10**9) > 100_000
    state = _state()
    assert state.add(msg, 100_000) == 0 and state.dropped.startswith("a comm_open message of ")
