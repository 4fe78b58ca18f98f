"""The value types of an execution's result and their one JSON shape.

Every value type here is a frozen dataclass, and its JSON shape is read off its fields (`to_dict`, `from_dict`,
`json_schema`): there is no second description to drift. A field's metadata says how it travels: ``host`` marks a
path on this host (left out of the ``public`` shape the HTTP service and nodes send), ``json=False`` keeps it out
of JSON altogether (the notebook itself, which is at ``notebook_path``), ``digits`` rounds a float. Pure.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, TypeVar

from nbformat import NotebookNode

from .kinds import ERROR_KINDS, ErrorKind, PackageStatus, RestoredBy, UploadKind, UploadStatus

_HOST = {"host": True}  # a path on this host: never in the public shape
_T = TypeVar("_T")


class _Value:
    """The JSON shape of a value type, read off its dataclass fields (see the module docstring)."""

    def to_dict(self, *, public: bool = False) -> dict[str, Any]:
        """The documented JSON shape (docs/library.md, "Result JSON"); ``public`` leaves out every path on this host."""
        return {f.name: _dump(getattr(self, f.name), f, public) for f in _fields(type(self), public)}

    @classmethod
    def from_dict(cls: type[_T], data: Any) -> _T:
        """The value ``to_dict`` made (either shape); ValueError naming the field that does not fit."""
        return typing.cast(_T, _load(cls, data, cls.__name__))

    @staticmethod
    def extra_schema() -> dict[str, Any]:
        """Keys ``to_dict`` adds beyond the fields (derived from them), as JSON schema properties."""
        return {}


def _fields(cls: type, public: bool = False) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("json", True) and not (public and f.metadata.get(
        "host"))]


def _dump(value: Any, spec: dataclasses.Field[Any] | None, public: bool) -> Any:
    digits = spec.metadata.get("digits") if spec is not None else None
    if spec is not None and spec.metadata.get("as_is"):  # the kernel's JSON: a walk in Python costs seconds a MiB
        return list(value)
    if isinstance(value, _Value):
        return value.to_dict(public=public)
    if isinstance(value, (tuple, list)):
        return [_dump(item, None, public) for item in value]
    if isinstance(value, dict):
        return {k: round(v, digits) if digits is not None else _dump(v, None, public) for k, v in value.items()}
    if digits is not None and isinstance(value, float):
        return round(value, digits)
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=globals())


def _load(kind: Any, data: Any, where: str) -> Any:
    """``data`` checked against the type ``kind`` and turned into it."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        return _load(next(a for a in args if a is not type(None)), data, where)
    if isinstance(kind, type) and issubclass(kind, _Value):
        return _load_value(kind, data, where)
    if origin is typing.Literal:  # a word of nbexec.kinds: only the listed ones
        if not isinstance(data, str) or data not in args:
            raise ValueError(f"{where} is not one of {', '.join(args)}")
        return data
    if origin is tuple:
        if not isinstance(data, list):
            raise ValueError(f"{where} is not a list")
        return tuple(_load(args[0], item, f"{where}[{i}]") for i, item in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not an object")
        return {str(k): _load(args[1], v, f"{where}.{k}") for k, v in data.items()}
    return _scalar(kind, data, where)


def _load_value(kind: type[_Value], data: Any, where: str) -> _Value:
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not an object")
    hints, values = _hints(kind), dict[str, Any]()
    for spec in dataclasses.fields(typing.cast(Any, kind)):
        if not spec.metadata.get("json", True):
            values[spec.name] = None  # not in JSON: the caller fills it in
        elif spec.name in data:
            values[spec.name] = _load(hints[spec.name], data[spec.name], f"{where}.{spec.name}")
        elif spec.metadata.get("host"):  # the public shape: no path here
            values[spec.name] = None if "None" in str(hints[spec.name]) else ""
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}.{spec.name} is missing")
    return kind(**values)


def _scalar(kind: Any, data: Any, where: str) -> Any:
    if kind is Any:
        return data
    if kind is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if kind in (str, int, bool) and type(data) is kind:
        return data
    raise ValueError(f"{where} is not a {getattr(kind, '__name__', kind)}")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_schema(cls: type | None = None, *, public: bool = False) -> dict[str, Any]:
    """The JSON schema (draft 2020-12, nothing referenced: every object inline) of a value type's ``to_dict``
    (default: ExecutionResult), read off the same fields."""
    return _schema(ExecutionResult if cls is None else cls, public)


def _schema(kind: Any, public: bool) -> dict[str, Any]:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        inner = _schema(next(a for a in args if a is not type(None)), public)
        return {"anyOf": [inner, {"type": "null"}]}
    if isinstance(kind, type) and issubclass(kind, _Value):
        hints = _hints(kind)
        properties = {f.name: _schema(hints[f.name], public) for f in _fields(kind, public)}
        properties.update(kind.extra_schema())
        required = [f.name for f in _fields(kind, public)]
        return {"type": "object", "title": kind.__name__, "properties": properties, "required": required,
                "additionalProperties": True}  # a field the result gains reaches clients before they know it
    if origin is typing.Literal:
        return {"type": "string", "enum": list(args)}
    if origin is tuple:
        return {"type": "array", "items": _schema(args[0], public)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(args[1], public)}
    if kind is Any:
        return {}
    return {"type": _JSON_TYPES[kind]}


@dataclass(frozen=True)
class CellError(_Value):
    """Why an execution failed. ``kind`` is one of ERROR_KINDS; ``traceback`` lines carry no ANSI escapes."""

    ename: str
    evalue: str
    traceback: tuple[str, ...]
    kind: ErrorKind = "exception"
    cell_index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:  # a word the docs do not list never reaches a caller
            raise ValueError(f"CellError.kind {self.kind!r} is not one of {', '.join(ERROR_KINDS)}")

    @property
    def traceback_text(self) -> str:
        return "\n".join(self.traceback)



@dataclass(frozen=True)
class Image(_Value):
    """An image output, saved on the host. Its JSON also names the file (``name``: the last part of ``path``)."""

    mime: str
    path: str = field(metadata=_HOST)
    cell_index: int
    size: int
    url: str | None = None

    def to_dict(self, *, public: bool = False) -> dict[str, Any]:
        return {**super().to_dict(public=public), "name": PurePath(self.path).name if self.path else ""}

    @staticmethod
    def extra_schema() -> dict[str, Any]:
        return {"name": {"type": "string"}}


@dataclass(frozen=True)
class File(_Value):
    """A regular file the code left in /mnt/data. ``name`` is relative to /mnt/data."""

    name: str
    path: str = field(metadata=_HOST)
    size: int
    mime: str
    sha256: str
    url: str | None = None



@dataclass(frozen=True)
class SkippedFile(_Value):
    """Something in /mnt/data that was not collected, and why (a link, a FIFO, a size cap, a bad name...)."""

    name: str
    reason: str



@dataclass(frozen=True)
class Upload(_Value):
    """What happened to one file or image in the artifact store: uploaded, kept (local store), failed or
    skipped (a cap). ``url`` is set when the file can be fetched; ``reason`` says why not."""

    name: str
    kind: UploadKind
    status: UploadStatus
    url: str | None
    reason: str | None = None
    blob: str | None = None



@dataclass(frozen=True)
class Package(_Value):
    """A package asked for by the call or a pip line of the code, and what became of it (see `nbexec.packages`).

    ``status``: installed (asked by the call, installed before the code ran), provided (its wheel was put in
    /mnt/wheels for the code's own pip line, or as a dependency), refused (the policy; never downloaded) or
    failed (it could not be resolved or installed). ``reason`` says why for the last two."""

    name: str
    status: PackageStatus
    version: str | None = None
    sha256: str | None = None
    filename: str | None = None
    size: int | None = None
    requested: bool = True
    reason: str | None = None



@dataclass(frozen=True)
class Connection(_Value):
    """One connection through the egress proxy of ``network="allowlist"`` (see `nbexec.egress`): where to, whether
    it was allowed, why it was refused or ended (``reason``), the address the host connected to, and the bytes
    sent up (from the sandbox) and down. ``open``: still open when the execution ended (logged again next time)."""

    host: str
    port: int
    method: str
    allowed: bool
    reason: str | None = None
    address: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    open: bool = False



@dataclass(frozen=True)
class ExecutionResult(_Value):
    """Everything one execution produced. ``ok`` is False when the code raised, timed out or was stopped."""

    ok: bool
    execution_id: str
    stdout: str
    stderr: str
    text: str
    error: CellError | None
    outputs: tuple[dict[str, Any], ...] = field(metadata={"as_is": True})  # plain JSON: never walked by to_dict
    images: tuple[Image, ...]
    files: tuple[File, ...]
    skipped_files: tuple[SkippedFile, ...]
    notebook: NotebookNode = field(repr=False, compare=False, metadata={"json": False})  # at notebook_path
    notebook_path: str | None = field(metadata=_HOST)
    output_dir: str = field(metadata=_HOST)
    duration_s: float = field(metadata={"digits": 6})
    timings: dict[str, float] = field(metadata={"digits": 6})
    truncated_bytes: int = 0
    uploads: tuple[Upload, ...] = ()
    notes: tuple[str, ...] = ()  # nbexec's own remarks on what it capped, dropped or enforced (never the code's)
    packages: tuple[Package, ...] = ()  # packages asked for and what became of them (nbexec.packages)
    connections: tuple[Connection, ...] = ()  # network="allowlist": every connection tried (nbexec.egress)
    node: str | None = None  # the node that ran it (NBEXEC_NODES, `nbexec serve`); None for a local run
    exit_code: int | None = None  # Session.shell: the command's exit status (None for code, or when it never ended)
    restored: RestoredBy | None = None  # a sleeping session woke for this run: memory back by "checkpoint" or "replay"

    @classmethod
    def from_dict(cls, data: Any, notebook: NotebookNode | None = None) -> ExecutionResult:
        """The result ``to_dict`` made (either shape), with ``notebook`` (default: an empty one) as its notebook;
        ValueError naming the field that does not fit."""
        if not isinstance(data, dict):
            raise ValueError("ExecutionResult is not an object")
        empty = NotebookNode(nbformat=4, nbformat_minor=5, metadata={}, cells=[])
        loaded = _load(cls, data, cls.__name__)
        return dataclasses.replace(loaded, notebook=notebook if notebook is not None else empty)


    def to_json(self, **dumps_options: Any) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, **dumps_options)
