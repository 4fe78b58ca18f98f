"""Every pass over sandbox text runs in linear time: each pathological shape, 1 MiB of it, costs under a second
of host CPU (`time.process_time()`, the CPU of this process, so a loaded machine does not flake it; the bound
is about ten times what a linear pass costs). The shapes are the worst cases of each pass: long runs of the
characters a loop strips one at a time, escapes that never end, many tiny matches, many tiny messages.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from nbformat import NotebookNode, v4

from nbexec.cli import render
from nbexec.engine import budget
from nbexec.errors import ProtocolError
from nbexec.integrations import tools
from nbexec.notebook import links, outputs
from nbexec.result import CellError, ExecutionResult, File, Image
from nbexec.sandbox.kernel import Execution, Message, dispatch
from nbexec.sandbox.messages import parse

MIB = 1024 * 1024
BOUND_S = 1.0
URLS = {"a": "https://store.example/a?sig=" + "s" * 200, "a.": "https://store.example/a-dot",
        **{"b" + "." * n: f"https://store.example/b{n}" for n in range(1, 200)}}
REFERENCE = "/mnt/data/a "


def _result(text: str = "", traceback: tuple[str, ...] = (), files: int = 0, outputs_: int = 0) -> ExecutionResult:
    error = CellError("KeyError", text[:65536], traceback, "exception", 0) if traceback else None
    return ExecutionResult(
        ok=error is None, execution_id="x", stdout=text, stderr=text, text=text, error=error,
        outputs=tuple({"output_type": "stream", "name": "stdout", "text": text[i::outputs_ or 1][:512]}
                      for i in range(outputs_)),
        images=tuple(Image("image/png", "/o/images/" + "\x1b[" * 100, 0, 1) for _ in range(files)),
        files=tuple(File("\x1b]" + "." * 200 + str(i), "/o/data/x", 1, "text/plain", "0" * 64) for i in range(files)),
        skipped_files=(), notebook=v4.new_notebook(), notebook_path=None, output_dir="/o", duration_s=0.0,
        timings={})


def _message(kind: str, content: Any) -> Message:
    raw = json.dumps(content).encode()
    return Message("iopub", kind, uuid.uuid4().hex, "p1", len(raw) + 2, raw)


def _feed(messages: list[Message], **allowance: int) -> Callable[[], Any]:
    """The cell loop's output rules, fed ``messages`` as the kernel client hands them over."""
    def run() -> NotebookNode:
        cell = NotebookNode(cell_type="code", source="", outputs=[], metadata={})
        state = budget.CellState(cell, 0, budget.Budget(**{"text": MIB, "display": 32 * MIB, "outputs": 2000,
                                                          **allowance}), None)
        execution = Execution()
        for message in messages:
            dispatch(message, execution, state.add)
        state.finish()
        return cell
    return run


def _refused(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse(raw, "test")


SHORT_STREAMS = [_message("stream", {"name": "stdout", "text": "0123456789" * 10})] * 20_000  # 2 MB, one output
TINY_STREAMS = [_message("stream", {"name": "stdout", "text": "0123456789"})] * 100_000
TINY_DISPLAYS = [_message("display_data", {"data": {"text/plain": "1"}, "metadata": {}})] * 100_000
DOTS = "." * MIB
SHAPES: list[tuple[str, Callable[[], Any]]] = [
    ("links-trailing-punctuation", lambda: links.rewrite("/mnt/data/a" + DOTS, URLS)),
    ("links-trailing-punctuation-many-names", lambda: links.rewrite("/mnt/data/b" + DOTS, URLS)),
    ("links-many-references", lambda: links.rewrite(REFERENCE * (MIB // len(REFERENCE)), URLS)),
    ("links-many-prefixes", lambda: links.rewrite("sandbox:" * (MIB // 8) + "/mnt/data/a", URLS)),
    ("links-percent-signs", lambda: links.rewrite("/mnt/data/" + "%" * MIB, URLS)),
    ("links-references-glued", lambda: links.rewrite("/mnt/data/a" * (MIB // 11), URLS)),
    ("ansi-unterminated-csi", lambda: outputs.strip_ansi("\x1b[" + "0" * MIB)),
    ("ansi-unterminated-osc", lambda: outputs.strip_ansi("\x1b]" + "x" * MIB)),
    ("ansi-escape-starts", lambda: outputs.strip_ansi("\x1b[" * (MIB // 2))),
    ("ansi-osc-starts", lambda: outputs.strip_ansi("\x1b]" * (MIB // 2))),
    ("clean-control-characters", lambda: outputs.clean("\x00\x9b" * (MIB // 2))),
    ("clean-lone-surrogates", lambda: outputs.clean("\ud800" * MIB)),
    ("clean-carriage-returns", lambda: outputs.clean("\r" * MIB)),
    ("trim-many-traceback-lines", lambda: outputs.trim_error("E", "v", ["File x\n"] * (MIB // 7), 64 * 1024)),
    ("trim-one-long-line", lambda: outputs.trim_error("E" * MIB, "v" * MIB, ["x" * MIB], 64 * 1024)),
    ("views-many-outputs", lambda: outputs.views([{"output_type": "stream", "name": "stdout",
                                                   "text": "\x1b[1mx\x00" * 64}] * 2000)),
    ("llm-render-escapes", lambda: tools.render_for_llm(_result("\x1b[" + "1" * MIB, ("\x1b[" * 1000,)))),
    ("llm-render-many-frames", lambda: tools.render_for_llm(_result("t", ("Cell In[1]\n",) * (MIB // 11)))),
    ("llm-render-many-library-frames", lambda: tools.render_for_llm(_result("t", ("File x\n",) * (MIB // 7)))),
    ("llm-render-files", lambda: tools.render_for_llm(_result("t", files=1000))),
    ("terminal-render", lambda: render.for_terminal(_result("\x00" * MIB, ("x",), files=1000, outputs_=2000))),
    ("terminal-error", lambda: render.error_text(_result("t", ("\x1b[0m\x00" * 100,) * (MIB // 600)))),
    ("parse-surrogates", lambda: parse(b'{"t": "' + b"\\ud800" * (MIB // 6) + b'"}', "test")),
    ("parse-nesting", lambda: _refused(b"[" * MIB + b"]" * MIB)),
    ("cell-short-streams-merged", _feed(SHORT_STREAMS, text=4 * MIB)),
    ("cell-tiny-displays-past-the-count", _feed(TINY_DISPLAYS)),
    ("cell-tiny-streams-past-the-budget", _feed(TINY_STREAMS, text=1000)),
]


@pytest.mark.parametrize("shape", [s[1] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_linear_time(shape: Callable[[], Any]) -> None:
    started = time.process_time()
    shape()
    spent = time.process_time() - started
    assert spent < BOUND_S, f"{spent:.2f} s of CPU"


def test_link_rewriting_is_bounded_in_size() -> None:
    """A reference costs a dozen characters and its URL hundreds: the rewritten text grows by at most its own
    length plus 1 MiB (references past that are left as they are); a short text still gets its long links."""
    text = REFERENCE * (MIB // len(REFERENCE))
    rewritten = links.rewrite(text, URLS)
    assert URLS["a"] in rewritten and len(rewritten) <= 2 * len(text) + links.GROWTH, len(rewritten)
    assert links.rewrite("see /mnt/data/a!", URLS) == f"see {URLS['a']}!"


def test_link_rewriting_keeps_its_meaning() -> None:
    assert links.rewrite("see /mnt/data/a.. and /mnt/data/b..., /mnt/data/c.", URLS) == (
        f"see {URLS['a.']}. and {URLS['b...']}, /mnt/data/c.")
    assert links.rewrite("(sandbox:/mnt/data/a%2E)", URLS) == f"({URLS['a.']})"
