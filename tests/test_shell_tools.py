"""The shell tool's definitions, validated against the installed OpenAI and Anthropic SDK types, and its dispatch
through `toolcall` (real sandboxes)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from pydantic import TypeAdapter

import nbexec
from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.integrations import tools
from nbexec.integrations.toolcall import (
    handle_anthropic_tool_use,
    handle_openai_function_call,
    handle_openai_shell_call,
    handle_openai_tool_call,
)


def test_openai_shapes_validate_against_the_sdk() -> None:
    from openai.types.chat import ChatCompletionToolParam
    from openai.types.responses import FunctionShellToolParam, FunctionToolParam

    TypeAdapter(ChatCompletionToolParam).validate_python(tools.openai_shell_tool(sessions=True), strict=True)
    responses = tools.openai_shell_tool(api="responses")
    TypeAdapter(FunctionToolParam).validate_python(responses, strict=True)
    assert responses["strict"] and responses["parameters"]["required"] == ["command"]
    TypeAdapter(FunctionShellToolParam).validate_python(tools.hosted_shell_tool(), strict=True)


def test_anthropic_shapes_validate_against_the_sdk() -> None:
    from anthropic.types import ToolBash20250124Param, ToolParam

    tool = tools.anthropic_shell_tool(sessions=True)
    TypeAdapter(ToolParam).validate_python(tool, strict=True)
    assert set(tool["input_schema"]["properties"]) == {"command", "session_id"}
    TypeAdapter(ToolBash20250124Param).validate_python(tools.anthropic_bash_tool(), strict=True)


def test_openai_calls_of_the_shell_tool_run_commands(config: nbexec.SandboxConfig) -> None:
    reply = handle_openai_tool_call({"id": "c1", "function": {"name": "shell", "arguments": json.dumps(
        {"command": "echo hello; exit 4"})}}, config=config)
    assert reply["content"].startswith("hello") and "Exit code 4" in reply["content"]
    missing = handle_openai_function_call({"call_id": "c2", "name": "shell", "arguments": '{"code": "1"}'},
                                          config=config)
    assert missing["output"].startswith("Tool error:") and '"command"' in missing["output"]


def test_the_hosted_shell_call_answers_in_the_sdks_shape(config: nbexec.SandboxConfig) -> None:
    from openai.types.responses import ResponseFunctionShellToolCall
    from openai.types.responses.response_input_item_param import ShellCallOutput

    call = ResponseFunctionShellToolCall(id="s1", call_id="call1", type="shell_call", status="completed", action={
        "commands": ["echo one > f.txt; cat f.txt", "cat f.txt; echo err >&2; exit 5", "echo never"],
        "timeout_ms": 20000})
    reply = handle_openai_shell_call(call, config=config)
    TypeAdapter(ShellCallOutput).validate_python(reply)
    assert [o["outcome"] for o in reply["output"]] == [{"type": "exit", "exit_code": 0},
                                                        {"type": "exit", "exit_code": 5}]
    assert reply["output"][1]["stdout"] == "one\n" and reply["output"][1]["stderr"] == "err\n"
    with Session(config) as session:
        timed = handle_openai_shell_call({"call_id": "c", "action": {"commands": ["sleep 900"], "timeout_ms": 1500}},
                                         session=session)
        assert timed["output"][0]["outcome"] == {"type": "timeout"}
        capped = handle_openai_shell_call({"call_id": "c", "action": {"commands": ["seq 1000; seq 5 >&2"],
                                                                       "max_output_length": 10}}, session=session)
        assert (capped["output"][0]["stdout"], capped["output"][0]["stderr"]) == ("1\n2\n3\n4\n5\n", "")
    bad = handle_openai_shell_call({"call_id": "c", "action": {"commands": "ls"}}, config=config)
    assert bad["output"][0]["outcome"] == {"type": "exit", "exit_code": 1}


def test_anthropics_bash_tool_is_served_with_restart(config: nbexec.SandboxConfig) -> None:
    from anthropic.types import ToolResultBlockParam

    manager = SessionManager(config)
    try:
        first = handle_anthropic_tool_use({"id": "b1", "name": "bash", "input": {"command": "echo kept > k.txt"}},
                                          sessions=manager)
        session_id = first["content"][0]["text"].split("session_id: ")[1].split(";")[0]
        python = handle_anthropic_tool_use({"id": "p1", "name": "execute_python", "input": {
            "code": "x = 1\nprint(open('k.txt').read())", "session_id": session_id}}, sessions=manager)
        assert python["content"][0]["text"].startswith("kept") and not python["is_error"]
        restart = handle_anthropic_tool_use({"id": "b2", "name": "bash", "input": {
            "restart": True, "session_id": session_id}}, sessions=manager)
        TypeAdapter(ToolResultBlockParam).validate_python(restart)
        assert not restart["is_error"] and "restarted" in restart["content"][0]["text"]
        after = handle_anthropic_tool_use({"id": "p2", "name": "execute_python", "input": {
            "code": "print('x' in globals(), open('k.txt').read())", "session_id": session_id}}, sessions=manager)
        assert after["content"][0]["text"].startswith("False kept")
        failed = handle_anthropic_tool_use({"id": "b3", "name": "bash", "input": {
            "command": "false", "session_id": session_id}}, sessions=manager)
        assert failed["is_error"] and "Exit code 1" in failed["content"][0]["text"]
    finally:
        manager.close_all()


def test_the_models_timeout_only_shortens_the_operators(config: nbexec.SandboxConfig) -> None:
    """Attack (#36): a hosted-shell call asks for 12 s under the operator's 5 s limit; the operator's limit wins."""
    operator = dataclasses.replace(config, timeout=5)
    with Session(operator) as session:
        session.run("1")  # the sandbox is up: the wall time below is the command's
        started = time.monotonic()
        reply = handle_openai_shell_call({"call_id": "c", "action": {"commands": ["sleep 12; echo finished"],
                                                                      "timeout_ms": 12000}}, session=session)
        took = time.monotonic() - started
    assert reply["output"][0]["outcome"] == {"type": "timeout"}
    assert "finished" not in reply["output"][0]["stdout"] and took < 11, took


@pytest.mark.parametrize("timeout_ms", [10**400, 2**63, 10**30], ids=["beyond-float", "int64", "large"])
def test_a_huge_model_timeout_is_the_operators_limit(config: nbexec.SandboxConfig, timeout_ms: int) -> None:
    """Attack (#36, found by the attacker's read): a valid JSON integer past a float's range raised OverflowError out
    of the handler; any size is capped by the operator's limit and the command runs."""
    call = json.loads('{"call_id": "c", "action": {"commands": ["echo hi"], "timeout_ms": ' + str(timeout_ms) + "}}")
    with Session(config) as session:
        reply = handle_openai_shell_call(call, session=session)
    assert reply["output"][0]["stdout"] == "hi\n" and reply["output"][0]["outcome"]["exit_code"] == 0, reply
