"""An Anthropic Messages tool loop: the model writes Python, nbexec runs it in the sandbox (charts come back as
images), and errors go back to the model, which may retry up to 3 times.

    python examples/anthropic_tool_loop.py            # live: needs ANTHROPIC_API_KEY (in .env or the environment)
    python examples/anthropic_tool_loop.py --replay   # replays examples/recordings/anthropic_messages.json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from anthropic.types import Message
from common import QUESTION, load_dotenv, recording

import nbexec
from nbexec.integrations.toolcall import handle_anthropic_tool_use
from nbexec.integrations.tools import anthropic_tool
from nbexec.notebook.links import url_map

MAX_RETRIES = 3
Model = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Message]


def live_model(model: str) -> Model:
    from anthropic import Anthropic

    client = Anthropic()
    return lambda messages, tools: client.messages.create(model=model, max_tokens=4096, messages=messages,
                                                          tools=tools)


def replay_model() -> Model:
    replies: Iterator[dict[str, Any]] = iter(recording("anthropic_messages"))
    return lambda messages, tools: Message.model_validate(next(replies))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", action="store_true", help="play the recorded conversation (no API key)")
    parser.add_argument("--model", default=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5"))
    args = parser.parse_args()
    load_dotenv()
    model = replay_model() if args.replay else live_model(args.model)
    config = nbexec.from_env()
    tools = [anthropic_tool(config)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    failures = 0
    files: dict[str, str] = {}
    while True:
        reply = model(messages, tools)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            text = "".join(b.text for b in reply.content if b.type == "text")
            print("assistant:", nbexec.rewrite_links(text, files))
            return 0
        results = []
        for use in uses:
            print(f"--- model runs:\n{use.input.get('code', use.input)}", file=sys.stderr)
            result = handle_anthropic_tool_use(use, config=config, on_result=lambda r: files.update(url_map(r)))
            print(f"--- sandbox says:\n{result['content'][0]['text']}", file=sys.stderr)
            failures += bool(result["is_error"])
            results.append(result)
        messages.append({"role": "user", "content": results})
        if failures > MAX_RETRIES:
            print("giving up after repeated errors", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
