"""Papermill-style parameters: parse values, inject them as a cell after the one tagged `parameters`. Pure but for
`load_file`, which reads the YAML or JSON file it is given."""

from __future__ import annotations

import ast
import keyword
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from nbformat import NotebookNode, from_dict

from nbexec.errors import ConfigError

INJECTED_TAG = "injected-parameters"


def parse_value(raw: str) -> Any:
    """A Python literal (``3``, ``[1, 2]``, ``'x'``), else a YAML scalar or collection, else the text itself."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        pass
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return raw if value is None and raw.strip() not in ("null", "~", "") else value


def load_file(path: Path) -> dict[str, Any]:
    """Parameters from a YAML (or JSON) mapping file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"--parameters-file {path} does not exist") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--parameters-file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--parameters-file {path} must hold a mapping of names to values")
    return {str(k): v for k, v in data.items()}


def validate(parameters: Mapping[str, Any]) -> None:
    for name, value in parameters.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"parameter name {name!r} is not a Python identifier")
        try:
            ast.literal_eval(repr(value))
        except (ValueError, SyntaxError) as exc:
            raise ConfigError(f"parameter {name} has a value that cannot be written as a Python literal") from exc


def inject(nb: NotebookNode, parameters: Mapping[str, Any]) -> NotebookNode:
    """Insert a cell assigning ``parameters`` after the cell tagged `parameters` (or at the top), replacing a
    previously injected one, and record them in ``metadata.nbexec.parameters``."""
    if not parameters:
        return nb
    validate(parameters)
    source = "# Parameters\n" + "".join(f"{name} = {value!r}\n" for name, value in parameters.items())
    cell = from_dict({"cell_type": "code", "execution_count": None, "metadata": {"tags": [INJECTED_TAG]},
                      "outputs": [], "source": source.rstrip("\n"), "id": "injected-parameters"})
    cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    position = next((i + 1 for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])), 0)
    cells.insert(position, cell)
    nb.cells = cells
    nb.metadata.setdefault("nbexec", {})["parameters"] = dict(parameters)
    return nb
