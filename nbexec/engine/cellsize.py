"""A cell too large to run, refused before a sandbox starts. The kernel echoes each cell's source in an
execute_input message, which the host reads whole or not at all (its content up to `messages.MAX_CONTROL`, its
frame up to the iopub frame limit); a larger cell would be read as a misbehaving sandbox after it started. Pure."""

from __future__ import annotations

import json

from nbformat import NotebookNode

from nbexec.config import SandboxConfig
from nbexec.errors import CellTooLargeError
from nbexec.sandbox.kernel import MAX_HEADER
from nbexec.sandbox.messages import MAX_CONTROL

_MARGIN = 1024  # the echo's other fields (execution_count) and its JSON punctuation


def limit(config: SandboxConfig) -> int:
    """Bytes of one cell's source, as a kernel may echo it (JSON with every character escaped to ASCII)."""
    frame = config.max_output_bytes + config.max_display_bytes + MAX_HEADER  # as the sandbox's iopub connection
    return min(MAX_CONTROL, frame) - _MARGIN


def check(config: SandboxConfig, nb: NotebookNode) -> None:
    """CellTooLargeError (a ConfigError) naming the first code cell of ``nb`` that is over `limit`."""
    most = limit(config)
    for index, cell in enumerate(nb.cells):
        source = cell.get("source", "")
        source = source if isinstance(source, str) else "".join(source)
        if cell.get("cell_type") != "code" or len(source) * 12 <= most:
            continue  # 12: the most one character takes escaped (a surrogate pair as two \uXXXX)
        size = len(json.dumps(source))
        if size > most:
            raise CellTooLargeError(
                f"cell {index} is {size:,} bytes as the kernel echoes it back, over the {most:,}-byte limit of "
                f"one cell (1 MiB, or less when max_output + max_display is smaller; this run has max_output "
                f"{config.max_output} (--max-output, NBEXEC_MAX_OUTPUT), max_display {config.max_display} "
                "(NBEXEC_MAX_DISPLAY)). Split the code into several cells, or pass its data as a file instead of in "
                "the source; nothing ran.")
