"""Read an executed notebook's outputs into the result's views. Pure: no I/O, tested on stored notebooks."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nbformat import NotebookNode

from nbexec.result import CellError

IMAGE_TYPES = {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg", "image/gif": "gif"}
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_R_HEADER = "\nTraceback:\n"  # what IRkernel ends an error's first traceback line with
_MAX_ERROR_LINE = 64 * 1024  # bytes of one traceback line or of an error's value
# Any terminal control left after the escapes: C0 but tab and newline, DEL, C1, and lone surrogates (which no
# UTF-8 encoder accepts). \r is handled first: as a line break, so progress lines stay readable.
_CONTROLS = (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))
# One pass in C (str.translate), where a regex with a function per match cost 0.4 s of CPU per MiB of controls.
_SHOWN = {**{c: f"\\x{c:02x}" for c in _CONTROLS}, **{c: "\ufffd" for c in range(0xD800, 0xE000)}}


def strip_ansi(text: str) -> str:
    """Remove terminal colour and cursor escapes."""
    return _ANSI.sub("", text)


def clean(text: str) -> str:
    """Text safe to show on a terminal: escapes removed, other control characters made visible (``\\x07``)."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return text.translate(_SHOWN)


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def flatten(nb: NotebookNode, start: int = 0) -> list[dict[str, Any]]:
    """Every output of the code cells from ``start`` on, in order, each a plain dict with its ``cell_index``."""
    flat = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or index < start:
            continue
        for output in cell.get("outputs", []):
            item = {"cell_index": index, **_plain(output)}
            flat.append(item)
    return flat


def _plain(value: Any) -> Any:
    """Nodes made plain; a display's parsed JSON values are shared as they are (a walk in Python costs a second of
    host CPU per MiB of small lists)."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, NotebookNode) else value


@dataclass(frozen=True)
class Views:
    stdout: str
    stderr: str
    text: str


def views(outputs: Iterable[dict[str, Any]]) -> Views:
    """The stdout, stderr and human-readable text of a list of flattened outputs."""
    stdout: list[str] = []
    stderr: list[str] = []
    text: list[str] = []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            chunk = clean(_text(output.get("text", "")))
            (stdout if output.get("name") == "stdout" else stderr).append(chunk)
            text.append(chunk)
        elif kind in ("execute_result", "display_data"):
            data = output.get("data", {})
            if "text/plain" in data and (kind == "execute_result" or not any(m in data for m in IMAGE_TYPES)):
                plain = clean(_text(data["text/plain"]))
                text.append(plain if plain.endswith("\n") else plain + "\n")
    return Views("".join(stdout), "".join(stderr), "".join(text))


def first_error(outputs: Iterable[dict[str, Any]]) -> CellError | None:
    """The first error output as a CellError (kind "exception"), or None."""
    for output in outputs:
        if output.get("output_type") == "error":
            return CellError(
                ename=clean(str(output.get("ename", ""))),
                evalue=clean(str(output.get("evalue", ""))),
                traceback=_without_header([clean(str(line)) for line in output.get("traceback", [])]),
                kind="exception",
                cell_index=output.get("cell_index"),
            )
    return None


@dataclass(frozen=True)
class ImageData:
    cell_index: int
    mime: str
    extension: str
    content: bytes


def images(outputs: Iterable[dict[str, Any]]) -> Iterator[ImageData]:
    """The decoded images of display and result outputs; undecodable data is skipped."""
    for output in outputs:
        if output.get("output_type") not in ("display_data", "execute_result"):
            continue
        for mime, extension in IMAGE_TYPES.items():
            value = output.get("data", {}).get(mime)
            if value is None:
                continue
            raw = _text(value)
            try:
                content = raw.encode("utf-8") if mime == "image/svg+xml" else base64.b64decode(raw, validate=False)
            except (binascii.Error, ValueError):
                continue
            yield ImageData(output["cell_index"], mime, extension, content)
            break


def _without_header(lines: list[str]) -> tuple[str, ...]:
    """A traceback without IRkernel's header: its first line is "Error in f(): deep\nTraceback:\n"."""
    if lines and lines[0].endswith(_R_HEADER):
        lines[0] = lines[0][:-len(_R_HEADER)]
    return tuple(lines)


def trim_error(ename: str, evalue: str, traceback: list[str], limit: int) -> tuple[str, str, list[str]]:
    """An error's name, value and traceback within ``limit`` bytes together (markers say what was cut)."""
    ename, evalue = _clip(ename, 1024), _clip(evalue, _MAX_ERROR_LINE)
    return ename, evalue, trim_traceback(traceback, limit - _size(ename) - _size(evalue))


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _clip(text: str, limit: int) -> str:
    """``text`` within ``limit`` bytes: its head and tail around a marker."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    room = max(0, limit - 80)
    head = data[: room * 3 // 4].decode("utf-8", "ignore")
    tail = data[len(data) - room // 4:].decode("utf-8", "ignore") if room // 4 else ""
    cut = len(data) - _size(head) - _size(tail)
    return f"{head}\n[nbexec: {cut:,} bytes trimmed]\n{tail}"


def trim_traceback(lines: list[str], limit: int) -> list[str]:
    """The traceback within ``limit`` bytes (a line costs its size + 1): its first line and the last frames."""
    if sum(len(line) + 1 for line in lines) <= limit // 4:  # fits whatever the encoding: no copies needed
        return lines
    lines = [_clip(line, _MAX_ERROR_LINE) for line in lines]
    if sum(_size(line) + 1 for line in lines) <= limit:
        return lines
    head, room = lines[:1], limit - 200 - sum(_size(line) + 1 for line in lines[:1])
    tail: list[str] = []
    for line in reversed(lines[1:]):
        if _size(line) + 1 > room:
            break
        tail.append(line)
        room -= _size(line) + 1
    tail.reverse()
    dropped = lines[1:len(lines) - len(tail)]
    marker = f"[nbexec: {len(dropped):,} traceback lines ({sum(map(_size, dropped)):,} bytes) trimmed]"
    return [*head, marker, *tail]
