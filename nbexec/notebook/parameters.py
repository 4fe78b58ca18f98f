"""Papermill-style parameters: parse values, inject them as a cell after the one tagged `parameters`. Pure but for
`load_file`, which reads the YAML or JSON file it is given."""

from __future__ import annotations

import ast
import base64
import binascii
import keyword
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from nbformat import NotebookNode, from_dict

from nbexec import notebook
from nbexec.errors import ConfigError

from . import assignments

INJECTED_TAG = "injected-parameters"


class _NoDates(yaml.SafeLoader):
    """YAML's safe loader with timestamps left as text (papermill's NoDatesSafeLoader): `2024-01-31` stays a string,
    as papermill injects it (a date object could not be written as a Python literal anyway)."""

    yaml_implicit_resolvers = {key: [r for r in resolvers if r[0] != "tag:yaml.org,2002:timestamp"]
                               for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_NoDates)  # a SafeLoader: builds plain values only


def parse_value(raw: str) -> Any:
    """A Python literal (``3``, ``[1, 2]``, ``'x'``), else a YAML scalar or collection, else the text itself."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        pass
    try:
        value = _yaml(raw)
    except yaml.YAMLError:
        return raw
    return raw if value is None and raw.strip() not in ("null", "~", "") else value


def _mapping(text: str, what: str) -> dict[str, Any]:
    """The parameters of a YAML (or JSON) mapping; ``what`` names where it came from in errors."""
    try:
        data = _yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a mapping of names to values (name: value), not a {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def load_file(path: Path) -> dict[str, Any]:
    """Parameters from a YAML (or JSON) mapping file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"--parameters-file {path} does not exist") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--parameters-file {path} is not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"--parameters-file {path} cannot be read: {exc.strerror}") from exc
    return _mapping(text, f"--parameters-file {path}")


def from_base64(text: str) -> dict[str, Any]:
    """Parameters from a base64-encoded YAML mapping (papermill's -b)."""
    try:
        decoded = base64.b64decode(text, validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"-b {text[:40]!r} is not valid base64 of UTF-8 YAML: {exc}") from exc
    return _mapping(decoded, "-b (decoded)")


def gather(*, base64_texts: Sequence[str] = (), files: Sequence[Path] = (), yaml_texts: Sequence[str] = (),
           pairs: Sequence[tuple[str, str]] = (), raw_pairs: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Parameters from every form papermill's command line takes, in its order (later wins): -b, -f, -y, -p
    (each value a Python or YAML literal), then -r (the value as given, a string)."""
    values: dict[str, Any] = {}
    for text in base64_texts:
        values.update(from_base64(text))
    for path in files:
        values.update(load_file(path))
    for text in yaml_texts:
        values.update(_mapping(text, f"-y {text[:40]!r}"))
    values.update({name: parse_value(raw) for name, raw in pairs})
    values.update(dict(raw_pairs))
    validate(values)
    return values


def validate(parameters: Mapping[str, Any]) -> None:
    for name, value in parameters.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"parameter name {name!r} is not a Python identifier")
        try:
            ast.literal_eval(repr(value))
        except (ValueError, SyntaxError) as exc:
            raise ConfigError(f"parameter {name} has a value that cannot be written as a Python literal") from exc


def inject(nb: NotebookNode, parameters: Mapping[str, Any]) -> NotebookNode:
    """Insert a cell assigning ``parameters`` (in the notebook's language, see `assignments`) after the cell tagged
    `parameters` (or at the top), replacing a previously injected one, and record them in
    ``metadata.nbexec.parameters``."""
    if not parameters:
        return nb
    validate(parameters)
    cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    tagged = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    source = assignments.render(notebook.language_of(nb), parameters, tagged.get("source", "") if tagged else "")
    cell = from_dict({"cell_type": "code", "execution_count": None, "metadata": {"tags": [INJECTED_TAG]},
                      "outputs": [], "source": source})
    if notebook.has_ids(nb):  # the cell follows the notebook's version: an id from nbformat 4.5 only
        taken = {c.get("id") for c in cells if isinstance(c.get("id"), str)}
        cell["id"] = INJECTED_TAG if INJECTED_TAG not in taken else notebook.new_id(taken)
    position = next((i + 1 for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])), 0)
    cells.insert(position, cell)
    nb.cells = cells
    nb.metadata.setdefault("nbexec", {})["parameters"] = dict(parameters)
    return nb
