"""Parameters as the assignments of an injected cell, in each language's syntax. Pure.

Python, R and Bash follow papermill's translators; papermill has none for TypeScript/JavaScript.

A value nbexec cannot write faithfully in a language is refused with a ConfigError naming it, never approximated.
That is a NUL character (neither R nor Bash strings hold one), a mapping for Bash, and, for R, Bash and Deno, a
value that is not plain data (str, int, float, bool, None, lists and mappings of them).
"""

from __future__ import annotations

import json
import keyword
import math
import re
from collections.abc import Mapping
from typing import Any

from nbexec.errors import ConfigError
from nbexec.languages import Language

_ASCII_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_R_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.]*|\.[A-Za-z_.][A-Za-z0-9_.]*")
_R_RESERVED = frozenset({
    "if", "else", "repeat", "while", "function", "for", "next", "break", "TRUE", "FALSE", "NULL", "Inf", "NaN",
    "NA", "NA_integer_", "NA_real_", "NA_character_", "NA_complex_", "in"})
_JS_RESERVED = frozenset({
    "break", "case", "catch", "class", "const", "continue", "debugger", "default", "delete", "do", "else",
    "enum", "export", "extends", "false", "finally", "for", "function", "if", "import", "in", "instanceof",
    "new", "null", "return", "super", "switch", "this", "throw", "true", "try", "typeof", "var", "void",
    "while", "with", "yield", "let", "static", "implements", "interface", "package", "private", "protected",
    "public", "await", "arguments", "eval", "undefined", "NaN", "Infinity"})
_BASH_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 _-.,:/+=@")
_DECLARED = re.compile(r"^\s*(?:export\s+)?(const|let|var)\s+([A-Za-z_$][\w$]*)", re.MULTILINE)


def render(language: Language, parameters: Mapping[str, Any], parameters_cell: str = "") -> str:
    """The injected cell's source: a comment, then one assignment per parameter.

    ``parameters_cell`` is the source of the cell tagged `parameters`. In Deno a name declared there with `let` or
    `var` is declared again with it."""
    if language.name == "python":
        lines = [f"{name} = {value!r}" for name, value in parameters.items()]
    elif language.name == "r":
        lines = [f"{_checked(name, _R_NAME, _R_RESERVED, 'R')} = {_r(value, name)}"
                 for name, value in parameters.items()]
    elif language.name == "bash":
        lines = [_bash(_checked(name, _ASCII_NAME, frozenset(), "Bash"), value) for name, value in parameters.items()]
    else:
        declared = {m[2]: m[1] for m in _DECLARED.finditer(parameters_cell)}
        lines = [f"{declared.get(name, 'const')} {_checked(name, _ASCII_NAME, _JS_RESERVED, 'TypeScript')} = "
                 f"{_json(value, name)};" for name, value in parameters.items()]
    return "\n".join([f"{language.comment} Parameters", *lines])


def _checked(name: str, pattern: re.Pattern[str], reserved: frozenset[str], language: str) -> str:
    if not pattern.fullmatch(name) or name in reserved or keyword.iskeyword(name):
        raise ConfigError(f"parameter name {name[:60]!r} is not a name {language} can assign (use ASCII letters, "
                          "digits and _, not a reserved word)")
    return name


def _plain(value: Any, name: str, depth: int = 0) -> None:
    """Refuse what is not plain data (or nested past 100 levels)."""
    if depth > 100:
        raise ConfigError(f"parameter {name} is nested too deeply")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"parameter {name} holds a NUL character, which this language's strings cannot hold")
    if isinstance(value, (list, tuple)):
        for item in value:
            _plain(item, name, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _plain(str(key), name, depth + 1)
            _plain(item, name, depth + 1)
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise ConfigError(f"parameter {name} is a {type(value).__name__}; only strings, numbers, booleans, null, "
                          "lists and mappings can be passed to this language")


def _r_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + re.sub(r"[\x01-\x1f\x7f]", lambda m: f"\\x{ord(m[0]):02x}", escaped) + '"'


def _r(value: Any, name: str) -> str:
    _plain(value, name)
    return _r_value(value)


def _r_value(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, str):
        return _r_string(value)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)  # a double in R, as papermill writes it
    if isinstance(value, dict):
        return "list(" + ", ".join(f"{_r_string(str(k))} = {_r_value(v)}" for k, v in value.items()) + ")"
    return "list(" + ", ".join(_r_value(item) for item in value) + ")"


def _bash(name: str, value: Any) -> str:
    """Assign with printf's %b from printable ASCII only.

    bash_kernel types each cell into readline, which acts on control characters (Ctrl-U erases the line). So no
    byte of a value may reach it as itself."""
    _plain(value, name)
    if isinstance(value, dict):
        raise ConfigError(f"parameter {name} is a mapping, which Bash variables cannot hold; pass strings, "
                          "numbers or a list (a Bash array)")
    if not isinstance(value, (list, tuple)):
        word = _bash_escaped(_bash_word(value))
        return f"{name}={word}" if "\\" not in word else f"printf -v {name} %b {word}"
    if any(isinstance(item, (list, tuple, dict)) for item in value):
        raise ConfigError(f"parameter {name} nests lists, which Bash arrays cannot hold")
    words = [_bash_escaped(_bash_word(item)) for item in value]
    if not any("\\" in word for word in words):  # plain words read as written
        return f"{name}=({' '.join(words)})"
    return "; ".join([f"{name}=()", *(f"printf -v '{name}[{i}]' %b {word}" for i, word in enumerate(words))])


def _bash_escaped(text: str) -> str:
    """``text`` single-quoted for printf's %b: letters, digits and a few marks as they are.

    Every other UTF-8 byte becomes a \\xHH escape, so quotes, backslashes and `!` never appear either."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError("a Bash parameter holds a lone surrogate, which is not text Bash can hold") from exc
    return "'" + "".join(chr(b) if chr(b) in _BASH_PLAIN else f"\\x{b:02x}" for b in data) + "'"


def _bash_word(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _json(value: Any, name: str) -> str:
    _plain(value, name)
    # JSON is a JavaScript expression (U+2028/2029 too, since ES2019); NaN and Infinity are JavaScript's globals.
    return json.dumps(value, ensure_ascii=True)
