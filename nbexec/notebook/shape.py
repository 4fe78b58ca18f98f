"""Whether parsed JSON has a notebook's shape at all, checked before nbformat converts or validates it (its errors
for a stray JSON file speak of versions and attributes). Pure."""

from __future__ import annotations

from typing import Any

NEEDS = ('a notebook is a JSON object with "nbformat": 4, "metadata" and a list of "cells", each an object with a '
         '"cell_type" and a "source"')


def problem(document: Any) -> str:
    """What keeps ``document`` from being a notebook ("" when its shape is one's: nbformat validates the rest)."""
    if not isinstance(document, dict):
        return f"its JSON is {type(document).__name__ if document is not None else 'null'}, not an object"
    version = document.get("nbformat")
    if version is None:
        return 'it has no "nbformat" version'
    if version == 3:
        sheets = document.get("worksheets")
        if not isinstance(sheets, list) or not all(isinstance(s, dict) for s in sheets):
            return 'its "worksheets" is not a list of objects'
        return next((f"worksheet {i}: {p}" for i, s in enumerate(sheets) if (p := _cells(s.get("cells", [])))), "")
    if version != 4:
        return f'its "nbformat" is {str(version)[:20]!r}; nbexec reads versions 4 and 3'
    return _cells(document.get("cells"))


def _cells(cells: Any) -> str:
    if not isinstance(cells, list):
        return 'it has no list of "cells"'
    for index, cell in enumerate(cells):
        if not isinstance(cell, dict):
            return f"cell {index} is a {type(cell).__name__}, not an object"
        if not isinstance(cell.get("cell_type"), str):
            return f'cell {index} has no "cell_type"'
    return ""
