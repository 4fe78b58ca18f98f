"""A LangChain tool-calling agent loop around nbexec's execute_python tool, retrying up to 3 times on errors.

    python examples/langchain_agent.py            # live: needs langchain-openai and OPENAI_API_KEY
    python examples/langchain_agent.py --replay   # replays the recorded model turns (examples/recordings), no key
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from common import QUESTION, load_dotenv, recording
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

import nbexec
from nbexec.integrations.langchain import execute_python_tool

MAX_RETRIES = 3


def recorded_turns() -> Iterator[AIMessage]:
    """The recorded OpenAI replies as LangChain messages."""
    for reply in recording("openai_chat"):
        message = reply["choices"][0]["message"]
        calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"],
                  "type": "tool_call"} for c in message.get("tool_calls") or []]
        yield AIMessage(content=message.get("content") or "", tool_calls=calls)


def model(replay: bool, tool: Any) -> Any:
    if replay:
        return GenericFakeChatModel(messages=recorded_turns())
    from langchain_openai import ChatOpenAI  # pip install langchain-openai

    return ChatOpenAI(model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini")).bind_tools([tool])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", action="store_true", help="play the recorded conversation (no API key)")
    args = parser.parse_args()
    load_dotenv()
    files: dict[str, str] = {}
    tool = execute_python_tool(nbexec.from_env(), on_result=lambda r: files.update(nbexec.notebook.links.url_map(r)))
    llm = model(args.replay, tool)
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    failures = 0
    while True:
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            print("assistant:", nbexec.rewrite_links(str(reply.content), files))
            return 0
        for call in reply.tool_calls:
            print(f"--- model runs:\n{call['args'].get('code')}", file=sys.stderr)
            result: ToolMessage = tool.invoke(call)
            print(f"--- sandbox says:\n{result.content}", file=sys.stderr)
            failures += "Error (" in str(result.content)
            messages.append(result)
        if failures > MAX_RETRIES:
            print("giving up after repeated errors", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
