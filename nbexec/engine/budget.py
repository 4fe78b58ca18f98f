"""What a cell keeps of its kernel's messages: the run's output allowance, charged by each message's raw size before
it is parsed, and the output rules (nbclient's process_message and _update_display_id, for the kinds nbexec keeps:
stream merging, clear_output, display updates across cells).

What is kept never costs more than was charged: a stream by its text as the notebook's JSON stores it, a display
update by its size for every output it reaches. A cap shortens what is kept, never what happened: the error that
ends the run is always kept (trimmed to MAX_ERROR), and when no error message could be kept (past the frame
limit, never sent) the one the reply or the kernel described stands in for it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbformat import NotebookNode, from_dict

from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, ProtocolError
from nbexec.notebook import outputs, verbatim
from nbexec.sandbox.kernel import Execution
from nbexec.sandbox.messages import FREE_OBJECTS, MAX_MEMBERS, Message, flat, objects

from . import cellsize, widgets

OutputCallback = Callable[[int, NotebookNode], None]
Displays = dict[str, list[NotebookNode]]  # display id -> the outputs that show it (update_display_data)
MAX_ERROR = 1024 * 1024  # bytes of an error's name + value + traceback kept; the rest is trimmed with a marker
# Bytes of a session's notebook besides outputs (code, cell and notebook metadata): with `keep_recent`, the notebook
# stays within 2 x (max_output + max_display) + 8 MiB at every run, and so does its durable record.
CODE_ALLOWANCE = 6 * 1024**2
BESIDE_TEXT = 64  # bytes of a stream message besides its content that cost nothing: an honest one's metadata is {}


@dataclass
class Budget:
    """What is left of the execution's output allowance (bytes and outputs), and what was dropped."""

    text: int
    display: int
    outputs: int
    dropped_text: int = 0
    dropped_display: int = 0
    dropped_outputs: int = 0
    dropped_frames: int = 0  # messages streamed past unread: larger than the whole allowance
    markers: list[NotebookNode] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Budget:
        return cls(text=config.max_output_bytes, display=config.max_display_bytes, outputs=config.max_outputs)

    @property
    def dropped(self) -> int:
        return self.dropped_text + self.dropped_display

    def finish(self, text_limit: int, output_limit: int) -> None:
        """Write the final counts into the truncation markers."""
        for marker in self.markers:
            marker["text"] = _marker_text(text_limit, self.dropped, output_limit, self.dropped_outputs)
            if self.dropped_frames:
                marker["text"] = marker["text"][:-2] + (
                    f"; {self.dropped_frames:,} messages larger than the whole output allowance dropped]\n")


def _marker_text(limit: int, dropped: int, output_limit: int, dropped_outputs: int) -> str:
    text = f"\n[nbexec: output truncated at the {limit:,}-byte limit; {dropped:,} bytes dropped"
    if dropped_outputs:
        text += f"; {dropped_outputs:,} outputs dropped past the {output_limit:,}-output limit"
    return text + "]\n"


class CellState:
    """Outputs of the running cell (see the module docstring). The error that ends the run is shown at the end
    of the cell even when a later clear_output took it."""

    def __init__(self, cell: NotebookNode, index: int, budget: Budget, on_output: OutputCallback | None,
                 displays: Displays | None = None, widget_state: widgets.WidgetState | None = None) -> None:
        self.cell, self.index, self.budget, self.on_output = cell, index, budget, on_output
        self.clear_pending = False
        self.displays: Displays = {} if displays is None else displays
        self.widgets = widget_state
        self.expected = "raises-exception" in tags(cell)  # its error does not end the run
        self.error: NotebookNode | None = None  # the first error output kept
        self._marker: NotebookNode | None = None  # this cell's truncation marker, while it is in the outputs
        self._stream: NotebookNode | None = None  # the stream output being merged into, and its pieces
        self._pieces: list[str] = []

    def add(self, msg: Message) -> None:
        """Keep what fits of one output message; raises ProtocolError for a malformed one."""
        kind, budget = msg.msg_type, self.budget
        if kind in widgets.KINDS:  # charged against the display allowance, by its raw size, before parsing
            budget.display -= self.widgets.add(msg, budget.display) if self.widgets is not None else 0
            return None
        if not msg.complete:
            return self.drop_frame(msg.size)
        if kind == "stream":
            # Its text is charged as stored; the rest (headers past their allowance, metadata) as sent.
            beside = max(0, msg.size - len(msg.raw_content) - BESIDE_TEXT)
            if budget.text <= beside:
                return self._drop(msg.size, text=True)
            budget.text -= beside
            if not flat(msg.raw_content):  # a stream's name and text are strings: anything else costs a parse
                raise ProtocolError("a stream message whose content holds a list or an object")
            self._add_stream(msg.content())
        elif kind == "error":
            self._add_error(msg)
        elif kind == "clear_output":
            if budget.text < msg.size:
                return self._drop(msg.size, text=True)
            budget.text -= msg.size
            self._clear(msg.content())
        else:
            self._add_kept(kind, msg)
        return None

    def _add_kept(self, kind: str, msg: Message) -> None:
        """A display, a result or an update: charged what holding it parsed costs the host (`Message.held`)."""
        budget = self.budget
        held = msg.held(budget.display) if budget.display >= msg.size else msg.size + 1  # no count when past it
        if budget.display < held:
            return self._drop(msg.size, text=False, output=kind != "update_display_data")
        if kind == "update_display_data":
            budget.display -= held  # parsing it costs that, whatever becomes of it
            return self._update(msg.bundle(), held)
        if budget.outputs <= 0:
            return self._drop(msg.size, text=False, output=True)
        budget.display -= held
        return self._add_display(kind, msg.bundle())

    def _add_error(self, msg: Message) -> None:
        budget = self.budget
        if (self.error is not None or self.expected) and (budget.text < msg.size or budget.outputs <= 0):
            return self._drop(msg.size, text=True, output=True)
        budget.text -= msg.size
        budget.outputs -= 1
        node = _error_output(msg.content())
        if self.error is None:
            self.error = node
        self._append(node)
        return None

    def drop_frame(self, size: int) -> None:
        """Count a message over the frame limit (``size`` bytes, streamed past unread)."""
        self.budget.dropped_frames += 1
        self._drop(size, text=False)

    def failure(self, run: Execution) -> NotebookNode:
        """The error output that ended the cell: the one kept (put back at the end when a clear_output took it),
        else one built from what the reply or the kernel said, else one saying the error was too large."""
        if self.error is None:
            self.error = _error_output(_described(run))
        if not any(output is self.error for output in self.cell.outputs):
            self._append(self.error)
        return self.error

    def finish(self) -> None:
        """Join the pieces of the stream output being merged (kept apart while the cell runs: joining them at
        each message would copy the whole text each time)."""
        if self._stream is not None:
            self._stream["text"] = "".join(self._pieces)
        self._stream, self._pieces = None, []

    def _drop(self, size: int, *, text: bool, output: bool = False) -> None:
        if text:
            self.budget.dropped_text += size
        else:
            self.budget.dropped_display += size
        self.budget.dropped_outputs += output
        self._ensure_marker()

    def _clear(self, content: dict[str, Any]) -> None:
        if content.get("wait"):
            self.clear_pending = True
        else:
            self._replace_outputs()

    def _replace_outputs(self) -> None:
        self.finish()
        self.cell.outputs, self.clear_pending, self._marker = [], False, None

    def _update(self, content: dict[str, Any], size: int) -> None:
        data, metadata = _bundle(content)
        reached = self.displays.get(_display_id(content) or "", [])
        extra, text = size * (len(reached) - 1) + _copies(data, metadata), _text_size(data) * len(reached)
        if reached and (extra > self.budget.display or text > self.budget.text):
            return self._drop(size * len(reached), text=False)
        self.budget.display -= max(0, extra) if reached else 0
        self.budget.text -= text
        data, metadata = NotebookNode(data), NotebookNode(metadata)  # a node's plain dict would be walked whole
        for output in reached:
            output["data"], output["metadata"] = data, metadata
        return None

    def _add_display(self, kind: str, content: dict[str, Any]) -> None:
        data, metadata = _bundle(content)
        output: dict[str, Any] = {"output_type": kind, "data": data, "metadata": metadata}
        if kind == "execute_result":
            count = content.get("execution_count")
            output["execution_count"] = count if isinstance(count, int) else None
        text_size, copies = _text_size(data), _copies(data, metadata)
        if copies > self.budget.display:  # the text its large values keep (`verbatim`) is held too
            return self._drop(copies, text=False, output=True)
        if text_size > self.budget.text:  # the text of rich outputs counts against the text allowance too
            return self._drop(text_size, text=True, output=True)
        self.budget.text, self.budget.display = self.budget.text - text_size, self.budget.display - copies
        self.budget.outputs -= 1
        # Two layers made nodes; the values stay the parsed JSON: converting each of a deep value's containers in
        # Python cost 1 s of host CPU per MiB of lists (10 s of deep ones), a hundred times the promise.
        node = NotebookNode({**output, "data": NotebookNode(data), "metadata": NotebookNode(metadata)})
        display_id = _display_id(content)
        if display_id:
            self.displays.setdefault(display_id, []).append(node)
        self._append(node)
        return None

    def _append(self, output: NotebookNode) -> None:
        if self.clear_pending:
            self._replace_outputs()
        self.finish()
        self.cell.outputs.append(output)
        if self.on_output is not None:
            self.on_output(self.index, output)

    def _add_stream(self, content: dict[str, Any]) -> None:
        name, text = content.get("name"), content.get("text")
        if not isinstance(name, str) or not isinstance(text, str):
            raise ProtocolError("a stream message without a string name and text")
        size = _json_size(text)
        over = 0
        if size > self.budget.text:
            kept = _prefix(text, self.budget.text)
            over, text, size = size - _json_size(kept), kept, _json_size(kept)
        self.budget.text -= size
        if text:
            self._keep_stream(name, text, size)
        if over:
            self._drop(over, text=True)

    def _keep_stream(self, name: str, text: str, size: int) -> None:
        if self.clear_pending:
            self._replace_outputs()
        outputs, merging = self.cell.outputs, self._stream
        if merging is not None and outputs and outputs[-1] is merging and merging["name"] == name:
            self._pieces.append(text)
        elif self.budget.outputs <= 0:
            self._drop(size, text=True, output=True)
            return
        else:
            self.finish()
            self.budget.outputs -= 1
            self._stream, self._pieces = NotebookNode(output_type="stream", name=name, text=text), [text]
            outputs.append(self._stream)
        if self.on_output is not None:
            self.on_output(self.index, NotebookNode(output_type="stream", name=name, text=text))

    def _ensure_marker(self) -> None:
        """Put one truncation marker (filled in at the end) in this cell's outputs."""
        if self._marker is not None:
            return
        self.finish()
        self._marker = NotebookNode(output_type="stream", name="stderr", text="")
        self.budget.markers.append(self._marker)
        self.cell.outputs.append(self._marker)


def _json_size(text: str) -> int:
    """Bytes ``text`` takes in the notebook's JSON (a control character costs six): what keeping it costs."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


def _prefix(text: str, room: int) -> str:
    """The longest start of ``text`` whose JSON fits in ``room`` bytes (cut at an escape and UTF-8 boundary)."""
    encoded = json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")[1:room + 1]
    cut = encoded.decode("utf-8", "ignore")
    for end in range(len(cut), max(-1, len(cut) - 7), -1):  # an escape is at most six characters (\uXXXX)
        try:
            return str(json.loads('"' + cut[:end] + '"'))
        except ValueError:
            continue
    return ""


def _text_size(data: dict[str, Any]) -> int:
    """What the text of a rich output costs the text allowance (its text views repeat it): its JSON size."""
    return sum(_json_size(v if isinstance(v, str) else v.text if isinstance(v, verbatim.KEPT)
                          else json.dumps(v, check_circular=False)) for k, v in data.items()
               if k.startswith("text/") and k != "text/html")


def _copies(data: dict[str, Any], metadata: dict[str, Any]) -> int:
    """Bytes the texts of a display's verbatim values hold (a second copy of what was parsed)."""
    return sum(sys.getsizeof(v.text) for v in (*data.values(), *metadata.values()) if isinstance(v, verbatim.KEPT))


def _bundle(content: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    data, metadata = content.get("data", {}), content.get("metadata", {})
    if not isinstance(data, dict) or not isinstance(metadata, dict):
        raise ProtocolError("a display message whose data or metadata is not a JSON object")
    if max(len(content), len(data), len(metadata)) > MAX_MEMBERS:  # each costs Python code; none is kept verbatim
        raise ProtocolError(f"a display message with more than {MAX_MEMBERS} members in its content, data or "
                            "metadata")
    return data, metadata


def _display_id(content: dict[str, Any]) -> str | None:
    # `transient` may be missing or null (nbclient keeps the same scar); anything else odd is ignored too.
    transient = content.get("transient")
    display_id = transient.get("display_id") if isinstance(transient, dict) else None
    return display_id if isinstance(display_id, str) else None


def _error_output(content: dict[str, Any]) -> NotebookNode:
    ename, evalue, traceback = content.get("ename", ""), content.get("evalue", ""), content.get("traceback", [])
    if not isinstance(ename, str) or not isinstance(evalue, str) or not isinstance(traceback, list) \
            or not all(isinstance(line, str) for line in traceback):
        raise ProtocolError("an error message whose ename, evalue or traceback has the wrong type")
    ename, evalue, lines = outputs.trim_error(ename, evalue, traceback, MAX_ERROR)
    return from_dict({"output_type": "error", "ename": ename, "evalue": evalue, "traceback": lines})


def _described(run: Execution) -> dict[str, Any]:
    """The error of a cell whose error message could not be kept, from what the reply or the kernel said."""
    if run.error is not None and run.error.raised:
        return {"ename": run.error.ename, "evalue": run.error.evalue, "traceback": list(run.error.traceback)}
    size = f" ({run.errors_dropped:,} bytes)" if run.errors_dropped else ""
    return {"ename": "UnknownError", "traceback": [], "evalue": (
        f"The code raised an exception, but its error message{size} was larger than the whole output allowance "
        "and the kernel did not say what it was. Raise smaller errors, or raise max_output / max_display.")}


def tags(cell: NotebookNode) -> list[str]:
    tags = cell.get("metadata", {}).get("tags", [])
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def admit(config: SandboxConfig, kept: NotebookNode, new: NotebookNode, one_shot: bool = False) -> None:
    """ConfigError, before anything runs, for a cell of ``new`` too large to run (`cellsize.check`), or when running
    ``new`` in a session whose notebook is ``kept`` would take the notebook past `CODE_ALLOWANCE` bytes besides
    outputs (a one-shot run is one run: not checked)."""
    cellsize.check(config, new)
    if one_shot:
        return
    used = sum(_without_outputs(nb) for nb in (kept, new) if nb.cells or nb is new)
    if used > CODE_ALLOWANCE:
        raise ConfigError(
            f"this session's notebook would hold {used:,} bytes of code and metadata with this run, past the "
            f"{CODE_ALLOWANCE:,}-byte code allowance of a session (its outputs are trimmed, its code is kept for "
            "replay). Start a new session, and pass large data as a file rather than in the code.")


def _without_outputs(nb: NotebookNode) -> int:
    """Bytes of ``nb``'s JSON besides its outputs: its metadata and each cell's source and metadata."""
    size = len(json.dumps(nb.get("metadata", {}), ensure_ascii=False).encode())
    for cell in nb.cells:
        size += len(json.dumps({k: v for k, v in cell.items() if k != "outputs"}, ensure_ascii=False).encode())
    return size


def keep_recent(nb: NotebookNode, current: int, limit: int, displays: Displays) -> str | None:
    """Keep a session's notebook within ``limit`` bytes of outputs (their JSON and, past a message's allowance, the
    objects they hold parsed, as `Message.held` charges them): drop the outputs of its oldest cells, never those
    of the run that starts at cell ``current``, until the rest fits. Each emptied cell keeps a marker, and the
    display ids of dropped outputs are forgotten. A note for the run, or None when all fit."""
    def size(cell: NotebookNode) -> int:  # its JSON, and what its values hold parsed as a message is charged
        text = verbatim.encode(cell.get("outputs", []), levels=3).encode("utf-8", "surrogatepass")
        return len(text) + max(0, objects(text) - FREE_OBJECTS * len(cell.get("outputs", [])))

    earlier = [size(cell) for cell in nb.cells[:current]]
    if not any(earlier):  # nothing could be dropped: this run's outputs (within its budgets) are not measured
        return None
    sizes = earlier + [size(cell) for cell in nb.cells[current:]]
    total, dropped, gone = sum(sizes), 0, set[int]()
    for index in range(min(current, len(nb.cells))):
        if total <= limit:
            break
        if nb.cells[index].cell_type != "code" or not nb.cells[index].get("outputs"):
            continue
        gone.update(id(output) for output in nb.cells[index].outputs)
        nb.cells[index].outputs = [NotebookNode(output_type="stream", name="stderr", text=(
            f"\n[nbexec: this cell's outputs ({sizes[index]:,} bytes) were dropped from the session's notebook, "
            f"which keeps its latest {limit:,} bytes of outputs]\n"))]
        total, dropped = total - sizes[index], dropped + sizes[index]
    for display_id in [key for key, shown in displays.items() if any(id(o) in gone for o in shown)]:
        displays[display_id] = [o for o in displays[display_id] if id(o) not in gone]
    return (f"outputs of earlier cells ({dropped:,} bytes) were dropped from the session's notebook, which keeps "
            f"its latest {limit:,} bytes of outputs") if dropped else None
