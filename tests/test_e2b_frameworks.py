"""Agent frameworks' own E2B integrations, from PyPI and unchanged, running a tool loop against nbexec's E2B door
with replayed model replies: LangChain Deep Agents' E2B sandbox (`langchain-e2b`) and smolagents' E2B executor.
The model is a script; everything else (the framework, E2B's SDK, the server, the sandbox) is real."""

from __future__ import annotations

from typing import Any

import pytest
from e2b_code_interpreter import Sandbox

from .test_e2b import door, sdk  # noqa: F401  (the module's service and the three variables)
from .test_server import Running


def test_deep_agents_run_shell_and_file_tools_in_an_nbexec_sandbox(sdk: Running) -> None:  # noqa: F811
    from deepagents import create_deep_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_e2b import E2BSandbox

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

    replies = iter([
        AIMessage("", tool_calls=[{"name": "write_file", "id": "w1", "args": {
            "file_path": "/home/user/plan.txt", "content": "step one\n"}}]),
        AIMessage("", tool_calls=[{"name": "execute", "id": "x1", "args": {
            "command": "cat /home/user/plan.txt; echo $((6*7)); ls /mnt/data"}}]),
        AIMessage("", tool_calls=[{"name": "read_file", "id": "r1", "args": {"file_path": "/home/user/plan.txt"}}]),
        AIMessage("done: 42"),
    ])
    sandbox = Sandbox.create(timeout=120)
    try:
        agent = create_deep_agent(model=Scripted(messages=replies), backend=E2BSandbox(sandbox=sandbox))
        state = agent.invoke({"messages": [{"role": "user", "content": "write a plan and run it"}]})
        tools = {m.tool_call_id: str(m.content) for m in state["messages"] if isinstance(m, ToolMessage)}
        assert "step one\n42\nplan.txt" in tools["x1"], tools
        assert "step one" in tools["r1"] and state["messages"][-1].content == "done: 42"
        assert sandbox.run_code("open('/mnt/data/plan.txt').read()").text == "'step one\\n'"
    finally:
        sandbox.kill()


def test_smolagents_code_agent_runs_its_steps_in_an_nbexec_sandbox(sdk: Running) -> None:  # noqa: F811
    from smolagents import CodeAgent
    from smolagents.models import ChatMessage, MessageRole, Model

    steps = iter([
        "Thought: compute in the sandbox.\n<code>\nimport os\nvalue = 6 * 7\nprint(os.getcwd(), value)\n</code>",
        "Thought: answer.\n<code>\nfinal_answer(value)\n</code>",
    ])

    class Scripted(Model):
        def generate(self, messages: Any, stop_sequences: Any = None, **kwargs: Any) -> ChatMessage:
            return ChatMessage(role=MessageRole.ASSISTANT, content=next(steps))

    agent = CodeAgent(tools=[], model=Scripted(model_id="scripted"), executor_type="e2b",
                      executor_kwargs={"timeout": 120}, max_steps=4)
    try:
        answer = agent.run("what is six times seven?")
        assert answer == 42
        logs = "\n".join(str(step.observations) for step in agent.memory.steps if getattr(step, "observations", None))
        assert "/mnt/data 42" in logs
    finally:
        agent.cleanup()


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frameworks may phone home; nothing leaves the machine in tests."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LANGCHAIN_TRACING_V2", "false")
