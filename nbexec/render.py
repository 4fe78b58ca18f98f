"""Results as text for people (the CLI). Pure."""

from __future__ import annotations

from .outputs import IMAGE_TYPES, clean
from .result import ExecutionResult, Image


def _text(value: object) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _image_line(image: Image | None) -> str:
    if image is None:
        return "[image]"
    uploaded = image.url and not image.url.startswith("file:")
    return f"[image: {clean(image.url if uploaded and image.url else image.path)}]"


def for_terminal(result: ExecutionResult) -> str:
    """What a notebook would show, in order: text, ``[image: path]``, then files written and the error."""
    lines: list[str] = []
    images = iter(result.images)
    for output in result.outputs:
        kind = output.get("output_type")
        if kind == "stream":
            lines.append(clean(_text(output.get("text", ""))).rstrip("\n"))
        elif kind in ("execute_result", "display_data"):
            data = output.get("data", {})
            if any(mime in data for mime in IMAGE_TYPES):
                lines.append(_image_line(next(images, None)))
            elif "text/plain" in data:
                lines.append(clean(_text(data["text/plain"])))
    if result.files:
        lines.append("")
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
    return "\n".join(line for line in lines if line is not None)


def error_text(result: ExecutionResult) -> str:
    """The traceback (or the limit that stopped the run), for stderr."""
    error = result.error
    if error is None:
        return ""
    if error.traceback:
        return clean(error.traceback_text)
    return clean(f"{error.ename}: {error.evalue}")
