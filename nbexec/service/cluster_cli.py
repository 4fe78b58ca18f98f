"""`nbexec serve --nodes ...`: start the router (kept out of cli.py, which serves a node)."""

from __future__ import annotations

import sys

import click

from nbexec.config import host_from_env, parse_size
from nbexec.errors import ConfigError

EXIT_USAGE = 2


def serve_router(host: str, port: int, nodes: str, tokens: tuple[bytes, ...], max_body: str) -> None:
    """Run the router on ``host:port`` in front of ``nodes`` (comma-separated URLs)."""
    try:
        import uvicorn

        from .router import RouterSettings, create_router

        urls = tuple(u.strip().rstrip("/") for u in nodes.split(",") if u.strip())
        settings = RouterSettings(nodes=urls, node_token=host_from_env().node_token,
                                  tokens=tuple(t.decode() for t in tokens), max_body=parse_size(max_body))
    except (ConfigError, ImportError) as exc:
        click.echo(f"nbexec: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    uvicorn.run(create_router(settings), host=host, port=port, log_level="info", access_log=False,
                timeout_graceful_shutdown=3)
