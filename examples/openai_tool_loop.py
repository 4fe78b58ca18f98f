"""An OpenAI Chat Completions tool loop: the model writes Python, nbexec runs it in the sandbox, and errors go
back to the model, which may retry up to 3 times.

    python examples/openai_tool_loop.py               # live: needs OPENAI_API_KEY (in .env or the environment)
    python examples/openai_tool_loop.py --replay      # replays examples/recordings/openai_chat.json, no key
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from common import QUESTION, load_dotenv, recording
from openai.types.chat import ChatCompletion

import nbexec
from nbexec.integrations.toolcall import handle_openai_tool_call
from nbexec.integrations.tools import openai_tool
from nbexec.notebook.links import url_map

MAX_RETRIES = 3


def live_model(model: str) -> Callable[[list[dict[str, Any]], list[dict[str, Any]]], ChatCompletion]:
    from openai import OpenAI

    client = OpenAI()
    return lambda messages, tools: client.chat.completions.create(model=model, messages=messages, tools=tools)


def replay_model() -> Callable[[list[dict[str, Any]], list[dict[str, Any]]], ChatCompletion]:
    replies: Iterator[dict[str, Any]] = iter(recording("openai_chat"))
    return lambda messages, tools: ChatCompletion.model_validate(next(replies))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", action="store_true", help="play the recorded conversation (no API key)")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"))
    args = parser.parse_args()
    load_dotenv()
    model = replay_model() if args.replay else live_model(args.model)
    config = nbexec.from_env()
    tools = [openai_tool(config)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    failures = 0
    files: dict[str, str] = {}
    while True:
        message = model(messages, tools).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print("assistant:", nbexec.rewrite_links(message.content or "", files))
            return 0
        for call in message.tool_calls:
            print(f"--- model runs:\n{call.function.arguments}", file=sys.stderr)
            reply = handle_openai_tool_call(call, config=config, on_result=lambda r: files.update(url_map(r)))
            print(f"--- sandbox says:\n{reply['content']}", file=sys.stderr)
            messages.append(reply)
            failures += "Error (" in reply["content"] or reply["content"].startswith("Tool error")
        if failures > MAX_RETRIES:
            print("giving up after repeated errors", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
