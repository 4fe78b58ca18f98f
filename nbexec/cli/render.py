"""Results as text for people (the CLI). Pure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nbexec.notebook.outputs import IMAGE_TYPES, clean
from nbexec.result import ExecutionResult, Image


def _text(value: object) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _image_where(image: Image) -> str:
    uploaded = image.url and not image.url.startswith("file:")
    return clean(image.url if uploaded and image.url else image.path)


def _image_line(image: Image | None) -> str:
    return "[image]" if image is None else f"[image: {_image_where(image)}]"


def output_lines(output: dict[str, Any], images: Iterator[Image] | None = None) -> tuple[str, str]:
    """One output as (where, text): where is "stdout" or "stderr" (the code's stderr stream), or "" for
    outputs a terminal does not show (errors: the traceback is shown once, at the end). Images show as
    ``[image: path]`` (``[image]`` while it is not saved)."""
    kind = output.get("output_type")
    if kind == "stream":
        where = "stderr" if output.get("name") == "stderr" else "stdout"
        return where, clean(_text(output.get("text", "")))
    if kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        if any(mime in data for mime in IMAGE_TYPES):
            return "stdout", _image_line(next(images, None) if images is not None else None) + "\n"
        if "text/plain" in data:
            return "stdout", clean(_text(data["text/plain"])) + "\n"
    return "", ""


def for_terminal(result: ExecutionResult) -> str:
    """What a notebook would show, in order: text, ``[image: path]``, then files written and the error."""
    images = iter(result.images)
    shown = [(where, text.rstrip("\n")) for where, text in (output_lines(o, images) for o in result.outputs)]
    notes = summary_lines(result)
    return "\n".join([text for where, text in shown if where] + (["", *notes] if notes else []))


def summary_lines(result: ExecutionResult, *, images: bool = False) -> list[str]:
    """What a run left behind: images (when asked: a live view showed them as ``[image]``), files written,
    files not uploaded or not collected, dropped output."""
    lines: list[str] = []
    if images and result.images:
        lines.append("images:")
        lines.extend(f"  {_image_where(image)}" for image in result.images)
    if result.files:
        lines.append("files written to /mnt/data:")
        lines.extend(f"  {clean(f.name)} ({f.size:,} bytes) -> {clean(f.url or f.path)}" for f in result.files)
    failed = [u for u in result.uploads if u.status in ("failed", "skipped")]
    if failed:
        lines.append("not uploaded (kept on disk):")
        lines.extend(f"  {clean(u.name)}: {clean(u.reason or '')}" for u in failed)
    if result.skipped_files:
        lines.append("not collected:")
        lines.extend(f"  {clean(s.name)}: {clean(s.reason)}" for s in result.skipped_files)
    if result.truncated_bytes:
        lines.append(f"[output truncated: {result.truncated_bytes:,} bytes dropped]")
    return lines


def error_text(result: ExecutionResult) -> str:
    """The traceback (or the limit that stopped the run), for stderr."""
    error = result.error
    if error is None:
        return ""
    if error.traceback:
        return clean(error.traceback_text)
    return clean(f"{error.ename}: {error.evalue}")
