"""Start ipykernel with two changes: a stream buffer is flushed once it holds 1 MiB, and start-up skips imports
the sandbox never uses.

ipykernel buffers stdout/stderr for 0.2 s before publishing; code that writes hundreds of MB at once would fill
the sandbox's memory with that buffer. Flushing early makes the writer wait for the publisher instead.

Start-up CPU is paid by every sandbox (benchmarks/profile.py): ipykernel imports debugpy for its debugger (about
0.1 s; nbexec never debugs, and a debugger needs a frontend), and `import jupyter_client` runs a package
`__init__` that imports every client, manager and provisioner (the kernel needs only the session and connection
modules). Both stay importable by the user's code: debugpy is hidden only while ipykernel decides that there is
no debugger, and jupyter_client's `__init__` runs in full the first time anything else asks for one of its names.
Its iopub socket waits for the host instead of dropping what passes its queue (iopub_nodrop). It also hands the
kernel's shell to `nbexec_display`, which shows a window left open at the end of a cell, and with NBEXEC_XVFB=1
starts the X server now, in the background, instead of at the first GUI import.
This runs inside the sandbox and is not trusted by the host: it only keeps the sandbox itself alive and cheap.
"""

import importlib.util
import os
import sys
import threading

import nbexec_display


def _lazy_package(name):
    """Register package ``name`` without running its ``__init__``; the first attribute asked for runs it."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr):
        del module.__getattr__
        spec.loader.exec_module(module)
        return getattr(module, attr)

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    return module


_client = _lazy_package("jupyter_client")
from jupyter_client.connect import find_connection_file, write_connection_file  # noqa: E402

# What ipykernel.connect takes from the package while a kernel starts.
_client.find_connection_file = find_connection_file
_client.write_connection_file = write_connection_file
sys.modules["debugpy"] = None  # ipykernel.debugger: "debugpy is not available"
from ipykernel import debugger, iostream, kernelapp  # noqa: E402, F401

import iopub_nodrop  # noqa: E402, F401  (the iopub socket waits for the host instead of dropping)

del sys.modules["debugpy"]

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


def main():
    """IPKernelApp.launch_instance, with the client class that kernels never use left unresolved."""
    _client.BlockingKernelClient = object  # resolved by the app's `blocking_class` trait, used only by clients
    try:
        app = kernelapp.IPKernelApp.instance()
    finally:
        del _client.BlockingKernelClient
    app.initialize()
    nbexec_display.watch(app.kernel.shell)
    if os.environ.get("NBEXEC_XVFB") == "1":
        threading.Thread(target=nbexec_display.start, name="nbexec-display", daemon=True).start()
    app.start()


if __name__ == "__main__":
    main()
