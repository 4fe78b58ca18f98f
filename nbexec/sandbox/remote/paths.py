"""File names in a node's URLs: checked segment by segment, then percent-encoded. Pure.

No HTTP client, proxy or server between here and the node can then rewrite the path. HTTP libraries normalise dot
segments (``a/../b`` becomes ``b``), and servers decode ``%2F``, ``%2e`` and ``%5c`` before routing. A name that
carries them could leave the session it names. So every segment must be plain, as it is and percent-decoded: not
empty, ``.`` or ``..``, and with no NUL, backslash or slash. Then each byte but letters, digits and ``-._~`` is
percent-encoded, which leaves nothing for anyone to normalise.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from nbexec.errors import FileTransferError

DECODINGS = 4  # "%25252e" is "." after three decodings; a segment still changing after four is refused


def bad_segment(segment: str) -> str | None:
    """Why one path segment cannot travel (as it is or percent-decoded), or None when it can."""
    seen = segment
    for _ in range(DECODINGS):
        if seen in ("", ".", ".."):
            return "an empty, '.' or '..' segment"
        if "\0" in seen or "\\" in seen or "/" in seen:
            return "a NUL, a backslash or an encoded slash in a segment"
        decoded = unquote(seen)
        if decoded == seen:
            return None
        seen = decoded
    return "a segment percent-encoded over and over"


def check(name: str) -> list[str]:
    """The segments of ``name``; FileTransferError when one of them cannot travel."""
    segments = name.split("/")
    for segment in segments:
        why = bad_segment(segment)
        if why:
            raise FileTransferError(
                f"{name!r} is not a plain relative name: it has {why}. Name a file inside /mnt/data with "
                "segments that are not empty, '.' or '..' and hold no NUL or backslash (also percent-encoded).")
    return segments


def encode(name: str) -> str:
    """``name`` as a URL path: checked (see ``check``), then every segment percent-encoded."""
    return "/".join(quote(segment, safe="") for segment in check(name))
