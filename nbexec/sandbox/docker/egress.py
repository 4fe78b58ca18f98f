"""The allowlist wiring of one container: its host proxy (`nbexec.egress.proxy`), the read-only mount of the proxy's
folder, and the forwarder the sandbox's kernel starts on 127.0.0.1:3128 (see `nbexec.egress` for the rules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbexec.config import SandboxConfig, parse_size
from nbexec.egress import ENVIRONMENT, MOUNT, PORT, SOCKET, Allowlist
from nbexec.egress.proxy import Limits, Proxy
from nbexec.errors import SandboxError
from nbexec.sandbox.kernel import KernelClient

# -- the sandbox's side: the proxy's folder, the forwarder, the log --------------------------------------------

_FORWARDER = f"""
import socket, sys, threading
listener = socket.socket(fileno=int(sys.argv[1]))
def pipe(source, sink):
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
def serve(client):
    upstream = socket.socket(socket.AF_UNIX)
    try:
        upstream.connect({MOUNT + "/" + SOCKET!r})
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()
while True:
    client, _ = listener.accept()
    threading.Thread(target=serve, args=(client,), daemon=True).start()
"""
# Bound before the child starts: once this returns, connections to the port queue even if the child is slow.
_SPAWN = f"""
import socket, subprocess, sys
listener = socket.socket()
listener.bind(("127.0.0.1", {PORT}))
listener.listen(64)
subprocess.Popen([sys.executable, "-I", "-S", "-c", {_FORWARDER!r}, str(listener.fileno())],
                 pass_fds=[listener.fileno()], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
listener.close()
"""


def open_proxy(workdir: Path, config: SandboxConfig) -> Proxy:
    """Start the host proxy of a sandbox about to be made, on ``workdir``/egress/proxy.sock."""
    folder = workdir / "egress"
    folder.mkdir(mode=0o755)
    limits = Limits(max_bytes=parse_size(config.max_egress), max_connections=config.max_connections,
                    max_open=config.max_open_connections, idle_timeout=config.egress_idle_timeout,
                    min_rate=config.egress_min_rate)
    return Proxy.start(folder / SOCKET, Allowlist.of(config.allowed_hosts), limits)


def mount(workdir: Path) -> Any:
    import docker.types

    return docker.types.Mount(MOUNT, str(workdir / "egress"), type="bind", read_only=True)


def start_forwarder(client: KernelClient, config: SandboxConfig) -> None:
    """Start the in-sandbox forwarder with a silent execution (no history, nothing in the notebook)."""
    content = client.run_silent(_SPAWN, config.startup_timeout) or {}
    if content.get("status") != "ok":
        raise SandboxError(f"the sandbox could not start its egress forwarder: {str(content.get('evalue'))[:200]}")


__all__ = ["ENVIRONMENT", "mount", "open_proxy", "start_forwarder"]
