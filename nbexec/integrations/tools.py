"""LLM tool definitions and model-facing rendering: what the model is told, and what it gets back. Pure."""

from __future__ import annotations

import base64
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from nbexec.config import SandboxConfig
from nbexec.names import DEFAULT_IMAGE_NAME
from nbexec.notebook.outputs import clean, strip_ansi
from nbexec.result import ExecutionResult

from . import wording

DEFAULT_NAME = "execute_python"  # never "python": models tuned on ChatGPT's tool send that one bare strings
DEFAULT_BUDGET = 8000
LIBRARIES = "numpy, pandas, matplotlib, scipy, seaborn, scikit-learn, pillow, openpyxl, sympy"
SPOKEN = {"python": "Python", "r": "R", "deno": "TypeScript or JavaScript (Deno)", "bash": "Bash"}


def description(config: SandboxConfig | None = None, *, stateful: bool = False, by_session_id: bool = True) -> str:
    """The truth about the environment, as configured, for the model. ``stateful`` with ``by_session_id``: the
    tool takes a session_id; without it, state is kept per connection (MCP) and no session_id is mentioned."""
    config = config or SandboxConfig()
    if not stateful:
        kernel = SPOKEN[config.language].split(" (")[0]
        state = f"Each call starts a fresh {kernel} process: nothing persists between calls."
    elif by_session_id:
        state = ("State persists between calls that pass the session_id the first call returned (variables, "
                 "imports, files).")
    else:
        state = "State persists between calls in this conversation (variables, imports, files)."
    network = "The sandbox has internet access." if config.network is True else \
        "There is no internet access: do not try to download data or install packages."
    if config.language != "python":
        return (f"Execute {SPOKEN[config.language]} code in a sandboxed Jupyter kernel and return its output. "
                f"{state} Save files to /mnt/data (the working directory); they are returned to the user as links, "
                "and you can reference them as sandbox:/mnt/data/<name>. Plots and rich values the kernel displays "
                f"are shown to the user automatically. {network} {limits(config)}"
                f"{_images(config, stateful)}{_languages(config, stateful)} Print what you need to see.")
    if config.network is not True and config.packages != "off":
        network = ("There is no internet access, so do not try to download data; but `%pip install <name>` at the "
                   "start of a line works for common data, science, plotting, file-format and text libraries (the "
                   "wheel is fetched for you and installed offline; a package outside the allowed list is refused "
                   "with a message saying why).")
    if config.network == "allowlist":
        network += (" HTTP and HTTPS to these hosts only work, through the proxy set in HTTP_PROXY/HTTPS_PROXY "
                    f"(urllib, requests and pip use it): {', '.join(config.allowed_hosts)}.")
    return (
        "Execute Python code in a sandboxed Jupyter kernel and return its output. "
        f"{state} Save files to /mnt/data (the working directory); they are returned to the user as links, "
        "and you can reference them as sandbox:/mnt/data/<name>. Charts shown with plt.show() or display() "
        "are shown to the user automatically, and so is a window (tkinter, turtle) still open when a call ends. "
        f"{network} {limits(config)} Installed: {LIBRARIES}.{_images(config, stateful)}"
        f"{_languages(config, stateful)} Print what you need to see: only printed output and the last expression's "
        "value come back."
    )


def offered(config: SandboxConfig) -> tuple[str, ...]:
    """The languages a model may choose with the ``language`` argument (the default first); none when only one."""
    names = tuple(dict.fromkeys((config.language, *config.languages)))
    return names if len(names) > 1 else ()


def _languages(config: SandboxConfig, stateful: bool) -> str:
    if not offered(config):
        return ""
    kept = " (a session keeps the language of its first call)" if stateful else ""
    others = ", ".join(f"{name} ({SPOKEN[name]})" for name in offered(config)[1:])
    return (f" Code in another language runs with the language argument{kept}: {others}; omitted, it is "
            f"{config.language}. %pip and the libraries above are for Python only.")


def _images(config: SandboxConfig, stateful: bool) -> str:
    if not config.images:
        return ""
    kept = " (a session keeps the image of its first call)" if stateful else ""
    return (f" Other images with more installed can be chosen with the image argument{kept}: "
            f"{', '.join(config.images)}; default is the standard one.")


@dataclass(frozen=True, kw_only=True)
class ToolArguments:
    """What a model passes to the tool: the one definition the OpenAI, Anthropic and MCP schemas are made from.

    A field whose metadata says ``sessions`` exists only in the stateful tool. A dataclass, not a pydantic model, so
    this module needs nothing beyond the core dependencies."""

    code: str = field(metadata={"description": "The source to run (Python unless the description says otherwise)."})
    session_id: str | None = field(default=None, metadata={"sessions": True, "description": (
        "The session_id an earlier call returned, to keep its state; omit it to start a new session. "
        "Never make one up.")})
    image: str | None = field(default=None, metadata={"images": True, "description": (
        "The image to run in, one of those listed; omit it for the default one.")})
    language: str | None = field(default=None, metadata={"languages": True, "description": (
        "The code's language, one of those listed; omit it for the default one.")})


@dataclass(frozen=True, kw_only=True)
class ShellArguments:
    """What a model passes to the shell tool (OpenAI function, Anthropic custom tool, MCP ``shell``)."""

    command: str = field(metadata={"description": "The shell command to run (/bin/sh -c), in /mnt/data."})
    session_id: str | None = field(default=None, metadata={"sessions": True, "description": (
        "The session_id an earlier call returned, to use its sandbox (files, and the Python tool's state); omit it "
        "to start a new session. Never make one up.")})


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
SHELL_NAME = "shell"


def shell_description(config: SandboxConfig | None = None, *, stateful: bool = False,
                      by_session_id: bool = True) -> str:
    """The truth about the shell tool, as configured, for the model."""
    config = config or SandboxConfig()
    if not stateful:
        state = "Each call runs in a fresh sandbox."
    elif by_session_id:
        state = ("Calls that pass the session_id the first call returned share one sandbox (its files, and the Python "
                 "tool's variables when it is given the same session_id).")
    else:
        state = "Calls in this conversation share one sandbox with the Python tool (its files)."
    return (f"Run a shell command (/bin/sh -c) in the same sandbox as the Python tool, with /mnt/data as the working "
            f"directory. {state} Each command starts a fresh shell: cd and exported variables do not carry over, "
            "files do. Only /mnt/data and /tmp are writable. The exit code comes back with stdout and stderr; "
            "processes left running in the background are killed when the command ends. "
            f"{'There is internet access.' if config.network is True else 'There is no internet access.'} "
            f"{limits(config)}")


def limits(config: SandboxConfig) -> str:
    """The limits a call runs under, from the config, as one or two sentences a person would write."""
    cell = f" ({wording.duration(config.cell_timeout)} per cell)" \
        if config.cell_timeout and config.cell_timeout < config.timeout else ""
    data = f" ({wording.size(config.max_data_bytes)} in all)" if config.max_data_bytes else ""
    cpus = f"{config.cpus:g} CPU{'' if config.cpus == 1 else 's'}"
    return (f"Each call is limited to {wording.duration(config.timeout)}{cell}, {wording.size(config.memory)} of "
            f"memory and {cpus}; printed text past {wording.size(config.max_output)} per call is dropped; at most "
            f"{wording.count(config.max_files, 'file')}{data} in /mnt/data come back.")


def json_schema(*, sessions: bool = False, images: tuple[str, ...] = (), languages: tuple[str, ...] = (),
                arguments: type = ToolArguments) -> dict[str, Any]:
    """The tool's parameters as JSON Schema, from ``arguments`` (``ToolArguments``: ``code``, with sessions
    ``session_id``, with named images allowed ``image`` (their names and "default"), with languages offered
    ``language`` (their names, the default first); or ``ShellArguments``)."""
    hints = get_type_hints(arguments)
    properties: dict[str, Any] = {}
    required = []
    for item in fields(arguments):
        if (item.metadata.get("sessions") and not sessions) or (item.metadata.get("images") and not images) \
                or (item.metadata.get("languages") and not languages):
            continue
        kind = next(t for t in (hints[item.name], *get_args(hints[item.name])) if t in _JSON_TYPES)
        properties[item.name] = {"type": _JSON_TYPES[kind], "description": item.metadata["description"]}
        if item.metadata.get("images"):
            properties[item.name]["enum"] = [DEFAULT_IMAGE_NAME, *images]
        if item.metadata.get("languages"):
            properties[item.name]["enum"] = list(languages)
        if item.default is MISSING:
            required.append(item.name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def openai_tool(config: SandboxConfig | None = None, *, name: str = DEFAULT_NAME, sessions: bool = False,
                api: str = "chat") -> dict[str, Any]:
    """A function tool for OpenAI's Chat Completions (``api="chat"``) or Responses API (``api="responses"``)."""
    images = config.images if config is not None else ()
    languages = offered(config) if config is not None else ()
    body = {"name": name, "description": description(config, stateful=sessions),
            "parameters": json_schema(sessions=sessions, images=images, languages=languages)}
    if api == "responses":  # strict schemas need every property required: true only without optional ones
        return {"type": "function", **body, "strict": not sessions and not images and not languages}
    if api != "chat":
        raise ValueError("api must be 'chat' or 'responses'")
    return {"type": "function", "function": body}


def anthropic_tool(config: SandboxConfig | None = None, *, name: str = DEFAULT_NAME,
                   sessions: bool = False) -> dict[str, Any]:
    """A client tool for Anthropic's Messages API."""
    return {"name": name, "description": description(config, stateful=sessions),
            "input_schema": json_schema(sessions=sessions, images=config.images if config is not None else (),
                                        languages=offered(config) if config is not None else ())}


def openai_shell_tool(config: SandboxConfig | None = None, *, name: str = SHELL_NAME, sessions: bool = False,
                      api: str = "chat") -> dict[str, Any]:
    """The shell tool as an OpenAI function tool (Chat Completions or Responses API), arguments ``ShellArguments``.
    (OpenAI's own ``{"type": "shell"}`` tool is served too: `hosted_shell_tool`.)"""
    body = {"name": name, "description": shell_description(config, stateful=sessions),
            "parameters": json_schema(sessions=sessions, arguments=ShellArguments)}
    if api == "responses":
        return {"type": "function", **body, "strict": not sessions}
    if api != "chat":
        raise ValueError("api must be 'chat' or 'responses'")
    return {"type": "function", "function": body}


def hosted_shell_tool() -> dict[str, Any]:
    """OpenAI's Responses API shell tool with a local environment: the model sends ``shell_call`` items that
    `nbexec.integrations.toolcall.handle_openai_shell_call` runs in the sandbox."""
    return {"type": "shell", "environment": {"type": "local"}}


def anthropic_shell_tool(config: SandboxConfig | None = None, *, name: str = SHELL_NAME,
                         sessions: bool = False) -> dict[str, Any]:
    """The shell tool as a client tool for Anthropic's Messages API (``input_schema`` from ``ShellArguments``)."""
    return {"name": name, "description": shell_description(config, stateful=sessions),
            "input_schema": json_schema(sessions=sessions, arguments=ShellArguments)}


def anthropic_bash_tool() -> dict[str, Any]:
    """Anthropic's own bash tool (``bash_20250124``; inputs ``command`` and ``restart``), which nbexec serves with
    `nbexec.integrations.toolcall.handle_anthropic_tool_use`: each command runs in a fresh shell in the sandbox
    (files persist; cd and variables do not, unlike a persistent bash), and ``restart`` restarts the session."""
    return {"type": "bash_20250124", "name": "bash"}


_FRAME_STARTS = ("File ", "Cell In[", "<ipython-input", "Input In [")
_USER_FRAME_STARTS = ("Cell In[", "<ipython-input", "Input In [")


def _trim_traceback(lines: tuple[str, ...]) -> list[str]:
    """Keep the user's frames (``Cell In[...]``) and the final error line; count the library frames dropped.
    IPython gives one entry per frame, between a header (a rule and ``Name  Traceback (most recent call
    last)``) and the error line; chained exceptions repeat header and frames."""
    if not lines:
        return []
    plain = [strip_ansi(line).lstrip() for line in lines[:-1]]
    frames = [index for index, line in enumerate(plain) if line.startswith(_FRAME_STARTS)]
    if not frames:  # not IPython's shape (R's call stack, Deno's): every line is the kernel's own account
        return list(lines)
    kept = [lines[index] for index in frames if plain[index].startswith(_USER_FRAME_STARTS)]
    dropped = len(frames) - len(kept)
    note = [f"({dropped} frame{'s' if dropped != 1 else ''} inside libraries omitted)"] if dropped else []
    return kept + note + [lines[-1]]


_NETWORK_NAMES = {"ConnectionError", "URLError", "gaierror", "ConnectTimeout", "ConnectError", "MaxRetryError",
                  "NewConnectionError", "ProxyError", "ConnectionRefusedError", "ClientConnectorError",
                  "NameResolutionError"}
_NETWORK_SAID = ("Name or service not known", "Temporary failure in name resolution", "Network is unreachable",
                 "Failed to establish a new connection", "No address associated with hostname", "Failed to resolve",
                 "Tunnel connection failed", "Connection refused")
NO_NETWORK = ("The code failed to reach the network. Internet access in this sandbox is off by default (the tool "
              "description says whether it is on here, and for which hosts), so calling again will fail the same "
              "way: do not retry the download. Use the files in /mnt/data, or data the code makes itself.")
KERNEL_DIED = ("The kernel's process ended and its variables are lost (see why above). Your next call starts a fresh "
               "kernel: run again the imports and definitions you need, without what ended the process.")


def reached_for_network(result: ExecutionResult) -> bool:
    """Whether the code failed trying to reach the network (by the exception's name or what it says)."""
    error = result.error
    if error is None or error.kind != "exception":
        return False
    said = f"{error.evalue}\n{error.traceback[-1] if error.traceback else ''}"
    return error.ename in _NETWORK_NAMES or any(text in said for text in _NETWORK_SAID)


def _hint(result: ExecutionResult) -> str:
    error = result.error
    assert error is not None
    if reached_for_network(result):
        return NO_NETWORK
    return {
        "exception": "Fix the code and call the tool again.",
        "timeout": "The code ran out of time: make it faster or work on less data, then call the tool again.",
        "oom": "The code ran out of memory: use less (smaller data, chunks), then call the tool again.",
        "kernel_died": KERNEL_DIED,
        "limit": "Too much data was written to /mnt/data: write less and call the tool again.",
    }.get(error.kind, "Fix the code and call the tool again.")


def truncate(text: str, budget: int) -> str:
    """Keep the head and the tail of ``text`` within ``budget`` characters, saying how much was cut."""
    if len(text) <= budget:
        return text
    marker = "\n[... {} characters omitted ...]\n"
    room = max(0, budget - len(marker.format(len(text))))
    head, tail = text[: room * 2 // 3], text[len(text) - room // 3:] if room // 3 else ""
    return head + marker.format(len(text) - len(head) - len(tail)) + tail


def _error_part(result: ExecutionResult) -> str:
    error = result.error
    assert error is not None
    if error.kind == "exit":
        return f"Exit code {result.exit_code}."
    trace = clean("\n".join(_trim_traceback(error.traceback)) or f"{error.ename}: {error.evalue}")
    said = clean(error.evalue).strip()
    if said and said not in trace:  # the message itself, wherever the kernel put it
        trace = f"{clean(error.ename)}: {said}\n{trace}"
    return f"Error ({error.kind}): {clean(error.ename)}\n{trace}\n{_hint(result)}"


def served(url: str | None) -> str:
    """`` (URL)`` when a store serves the file at a URL the model may hand on (https, an MCP resource); never a
    host path or file:// link, which nobody but this host can open."""
    return f" ({clean(url)})" if url and url.split(":", 1)[0].lower() in _SERVED else ""


_SERVED = ("https", "http", "nbexec")


def _listing(result: ExecutionResult) -> str:
    parts = []
    if result.files:
        parts.append("Files in /mnt/data (link to them as shown):\n" + "\n".join(
            f"- sandbox:/mnt/data/{clean(f.name)} ({f.size:,} bytes){served(f.url)}" for f in result.files))
    if result.images:
        parts.append("Images shown to the user:\n" + "\n".join(
            f"- {clean(Path(i.path).name)}{served(i.url)}" for i in result.images))
    return "\n\n".join(parts)


def render_for_llm(result: ExecutionResult, *, budget: int = DEFAULT_BUDGET) -> str:
    """Compact text for the model: output, the error with the user's frames and a hint, files and images.

    The error (up to half of ``budget``: its head, with the kind and name, and its tail, with the last frame and
    the hint) and the listings (up to a quarter) are given their room first, so no amount of output pushes the
    failure out of what the model reads."""
    error = truncate(_error_part(result), budget // 2) if result.error is not None else ""
    listing = truncate(_listing(result), budget // 4)
    after = "\n\n".join(part for part in (error, listing) if part)
    text = clean(result.text).strip("\n")
    room = budget - len(after) - (2 if after else 0)
    parts = [truncate(text, room)] if text and room > 0 else []
    body = "\n\n".join(parts + ([after] if after else [])) or "(no output)"
    return truncate(body, budget)


def _encoded_images(result: ExecutionResult, max_images: int) -> list[tuple[str, str]]:
    """(mime, base64) of the first raster images a model API accepts (SVG is left out)."""
    encoded = []
    for image in result.images[:max_images]:
        if image.mime not in ("image/png", "image/jpeg", "image/gif"):
            continue
        try:
            encoded.append((image.mime, base64.b64encode(Path(image.path).read_bytes()).decode("ascii")))
        except OSError:
            continue
    return encoded


def anthropic_content(result: ExecutionResult, *, budget: int = DEFAULT_BUDGET,
                      max_images: int = 4) -> list[dict[str, Any]]:
    """Content blocks for an Anthropic tool_result: the text, then the images."""
    return [{"type": "text", "text": render_for_llm(result, budget=budget)}] + [
        {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}
        for mime, data in _encoded_images(result, max_images)]


def openai_content(result: ExecutionResult, *, budget: int = DEFAULT_BUDGET,
                   max_images: int = 4) -> list[dict[str, Any]]:
    """Content parts for an OpenAI Responses ``function_call_output``: input_text, then input_image."""
    return [{"type": "input_text", "text": render_for_llm(result, budget=budget)}] + [
        {"type": "input_image", "image_url": f"data:{mime};base64,{data}"}
        for mime, data in _encoded_images(result, max_images)]
