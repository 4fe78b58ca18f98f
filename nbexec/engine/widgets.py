"""Widget state for the executed notebook, built from the kernel's comm messages as nbclient does
(NotebookClient.handle_comm_msg, _serialize_widget_state, set_widgets_metadata): every ``comm_open`` for the
``jupyter.widget`` target starts a model and every ``comm_msg`` with method "update" merges into it; at the end of a
run the models go to ``notebook.metadata.widgets["application/vnd.jupyter.widget-state+json"]``, so a notebook
viewer can draw the widget views kept in the outputs. A viewer loads the module each model names: only models
`nbexec.notebook.viewer.widget_state` allows are saved (pinned @jupyter-widgets modules, markup as text), and a
state the notebook came with is held to the same rule.

Every message is hostile: its raw size is charged against the run's display allowance before it is parsed, the
models are capped in number and the state kept in bytes, ids and model names must be short strings, and binary
buffers are kept base64-encoded only within the allowance. Whatever does not fit or does not make sense drops the
whole state (a partial state would show wrong values) with a note; nothing here raises. Pure: no I/O.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.errors import ProtocolError
from nbexec.notebook import viewer
from nbexec.sandbox.messages import Message

KINDS = frozenset({"comm_open", "comm_msg"})
TARGET = "jupyter.widget"
MIME = viewer.WIDGET_STATE
MAX_NAME = 256  # characters of a model id, model name, module or version (ipywidgets uses 32-hex ids)
_NAMES = ("_model_name", "_model_module", "_model_module_version")


class WidgetState:
    """The widget models seen so far (a session keeps one across its runs), within ``max_models`` models and
    ``max_bytes`` bytes of state (each run's config sets both: `limit`); ``dropped`` says why the state was given
    up ("" while it is kept)."""

    def __init__(self) -> None:
        self.max_models = self.max_bytes = 0  # nothing is kept before `limit`
        self.models: dict[str, dict[str, Any]] = {}  # model id -> its state (key -> value)
        self.buffers: dict[str, dict[tuple[str | int, ...], dict[str, Any]]] = {}  # model id -> path -> buffer
        self._sizes: dict[str, dict[Any, int]] = {}  # model id -> key or buffer path -> bytes kept for it
        self.kept = 0
        self.dropped = ""
        self.notes: list[str] = []

    def limit(self, config: SandboxConfig) -> WidgetState:
        """Hold the models to ``config``'s output limits: max_outputs models, max_display bytes of state."""
        self.max_models, self.max_bytes = config.max_outputs, config.max_display_bytes
        return self

    def add(self, msg: Message, room: int) -> int:
        """Apply one comm message with ``room`` bytes left of the display allowance; return the bytes charged."""
        if self.dropped:
            return 0  # given up: later messages are not even parsed
        held = msg.held(room) if msg.complete and msg.size <= room else msg.size  # its state's cost once parsed
        if not msg.complete or held > room:
            self._drop(f"a {msg.msg_type} message of {msg.size:,} bytes came past the display allowance")
            return 0
        try:
            return held + self._apply(msg, room - held)
        except ProtocolError as exc:
            self._drop(str(exc))
            return held

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def save(self, nb: NotebookNode) -> None:
        """Write the viewable models into ``nb.metadata.widgets`` (removed when the state was dropped); a state
        the notebook already held (its input's) is held to the same rule when this run made none."""
        widgets = nb.metadata.get("widgets")
        if self.dropped:
            if isinstance(widgets, dict):
                widgets.pop(MIME, None)
                if not widgets:
                    del nb.metadata["widgets"]
            return
        if not self.models:  # as nbclient: a run without widgets leaves the metadata as it was, but viewable
            if widgets is not None:
                self._write(nb, widgets.get(MIME) if isinstance(widgets, dict) else None)
            return
        state = {}
        for model_id, values in self.models.items():
            if "_model_name" not in values:  # opened but never described: nothing a viewer could draw
                continue
            entry = {"model_name": values["_model_name"], "model_module": values.get("_model_module"),
                     "model_module_version": values.get("_model_module_version"), "state": dict(values)}
            if self.buffers.get(model_id):
                entry["buffers"] = list(self.buffers[model_id].values())
            state[model_id] = entry
        self._write(nb, {"version_major": 2, "version_minor": 0, "state": state})

    def _write(self, nb: NotebookNode, saved: Any) -> None:
        kept, notes = viewer.widget_state(saved)
        self.notes.extend(notes)
        if kept["state"]:
            nb.metadata["widgets"] = NotebookNode({MIME: kept})  # a plain dict would be made nodes, value by value
        else:
            nb.metadata.pop("widgets", None)

    def _drop(self, reason: str) -> None:
        self.dropped = reason
        self.models, self.buffers, self._sizes, self.kept = {}, {}, {}, 0
        self.notes.append(f"The widget state was not saved in the notebook: {reason}.")

    def _apply(self, msg: Message, room: int) -> int:
        """Merge one message (already charged); return the extra bytes its base64 buffers cost."""
        content = msg.content()
        comm_id = _name(content.get("comm_id"), "comm_id")
        data = content.get("data")
        if not isinstance(data, dict):
            raise ProtocolError(f"a {msg.msg_type} message whose data is not a JSON object")
        if msg.msg_type == "comm_open":
            if content.get("target_name") != TARGET:
                return 0  # another library's comm: not a widget model
            if comm_id not in self.models and len(self.models) >= self.max_models:
                raise ProtocolError(f"more than {self.max_models:,} widget models (the max_outputs limit)")
            self.models.setdefault(comm_id, {})
            self._sizes.setdefault(comm_id, {})
            self.buffers.setdefault(comm_id, {})
        elif comm_id not in self.models or data.get("method") != "update":
            return 0  # a custom message, or a comm that is not a widget we saw open
        state = data.get("state", {})
        if not isinstance(state, dict):
            raise ProtocolError(f"a {msg.msg_type} message whose state is not a JSON object")
        for key in _NAMES:
            if key in state:
                _name(state[key], key, empty=True)  # some libraries leave a version empty
        buffers, raw = _buffers(data.get("buffer_paths"), msg.buffers)
        extra = sum(len(b["data"]) for b in buffers) - raw  # base64 costs a third more than the bytes charged
        if extra > room:
            raise ProtocolError("the widget buffers, base64-encoded, came past the display allowance")
        self._merge(comm_id, state, buffers)
        return extra

    def _merge(self, comm_id: str, state: dict[str, Any], buffers: list[dict[str, Any]]) -> None:
        sizes = self._sizes[comm_id]
        new: dict[Any, int] = {key: len(key) + len(json.dumps(value, ensure_ascii=False))
                               for key, value in state.items()}
        new.update({tuple(b["path"]): len(b["data"]) for b in buffers})
        kept = self.kept + sum(new.values()) - sum(sizes.get(key, 0) for key in new)
        if kept > self.max_bytes:
            raise ProtocolError(f"the widget state grew past {self.max_bytes:,} bytes (the max_display limit)")
        self.models[comm_id].update(state)
        self.buffers[comm_id].update({tuple(b["path"]): b for b in buffers})
        sizes.update(new)
        self.kept = kept


def _name(value: Any, what: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME or not (value or empty):
        raise ProtocolError(f"a widget message whose {what} is not a string of {int(not empty)} to {MAX_NAME} "
                            "characters")
    return value


def _buffers(paths: Any, frames: tuple[bytes | bytearray | None, ...]) -> tuple[list[dict[str, Any]], int]:
    """The binary buffers as nbclient's _get_buffer_data keeps them ({data (base64), encoding, path}), and their
    size in bytes before encoding."""
    if paths is None or paths == []:
        return [], 0
    if not isinstance(paths, list) or len(paths) > len(frames):
        raise ProtocolError("a widget message names more buffers than it carries")
    kept, raw = [], 0
    for path, frame in zip(paths, frames, strict=False):
        if not isinstance(path, list) or not path or len(path) > 64 \
                or not all(isinstance(p, int) or (isinstance(p, str) and len(p) <= MAX_NAME) for p in path):
            raise ProtocolError("a widget message with a buffer path that is not a short list of keys")
        if frame is None:
            raise ProtocolError("a widget message whose buffers came past the message size limit")
        raw += len(frame)
        kept.append({"data": base64.b64encode(frame).decode("ascii"), "encoding": "base64", "path": path})
    return kept, raw
