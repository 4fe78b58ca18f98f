"""A LangChain tool that runs Python in nbexec's sandbox (needs the langchain extra: langchain-core).

The tool answers ``(content, artifact)`` (``response_format="content_and_artifact"``). The content is the text for
the model, then the images as standard image blocks. The artifact is the ExecutionResult, for the application.
When the code raised, the ToolMessage has ``status="error"`` and no artifact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbexec.config import SandboxConfig
from nbexec.engine.manager import SessionManager
from nbexec.result import ExecutionResult
from nbexec.stores.storage import ArtifactStore

from . import tools
from .toolcall import outcome

try:
    from langchain_core.tools import StructuredTool, ToolException
    from pydantic import BaseModel, Field
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("the LangChain tool needs the langchain extra: pip install 'nbexec-sandbox[langchain]'") from exc

Content = str | list[str | dict[str, Any]]


class CodeInput(BaseModel):
    code: str = Field(description="The source to run (Python unless the tool's description says otherwise).")


class SessionCodeInput(CodeInput):
    session_id: str | None = Field(default=None, description=(
        "The session_id an earlier call returned, to keep its state; omit it to start a new session."))


class CodeFailed(ToolException):
    """The code raised (or hit a limit): carries what the model is shown."""

    def __init__(self, content: Content) -> None:
        super().__init__("the code failed")
        self.content = content


def content(result: ExecutionResult, *, budget: int = tools.DEFAULT_BUDGET, max_images: int = 4) -> Content:
    """The model's view of a result: the text alone, or the text then one image block per raster image."""
    text = tools.render_for_llm(result, budget=budget)
    images = tools._encoded_images(result, max_images)
    if not images:
        return text
    blocks: list[str | dict[str, Any]] = [{"type": "text", "text": text}]
    return blocks + [{"type": "image", "base64": data, "mime_type": mime} for mime, data in images]


def _shown_on_failure(exc: ToolException) -> Content:
    return exc.content if isinstance(exc, CodeFailed) else f"Tool error: {exc}"


def execute_python_tool(config: SandboxConfig | None = None, *, sessions: SessionManager | None = None,
                        store: ArtifactStore | None = None, name: str = tools.DEFAULT_NAME,
                        budget: int = tools.DEFAULT_BUDGET, conversation: str | None = None,
                        on_result: Callable[[ExecutionResult], None] | None = None) -> StructuredTool:
    """A StructuredTool named ``execute_python``; stateful, with a ``session_id`` argument, given a SessionManager.

    When one manager serves several conversations, a session is found only by the ``conversation`` that made it."""

    def run(code: str, session_id: str | None = None) -> tuple[Content, ExecutionResult]:
        arguments: dict[str, Any] = {"code": code}
        if session_id:
            arguments["session_id"] = session_id
        result, problem = outcome(arguments, on_result=on_result, config=config, sessions=sessions, store=store,
                                    conversation=conversation)
        if problem:
            raise ToolException(problem)
        assert result is not None
        shown = content(result, budget=budget)
        if not result.ok:
            raise CodeFailed(shown)
        return shown, result

    return StructuredTool.from_function(
        func=run, name=name, description=tools.description(config, stateful=sessions is not None),
        args_schema=SessionCodeInput if sessions is not None else CodeInput,
        response_format="content_and_artifact", handle_tool_error=_shown_on_failure)
