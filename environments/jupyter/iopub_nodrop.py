"""The kernel's iopub socket waits for the host instead of dropping what passes its send queue.

libzmq's PUB and XPUB sockets drop every message past a subscriber's queue (1,000 messages) while it reads
slower than the kernel writes, without a word to either side: on a loaded host, code that prints many small
messages lost thousands of lines and its run still came back complete. With XPUB_NODROP the send waits instead.
ipykernel sends from its IOPub thread: a writer waits for it at each flush (kernel_launcher flushes every 1 MiB),
and what waits is charged to the sandbox's memory, a limit the kernel enforces.

Imported by the Python and Bash kernels' launchers before the kernel binds its sockets. Runs inside the sandbox
and is not trusted by the host: the host counts what arrives whatever the kernel does.
"""

import zmq
from ipykernel import kernelapp

_bind = kernelapp.IPKernelApp._bind_socket


def _bind_socket(self, sock, port):
    if sock.socket_type in (zmq.PUB, zmq.XPUB):  # iopub: the only publisher bound here
        sock.setsockopt(zmq.XPUB_NODROP, 1)
    return _bind(self, sock, port)


kernelapp.IPKernelApp._bind_socket = _bind_socket
