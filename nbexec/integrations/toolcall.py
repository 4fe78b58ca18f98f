"""Run a model's tool call and answer in that API's shape. Malformed calls and sandbox failures come back to the
model as tool errors; nothing here raises into the caller's loop.

Every handler takes ``config``, ``sessions`` (a SessionManager: stateful, by ``session_id``), ``conversation``
(the caller's key for the chat: a session made in one conversation is not found from another sharing the same
SessionManager), ``store`` and ``on_result`` (called with each ExecutionResult, e.g. to keep the file links for
the final answer).

Session ids are issued by nbexec, never chosen by the model: an id nbexec did not issue to this conversation is a
tool error telling the model to omit it, so a model cannot create or join a session by naming one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbexec import notebook
from nbexec.config import SandboxConfig, from_env
from nbexec.engine.execute import execute_notebook
from nbexec.engine.manager import SessionManager
from nbexec.engine.session import Session
from nbexec.errors import CellTooLargeError, ConfigError, NbexecError, SessionError
from nbexec.files.folders import output_root
from nbexec.files.workdir import remove_tree
from nbexec.result import ExecutionResult
from nbexec.stores.storage import ArtifactStore

from . import sessionview, tools


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def parse_arguments(raw: Any, *, shell: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments, None) or (None, an error message for the model). ``shell``: the shell tool's arguments
    (``command``; Anthropic's bash tool may send ``restart`` instead)."""
    if shell:
        return _shell_arguments(raw)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return None, ('The arguments were not JSON. Call the tool with a JSON object such as '
                          '{"code": "print(1 + 1)"}.')
    if not isinstance(raw, Mapping):
        return None, 'The arguments must be a JSON object such as {"code": "print(1 + 1)"}.'
    code = raw.get("code")
    if not isinstance(code, str) or not code.strip():
        return None, 'The "code" argument is missing or empty: pass the source to run as "code".'
    session_id = raw.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        return None, 'The "session_id" argument must be a string.'
    image = raw.get("image")
    if image is not None and not isinstance(image, str):
        return None, 'The "image" argument must be the name of one of the images listed, or omitted.'
    language = raw.get("language")
    if language is not None and not isinstance(language, str):
        return None, 'The "language" argument must be the name of one of the languages listed, or omitted.'
    return dict(raw), None


def _shell_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            raw = None
    if not isinstance(raw, Mapping):
        return None, 'The arguments must be a JSON object such as {"command": "ls -l"}.'
    command = raw.get("command")
    if raw.get("restart") is True and command is None:
        return {**raw, "shell": True}, None
    if not isinstance(command, str) or not command.strip():
        return None, 'The "command" argument is missing or empty: pass the shell command to run as "command".'
    session_id = raw.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        return None, 'The "session_id" argument must be a string.'
    return {**raw, "shell": True}, None


def _scope(conversation: str | None) -> str:
    """The prefix of the session ids issued to ``conversation`` (none without one)."""
    if conversation is None:
        return ""
    return "c" + hashlib.sha256(conversation.encode("utf-8")).hexdigest()[:16] + "-"


def _session(sessions: SessionManager, session_id: str | None, conversation: str | None,
             store: ArtifactStore | None, config: SandboxConfig | None) -> Session | str:
    """The conversation's session named ``session_id``, a new one (with ``config``) without an id, or a message
    for the model."""
    scope = _scope(conversation)
    if not session_id:
        try:
            return sessions.create(session_id=scope + uuid.uuid4().hex, store=store, config=config)
        except SessionError as exc:
            return f"Cannot start a session: {exc}"
    unknown = (f"There is no session {session_id[:80]!r} in this conversation (it was closed, reaped after "
               "being idle, or never issued). Omit session_id to start a new session; its id comes back in the "
               "result.")
    if not re.fullmatch(re.escape(scope) + "[0-9a-f]{32}", session_id):
        return unknown
    try:
        return sessions.get(session_id)
    except SessionError:
        return unknown


def run(arguments: Mapping[str, Any], *, config: SandboxConfig | None = None, sessions: SessionManager | None = None,
        store: ArtifactStore | None = None, conversation: str | None = None) -> ExecutionResult | str:
    """Execute parsed arguments one-shot, or in the conversation's session when ``sessions`` is given."""
    session_id = arguments.get("session_id")
    asked, language, chosen = arguments.get("image"), arguments.get("language"), config
    if asked is not None or language is not None:
        # only a name the operator allows (config.images, config.languages); never a Docker tag the model made up
        try:
            chosen = (config or (sessions.config if sessions is not None else None) or from_env()) \
                .choose_image(asked).offer_language(language)
        except ConfigError as exc:
            return f"{exc}"
    if sessions is None:
        return _one_shot(arguments, chosen, store)
    session = _session(sessions, session_id, conversation, store, chosen)
    if isinstance(session, str):
        return session
    if session_id and chosen is not None and asked is not None and session.config.image != chosen.image:
        return (f"Session {session_id[:80]} runs in the image it started with; omit image to keep using it, or omit "
                "session_id to start a new session in another image.")
    if session_id and chosen is not None and language is not None and session.config.language != chosen.language:
        return (f"Session {session_id[:80]} runs {session.config.language} code, the language it started with; "
                "omit language to keep using it, or omit session_id to start a new session in another language.")
    try:
        result = _in_session(session, arguments)
    except SessionError as exc:
        return f"{exc}"
    if isinstance(result, str):
        return result
    if not session_id:  # the model must learn the id to keep its state
        note = f"[session_id: {session.id}; pass it again to keep variables and files]\n"
        result = dataclasses.replace(result, text=note + result.text)
    return result


def _one_shot(arguments: Mapping[str, Any], config: SandboxConfig | None,
              store: ArtifactStore | None) -> ExecutionResult | str:
    if not arguments.get("shell"):
        config = config or from_env()  # the model's code is built as code: a str naming a file is never a path
        return execute_notebook(notebook.build(arguments["code"], config.language), config=config, store=store)
    if arguments.get("command") is None:
        return "There is nothing to restart: each call without sessions runs in a fresh sandbox."
    session = Session(config or from_env(), ttl=None, store=store, one_shot=True)
    try:
        return session.shell(arguments["command"])
    finally:
        session.close()


def _in_session(session: Session, arguments: Mapping[str, Any]) -> ExecutionResult | str:
    if not arguments.get("shell"):  # a dead kernel is replaced (the model has no restart); only new files listed
        result = sessionview.revived(session, lambda: session.run(arguments["code"]))
        return sessionview.only_changed(session, result)
    if arguments.get("command") is None:  # Anthropic's bash tool: {"restart": true}
        session.restart()
        return RESTARTED
    return sessionview.revived(session, lambda: session.shell(arguments["command"]))


def outcome(raw_arguments: Any, on_result: Callable[[ExecutionResult], None] | None = None, *, shell: bool = False,
            **options: Any) -> tuple[ExecutionResult | None, str | None]:
    arguments, problem = parse_arguments(raw_arguments, shell=shell)
    if arguments is None:
        return None, problem
    try:
        outcome = run(arguments, **options)
    except CellTooLargeError as exc:  # the model's to fix: its code is too large for one cell
        return None, f"{exc}"
    except NbexecError as exc:  # the sandbox itself failed: tell the model it was not its fault
        return None, f"The sandbox is unavailable ({exc}). This is not an error in the code; try again later."
    if isinstance(outcome, str):
        return None, outcome
    if on_result is not None:
        on_result(outcome)
    return outcome, None


def _retire(result: ExecutionResult | None, options: Mapping[str, Any]) -> None:
    """Delete a one-shot run's folder once its reply is built, when its files went to a store that uploads (the
    links are all the model and the caller get); a local store's files stay, as their links point at them."""
    store = options.get("store")
    if result is None or options.get("sessions") is not None or store is None:
        return
    folder = Path(result.output_dir)
    if store.local_url(folder) is None and folder.parent == output_root():
        remove_tree(folder)


SHELL_NAMES = (tools.SHELL_NAME, "bash")  # tool names run as shell commands (Anthropic's bash tool is "bash")
RESTARTED = "The sandbox's kernel was restarted (files in /mnt/data are kept)."


def _is_shell(name: Any) -> bool:
    return name in SHELL_NAMES


def _text(result: ExecutionResult | None, problem: str | None, budget: int) -> str:
    if problem == RESTARTED:
        return problem
    return f"Tool error: {problem}" if problem else tools.render_for_llm(result, budget=budget)  # type: ignore[arg-type]


def handle_openai_tool_call(call: Any, *, budget: int = tools.DEFAULT_BUDGET, **options: Any) -> dict[str, Any]:
    """Chat Completions: take a tool call (SDK object or dict) and return the ``role: tool`` message. A call of
    the shell tool (named in SHELL_NAMES) runs its command."""
    function = _field(call, "function", {})
    result, problem = outcome(_field(function, "arguments", "{}"), shell=_is_shell(_field(function, "name")),
                              **options)
    content = _text(result, problem, budget)
    _retire(result, options)
    return {"role": "tool", "tool_call_id": _field(call, "id", ""), "content": content}


def handle_openai_function_call(call: Any, *, budget: int = tools.DEFAULT_BUDGET, **options: Any) -> dict[str, Any]:
    """Responses API: take a ``function_call`` item and return the ``function_call_output`` item (with images)."""
    result, problem = outcome(_field(call, "arguments", "{}"), shell=_is_shell(_field(call, "name")), **options)
    output: Any = _text(None, problem, budget) if problem else tools.openai_content(result, budget=budget)  # type: ignore[arg-type]
    _retire(result, options)
    return {"type": "function_call_output", "call_id": _field(call, "call_id", ""), "output": output}


def handle_openai_shell_call(call: Any, *, session: Session | None = None, config: SandboxConfig | None = None,
                             store: ArtifactStore | None = None) -> dict[str, Any]:
    """Responses API with `tools.hosted_shell_tool`: take a ``shell_call`` item and return its ``shell_call_output``
    item: stdout, stderr and the outcome (``exit`` with its code, or ``timeout``) of each of ``action.commands``, run
    one after another (until one fails) in ``session``, or in a throwaway sandbox for the call. A malformed call or
    a failed sandbox is one output with exit code 1 and the reason on stderr."""
    action = _field(call, "action", {})
    commands, timeout_ms = _field(action, "commands"), _field(action, "timeout_ms")
    most = _field(action, "max_output_length")
    reply = {"type": "shell_call_output", "call_id": _field(call, "call_id", ""), "output": list[dict[str, Any]]()}
    if not isinstance(commands, list) or not commands or not all(isinstance(c, str) for c in commands):
        reply["output"].append(_shell_output(None, "action.commands must be a non-empty list of strings"))
        return reply
    own = session is None
    running = session or Session(config or from_env(), ttl=None, store=store, keep_files=False)
    timeout = _shell_limit(timeout_ms, running.config.timeout)
    try:
        for command in commands:
            try:
                result = running.shell(command, timeout=timeout)
            except NbexecError as exc:
                reply["output"].append(_shell_output(None, f"{exc}"))
                break
            reply["output"].append(_shell_output(result, None, most if isinstance(most, int) and most > 0 else 0))
            if not result.ok:
                break
    finally:
        if own:
            running.close()
    return reply


def _shell_limit(timeout_ms: Any, ceiling: float) -> float:
    """The limit of each command: the operator's ``ceiling``, shortened (never lengthened) by the model's
    ``timeout_ms``."""
    if isinstance(timeout_ms, int) and not isinstance(timeout_ms, bool) and timeout_ms > 0:
        return min(timeout_ms, ceiling * 1000) / 1000  # compared as integers first: any JSON integer fits
    return ceiling


def _shell_output(result: ExecutionResult | None, problem: str | None, most: int = 0) -> dict[str, Any]:
    """One command's output item; ``most`` (the call's max_output_length) caps stdout and stderr together."""
    if result is None:
        return {"stdout": "", "stderr": f"Tool error: {problem}", "outcome": {"type": "exit", "exit_code": 1}}
    timed_out = result.error is not None and result.error.kind == "timeout"
    code = result.exit_code if result.exit_code is not None else 1
    stdout, stderr = result.stdout, result.stderr
    if result.error is not None and result.exit_code is None:  # stopped, not exited: say why
        stderr += f"{result.error.ename}: {result.error.evalue}\n"
    if most:
        stdout, stderr = stdout[:most], stderr[:max(0, most - len(stdout[:most]))]
    return {"stdout": stdout, "stderr": stderr,
            "outcome": {"type": "timeout"} if timed_out else {"type": "exit", "exit_code": code}}


def handle_anthropic_tool_use(block: Any, *, budget: int = tools.DEFAULT_BUDGET, **options: Any) -> dict[str, Any]:
    """Messages API: take a ``tool_use`` block and return the ``tool_result`` block (text and images). A block of
    the shell tool or of Anthropic's bash tool (``command``, or ``restart``) runs in the sandbox's shell."""
    result, problem = outcome(_field(block, "input", {}), shell=_is_shell(_field(block, "name")), **options)
    if problem:
        return {"type": "tool_result", "tool_use_id": _field(block, "id", ""), "is_error": problem != RESTARTED,
                "content": [{"type": "text", "text": _text(None, problem, budget)}]}
    assert result is not None
    content = tools.anthropic_content(result, budget=budget)
    _retire(result, options)
    return {"type": "tool_result", "tool_use_id": _field(block, "id", ""), "is_error": not result.ok,
            "content": content}
