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
from nbexec.result import CellError

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
