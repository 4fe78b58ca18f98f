"""Tool definitions against the SDKs' own types, model-facing rendering, tool-call handlers, MCP, LangChain,
and the LLM examples replayed end to end on real Docker."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import TypeAdapter

import nbexec
from nbexec.integrations import tools
from nbexec.integrations.toolcall import (
    handle_anthropic_tool_use,
    handle_openai_function_call,
    handle_openai_tool_call,
)
from nbexec.notebook.outputs import strip_ansi

from .conftest import IMAGE, own_children, own_workdirs, owned_by, settle

ROOT = Path(__file__).parent.parent


def test_openai_tool_shapes_validate_against_the_sdk() -> None:
    from openai.types.chat import ChatCompletionToolParam
    from openai.types.responses import FunctionToolParam

    chat = tools.openai_tool(sessions=True)
    TypeAdapter(ChatCompletionToolParam).validate_python(chat, strict=True)
    assert chat["function"]["name"] == "execute_python"
    assert chat["function"]["parameters"]["required"] == ["code"]
    assert "session_id" in chat["function"]["parameters"]["properties"]
    TypeAdapter(FunctionToolParam).validate_python(tools.openai_tool(api="responses"), strict=True)


def test_anthropic_tool_validates_against_the_sdk() -> None:
    from anthropic.types import ToolParam

    tool = tools.anthropic_tool()
    TypeAdapter(ToolParam).validate_python(tool, strict=True)
    assert tool["input_schema"]["properties"].keys() == {"code"}


def test_description_tells_the_truth() -> None:
    closed = tools.description(nbexec.SandboxConfig(timeout=30))
    assert "no internet" in closed and "30 seconds" in closed and "/mnt/data" in closed and "fresh" in closed
    opened = tools.description(nbexec.SandboxConfig(network=True), stateful=True)
    assert "internet access" in opened and "no internet" not in opened and "session_id" in opened
    per_connection = tools.description(nbexec.SandboxConfig(), stateful=True, by_session_id=False)
    assert "session_id" not in per_connection and "persists" in per_connection


def test_description_states_the_configured_limits() -> None:
    config = nbexec.SandboxConfig(timeout=45, cell_timeout=10, memory="3g", cpus=2, max_output="200k",
                                  max_data="50m", max_files=30)
    text = tools.description(config)
    for fact in ("45 seconds (10 seconds per cell)", "3 GB of memory", "2 CPUs", "past 200 KB per call is dropped",
                 "at most 30 files (50 MB in all) in /mnt/data"):
        assert fact in text, fact


def test_the_omitted_frames_are_counted(config: nbexec.SandboxConfig) -> None:
    own = tools.render_for_llm(nbexec.execute_notebook("def f():\n    1/0\nf()", config=config))
    assert "omitted" not in own and own.count("Cell In[1]") == 2
    deep = nbexec.execute_notebook("import pandas as pd\npd.read_csv('missing.csv')", config=config)
    library = sum(strip_ansi(line).startswith("File ") for line in deep.error.traceback)  # type: ignore[union-attr]
    assert library >= 2
    assert f"({library} frames inside libraries omitted)" in tools.render_for_llm(deep)


def test_truncate_keeps_head_and_tail() -> None:
    text = "HEAD" + "x" * 20000 + "TAIL"
    cut = tools.truncate(text, 1000)
    assert len(cut) <= 1000 and cut.startswith("HEAD") and cut.endswith("TAIL") and "characters omitted" in cut


def test_render_trims_library_frames_and_hints(config: nbexec.SandboxConfig) -> None:
    result = nbexec.execute_notebook("import pandas as pd\nprint('before')\npd.DataFrame({'a': [1]})['missing']",
                                     config=config)
    text = tools.render_for_llm(result)
    assert text.startswith("before\n")
    assert "Cell In[1], line 3" in text and "KeyError: 'missing'" in text
    assert "frames inside libraries omitted" in text and "site-packages" not in text
    assert "Fix the code and call the tool again." in text
    assert len(tools.render_for_llm(result, budget=300)) <= 300


@pytest.mark.parametrize(
    ("arguments", "message"),
    [("print(1)", "not JSON"), ("[1]", "JSON object"), ("{}", "missing or empty"), ('{"code": 3}', "missing")],
    ids=["bare-string", "array", "no-code", "code-not-string"],
)
def test_malformed_calls_become_tool_errors(arguments: str, message: str) -> None:
    from openai.types.chat import ChatCompletionMessageToolCall

    call = ChatCompletionMessageToolCall.model_validate(
        {"id": "call_9", "type": "function", "function": {"name": "execute_python", "arguments": arguments}})
    reply = handle_openai_tool_call(call)
    assert reply["role"] == "tool" and reply["tool_call_id"] == "call_9"
    assert reply["content"].startswith("Tool error:") and message in reply["content"]


def test_openai_handlers_run_code(config: nbexec.SandboxConfig) -> None:
    reply = handle_openai_tool_call({"id": "c1", "function": {"arguments": '{"code": "print(6 * 7)"}'}},
                                    config=config)
    assert reply == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    output = handle_openai_function_call(
        {"type": "function_call", "call_id": "c2", "arguments": json.dumps(
            {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()"})}, config=config)
    assert output["call_id"] == "c2"
    assert [p["type"] for p in output["output"]] == ["input_text", "input_image"]
    assert output["output"][1]["image_url"].startswith("data:image/png;base64,")


def test_anthropic_handler_with_sdk_block_and_sessions(config: nbexec.SandboxConfig) -> None:
    from anthropic.types import ToolResultBlockParam, ToolUseBlock

    manager = nbexec.SessionManager(config)
    first = handle_anthropic_tool_use(ToolUseBlock(type="tool_use", id="t1", name="execute_python",
                                                   input={"code": "x = 41"}), sessions=manager)
    session_id = first["content"][0]["text"].split("session_id: ", 1)[1].split(";", 1)[0]
    second = handle_anthropic_tool_use(
        {"type": "tool_use", "id": "t2", "input": {"code": "import matplotlib.pyplot as plt\nprint(x + 1)\n"
                                                           "plt.plot([1]); plt.show()", "session_id": session_id}},
        sessions=manager)
    TypeAdapter(ToolResultBlockParam).validate_python(second)
    assert second["is_error"] is False and second["content"][0]["text"].startswith("42")
    assert second["content"][1]["type"] == "image"
    failed = handle_anthropic_tool_use({"id": "t3", "input": {"code": "1/0", "session_id": session_id}},
                                       sessions=manager)
    assert failed["is_error"] is True and "ZeroDivisionError" in failed["content"][0]["text"]
    manager.close_all()


def test_a_model_cannot_name_a_session_into_being(config: nbexec.SandboxConfig) -> None:
    manager = nbexec.SessionManager(config)
    reply = handle_openai_tool_call({"id": "c1", "function": {"arguments": json.dumps(
        {"code": "x = 1", "session_id": "my-session"})}}, sessions=manager)
    assert reply["content"].startswith("Tool error:") and "Omit session_id" in reply["content"]
    assert len(manager) == 0, "a session was made under an id the model chose"


def test_another_conversation_cannot_join_a_session_by_its_id(config: nbexec.SandboxConfig) -> None:
    manager = nbexec.SessionManager(config)  # one manager for a whole server, as a chat backend would keep
    try:
        first = handle_anthropic_tool_use({"id": "a1", "input": {"code": "x = 'alice'"}}, sessions=manager,
                                          conversation="chat-alice")
        alice_id = first["content"][0]["text"].split("session_id: ", 1)[1].split(";", 1)[0]
        stolen = handle_anthropic_tool_use({"id": "b1", "input": {"code": "print(x)", "session_id": alice_id}},
                                           sessions=manager, conversation="chat-bob")
        assert stolen["is_error"] is True and "alice" not in stolen["content"][0]["text"]
        assert "Omit session_id" in stolen["content"][0]["text"]
        unscoped = handle_anthropic_tool_use({"id": "b2", "input": {"code": "print(x)", "session_id": alice_id}},
                                             sessions=manager)
        assert unscoped["is_error"] is True and "alice" not in unscoped["content"][0]["text"]
        again = handle_anthropic_tool_use({"id": "a2", "input": {"code": "print(x)", "session_id": alice_id}},
                                          sessions=manager, conversation="chat-alice")
        assert again["is_error"] is False and again["content"][0]["text"] == "alice"
    finally:
        manager.close_all()


def test_mcp_server_over_stdio(cleanup_ledger: None) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    async def talk() -> dict:
        params = StdioServerParameters(command=sys.executable, args=["-m", "nbexec.cli", "mcp", "--timeout", "30"],
                                       env={**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0"})
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            servers.extend(pid for pid, line in own_children().items() if "nbexec.cli mcp" in line)
            listed = await client.list_tools()
            description = listed.tools[0].description
            first = await client.call_tool("execute_python", {"code": "x = 41\nopen('out.txt', 'w').write('hi')"})
            second = await client.call_tool("execute_python", {"code": "import matplotlib.pyplot as plt\n"
                                                                       "print(x + 1)\nplt.plot([1]); plt.show()"})
            error = await client.call_tool("execute_python", {"code": "1/0"})
            resources = await client.list_resources()
            content = await client.read_resource(resources.resources[0].uri)
            return {"tools": [t.name for t in listed.tools], "schema": listed.tools[0].input_schema,
                    "description": description, "first": first, "second": second, "error": error,
                    "resources": [r.name for r in resources.resources], "content": content}

    servers: list[int] = []
    out = asyncio.run(talk())
    assert len(servers) == 1, servers
    # The client has closed the server (stdin closed, then SIGTERM): it must have removed its session's
    # container and folders itself; nothing here cleans up for it.
    settle(lambda: not owned_by(servers[0]) and not own_workdirs(servers[0]), 10)
    assert owned_by(servers[0]) == [], "the MCP server left its session container behind"
    assert own_workdirs(servers[0]) == [], "the MCP server left its working folders behind"
    assert out["tools"] == ["execute_python", "shell", "upload_file", "snapshot_session", "list_snapshots",
                            "delete_snapshot", "restore_session"]
    assert out["schema"] == tools.json_schema()  # the same arguments model as the OpenAI and Anthropic tools
    assert not out["first"].is_error and not out["second"].is_error
    assert out["error"].is_error  # the code raised: the client is told, not only the text
    assert "session_id" not in out["description"] and "1 GB of memory" in out["description"]
    assert [c.type for c in out["second"].content] == ["text", "image"]
    assert out["second"].content[0].text.startswith("42")
    assert "ZeroDivisionError" in out["error"].content[0].text
    assert out["resources"] == ["out.txt"]
    assert out["content"].contents[0].blob == "aGk="  # base64 of b"hi"


def test_langchain_tool(config: nbexec.SandboxConfig) -> None:
    from langchain_core.messages import ToolMessage

    from nbexec.integrations.langchain import execute_python_tool

    tool = execute_python_tool(config)
    assert tool.name == "execute_python" and "/mnt/data" in tool.description
    assert "session_id" not in tool.description and set(tool.args) == {"code"}  # stateless: no session words
    assert tool.invoke({"code": "print(sum(range(10)))"}) == "45"

    def call(code: str) -> ToolMessage:
        message = tool.invoke({"type": "tool_call", "id": "call-1", "name": tool.name, "args": {"code": code}})
        assert isinstance(message, ToolMessage)
        return message

    failed = call("1/0")
    assert failed.status == "error" and "ZeroDivisionError" in str(failed.content)
    plotted = call("import matplotlib.pyplot as plt\nprint('plotted')\nplt.plot([1, 2]); plt.show()")
    assert plotted.status == "success" and isinstance(plotted.artifact, nbexec.ExecutionResult)
    assert isinstance(plotted.content, list)
    text, image = plotted.content
    assert isinstance(text, dict) and isinstance(image, dict)
    assert text["text"].startswith("plotted") and image["type"] == "image" and image["mime_type"] == "image/png"
    assert base64.b64decode(image["base64"]).startswith(b"\x89PNG")
    manager = nbexec.SessionManager(config)
    try:
        stateful = execute_python_tool(config, sessions=manager)
        assert set(stateful.args) == {"code", "session_id"} and "session_id" in stateful.description
    finally:
        manager.close_all()


@pytest.mark.parametrize("example", ["openai_tool_loop.py", "anthropic_tool_loop.py", "langchain_agent.py"])
def test_examples_replay_end_to_end(cleanup_ledger: None, example: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--replay"], cwd=tmp_path,
                          env={**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Error (exception)" in done.stderr and "KeyError" in done.stderr  # a real failure, then a retry
    assert "assistant:" in done.stdout and "file:///" in done.stdout and "revenue_by_region.csv" in done.stdout
    assert "sandbox:/mnt/data" not in done.stdout
