"""The pure parser, on a stored executed notebook."""

from __future__ import annotations

import nbformat
import pytest

from nbexec.notebook import outputs

from .conftest import FILES


def _flat() -> list[dict]:
    nb = nbformat.read(FILES / "executed_error.ipynb", as_version=4)
    return outputs.flatten(nb)


def test_views_keep_order_and_results() -> None:
    view = outputs.views(_flat())
    assert view.stdout == "hello\n"
    assert view.stderr == "warn\n"
    assert view.text == "hello\nwarn\n42\n<IPython.core.display.HTML object>\n"


def test_error_has_clean_traceback_and_cell_index() -> None:
    error = outputs.first_error(_flat())
    assert error is not None
    assert (error.ename, error.kind, error.cell_index) == ("ValueError", "exception", 3)
    assert error.evalue == "bad red value"
    assert not any("\x1b" in line for line in error.traceback)
    assert "raise ValueError" in error.traceback_text


def test_images_are_decoded() -> None:
    images = list(outputs.images(_flat()))
    assert [(i.cell_index, i.mime) for i in images] == [(2, "image/png")]
    assert images[0].content.startswith(b"\x89PNG\r\n\x1a\n")


def test_flatten_from_a_cell_on() -> None:
    nb = nbformat.read(FILES / "executed_error.ipynb", as_version=4)
    assert {o["cell_index"] for o in outputs.flatten(nb, start=2)} == {2, 3}


def test_strip_ansi() -> None:
    assert outputs.strip_ansi("\x1b[0;31mred\x1b[0m \x1b]0;title\x07ok") == "red ok"


# -- exact edges (each case pins a boundary a one-character change of the code would move) ----------------------

def test_clip_keeps_text_that_fits_and_cuts_at_character_boundaries() -> None:
    assert outputs._clip("a" * 100, 100) == "a" * 100  # exactly at the limit: kept whole
    assert outputs._clip("a" * 101, 100) != "a" * 101
    # 400 bytes into 204: room 124, the head gets 93 bytes (46 whole "é"), the tail 31 (15 whole), 278 cut
    assert outputs._clip("é" * 200, 204) == "é" * 46 + "\n[nbexec: 278 bytes trimmed]\n" + "é" * 15
    assert outputs._clip("a" * 300, 50) == "\n[nbexec: 300 bytes trimmed]\n"  # no room: the marker alone
    assert outputs._clip("ab" * 100, 84) == "aba" + "\n[nbexec: 196 bytes trimmed]\n" + "b"  # room 4: 3 + 1 bytes


def test_trim_traceback_keeps_the_first_line_and_the_last_frames_that_fit() -> None:
    lines = ["head"] + [f"{i:09d}x" for i in range(100)]  # 10 characters each: 11 bytes with the newline
    same = ["a" * 9] * 10
    assert outputs.trim_traceback(same, 400) is same  # fits with room to spare: handed back, not copied
    assert outputs.trim_traceback(same, 100) == same  # exactly the limit (10 lines of 10 bytes): kept whole
    # 500 bytes: 295 after the first line and the marker's allowance, so the last 26 lines (286 bytes)
    trimmed = outputs.trim_traceback(lines, 500)
    assert trimmed == ["head", "[nbexec: 74 traceback lines (740 bytes) trimmed]", *lines[-26:]]
    assert outputs.trim_traceback(same, 99) == ["a" * 9, "[nbexec: 9 traceback lines (81 bytes) trimmed]"]
    long = outputs.trim_traceback(["y" * 70_000] * 5, 340_000)  # past the quick check: each line clipped, all fit
    assert len(long) == 5 and all(len(line) <= 64 * 1024 and "bytes trimmed" in line for line in long)


def test_trim_error_shares_the_limit_between_name_value_and_traceback() -> None:
    ename, evalue, lines = outputs.trim_error("E" * 2000, "v" * 70_000, ["t" * 100] * 1000, 200_000)
    assert len(ename.encode()) <= 1024 and ename.startswith("E" * 700)
    assert len(evalue.encode()) <= 64 * 1024 and evalue.startswith("v" * 1000)
    assert sum(len(line) + 1 for line in lines) + len(ename) + len(evalue) <= 200_000
    assert outputs.trim_error("E", "v", ["t"], 100) == ("E", "v", ["t"])


def test_views_route_streams_and_skip_the_text_of_displayed_images() -> None:
    flat = [
        {"output_type": "stream", "name": "stdout", "text": ["a", "b\n"]},
        {"output_type": "stream", "name": "stdout"},  # no text at all: nothing, not "None"
        {"output_type": "stream", "name": "stdout", "text": 5},  # not text: shown as text, never a crash
        {"output_type": "display_data"},  # no data
        {"output_type": "stream", "name": "stderr", "text": "e\r\n"},
        {"output_type": "stream", "text": "unnamed\n"},  # not stdout: stderr
        {"output_type": "display_data", "data": {"image/png": "x", "text/plain": "<Figure>"}},
        {"output_type": "execute_result", "data": {"image/png": "x", "text/plain": "kept"}},
        {"output_type": "display_data", "data": {"text/plain": ["shown", "\n"]}},
        {"output_type": "update_display_data", "data": {"text/plain": "never"}},
        {"output_type": "error", "ename": "E"},
    ]
    view = outputs.views(flat)
    assert view == outputs.Views("ab\n5", "e\nunnamed\n", "ab\n5e\nunnamed\nkept\nshown\n")


def test_first_error_is_the_first_and_clean() -> None:
    flat = [{"output_type": "stream", "name": "stdout", "text": "x"},
            {"output_type": "error", "ename": "A\x1b[31m", "evalue": "v\x07", "traceback": ["\x1b[1mt\x00"],
             "cell_index": 4},
            {"output_type": "error", "ename": "B", "evalue": "w", "traceback": [], "cell_index": 5}]
    error = outputs.first_error(flat)
    assert error == outputs.CellError(ename="A", evalue="v\\x07", traceback=("t\\x00",), kind="exception",
                                      cell_index=4)
    bare = outputs.first_error([{"output_type": "error"}])
    assert bare is not None and (bare.ename, bare.evalue, bare.traceback, bare.cell_index) == ("", "", (), None)
    assert outputs.first_error(flat[:1]) is None


@pytest.mark.parametrize(("first", "kept"), [
    ("Error in g(): deep\nTraceback:\n", "Error in g(): deep"),  # IRkernel's header dropped
    ("Error in g(): deep\n", "Error in g(): deep\n"),  # no header: as it came
    ("Traceback:\n", "Traceback:\n"),  # only a header, no message before it: kept
    ("x\nTraceback:\ny", "x\nTraceback:\ny"),  # a header inside the text is the code's text
])
def test_an_r_traceback_loses_only_irkernels_header(first: str, kept: str) -> None:
    error = outputs.first_error([{"output_type": "error", "ename": "ERROR", "evalue": "deep",
                                  "traceback": [first, "1. f()", "2. g()   # at line 1 of file <text>"]}])
    assert error is not None and error.traceback == (kept, "1. f()", "2. g()   # at line 1 of file <text>")


def test_images_take_the_first_type_of_each_display_and_skip_undecodable_data() -> None:
    flat = [
        {"output_type": "display_data", "cell_index": 1, "data": {"image/png": ["iVBO", "Rw=="]}},
        {"output_type": "execute_result", "cell_index": 2, "data": {"image/svg+xml": "<svg>é</svg>",
                                                                     "image/png": "iVBORw=="}},
        {"output_type": "display_data", "cell_index": 3, "data": {"image/jpeg": "a"}},  # bad padding: skipped
        {"output_type": "stream", "cell_index": 4, "data": {"image/png": "iVBORw=="}},
        {"output_type": "display_data", "cell_index": 5, "data": {"image/gif": "R0lG", "text/plain": "x"}},
        {"output_type": "display_data", "cell_index": 6, "data": {"image/png": "a", "image/gif": "R0l\nG"}},
        {"output_type": "display_data", "cell_index": 7},
    ]
    found = [(i.cell_index, i.mime, i.extension, i.content) for i in outputs.images(flat)]
    assert found == [(1, "image/png", "png", b"\x89PNG"), (2, "image/png", "png", b"\x89PNG"),
                     (5, "image/gif", "gif", b"GIF"), (6, "image/gif", "gif", b"GIF")]  # a bad png: the next type
    svg = outputs.images([{"output_type": "display_data", "cell_index": 0, "data": {"image/svg+xml": "<svg>é</svg>"}}])
    assert [(i.mime, i.extension, i.content) for i in svg] == [("image/svg+xml", "svg", "<svg>é</svg>".encode())]


def test_clean_makes_every_control_visible_and_keeps_line_breaks() -> None:
    assert outputs.clean("a\r\nb\rc\td\n") == "a\nb\nc\td\n"
    assert outputs.clean("\x00\x07\x1f\x7f\x9f\x80") == "\\x00\\x07\\x1f\\x7f\\x9f\\x80"
    assert outputs.clean("x\ud800y\udfff") == "x\ufffdy\ufffd"
    assert outputs.clean("\x1b[1;31mred\x1b[0m \x1b]0;t\x1b\\ \x1bMz") == "red  z"


def test_flatten_skips_other_cells_and_gives_plain_values() -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("0"),
        nbformat.v4.new_code_cell("1", outputs=[nbformat.v4.new_output("stream", name="stdout", text="one")]),
        nbformat.v4.new_code_cell("2", outputs=[nbformat.v4.new_output("execute_result", data={"text/plain": "2"})]),
    ])
    del nb.cells[0]["outputs"]  # an .ipynb may omit them
    assert [o["cell_index"] for o in outputs.flatten(nb)] == [1, 2]
    nb.cells.insert(1, nbformat.v4.new_markdown_cell("m"))
    flat = outputs.flatten(nb, start=1)
    assert [o["cell_index"] for o in flat] == [2, 3] and type(flat[1]["data"]) is dict
    assert outputs.flatten(nb, start=3) == [{"cell_index": 3, "output_type": "execute_result",
                                             "data": {"text/plain": "2"}, "metadata": {}, "execution_count": None}]
