"""Reports of a batch for CI: JUnit XML for the test tab, HTML renders for people, a summary table."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import nbformat

from nbexec.notebook import viewer

from .batch import Item

_INVALID_XML = dict.fromkeys(c for c in range(32) if c not in (9, 10, 13))
# Passive markup kept in HTML outputs (pandas tables, text); bleach escapes every other tag and attribute.
_TAGS = frozenset({"a", "abbr", "b", "blockquote", "br", "caption", "code", "col", "colgroup", "dd", "div", "dl",
                   "dt", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "li", "ol", "p", "pre", "s", "small",
                   "span", "strong", "sub", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul"})
_ATTRIBUTES = {"*": ["class", "title"], "a": ["href", "title"], "table": ["border", "class"],
               "td": ["colspan", "rowspan", "align"], "th": ["colspan", "rowspan", "align"]}


def _clean(text: str) -> str:
    return text.translate(_INVALID_XML)


def junit_xml(items: list[Item], path: Path, *, suite: str = "nbexec") -> None:
    """One testcase per input: failures carry ename, evalue and the ANSI-free traceback; timeouts say so."""
    failures = sum(i.status in ("failed", "timeout") for i in items)
    errors = sum(i.status == "error" for i in items)
    skipped = sum(i.status == "skipped" for i in items)
    root = ET.Element("testsuites")
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(items)), failures=str(failures),
                         errors=str(errors), skipped=str(skipped), time=f"{sum(i.duration_s for i in items):.3f}")
    for item in items:
        case = ET.SubElement(node, "testcase", classname=suite, name=item.name, time=f"{item.duration_s:.3f}")
        error = item.result.error if item.result else None
        if item.status in ("failed", "timeout"):
            kind = "timeout" if item.status == "timeout" else error.ename if error else "InvalidInput"
            detail = (error.traceback_text or error.evalue) if error else item.message
            failure = ET.SubElement(case, "failure", type=kind, message=_clean(item.message))
            failure.text = _clean(detail)
        elif item.status == "error":
            ET.SubElement(case, "error", type="nbexec", message=_clean(item.message)).text = _clean(item.message)
        elif item.status == "skipped":
            ET.SubElement(case, "skipped", message=item.message)
        if item.result is not None and item.result.stdout:
            ET.SubElement(case, "system-out").text = _clean(item.result.stdout[-65536:])
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


# The report page: nbconvert's lab page without its scripts (require.js, MathJax, mermaid, the widget manager, all
# from CDNs), under a Content-Security-Policy placed first in <head> so it covers every later element.
_PAGE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head -%}
<meta http-equiv="Content-Security-Policy" content="POLICY">
<meta name="referrer" content="no-referrer">
<meta http-equiv="x-dns-prefetch-control" content="off">
<link rel="icon" href="data:,">
{{ super() }}
{%- endblock html_head -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
""".replace("POLICY", viewer.REPORT_POLICY)


def html(items: list[Item], folder: Path) -> list[Path]:
    """An HTML render (images embedded) of each executed notebook; returns the files written.

    Everything in the notebook is the sandbox's (or its author's): the page is made from `viewer.report_copy`
    (sources and text, markup and raster image outputs; no metadata, no widget state), nbconvert's SanitizeHTML
    (bleach) escapes unsafe tags and drops event handlers and javascript: links from HTML and Markdown, and the
    page runs no script and loads nothing but its own inline styles and data: images (`viewer.REPORT_POLICY`).
    """
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors.sanitize import SanitizeHTML

    exporter = HTMLExporter(extra_loaders=[DictLoader({"nbexec-report.html.j2": _PAGE})],
                            template_file="nbexec-report.html.j2", embed_images=False)
    exporter.register_preprocessor(SanitizeHTML(tags=sorted(_TAGS), attributes=_ATTRIBUTES), enabled=True)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for item in items:
        if item.result is None or not item.result.notebook_path:
            continue
        target = folder / f"{Path(item.result.output_dir).name}.html"
        nb = viewer.report_copy(nbformat.read(item.result.notebook_path, as_version=4))
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": target.stem}})
        target.write_text(body, encoding="utf-8")
        written.append(target)
    return written


def summary(items: list[Item], style: Callable[[str, str], str] = lambda status, text: text) -> str:
    """A plain table: file, status, duration, error; ``style(status, cell)`` may colour the status cells."""
    rows = [("file", "status", "duration", "error")]
    rows += [(i.name, i.status.upper(), f"{i.duration_s:.1f} s", i.message.splitlines()[0][:80] if i.message else "")
             for i in items]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    statuses = ["", *(i.status for i in items)]
    lines = ["  ".join((style(status, r[c].ljust(widths[c])) if c == 1 and status else r[c].ljust(widths[c]))
                       for c in range(3)) + "  " + r[3] for r, status in zip(rows, statuses, strict=True)]
    passed = sum(i.status == "passed" for i in items)
    lines.append(f"{passed} passed, {len(items) - passed} failed")
    return "\n".join(line.rstrip() for line in lines)
