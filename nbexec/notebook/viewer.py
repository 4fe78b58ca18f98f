"""What a notebook viewer is handed: widget state that loads only what viewers bundle, and a report copy that
names nothing outside itself.

A viewer of a saved notebook (JupyterLab, VS Code, nbviewer, the widget manager of an nbconvert page) loads the
JavaScript module each saved widget model names, from a CDN or a URL. It renders parts of the models' state as
markup. The code in the sandbox chose all of it.
So `widget_state` keeps a model only when its modules are @jupyter-widgets modules at the exact versions
ipywidgets 7 and 8 name, the ones viewers bundle. Its names must be identifiers, and nothing in it may make a
viewer fetch. An Image, Audio or Video widget in the "url" format drops the model. So does a style or layout value
that could fetch (``url(...)``, ``image-set(...)``, escapes, a second property). What a kept model renders as
markup becomes text (HTML values escaped, ``description_allow_html`` off). An Output widget keeps only text and
raster images, because viewers render its outputs as trusted.

`report_copy` is the notebook an HTML report is made from. It keeps the cells' sources and their text, markup and
raster image outputs, and none of the notebook's or the cells' metadata. The report carries `REPORT_POLICY`: it
loads nothing but its own inline styles and ``data:`` images, and runs no script. Pure: no I/O.
"""

from __future__ import annotations

import html
import re
from typing import Any

import nbformat
from nbformat import NotebookNode

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_MODULES: dict[str, frozenset[str]] = {  # module -> the versions ipywidgets 7.0-8.x name (viewers bundle them)
    "@jupyter-widgets/base": frozenset({"1.0.0", "1.1.0", "1.2.0", "2.0.0"}),
    "@jupyter-widgets/controls": frozenset({"1.0.0", "1.1.0", "1.2.0", "1.4.0", "1.5.0", "2.0.0"}),
    "@jupyter-widgets/output": frozenset({"1.0.0"}),
}
# No script-src (so no script at all, inline or not), nothing fetched but data: images and fonts, no <base>.
REPORT_POLICY = ("default-src 'none'; img-src data:; font-src data:; style-src 'unsafe-inline'; base-uri 'none'; "
                 "form-action 'none'")
REPORT_MIMES = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/gif")
RASTER = frozenset({"image/png", "image/jpeg", "image/gif"})
_OUTPUT_WIDGET_MIMES = frozenset({"text/plain", "application/vnd.jupyter.widget-view+json"} | RASTER)
_MARKUP_MODELS = frozenset({"HTMLModel", "HTMLMathModel"})  # their value is set as innerHTML by every viewer
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
_CSS_VALUE = re.compile(r"[\w\s#%.,+\-/()'\"]*")  # no escapes, no ';', no '@', no '{}', no ':'
_CSS_FUNCTION = re.compile(r"([\w-]*)\s*\(")
_CSS_FUNCTIONS = frozenset({"rgb", "rgba", "hsl", "hsla", "hwb", "calc", "var", "min", "max", "clamp", "repeat",
                            "minmax", "fit-content"})
_SHOWN_DROPS = 5


def widget_state(saved: Any) -> tuple[dict[str, Any], list[str]]:
    """The viewable part of a saved widget state (metadata.widgets[WIDGET_STATE]) and a note on what was dropped."""
    models = saved.get("state") if isinstance(saved, dict) else None
    models = models if isinstance(models, dict) else {}
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for model_id, model in models.items():
        problem = _problem(model)
        if problem:
            name = model.get("model_name") if isinstance(model, dict) else None
            dropped.append(f"{model_id!r:.40} ({name!r:.60}: {problem})")
        else:
            kept[model_id] = _tamed(model)
    versions = {key: saved[key] if isinstance(saved.get(key), int) else default
                for key, default in (("version_major", 2), ("version_minor", 0))} if isinstance(saved, dict) else {}
    notes = []
    if dropped:
        shown = "; ".join(dropped[:_SHOWN_DROPS]) + (f"; and {len(dropped) - _SHOWN_DROPS} more"
                                                       if len(dropped) > _SHOWN_DROPS else "")
        notes.append(f"nbexec dropped {len(dropped)} of {len(models)} widget models from the saved widget state, "
                     f"since a viewer would load or render what the code named: {shown}.")
    return {"version_major": 2, "version_minor": 0, **versions, "state": kept}, notes


def _problem(model: Any) -> str:
    """Why a viewer must not be handed ``model`` ("" when it may)."""
    values = model.get("state") if isinstance(model, dict) else None
    if not isinstance(values, dict):
        return "not a model with a state"
    for kind in ("model", "view"):
        module, version, name = (values.get(f"_{kind}_{part}") for part in ("module", "module_version", "name"))
        if kind == "view" and module is None and name is None:
            continue  # a model without a view (Link, a style's own view is named)
        if not isinstance(module, str) or not isinstance(version, str) or version not in WIDGET_MODULES.get(module,
                                                                                                         ()):
            return f"its {kind} module {module!r:.80} at {version!r:.40} is not a @jupyter-widgets module " \
                   "at a pinned version"
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            return f"its {kind} name {name!r:.60} is not an identifier"
    if str(values.get("format", "")).lower() == "url":
        return "it shows a URL the code chose"
    styled = values["_model_name"] == "LayoutModel" or values["_model_name"].endswith("StyleModel")
    if styled and not all(_css_safe(v) for k, v in values.items() if isinstance(v, str) and not k.startswith("_")):
        return "a style value could fetch a resource"
    if not _buffers_ok(model.get("buffers", [])):
        return "its buffers are not base64 data at key paths"
    return ""


def _css_safe(value: str) -> bool:
    return bool(_CSS_VALUE.fullmatch(value)) and all(
        function.lower() in _CSS_FUNCTIONS for function in _CSS_FUNCTION.findall(value))


def _buffers_ok(buffers: Any) -> bool:
    return isinstance(buffers, list) and all(
        isinstance(b, dict) and b.get("encoding") == "base64" and isinstance(b.get("data"), str)
        and isinstance(b.get("path"), list) and all(isinstance(p, str | int) for p in b["path"]) for b in buffers)


def _tamed(model: dict[str, Any]) -> dict[str, Any]:
    """The model with what a viewer would render as markup turned into text.

    Its top-level names are taken from its state, because viewers load the module the top level names."""
    values = dict(model["state"])
    if values["_model_name"] in _MARKUP_MODELS and isinstance(values.get("value"), str):
        values["value"] = html.escape(values["value"])
    if values.get("description_allow_html"):
        values["description_allow_html"] = False
    if "outputs" in values:
        values["outputs"] = _plain_outputs(values["outputs"], _OUTPUT_WIDGET_MIMES)
    entry = {"model_name": values["_model_name"], "model_module": values["_model_module"],
             "model_module_version": values["_model_module_version"], "state": values}
    if model.get("buffers"):
        entry["buffers"] = model["buffers"]
    return entry


def _plain_outputs(outputs: Any, mimes: frozenset[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """Outputs rebuilt from their known fields, display data limited to ``mimes`` (raster images base64 only)."""
    kept = []
    for output in outputs if isinstance(outputs, list) else []:
        rebuilt = _output(output, mimes) if isinstance(output, dict) else None
        if rebuilt is not None:
            kept.append(rebuilt)
    return kept


def _output(output: dict[str, Any], mimes: frozenset[str] | tuple[str, ...]) -> dict[str, Any] | None:
    kind = output.get("output_type")
    if kind == "stream":
        name = output.get("name") if output.get("name") in ("stdout", "stderr") else "stdout"
        return {"output_type": "stream", "name": name, "text": _text(output.get("text"))}
    if kind == "error":
        traceback = output.get("traceback")
        return {"output_type": "error", "ename": _text(output.get("ename")), "evalue": _text(output.get("evalue")),
                "traceback": [_text(line) for line in traceback] if isinstance(traceback, list) else []}
    if kind not in ("display_data", "execute_result") or not isinstance(output.get("data"), dict):
        return None
    data = {}
    for mime, value in output["data"].items():
        if mime not in mimes:
            continue
        if mime == "application/vnd.jupyter.widget-view+json":
            if isinstance(value, dict) and isinstance(value.get("model_id"), str):
                data[mime] = {"version_major": 2, "version_minor": 0, "model_id": value["model_id"]}
            continue
        text = _text(value, None)
        if text is not None and (mime not in RASTER or _BASE64.fullmatch(text)):
            data[mime] = text
    if not data:
        return None
    rebuilt: dict[str, Any] = {"output_type": kind, "metadata": {}, "data": data}
    if kind == "execute_result":
        count = output.get("execution_count")
        rebuilt["execution_count"] = count if isinstance(count, int) else None
    return rebuilt


def _text(value: Any, default: str | None = "") -> Any:
    """A str, or a list of str joined (nbformat's multi-line form); ``default`` for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, str) for part in value):
        return "".join(value)
    return default


def report_copy(nb: NotebookNode) -> NotebookNode:
    """The notebook a report is made from: sources and outputs a report may show, and no metadata."""
    cells = []
    for cell in nb.get("cells", []):
        source = _text(cell.get("source"))
        if cell.get("cell_type") == "markdown":
            copy = nbformat.v4.new_markdown_cell(source)
            attachments = {name: {mime: data for mime, data in item.items()
                                  if mime in RASTER and isinstance(data, str) and _BASE64.fullmatch(data)}
                           for name, item in (cell.get("attachments") or {}).items() if isinstance(item, dict)}
            if any(attachments.values()):
                copy.attachments = {name: item for name, item in attachments.items() if item}
        elif cell.get("cell_type") == "code":
            count = cell.get("execution_count")
            copy = nbformat.v4.new_code_cell(source, execution_count=count if isinstance(count, int) else None,
                                              outputs=[nbformat.from_dict(o) for o in
                                                       _plain_outputs(cell.get("outputs"), REPORT_MIMES)])
        elif cell.get("cell_type") == "raw" and (cell.get("metadata") or {}).get("raw_mimetype") == "text/html":
            copy = nbformat.v4.new_raw_cell(source, metadata={"raw_mimetype": "text/html"})  # sanitised as HTML
        else:
            continue  # a raw cell for another format: a report does not show it
        cells.append(copy)
    return nbformat.v4.new_notebook(cells=cells, metadata={"language_info": {"name": "python"}})
