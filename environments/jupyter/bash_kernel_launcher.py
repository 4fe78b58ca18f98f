"""Start bash_kernel without pexpect's pause before each line it types into bash.

bash_kernel feeds a cell to bash line by line through pexpect, which sleeps `delaybeforesend` (0.05 s) before each
send: 2.2 s of a 3.2 s start (its set-up is 43 lines) and 2 s per 40-line cell. The pause guards against a terminal
that echoes input typed before it turned echo off; bash_kernel spawns bash with echo off, so nothing is lost.

When bash itself dies in a cell (killed at the memory limit, or `exit`), bash_kernel starts a new bash and replies
ok: the cell "succeeds" and the shell's state is gone without a word. `_Kernel` ends the kernel instead, as a Python
kernel that dies ends, so the host reports it from outside: kind "oom" (with the limit) when the memory limit
killed it, else "kernel_died" with bash's exit status.
Runs inside the sandbox; not trusted by the host.
"""

import os

import pexpect

_spawn = pexpect.spawn


class _Spawn(_spawn):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.delaybeforesend = None


pexpect.spawn = _Spawn  # bash_kernel.kernel calls pexpect.spawn(...) when the kernel starts

from bash_kernel.kernel import BashKernel  # noqa: E402
from ipykernel.kernelapp import IPKernelApp  # noqa: E402

import iopub_nodrop  # noqa: E402, F401  (the iopub socket waits for the host instead of dropping)



class _Kernel(BashKernel):
    def _start_bash(self):
        wrapper = getattr(self, "bashwrapper", None)
        if wrapper is None:  # the first bash, from __init__
            return super()._start_bash()
        child = wrapper.child  # bash is gone (pexpect saw EOF): end with its status instead of a new bash
        child.isalive()  # reaps it, setting exitstatus or signalstatus
        os._exit(128 + child.signalstatus if child.signalstatus else child.exitstatus or 0)


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=_Kernel)
