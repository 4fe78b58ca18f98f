"""How nbexec itself behaves on the host (not the sandbox policy): `HostConfig`, read from NBEXEC_NODE_NAME,
NBEXEC_SHARED_OUTPUT, NBEXEC_NODES and NBEXEC_NODE_TOKEN by `host_from_env`. A leaf, as `config` is."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    """How nbexec itself behaves on the host (not the sandbox policy); read by `host_from_env`."""

    node_name: str = field(default_factory=socket.gethostname, metadata=_doc(
        "NBEXEC_NODE_NAME: this nbexec instance's name on the Docker engine (default: the hostname). Give each "
        "instance sharing an engine its own, and keep it across restarts: the automatic sweep removes containers "
        "of its own node whose process is gone, never those of other nodes."))
    shared_output: bool = field(default=False, metadata=_doc(
        "NBEXEC_SHARED_OUTPUT=1: output folders and files nbexec makes are readable (never writable) by other "
        "local users, 0755/0644 instead of 0700/0600 (the private roots in the temporary folder stay 0700)."))
    nodes: tuple[str, ...] = field(default=(), metadata=_doc(
        "NBEXEC_NODES=http://n1:8080,n2=http://n2:8080 (URL or name=URL): run sandboxes on these `nbexec serve` "
        "nodes (or one router) instead of the local Docker engine; results and files come back to this host."))
    node_token: str = field(default="", repr=False, metadata=_doc(
        "NBEXEC_NODE_TOKEN: the bearer token sent to the nodes (one of their API tokens)."))

    def __post_init__(self) -> None:
        for url in self.nodes:
            if not re.fullmatch(r"https?://[^\s/?#]+/?", url):
                raise ConfigError(f"NBEXEC_NODES: {url!r} is not a base URL like http://host:8080")
        if self.nodes and len(self.node_token) < 16:
            raise ConfigError("NBEXEC_NODES needs NBEXEC_NODE_TOKEN (at least 16 characters)")
        object.__setattr__(self, "nodes", tuple(url.rstrip("/") for url in self.nodes))


def host_from_env(environ: Mapping[str, str] | None = None) -> HostConfig:
    """The HostConfig from NBEXEC_NODE_NAME, NBEXEC_SHARED_OUTPUT, NBEXEC_NODES and NBEXEC_NODE_TOKEN."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if environ.get("NBEXEC_NODE_NAME", "").strip():
        values["node_name"] = environ["NBEXEC_NODE_NAME"].strip()
    shared = environ.get("NBEXEC_SHARED_OUTPUT", "").strip().lower()
    if shared not in {"", "1", "0", "true", "false", "yes", "no", "on", "off"}:
        raise ConfigError(f"NBEXEC_SHARED_OUTPUT={shared!r} is not 1 or 0")
    values["shared_output"] = shared in {"1", "true", "yes", "on"}
    values["nodes"] = tuple(_url(u) for u in environ.get("NBEXEC_NODES", "").split(",") if u.strip())
    values["node_token"] = environ.get("NBEXEC_NODE_TOKEN", "").strip()
    return HostConfig(**values)


def _url(entry: str) -> str:
    """The URL of one NBEXEC_NODES entry: ``URL`` or ``name=URL`` as `nbexec serve --nodes` takes them (a node
    names itself in its answers, so the name here is only for the reader)."""
    name, equals, url = entry.strip().partition("=")
    return url.strip() if equals and "://" not in name else entry.strip()
