"""The allowlist wiring of one container: its host proxy (`nbexec.egress.proxy`), the read-only mount of the proxy's
folder, and the forwarder the sandbox's kernel starts on 127.0.0.1:3128 (see `nbexec.egress` for the rules)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from nbexec.config import SandboxConfig, parse_size
from nbexec.egress import ENVIRONMENT, MOUNT, PORT, SOCKET, Allowlist
from nbexec.egress.proxy import Limits, Proxy
from nbexec.errors import ConfigError, SandboxError
from nbexec.sandbox.kernel import KernelClient

RULES = "egress-rules.json"  # in the working folder (never mounted): the rules as the last change left them
MAX_RULES_BYTES = 256 * 1024  # MAX_RULES rules of the longest names fit

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
    """Start the host proxy of a sandbox on ``workdir``/egress/proxy.sock: a new one's, or again for one that slept
    or whose owner died (its folder kept, the old socket replaced), judging by the rules it last had (`keep_rules`)."""
    folder = workdir / "egress"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o755)
    found = os.lstat(folder)  # made by nbexec in its private working folder, read-only to the sandbox
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        raise SandboxError(f"{folder} is not the egress folder nbexec made")
    (folder / SOCKET).unlink(missing_ok=True)  # a proxy that is gone left its socket's name behind
    limits = Limits(max_bytes=parse_size(config.max_egress), max_connections=config.max_connections,
                    max_open=config.max_open_connections, idle_timeout=config.egress_idle_timeout,
                    min_rate=config.egress_min_rate)
    return Proxy.start(folder / SOCKET, kept_rules(workdir, config), limits)


def keep_rules(workdir: Path, allowlist: Allowlist) -> None:
    """Write the sandbox's rules as they are now beside its folders (host-only, 0600, atomically), so a proxy
    opened again later judges by them and not by the ones it started with: a host denied stays denied."""
    data = json.dumps(allowlist.to_json()).encode()
    temporary = workdir / f".{RULES}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, workdir / RULES)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def kept_rules(workdir: Path, config: SandboxConfig) -> Allowlist:
    """The rules `keep_rules` wrote, checked again (within the config's hosts unless it widens), else the config's."""
    try:
        fd = os.open(workdir / RULES, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return Allowlist.of(config.allowed_hosts)
    except OSError as exc:
        raise SandboxError(f"the sandbox's kept egress rules cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_RULES_BYTES + 1)
    try:
        if len(data) > MAX_RULES_BYTES:
            raise ConfigError("the kept allowlist is too large")
        return Allowlist.from_json(json.loads(data), config.allowed_hosts, widen=config.egress_widen)
    except (ConfigError, ValueError, RecursionError) as exc:
        raise SandboxError(f"the sandbox's kept egress rules are not nbexec's ({exc}): it is not woken") from None


def mount(workdir: Path) -> Any:
    import docker.types

    return docker.types.Mount(MOUNT, str(workdir / "egress"), type="bind", read_only=True)


def start_forwarder(client: KernelClient, config: SandboxConfig) -> None:
    """Start the in-sandbox forwarder with a silent execution (no history, nothing in the notebook)."""
    content = client.run_silent(_SPAWN, config.startup_timeout) or {}
    if content.get("status") != "ok":
        raise SandboxError(f"the sandbox could not start its egress forwarder: {str(content.get('evalue'))[:200]}")


__all__ = ["ENVIRONMENT", "keep_rules", "mount", "open_proxy", "start_forwarder"]
