"""The code a kernel runs before a checkpoint, to let go of its sockets and take them back once restored.

`checkpoint.checkpoint` runs it silently in the kernel, like the warm imports. It refuses, before anything
changes, when the code holds sockets gVisor could not save (see `checkpoint`). Otherwise it starts a thread and
returns; its reply is the host's answer. The thread lets go of the sockets only once the host has read that reply.
The host says so with a file (``go``) in the runtime folder, which the sandbox cannot write when nbexec runs as
root; a name planted there refuses the checkpoint. There is no timer, so neither a slow host nor a starved kernel
loses the reply. A host that gave up never makes the file: after ``patience`` seconds the thread ends and the
kernel runs on with its sockets. Restored, the thread waits for ``wake`` (its fresh key and session id) and binds
the same addresses again.
"""

from __future__ import annotations

RUNTIME = "/run/nbexec"  # the runtime folder as the kernel sees it

_CODE = """
def __nbexec_agent(wake, go, patience):
    import os, threading, time, zmq
    from ipykernel.kernelapp import IPKernelApp
    app = IPKernelApp.instance()
    pipe = getattr(app.iopub_thread, '_pipe_in', None)
    port = getattr(app.iopub_thread, '_pipe_port', None)
    socks = [app.shell_socket, app.control_socket, app.iopub_thread.socket, app.stdin_socket, app.heartbeat.socket]
    ends = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks]
    blockers = []  # sockets gVisor cannot save: any TCP/UDP but the pipe's listener, unix ones on host mounts
    for table in ('tcp', 'tcp6', 'udp', 'udp6'):
        for line in open(f'/proc/net/{table}').read().splitlines()[1:]:
            if not (table == 'tcp' and line.split()[1] == f'0100007F:{port or 0:04X}'):
                blockers.append(table + ' ' + line.split()[1])
    for line in open('/proc/net/unix').read().splitlines()[1:]:
        path = line.split()[7] if len(line.split()) > 7 else ''
        if path.startswith(('/mnt/', '/run/nbexec/')) and path[:-1] != '/run/nbexec/kernel-':
            blockers.append('unix ' + path)
    if blockers:
        raise RuntimeError('nbexec-checkpoint-blocked: ' + ', '.join(blockers[:8]))
    def run():
        give_up = time.monotonic() + patience
        while not os.path.exists(go):  # the host has read this cell's reply: nothing more goes out
            if time.monotonic() > give_up:
                return  # the host gave up on this checkpoint: the kernel keeps its sockets
            time.sleep(0.005)
        if pipe is not None and port:
            pipe.socket.unbind(f'tcp://127.0.0.1:{port}')
        for s, e in zip(socks, ends):
            s.unbind(e)
        while not os.path.exists(wake):
            time.sleep(0.005)
        fresh = __import__('json').load(open(wake))  # this sandbox's own key and ids, never the image's
        app.session.session, app.session.key = fresh['session'], fresh['key'].encode()
        __import__('random').seed()
        if 'numpy' in __import__('sys').modules:
            __import__('numpy').random.seed()
        if pipe is not None and port:
            pipe.socket.bind(f'tcp://127.0.0.1:{port}')
        for s, e in zip(socks, ends):
            s.bind(e)
    threading.Thread(target=run, name='nbexec-checkpoint', daemon=True).start()
__nbexec_agent(@ARGS@)
del __nbexec_agent
"""


def names(token: str) -> tuple[str, str]:
    """The runtime folder's file names for one checkpoint: (wake, go)."""
    return f"wake-{token}", f"go-{token}"


def code(wake: str, go: str, patience: float) -> str:
    """The agent's code for the files ``wake`` and ``go`` of the runtime folder; it gives up after ``patience`` s."""
    return _CODE.replace("@ARGS@", f"{RUNTIME + '/' + wake!r}, {RUNTIME + '/' + go!r}, {float(patience)!r}")
