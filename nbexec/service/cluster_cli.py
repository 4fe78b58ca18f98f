"""`nbexec serve --nodes ...`: start the router (kept out of cli.py, which serves a node)."""

from __future__ import annotations

import sys
from typing import Any

import click

from nbexec.config import SandboxConfig, parse_size
from nbexec.errors import ConfigError
from nbexec.hostconfig import host_from_env

EXIT_USAGE = 2


def router_settings(nodes: str, tokens: tuple[bytes, ...], max_body: str, policy: SandboxConfig,
                    max_calls_per_token: int) -> Any:
    """The RouterSettings for ``nodes`` (comma-separated ``name=URL`` or ``URL``); its caps on what a node may send
    follow ``policy`` (the sandbox options the nodes were given). Exits with a usage error when they are wrong."""
    try:
        from .router import RouterSettings

        entries = tuple(u.strip() for u in nodes.split(",") if u.strip())
        return RouterSettings.for_policy(policy, nodes=entries, node_token=host_from_env().node_token,
                                         tokens=tuple(t.decode() for t in tokens), max_body=parse_size(max_body),
                                         max_calls_per_token=max_calls_per_token)
    except (ConfigError, ImportError) as exc:
        click.echo(f"nbexec: {exc}", err=True)
        sys.exit(EXIT_USAGE)


def serve_router(host: str, port: int, settings: Any) -> None:
    """Run the router with ``settings`` on ``host:port``."""
    import uvicorn

    from .router import create_router

    uvicorn.run(create_router(settings), host=host, port=port, log_level="info", access_log=False,
                timeout_graceful_shutdown=3)
