"""Give a TCP-only kernel (Deno's) the unix sockets nbexec's host connects to.

    python kernel_relay.py CONNECTION_FILE TCP_CONNECTION_FILE

Reads nbexec's connection file (transport ipc, ip /run/nbexec/kernel, ports 1..5), writes a copy for the kernel
with transport tcp, ip 127.0.0.1 and five free loopback ports, and returns once that copy is written; a forked
child then waits for each TCP port to accept, binds `<ip>-<port>` (ipykernel's ipc naming) and copies bytes both
ways for every connection the host makes. The sockets appear only once the kernel listens, so the host's "socket
exists" check still means "kernel ready". ZMTP passes through unchanged: the relay never parses a frame.
The kernel's copy of the connection file (it holds the key) is removed once the kernel has bound its ports.

Runs inside the sandbox and is not trusted by the host; the sandbox's own code can reach the loopback ports, which
gives it nothing it does not already have (it runs inside the kernel).
"""

import asyncio
import json
import os
import socket
import sys
import time

PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
CHUNK = 1 << 16


def free_ports(count):
    """Loopback ports free now (the kernel binds them a moment later; nothing else runs in the sandbox yet)."""
    holders = [socket.socket() for _ in range(count)]
    try:
        for holder in holders:
            holder.bind(("127.0.0.1", 0))
        return [holder.getsockname()[1] for holder in holders]
    finally:
        for holder in holders:
            holder.close()


def write_tcp_copy(info, path):
    tcp = {**info, "transport": "tcp", "ip": "127.0.0.1", **dict(zip(PORTS, free_ports(len(PORTS)), strict=True))}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(tcp, out)
    return tcp


def wait_listening(port, limit=120.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)
    raise SystemExit(f"kernel_relay: the kernel did not listen on 127.0.0.1:{port}")


async def pump(reader, writer):
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(unix_path, port):
    async def handle(host_reader, host_writer):
        try:
            kernel_reader, kernel_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            host_writer.close()
            return
        await asyncio.gather(pump(host_reader, kernel_writer), pump(kernel_reader, host_writer))

    server = await asyncio.start_unix_server(handle, unix_path)
    os.chmod(unix_path, 0o700)  # as ipykernel's: only the sandbox's user (and the host's root) connects
    return server


async def relay(info, tcp, tcp_path, kernel_pid):
    # The relay ends with the kernel (outside a container nothing else would end it).
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(os.pidfd_open(kernel_pid), lambda: gone.done() or gone.set_result(None))
    for name in PORTS:
        wait_listening(tcp[name])
    os.unlink(tcp_path)
    # iopub before shell: the host waits for shell and iopub, then subscribes at once.
    servers = [await serve(f"{info['ip']}-{info[name]}", tcp[name]) for name in
               ("hb_port", "stdin_port", "control_port", "iopub_port", "shell_port")]
    await gone
    for server in servers:
        server.close()


def main():
    conn_path, tcp_path = sys.argv[1], sys.argv[2]
    with open(conn_path) as conn:
        info = json.load(conn)
    if info.get("transport") != "ipc":
        raise SystemExit("kernel_relay: the connection file's transport is not ipc")
    tcp = write_tcp_copy(info, tcp_path)
    kernel_pid = os.getppid()  # the launcher, which execs the kernel next
    if os.fork():
        return
    os.setsid()  # out of the kernel's process group: an interrupt sent to the group is not for the relay
    asyncio.run(relay(info, tcp, tcp_path, kernel_pid))


if __name__ == "__main__":
    main()
