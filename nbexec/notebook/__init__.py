"""Turn code, a `# %%` script or an .ipynb file into a validated nbformat v4 notebook."""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode, from_dict
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_raw_cell

from nbexec import languages
from nbexec.errors import ConfigError, NotebookError
from nbexec.languages import Language

from . import shape, verbatim

_CELL_TYPE = re.compile(r"\[(markdown|md|raw)\]")
_TAGS = re.compile(r"tags\s*=\s*(\[[^\]]*\])")


def _finish(nb: NotebookNode, language: Language, *, validate: bool = True) -> NotebookNode:
    nb.metadata["kernelspec"] = language.spec
    # nbexec's own metadata is nbexec's to write: a notebook from a client may carry any value there
    for holder in (nb, *nb.get("cells", [])):
        metadata = holder.get("metadata") if isinstance(holder, dict) else None
        if isinstance(metadata, dict) and not isinstance(metadata.get("nbexec", {}), dict):
            metadata["nbexec"] = {}
    info = nb.metadata.get("language_info")
    if not isinstance(info, dict) or str(info.get("name", "")).lower() != language.info.lower():
        nb.metadata["language_info"] = {"name": language.info}  # the kernel's own replaces it once it answers
    if not validate:
        return nb
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        raise NotebookError(f"The notebook is not valid nbformat v4: {exc.message}") from exc
    return nb


def language_of(nb: NotebookNode) -> Language:
    """The language ``nb``'s kernelspec names (python when it names none); NotebookError for one nbexec does not
    run, or a kernelspec that is not an object."""
    spec = nb.get("metadata", {}).get("kernelspec")
    if spec is None:
        return languages.LANGUAGES["python"]
    try:
        return languages.of_kernelspec(spec)
    except ConfigError as exc:
        raise NotebookError(str(exc)) from exc


def build(code: str, language: str = "python") -> NotebookNode:
    """A one-cell notebook that runs ``code`` in ``language`` (a name or an alias; ConfigError otherwise)."""
    return build_cells([code], language)


def build_cells(sources: Sequence[str], language: str = "python") -> NotebookNode:
    """A notebook of one code cell per source, in order (blank ones are skipped when it runs)."""
    lang = languages.get(language)
    for code in sources:
        if not isinstance(code, str):
            raise NotebookError(f"code must be a string, got {type(code).__name__}")
    if not any(code.strip() for code in sources):
        raise NotebookError("There is no code to run: the input is empty.")
    # Built by hand and known valid: skipping jsonschema here saves a few ms on every call.
    taken: set[str] = set()
    cells: list[dict[str, Any]] = [{"id": new_id(taken), "cell_type": "code", "metadata": {},
                                    "execution_count": None, "outputs": [], "source": code} for code in sources]
    nb = from_dict({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells})
    return _finish(nb, lang, validate=False)


def _marker_cell(marker: str, lines: list[str], comment: str) -> NotebookNode | None:
    rest = marker
    tags: list[str] = []
    tag_match = _TAGS.search(rest)
    if tag_match:
        try:
            tags = [str(t) for t in json.loads(tag_match.group(1))]
        except json.JSONDecodeError as exc:
            raise NotebookError(f"Bad cell tags in `{comment} %%{marker}`: {exc.msg}; write tags=[\"name\", ...]"
                                ) from exc
    type_match = _CELL_TYPE.search(rest)
    source = "\n".join(lines).strip("\n")
    if type_match and type_match.group(1) in ("markdown", "md"):
        prefix = re.compile(f"^{re.escape(comment)} ?")
        source = "\n".join(prefix.sub("", line) for line in source.splitlines())
        cell = new_markdown_cell(source)
    elif type_match:
        cell = new_raw_cell(source)
    else:
        if not source.strip() and not tags:
            return None
        cell = new_code_cell(source)
    if tags:
        cell.metadata["tags"] = tags
    return cell


def empty(language: str = "python") -> NotebookNode:
    """A notebook with no cells (a session's before its first run)."""
    return _finish(from_dict({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}),
                   languages.get(language), validate=False)


def from_script(text: str, language: str = "python") -> NotebookNode:
    """A notebook from source in ``language``: one code cell, or one cell per `# %%` block (percent format;
    `// %%` in TypeScript/JavaScript)."""
    lang = languages.get(language)
    marker_line = re.compile(f"^{re.escape(lang.comment)}\\s*%%(?P<rest>.*)$")
    cells: list[NotebookNode] = []
    marker: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        match = marker_line.match(line)
        if match:
            cell = _marker_cell(marker or "", lines, lang.comment) \
                if marker is not None or "\n".join(lines).strip() else None
            if cell is not None:
                cells.append(cell)
            marker, lines = match.group("rest"), []
        else:
            lines.append(line)
    cell = _marker_cell(marker or "", lines, lang.comment)
    if cell is not None:
        cells.append(cell)
    if not any(c.cell_type == "code" and c.source.strip() for c in cells):
        raise NotebookError("There is no code to run: the script is empty.")
    return _finish(new_notebook(cells=cells), lang)


def from_json(text: str, name: str = "<notebook>", language: str | None = None) -> NotebookNode:
    """Parse and validate an .ipynb document: nbformat 4 keeps its minor version (an older one gets no cell ids,
    a 4.5 one missing some gets them), nbformat 3 is upgraded (to 4.5, with ids), as papermill reads them. Its
    kernelspec chooses the language (python when it has none) unless ``language`` is given."""
    try:
        nb = nbformat.reader.reads(text)
        if nb.get("nbformat") == 3:  # nbformat's own v3 test files may lack it; its converter needs it
            nb.setdefault("metadata", NotebookNode())
        nb = nbformat.convert(nb, 4)
    except (json.JSONDecodeError, nbformat.reader.NotJSONError) as exc:
        raise NotebookError(f"{name} is not valid notebook JSON: {exc}") from exc
    except Exception as exc:  # nbformat raises several kinds for malformed documents
        _not_a_notebook(text, name)
        raise NotebookError(f"{name} is not a valid notebook: {exc}") from exc
    if has_ids(nb):
        _add_missing_ids(nb.cells)
    try:
        lang = language_of(nb) if language is None else languages.get(language)
    except NotebookError as exc:
        raise NotebookError(f"{name}: {exc}") from exc
    return _finish(nb, lang)


def _not_a_notebook(text: str, name: str) -> None:
    """NotebookError saying what a document nbformat refused lacks, when it lacks a notebook's very shape."""
    try:
        found = shape.problem(json.loads(text))
    except (ValueError, RecursionError):  # nbformat's own error says enough
        return
    if found:
        raise NotebookError(f"{name} is not a notebook: {found} ({shape.NEEDS}).")


def has_ids(nb: NotebookNode) -> bool:
    """Whether ``nb``'s version has cell ids (nbformat 4.5 and later): older ones forbid them."""
    return (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5)


def new_id(taken: set[str]) -> str:
    """A cell id no cell in ``taken`` has (and now taken)."""
    while True:
        cell_id = uuid.uuid4().hex[:8]
        if cell_id not in taken:
            taken.add(cell_id)
            return cell_id


def _add_missing_ids(cells: list[NotebookNode]) -> None:
    """Give each cell without an id a fresh one (what nbformat would do with a warning)."""
    taken = {c["id"] for c in cells if isinstance(c.get("id"), str)}
    for cell in cells:
        if not isinstance(cell.get("id"), str):
            cell["id"] = new_id(taken)


def fit_cells(nb: NotebookNode, cells: list[NotebookNode]) -> list[NotebookNode]:
    """``cells`` made fit to be appended to ``nb``: without ids below nbformat 4.5, with ids unique in it from 4.5."""
    if not has_ids(nb):
        for cell in cells:
            cell.pop("id", None)
        return cells
    taken = {c.get("id") for c in nb.cells if isinstance(c.get("id"), str)}
    for cell in cells:  # the same notebook run twice: cell ids stay unique
        if not isinstance(cell.get("id"), str) or cell["id"] in taken:
            cell["id"] = new_id(taken)
        taken.add(cell["id"])
    return cells


def _read_text(path: Path) -> str:
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except FileNotFoundError as exc:
        raise NotebookError(f"{path} does not exist.") from exc
    except IsADirectoryError as exc:
        raise NotebookError(f"{path} is a directory; give a script (.py, .R, .ts, .js, .sh) or an .ipynb file."
                            ) from exc
    except OSError as exc:
        raise NotebookError(f"Cannot read {path}: {exc.strerror}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotebookError(
            f"{path} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); save it as UTF-8."
        ) from exc


def load(path: str | Path, language: str | None = None, *, default: str = "python") -> NotebookNode:
    """Read a script, an .ipynb notebook, or ``-`` (stdin: a notebook if it parses as one, else a script). A
    notebook's kernelspec, a script's extension (.R, .ts, .sh ...; else ``default``) choose the language, unless
    ``language`` is given."""
    path = Path(path)
    text = _read_text(path)
    if path.suffix == ".ipynb" or (str(path) == "-" and text.lstrip().startswith("{")):
        nb = from_json(text, str(path), language)
    else:
        by_extension = languages.for_extension(path.suffix)
        nb = from_script(text, language or (by_extension.name if by_extension else default))
    nb.metadata.setdefault("nbexec", {})["input_path"] = str(path)  # papermill's input_path (see `papermill`)
    return nb


PATH_SUFFIXES = (".ipynb", ".py")  # a one-line str ending so names a file (see `is_path`)


def is_path(text: str) -> bool:
    """The rule for a str given as a source: one line ending in .ipynb or .py (any case) is a path, as papermill
    takes it; anything else is code. No such line is meaningful code, so a file name is never run as code."""
    return "\n" not in text and "\r" not in text and text.lower().endswith(PATH_SUFFIXES)


def _named(text: str, language: str | None, default: str) -> NotebookNode:
    if not Path(text).is_file():
        raise NotebookError(f"{text!r} names no file (from {Path.cwd()}): a one-line str ending in .ipynb or .py "
                            "is taken as a path, never as code. Give an existing file, or pass code with a newline.")
    return load(Path(text), language, default=default)


def coerce(source: Any, language: str | None = None, *, default: str = "python") -> NotebookNode:
    """A notebook from code (str: in ``language``, else ``default``), a path (os.PathLike, or a str by `is_path`),
    or a notebook (NotebookNode or dict; copied). A path or a notebook says its own language unless ``language``
    is given."""
    if isinstance(source, str):
        return _named(source, language, default) if is_path(source) else build(source, language or default)
    if isinstance(source, Path) or hasattr(source, "__fspath__"):
        return load(Path(source), language, default=default)
    if isinstance(source, dict):
        return from_json(json.dumps(source), language=language)
    raise NotebookError(f"Cannot run a {type(source).__name__}: pass code (str), a path, or a notebook.")


def source(nb: Any, *, default: str = "python") -> NotebookNode:
    """What Session.run_notebook runs: a NotebookNode as it is (not copied), else ``coerce``'s notebook."""
    return nb if isinstance(nb, NotebookNode) else coerce(nb, default=default)


LEVELS = 6  # from a notebook down to a display's values: cells, a cell, outputs, an output, its data
_INDENTED = 20_000  # containers (brackets, counted in the compact text) up to which a notebook is indented


def dumps(nb: NotebookNode) -> bytes:
    """The notebook as .ipynb bytes, without re-validating what nbexec built: nbformat's layout (indented) when it
    is small, else compact. Indenting runs json's encoder in Python, a few microseconds per container: 10 s of host
    CPU per MiB of deeply nested display data, where the compact C encoder takes a fraction of one."""
    text = verbatim.encode(nb, levels=LEVELS, sort_keys=True)  # large display values as they came
    if text.count("[") + text.count("{") <= _INDENTED:
        text = json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False)
    return (text + "\n").encode("utf-8", "surrogatepass")
