"""The judge's checker wrapper: shipped as text and run by the runner as ``python -I -c`` in a process of its own.

Its arguments are descriptors: the checker's source, the test's input, the program's output, the expected output
("-": none), and the pipe its answer goes to. The checker's own prints go to stderr; only
``[bool, message]`` on the pipe, from a process that then exits 0, is an answer. Never imported on the host.
"""

import json
import os
import sys
from typing import Any


def _read(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


source, given, output = (_read(int(a)) for a in sys.argv[1:4])
expected = None if sys.argv[4] == "-" else _text(_read(int(sys.argv[4])))
answer = os.fdopen(int(sys.argv[5]), "w")
sys.stdout = sys.stderr
space: dict[str, Any] = {"__name__": "__checker__"}
exec(compile(source.decode(), "<checker>", "exec"), space)
result = space["check"](_text(given), _text(output), expected)
message = ""
if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str):
    result, message = result
if result is not True and result is not False:
    raise TypeError(f"check() returned {type(result).__name__}, not True, False or (bool, str)")
answer.write(json.dumps([result, message[:500]]))
answer.close()
