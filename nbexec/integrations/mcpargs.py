"""The arguments of `nbexec mcp`'s tools as a model sees them.

``execute_python`` is listed with nbexec's own schema. A call whose arguments do not fit gets a sentence the model
can act on: what is missing or mistyped, and what the tool takes. The validation library's report is never shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer

from . import tools

_JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
               "object": "an object", "array": "an array", "null": "null"}


async def declared(ctx: ServerRequestContext[Any, Any], call_next: CallNext, *,
                   images: tuple[str, ...] = (), languages: tuple[str, ...] = ()) -> HandlerResult:
    """List ``execute_python`` with the parameters of ``tools.ToolArguments``, the schema the other tools use.

    ``image`` is listed only when named images are allowed, ``language`` only when languages are offered. The SDK
    would derive a schema from the handler's signature instead. mcp 2.3 hands middleware the listing serialized."""
    result = await call_next(ctx)
    if ctx.method == "tools/list" and isinstance(result, dict):
        for tool in result.get("tools", []):
            if isinstance(tool, dict) and tool.get("name") == tools.DEFAULT_NAME:
                tool["inputSchema"] = tools.json_schema(images=images, languages=languages)
    return result


async def friendly(ctx: ServerRequestContext[Any, Any], call_next: CallNext, *, server: MCPServer,
                   images: tuple[str, ...] = (), languages: tuple[str, ...] = ()) -> HandlerResult:
    """Answer a tools/call whose arguments do not fit the tool's schema with a plain tool error.

    For execute_python the schema is the one `declared` lists."""
    params = ctx.params if isinstance(ctx.params, Mapping) else {}
    if ctx.method != "tools/call" or not isinstance(params.get("name"), str):
        return await call_next(ctx)
    schema = tools.json_schema(images=images, languages=languages) if params["name"] == tools.DEFAULT_NAME else \
        next((t.input_schema for t in await server.list_tools() if t.name == params["name"]), None)
    said = problem(params["name"], params.get("arguments") or {}, schema) if schema is not None else ""
    if not said:
        return await call_next(ctx)
    return {"content": [{"type": "text", "text": f"Tool error: {said}"}], "isError": True}


def problem(name: str, arguments: Any, schema: Mapping[str, Any]) -> str:
    """What is wrong with ``arguments`` for the tool ``name`` ("" when they fit ``schema``'s names and types)."""
    properties: Mapping[str, Any] = schema.get("properties") or {}
    takes = ", ".join(f'"{key}"' + (" (required)" if key in schema.get("required", ()) else "")
                      for key in properties)
    if not isinstance(arguments, Mapping):
        return f"the arguments of {name} must be a JSON object; it takes {takes}."
    found = [f'the "{key}" argument is missing' for key in schema.get("required", ()) if key not in arguments]
    for key, value in arguments.items():
        allowed = _types(properties.get(key, {}))
        if key in properties and allowed and _type(value) not in allowed and not (
                _type(value) == "integer" and "number" in allowed):
            found.append(f'the "{key}" argument must be {" or ".join(_JSON_TYPES.get(t, t) for t in allowed)}, '
                         f"not {_JSON_TYPES[_type(value)]}")
    if not found:
        return ""
    unknown = [key for key in arguments if key not in properties]
    extra = f" (it has no {', '.join(repr(k)[:40] for k in unknown[:5])})" if unknown else ""
    said = "; ".join(found)
    return f"{said[0].upper()}{said[1:]}. {name} takes {takes}{extra}."


def _types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a property's schema allows (``type``, or each ``anyOf`` branch's); none: any."""
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, list):
        return [k for k in kinds if isinstance(k, str)]
    return [k for branch in schema.get("anyOf", []) if isinstance(branch, Mapping) for k in _types(branch)]


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"
