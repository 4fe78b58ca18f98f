"""Start ipykernel with one change: a stream buffer is flushed once it holds 1 MiB.

ipykernel buffers stdout/stderr for 0.2 s before publishing; code that writes hundreds of MB at once would fill
the sandbox's memory with that buffer. Flushing early makes the writer wait for the publisher instead.
This runs inside the sandbox and is not trusted by the host: it only keeps the sandbox itself alive.
"""

from ipykernel import iostream, kernelapp

_LIMIT = 1 << 20
_write = iostream.OutStream.write


def _write_with_backpressure(self, string):
    written = _write(self, string)
    pending = getattr(self, "_nbexec_pending", 0) + len(string)
    if pending >= _LIMIT and self._is_master_process():
        pending = 0
        self.flush()
    self._nbexec_pending = pending
    return written


iostream.OutStream.write = _write_with_backpressure

if __name__ == "__main__":
    kernelapp.launch_new_instance()
