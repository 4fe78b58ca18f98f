"""What the model reads back from the tool handlers and `nbexec mcp`: links it can use (never a host path), only
the files a session call changed, advice it can act on (after a kernel death, a network failure, a malformed
call) and the limits written as a person would write them."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio

import nbexec
from nbexec.integrations import tools
from nbexec.integrations.toolcall import handle_anthropic_tool_use, handle_openai_tool_call

from .conftest import IMAGE

_WRITES = ("import matplotlib.pyplot as plt\nopen('/mnt/data/out.csv', 'w').write('a,b\\n1,2\\n')\n"
           "plt.plot([1, 2]); plt.show()")


def _said(reply: dict[str, Any]) -> str:
    return reply["content"] if isinstance(reply["content"], str) else reply["content"][0]["text"]


def _session_id(text: str) -> str:
    return text.split("session_id: ", 1)[1].split(";", 1)[0]


def test_the_model_gets_sandbox_links_never_host_paths(config: nbexec.SandboxConfig) -> None:
    reply = handle_openai_tool_call({"id": "c1", "function": {"arguments": json.dumps({"code": _WRITES})}},
                                    config=config)
    text = _said(reply)
    assert "sandbox:/mnt/data/out.csv" in text
    assert "file:" not in text and "/tmp/" not in text and "nbexec-output" not in text, text


def test_a_url_a_store_serves_is_given_beside_the_sandbox_link(config: nbexec.SandboxConfig) -> None:
    result = nbexec.execute_notebook(_WRITES, config=config)
    served = dataclasses.replace(result, files=tuple(
        dataclasses.replace(f, url=f"https://store.example/{f.name}?sig=1") for f in result.files))
    text = tools.render_for_llm(served)
    assert "sandbox:/mnt/data/out.csv" in text and "(https://store.example/out.csv?sig=1)" in text
    assert str(Path(result.output_dir)) not in text and "file:" not in tools.render_for_llm(result)


def test_a_session_call_lists_only_new_or_changed_files(config: nbexec.SandboxConfig) -> None:
    manager = nbexec.SessionManager(config)
    try:
        first = _said(handle_anthropic_tool_use({"id": "t1", "input": {"code": "open('a.txt', 'w').write('1')"}},
                                                sessions=manager))
        session_id = _session_id(first)
        assert "sandbox:/mnt/data/a.txt" in first

        def call(code: str) -> str:
            return _said(handle_anthropic_tool_use({"id": "t", "input": {"code": code, "session_id": session_id}},
                                                   sessions=manager))

        second = call("open('b.txt', 'w').write('2')")
        assert "sandbox:/mnt/data/b.txt" in second and "a.txt" not in second
        assert "1 file in /mnt/data unchanged since the last call is not listed again" in second
        third = call("open('a.txt', 'w').write('changed')")
        assert "sandbox:/mnt/data/a.txt" in third and "b.txt" not in third
    finally:
        manager.close_all()


def test_after_a_kernel_death_the_advice_is_one_the_model_can_follow(config: nbexec.SandboxConfig) -> None:
    manager = nbexec.SessionManager(config)
    try:
        died = _said(handle_anthropic_tool_use({"id": "t1", "input": {"code": "x = 1\nimport os\nos._exit(3)"}},
                                               sessions=manager))
        assert "next call starts a fresh kernel" in died and "restart()" not in died, died
        after = handle_anthropic_tool_use({"id": "t2", "input": {"code": "print('alive')",
                                                                 "session_id": _session_id(died)}},
                                          sessions=manager)
        text = _said(after)
        assert after["is_error"] is False and "alive" in text, text
        assert "ran in a fresh one" in text and "restart()" not in text
    finally:
        manager.close_all()


def test_a_network_failure_does_not_invite_a_retry(config: nbexec.SandboxConfig) -> None:
    code = "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=5).read()"
    text = _said(handle_openai_tool_call({"id": "c1", "function": {"arguments": json.dumps({"code": code})}},
                                         config=config))
    assert "URLError" in text or "gaierror" in text, text
    assert "do not retry" in text and "off by default" in text and "call the tool again" not in text


def test_the_limits_are_written_as_a_person_would() -> None:
    config = nbexec.SandboxConfig(timeout=60, cell_timeout=30, memory="1g", cpus=2, max_output="200k",
                                  max_data="1g", max_files=1000)
    text = tools.description(config)
    for fact in ("limited to 1 minute (30 seconds per cell)", "1 GB of memory", "2 CPUs",
                 "printed text past 200 KB per call", "at most 1,000 files (1 GB in all) in /mnt/data"):
        assert fact in text, (fact, text)
    assert "1000 1g" not in text and "60 s" not in text


def test_mcp_argument_errors_are_plain_sentences(cleanup_ledger: None, tmp_path: Path) -> None:
    async def calls() -> list[Any]:
        from mcp.client.session import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        env = {**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0", "TMPDIR": str(tmp_path)}
        params = StdioServerParameters(command=sys.executable, args=["-m", "nbexec.cli", "mcp"], env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            return [await client.call_tool(name, arguments) for name, arguments in (
                ("execute_python", {}), ("execute_python", {"code": 3}), ("upload_file", {"name": "x.txt"}))]

    missing, wrong, upload = (("\n".join(c.text for c in r.content), r.is_error) for r in anyio.run(calls))
    for text, is_error in (missing, wrong, upload):
        assert is_error and text.startswith("Tool error: "), text
        assert "validation error" not in text and "pydantic" not in text and "type=" not in text, text
    assert 'The "code" argument is missing' in missing[0] and 'takes "code" (required)' in missing[0]
    assert 'The "code" argument must be a string, not an integer' in wrong[0]
    assert 'The "content_base64" argument is missing' in upload[0]
