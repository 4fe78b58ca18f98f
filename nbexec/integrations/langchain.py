"""A LangChain tool that runs Python in nbexec's sandbox (needs the langchain extra: langchain-core)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import SandboxConfig
from ..result import ExecutionResult
from ..session import SessionManager
from ..storage import ArtifactStore
from . import tools
from .toolcall import _outcome

try:
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel, Field
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("the LangChain tool needs the langchain extra: pip install 'nbexec-sandbox[langchain]'") from exc


class CodeInput(BaseModel):
    code: str = Field(description="Python source to run.")
    session_id: str | None = Field(default=None, description=(
        "The session_id an earlier call returned, to keep its state; omit it to start a new session."))


def execute_python_tool(config: SandboxConfig | None = None, *, sessions: SessionManager | None = None,
                        store: ArtifactStore | None = None, name: str = tools.DEFAULT_NAME,
                        budget: int = tools.DEFAULT_BUDGET, conversation: str | None = None,
                        on_result: Callable[[ExecutionResult], None] | None = None) -> StructuredTool:
    """A StructuredTool named ``execute_python``; stateful when given a SessionManager (sessions are found only
    by the ``conversation`` that made them, when one manager serves several)."""

    def run(code: str, session_id: str | None = None) -> str:
        arguments: dict[str, Any] = {"code": code}
        if session_id:
            arguments["session_id"] = session_id
        result, problem = _outcome(arguments, on_result=on_result, config=config, sessions=sessions, store=store,
                                    conversation=conversation)
        if problem:
            return f"Tool error: {problem}"
        assert result is not None
        return tools.render_for_llm(result, budget=budget)

    return StructuredTool.from_function(
        func=run, name=name, description=tools.description(config, stateful=sessions is not None),
        args_schema=CodeInput)
