"""The supervisor's wire (pure, stdlib only, Python 3.9+): frames and caps, shared by the host and the agent.

A frame is 8 bytes (big-endian JSON length, data length), a JSON object, then raw data. The host sends requests
(``op``, an ``id``), the agent answers each by its ``id`` (``error`` and ``message`` when refused) and sends events
(``ev``: ready, out, end) of its own.
"""

from __future__ import annotations

import json
import struct
from typing import Any

HEADER = struct.Struct(">II")
MAX_JSON = 1 << 20  # bytes of one frame's JSON
MAX_DATA = 1 << 20  # bytes of one frame's raw data
OUTPUT_CHUNK = 64 * 1024  # bytes of process output per frame
FILE_CHUNK = 256 * 1024  # bytes of file content per frame
MAX_PROCESSES = 64  # running processes per sandbox (below its pids cap)
MAX_PENDING_STDIN = 1 << 20  # stdin bytes waiting for a process that does not read
MAX_HANDLES = 16  # open file reads and writes
MAX_ENTRIES = 10_000  # entries of one list_dir
MAX_DEPTH = 32  # depth of one list_dir
MAX_WATCHERS = 16  # open folder watches
MAX_WATCH_DIRS = 1024  # folders of one recursive watch
MAX_PORT_CONNS = 32  # open connections to ports inside the sandbox (agentports)
PORT_WINDOW = 256 * 1024  # bytes of one port connection in flight each way: the receiver grants more as it takes


class FrameReader:
    """Frames out of a byte stream, each sized before it is read or parsed (pure)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[dict[str, Any], bytes]]:
        """Append ``chunk``; return the frames now complete. ValueError on a frame over the caps or not JSON."""
        self._buffer += chunk
        frames = []
        while len(self._buffer) >= HEADER.size:
            size, length = HEADER.unpack_from(self._buffer)
            if not 0 < size <= MAX_JSON or length > MAX_DATA:
                raise ValueError(f"a frame of {size} + {length} bytes is over the caps")
            end = HEADER.size + size + length
            if len(self._buffer) < end:
                break
            head = json.loads(bytes(self._buffer[HEADER.size:HEADER.size + size]))
            if not isinstance(head, dict):
                raise ValueError("a frame that is not a JSON object")
            frames.append((head, bytes(self._buffer[HEADER.size + size:end])))
            del self._buffer[:end]
        return frames


def encode(head: dict[str, Any], data: bytes = b"") -> bytes:
    """One frame."""
    text = json.dumps(head, separators=(",", ":")).encode()
    return HEADER.pack(len(text), len(data)) + text + data
