"""Every type a user receives or passes is exported, and Session shows users only what they call.

The walk starts at `nbexec.__all__` and follows the annotations of every public function, method, property,
dataclass field and TypedDict key, recursively; any class or type alias of nbexec it meets must be exported.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Iterator
from typing import Any

import nbexec
from nbexec import errors
from nbexec.files import transfer

# Classes nbexec hands out but users never make: their constructors take nbexec's own internals.
NOT_MADE_BY_USERS = {transfer.FileChunks}


def _aliases() -> dict[Any, str]:
    """Every module-level type alias of nbexec (a Literal, a Callable, a generic): value -> where."""
    found: dict[Any, str] = {}
    for name, module in list(sys.modules.items()):
        if name == "nbexec" or not name.startswith("nbexec."):
            continue
        for attr, value in vars(module).items():
            if typing.get_origin(value) is not None and not attr.startswith("_"):
                found.setdefault(value, f"{name}.{attr}")
    return found


def _parts(annotation: Any) -> Iterator[Any]:
    """The annotation, then everything inside it (a union's members, a generic's arguments)."""
    yield annotation
    for argument in typing.get_args(annotation):
        yield from _parts(argument)


def _hints(thing: Any) -> dict[str, Any]:
    return typing.get_type_hints(thing)


class Walk:
    def __init__(self) -> None:
        self.aliases = _aliases()
        self.reached: dict[Any, str] = {}  # a class or alias of nbexec -> the path that reached it
        self.seen: set[int] = set()

    def annotation(self, annotation: Any, where: str) -> None:
        for part in _parts(annotation):
            if self._hashable(part) and part in self.aliases:
                self.reached.setdefault(part, where)
            origin = typing.get_origin(part)
            for kind in (part, origin):
                if isinstance(kind, type) and kind.__module__.startswith("nbexec"):
                    self.cls(kind, where)

    @staticmethod
    def _hashable(value: Any) -> bool:
        try:
            hash(value)
        except TypeError:
            return False
        return True

    def callable(self, function: Any, where: str) -> None:
        for name, annotation in _hints(function).items():
            self.annotation(annotation, f"{where}({name})")

    def cls(self, kind: type, where: str, *, constructed: bool = False) -> None:
        if id(kind) in self.seen:
            return
        self.seen.add(id(kind))
        self.reached.setdefault(kind, where)
        if issubclass(kind, BaseException):
            return
        if dataclasses.is_dataclass(kind) or typing.is_typeddict(kind):
            for name, annotation in _hints(kind).items():
                if not name.startswith("_"):
                    self.annotation(annotation, f"{where}.{name}")
        for name in dir(kind):
            if name.startswith("_") and not (name == "__init__" and constructed):
                continue
            member = inspect.getattr_static(kind, name)
            if isinstance(member, property) and member.fget is not None:
                self.callable(member.fget, f"{where}.{name}")
            elif isinstance(member, (staticmethod, classmethod)):
                self.callable(member.__func__, f"{where}.{name}")
            elif inspect.isfunction(member):
                self.callable(member, f"{where}.{name}")


def _walk() -> Walk:
    walk = Walk()
    for name in nbexec.__all__:
        value = getattr(nbexec, name)
        if isinstance(value, type):
            walk.cls(value, name, constructed=value not in NOT_MADE_BY_USERS)
        elif inspect.isfunction(value):
            walk.callable(value, name)
    return walk


def _exported() -> list[Any]:
    return [getattr(nbexec, name) for name in nbexec.__all__]


def test_every_reachable_type_is_exported() -> None:
    exported = _exported()
    walk = _walk()
    missing = {f"{walk.aliases.get(k) or k.__qualname__} (reached by {where})" for k, where in walk.reached.items()
               if not any(k is e for e in exported)}
    assert not missing, "types users meet but cannot import from nbexec:\n" + "\n".join(sorted(missing))


def test_the_walk_finds_what_it_should() -> None:
    """The walk is not vacuous: it reaches types only found through fields, returns, parameters and aliases."""
    reached = _walk().reached
    assert {nbexec.Package, nbexec.Connection, nbexec.ArtifactStore, nbexec.Collection, nbexec.FileChunks,
            nbexec.ConfigOverrides, nbexec.RunOverrides, nbexec.ExecuteOptions} <= set(reached)
    assert nbexec.OutputCallback in reached and nbexec.ErrorKind in reached and nbexec.SessionStatus in reached


def test_every_error_is_exported() -> None:
    """Errors are raised, not annotated: each one of nbexec.errors is importable from nbexec."""
    defined = {value for value in vars(errors).values()
               if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__}
    assert defined - set(_exported()) == set()


def test_session_shows_what_users_call() -> None:
    """Session's public members are its API; the engine's internals carry a leading underscore."""
    assert [m for m in dir(nbexec.Session) if not m.startswith("_")] == [
        "allow_hosts", "busy", "change_hosts", "close", "config", "deny_hosts", "download", "files", "fork",
        "from_snapshot", "hibernate", "install", "interrupt", "listing", "open_file", "restart", "resume", "run",
        "run_notebook", "save", "shell", "snapshot", "start", "status", "upload"]
