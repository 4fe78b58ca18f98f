"""Start bash_kernel without pexpect's pause before each line it types into bash.

bash_kernel feeds a cell to bash line by line through pexpect, which sleeps `delaybeforesend` (0.05 s) before each
send: 2.2 s of a 3.2 s start (its set-up is 43 lines) and 2 s per 40-line cell. The pause guards against a terminal
that echoes input typed before it turned echo off; bash_kernel spawns bash with echo off, so nothing is lost.
Runs inside the sandbox; not trusted by the host.
"""

import pexpect

_spawn = pexpect.spawn


class _Spawn(_spawn):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.delaybeforesend = None


pexpect.spawn = _Spawn  # bash_kernel.kernel calls pexpect.spawn(...) when the kernel starts

from bash_kernel.kernel import BashKernel  # noqa: E402
from ipykernel.kernelapp import IPKernelApp  # noqa: E402

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
