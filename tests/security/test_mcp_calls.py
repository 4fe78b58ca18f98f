"""`nbexec mcp`'s interrupt, upload and shell, attacked with the real `mcp` client over stdio against a real
`nbexec mcp` process (its own TMPDIR, so every folder it makes is under the test's tmp_path).

- A client's cancellation (the SDK sends ``notifications/cancelled`` when a call times out on its side) stops the
  run: judged by the next call answering at once, by the sandbox's process list (no sleeper), and by the
  cancelled call never being answered as a success.
- Hostile uploads (traversal, absolute, NUL, a name over 255 bytes, oversized or invalid content, one file too
  many) are each refused with a tool error; nothing is written into the sandbox or anywhere on the host.
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from ..conftest import IMAGE

_MARK = b"nbexec-upload-marker-7f3a"
_PROCESSES = ("import os\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
              "            print(open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())\n"
              "        except OSError:\n            pass")


@asynccontextmanager
async def _client(tmp: Path, *args: str, env: dict[str, str] | None = None) -> AsyncIterator[Any]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    environ = {**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0", "TMPDIR": str(tmp), **(env or {})}
    params = StdioServerParameters(command=sys.executable, args=["-m", "nbexec.cli", "mcp", *args], env=environ)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        yield client


def _text(result: Any) -> str:
    return "\n".join(getattr(c, "text", "") for c in result.content)


@pytest.fixture
def tmp(tmp_path: Path, cleanup_ledger: None) -> Path:
    path = tmp_path / "t"
    path.mkdir(mode=0o700)
    return path


def test_a_cancelled_call_stops_the_run(tmp: Path) -> None:
    async def attack() -> dict[str, Any]:
        from mcp.shared.exceptions import MCPError

        async with _client(tmp, "--timeout", "900") as client:
            warm = await client.call_tool("execute_python", {"code": "print('warm')"})
            cancelled: Any = None
            try:  # the SDK abandons the call after 5 s and sends notifications/cancelled for it
                cancelled = await client.call_tool("execute_python", {"code": "import time\ntime.sleep(800)"},
                                                   read_timeout_seconds=5)
            except (MCPError, TimeoutError) as exc:
                cancelled = exc
            with anyio.fail_after(120):  # the sleep would hold the session for 800 s
                after = await client.call_tool("execute_python", {"code": _PROCESSES})
            return {"warm": warm, "cancelled": cancelled, "after": after}

    out = anyio.run(attack)
    assert not out["warm"].is_error
    assert not hasattr(out["cancelled"], "is_error"), "a cancelled call was answered"
    assert not out["after"].is_error, _text(out["after"])
    assert "time.sleep(800)" not in _text(out["after"]) and "sleep" not in _text(out["after"])


def test_a_cancelled_shell_command_is_killed(tmp: Path) -> None:
    async def attack() -> str:
        from mcp.shared.exceptions import MCPError

        async with _client(tmp, "--timeout", "900") as client:
            await client.call_tool("shell", {"command": "echo warm"})
            with pytest.raises((MCPError, TimeoutError)):
                await client.call_tool("shell", {"command": "sleep 812 & sleep 813; echo never"},
                                       read_timeout_seconds=5)
            with anyio.fail_after(120):
                return _text(await client.call_tool("execute_python", {"code": _PROCESSES}))

    listing = anyio.run(attack)
    assert "sleep 812" not in listing and "sleep 813" not in listing, listing


def test_shell_and_upload_round_trip(tmp: Path) -> None:
    async def use() -> dict[str, Any]:
        async with _client(tmp) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            saved = await client.call_tool("upload_file", {"name": "in.csv",
                                                           "content_base64": base64.b64encode(b"a,b\n1,2\n").decode()})
            read = await client.call_tool("execute_python", {"code": "print(open('in.csv').read().split()[1])"})
            shell = await client.call_tool("shell", {"command": "wc -l < in.csv; exit 3"})
            return {"names": names, "saved": saved, "read": read, "shell": shell}

    out = anyio.run(use)
    assert {"execute_python", "shell", "upload_file"} <= set(out["names"])
    assert not out["saved"].is_error and "/mnt/data/in.csv" in _text(out["saved"])
    assert _text(out["read"]).startswith("1,2")
    assert out["shell"].is_error and _text(out["shell"]).startswith("2") and "Exit code 3" in _text(out["shell"])


_HOSTILE = [
    ("../esc7f3a.txt", _MARK, "plain file name"),
    ("a/../../esc7f3a.txt", _MARK, "plain file name"),
    ("/etc/esc7f3a.txt", _MARK, "plain file name"),
    ("/mnt/data/esc7f3a.txt", _MARK, "plain file name"),
    ("sub\\esc7f3a.txt", _MARK, "plain file name"),
    ("nul\0esc7f3a.txt", _MARK, "NUL"),
    ("x" * 256, _MARK, "255"),
    ("..", _MARK, "must not be"),
    ("", _MARK, "non-empty"),
    ("bell\x07.txt", _MARK, "control"),
    ("big.bin", _MARK * 5000, "larger than the /mnt/data cap"),
]


def test_hostile_uploads_are_refused_and_nothing_is_written(tmp: Path) -> None:
    async def attack() -> dict[str, Any]:
        async with _client(tmp, "--max-data", "64k", env={"NBEXEC_MAX_FILES": "3"}) as client:
            refused = [await client.call_tool("upload_file", {"name": name,
                                                              "content_base64": base64.b64encode(data).decode()})
                       for name, data, _ in _HOSTILE]
            invalid = [await client.call_tool("upload_file", {"name": "bad.bin", "content_base64": text})
                       for text in ("!!!notbase64", "YWJj\0", "YW=Jj", "a" * (16 * 1024 * 1024 + 4))]
            for index in range(3):
                await client.call_tool("upload_file", {"name": f"ok{index}.txt",
                                                       "content_base64": base64.b64encode(b"fine").decode()})
            too_many = await client.call_tool("upload_file", {"name": "fourth.txt",
                                                              "content_base64": base64.b64encode(_MARK).decode()})
            replaced = await client.call_tool("upload_file", {"name": "ok0.txt",
                                                              "content_base64": base64.b64encode(b"again").decode()})
            listing = await client.call_tool("shell", {"command": "find / -xdev -name '*esc7f3a*' 2>/dev/null; "
                                                                  "ls -A /mnt/data; cat /mnt/data/ok0.txt"})
            return {"refused": refused, "invalid": invalid, "too_many": too_many, "replaced": replaced,
                    "listing": _text(listing)}

    out = anyio.run(attack)
    for (name, _, why), answer in zip(_HOSTILE, out["refused"], strict=True):
        assert answer.is_error and why in _text(answer), (name[:40], _text(answer))
    for answer in out["invalid"]:
        assert answer.is_error and ("base64" in _text(answer) or "limit" in _text(answer)), _text(answer)
    assert out["too_many"].is_error and "already holds 3 files" in _text(out["too_many"])
    assert not out["replaced"].is_error  # replacing a file adds none
    assert out["listing"].split("\n")[:4] == ["ok0.txt", "ok1.txt", "ok2.txt", "again"], out["listing"]
    on_host = [p for p in tmp.rglob("*") if "esc7f3a" in p.name or p.name in ("big.bin", "fourth.txt")]
    assert on_host == []
    marked = [p for p in tmp.rglob("*") if p.is_file() and not p.is_symlink() and _readable(p) and
              _MARK in p.read_bytes()]
    assert marked == [], marked


def _readable(path: Path) -> bool:
    return os.access(path, os.R_OK)
