"""The pure parser, on a stored executed notebook."""

from __future__ import annotations

import nbformat

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
