"""Durable sessions: a session's record in a state folder, so that a new process finds it again.

A session given a ``state_dir`` holds that folder (see `nbexec.files.statefolder`: private, one live holder).
It writes its record there (``<id>.session``, 0600, atomic) when its sandbox starts and around each run, and
removes it at close. The record holds its id, owner, config, output folder, notebook and status, and the sandbox's
record (`SandboxHandle.describe`: container, working folder, kernel connection with its key). The sandbox is
acquired with the folder's claim. So a restarted process's orphan sweep keeps it, until the folder's holder has
been dead past the grace period.

`load` reads a record back for `Session.resume`. It is sized before it is parsed, the config is rebuilt through
its own checks, and the notebook is validated again. Being in the record makes nothing the sandbox wrote trusted.

A session whose adoption failed is marked lost (``<id>.lost``: its owner and why; the record removed). A later
start answers it as lost at once and never tries it again. The marker goes after `statefolder.grace`, as a dead
holder's kept sandboxes do. `under` is the config a kept session resumes in: today's policy, never the record's.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbformat import NotebookNode

from nbexec import notebook
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NbexecError, NotOfferedError, SessionLostError, SessionNotFoundError
from nbexec.files import statefolder
from nbexec.files.statefolder import StateFolder
from nbexec.notebook import verbatim

SUFFIX = ".session"
LOST = ".lost"
VERSION = 1
# What a running sandbox was made with and cannot change: a kept session whose policy changed these is lost.
# Limits (memory, cpus, pids), egress rules, packages, time and output caps come from today's policy.
MADE_WITH = ("image", "language", "user", "env", "runtime", "tmp_size", "input_dir", "link_input", "max_data")


@dataclass(frozen=True)
class Record:
    """A durable session as its state folder keeps it."""

    id: str
    owner: str
    config: SandboxConfig
    sandbox: dict[str, Any]
    output_dir: str | None
    notebook: NotebookNode
    ttl: float | None
    status: str
    created_at: float
    asleep: str | None = None  # how it wakes: "checkpoint" (``memory`` is the source's record) or "replay"
    memory: dict[str, Any] | None = None


def config_dict(config: SandboxConfig) -> dict[str, Any]:
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return dict(value)
    return value


def config_from(raw: Any) -> SandboxConfig:
    """The config a record keeps, through SandboxConfig's own checks (unknown fields refused)."""
    if not isinstance(raw, dict):
        raise ConfigError("the session record has no config")
    fields = {f.name: f for f in dataclasses.fields(SandboxConfig)}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in fields:
            raise ConfigError(f"the session record's config has an unknown field {name!r}")
        values[name] = tuple(value) if isinstance(value, list) else value
    try:
        return SandboxConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the session record's config is not valid: {exc}") from exc


def save(folder: StateFolder, record: Record) -> None:
    """Write ``record`` (atomically, 0600) and say that the folder's holder is alive."""
    body = {"version": VERSION, "id": record.id, "owner": record.owner, "config": config_dict(record.config),
            "sandbox": record.sandbox, "output_dir": record.output_dir, "notebook": record.notebook,
            "ttl": record.ttl, "status": record.status, "created_at": record.created_at, "saved_at": time.time(),
            "asleep": record.asleep, "memory": record.memory}
    text = verbatim.encode(body, levels=1 + notebook.LEVELS, ensure_ascii=True)  # display values as they came
    folder.write(record.id + SUFFIX, text.encode("utf-8", "surrogatepass"))
    folder.touch()


def forget(folder: StateFolder, session_id: str) -> None:
    folder.remove(session_id + SUFFIX)


def ids(folder: StateFolder) -> list[str]:
    return [name[: -len(SUFFIX)] for name in folder.names(SUFFIX)]


def load(folder: StateFolder, session_id: str) -> Record:
    """The record of ``session_id``.

    SessionNotFoundError when there is none or it cannot be read back. SessionLostError, naming the record and
    its size, when it is too large to read."""
    if not statefolder.valid_name(session_id + SUFFIX):
        raise SessionNotFoundError(f"no session with id {session_id!r}")
    raw = folder.read(session_id + SUFFIX)
    size = folder.size(session_id + SUFFIX) if raw is None else None
    if size is not None and size > statefolder.MAX_RECORD:  # kept, but too large to read: say so, never "no session"
        raise SessionLostError(f"the record {session_id + SUFFIX} in {folder.path} is {size:,} bytes, past the "
                               f"{statefolder.MAX_RECORD:,}-byte limit of a session record: it is not read back. "
                               "Remove it and start a new session.")
    if raw is None:
        raise SessionNotFoundError(f"no session with id {session_id!r} in the state folder {folder.path}")
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("version") != VERSION or body.get("id") != session_id:
            raise ValueError("not a session record of this version")
        ttl = body.get("ttl")
        return Record(id=session_id, owner=str(body.get("owner") or ""), config=config_from(body.get("config")),
                      sandbox=_dict(body.get("sandbox")), output_dir=_text(body.get("output_dir")),
                      notebook=notebook.from_json(json.dumps(body.get("notebook")), f"session {session_id}"),
                      ttl=float(ttl) if isinstance(ttl, (int, float)) else None,
                      status=str(body.get("status") or ""), created_at=float(body.get("created_at") or 0),
                      asleep=_asleep(body.get("asleep")),
                      memory=body["memory"] if isinstance(body.get("memory"), dict) else None)
    except (ValueError, TypeError, NbexecError) as exc:
        raise SessionNotFoundError(f"the record of session {session_id!r} in {folder.path} cannot be read "
                                   f"back ({exc}); remove it") from None


def _asleep(value: Any) -> str | None:
    if value not in (None, "checkpoint", "replay"):
        raise ValueError("the record's sleep is neither checkpoint nor replay")
    return str(value) if value else None


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("the record has no sandbox")
    if not value:
        return {}
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.startswith("/") else None


def under(policy: SandboxConfig, kept: SandboxConfig) -> SandboxConfig:
    """The config a kept session resumes in: ``policy`` as it is now, with the session's image and language.

    NotOfferedError, naming what changed, when its sandbox needs what the policy no longer gives: a language, an
    image, a network, anything in MADE_WITH."""
    try:
        config = policy.choose_image(None if kept.image == policy.image else kept.image).offer_language(kept.language)
    except ConfigError as exc:
        raise NotOfferedError(f"its image or language is not offered here any more: {exc}") from None
    changed = [name for name in MADE_WITH if getattr(config, name) != getattr(kept, name)]
    if kept.language != "python" and config.kernels_image != kept.kernels_image:
        changed.append("kernels_image")
    if config.network != kept.network and not (config.network is False and kept.network == "allowlist"):
        changed.append("network")  # allowlist to off is kept: no proxy is opened, the sandbox has no interface
    if changed:
        raise NotOfferedError(f"its sandbox was made under a policy this node no longer runs "
                              f"({', '.join(changed)} changed); start a new session")
    return config


def within(policy: SandboxConfig, kept: SandboxConfig) -> SandboxConfig:
    """The config a snapshot restores in for a caller of ``policy`` (a service's, MCP's): the policy as it is now,
    with the snapshot's image and language only while the policy still offers them (NotOfferedError otherwise).
    Unlike `under`, nothing else of the snapshot's config is kept: its sandbox is a new one."""
    try:
        chosen = policy.choose_image(None if kept.image == policy.image else kept.image)
    except ConfigError as exc:
        raise NotOfferedError(f"the snapshot's image is not offered here any more: {exc}") from None
    return chosen.offer_language(kept.language)


def mark_lost(folder: StateFolder, session_id: str, owner: str, reason: str,
              leftover: dict[str, Any] | None = None) -> None:
    """Keep that ``session_id`` is lost and why (for its owner), and remove its record: never tried again.
    ``leftover``: the sandbox's record while it is not removed yet (a next start removes it, never adopts it)."""
    body = {"owner": owner, "reason": reason[:2000], "leftover": leftover or {}}
    folder.write(session_id + LOST, json.dumps(body).encode())
    forget(folder, session_id)


def lost(folder: StateFolder) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """The sessions marked lost: id -> (owner, why, the leftover sandbox's record or {}).

    A marker lives as long as a dead holder's kept sessions (`statefolder.grace`), then goes. Once its sandbox is
    removed nothing is left to answer for, and the folder must not grow for ever."""
    found: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for name in folder.names(LOST):
        age = folder.age(name)
        if age is not None and age > statefolder.grace() and not _leftover(folder, name):
            folder.remove(name)
            continue
        try:
            body = json.loads(folder.read(name, limit=64 * 1024) or b"")
            leftover = body.get("leftover")
            found[name[: -len(LOST)]] = (str(body["owner"]), str(body["reason"]),
                                         leftover if isinstance(leftover, dict) else {})
        except (ValueError, TypeError, KeyError, AttributeError):
            folder.remove(name)  # unreadable: nothing to answer with
    return found


def _leftover(folder: StateFolder, name: str) -> bool:
    """Whether lost marker ``name`` still names a sandbox to remove (kept until it is removed)."""
    try:
        return bool(json.loads(folder.read(name, limit=64 * 1024) or b"").get("leftover"))
    except (ValueError, AttributeError):
        return False


def forget_lost(folder: StateFolder, session_id: str) -> None:
    if statefolder.valid_name(session_id + LOST):
        folder.remove(session_id + LOST)


def hold(state_dir: str | Path) -> StateFolder:
    return statefolder.hold(state_dir)
