"""Seal the sandbox's init against the judged program: shipped as text with `judgerunner`, run in its kernel.

Init (PID 1, tini) runs as the sandbox's user and is dumpable, and kill(-1) spares it: a test could open
/proc/1/mem or ptrace it and leave code there that outlives every test (a thread of init is in no /proc listing
and no kill reaches it). The runner makes init non-dumpable before the first test, by having init itself call
prctl(PR_SET_DUMPABLE, 0): a one-instruction syscall through ptrace, its registers then restored. The seal is
checked from outside (/proc/1/mem no longer opens); where it cannot be made, no test is run. Standard library only.
"""

import ctypes
import os
from typing import Any

_SEIZE, _INTERRUPT, _GETREGS, _SETREGS, _SINGLESTEP, _DETACH = 0x4206, 0x4207, 12, 13, 9, 17
_WALL = 0x40000000
_RAX, _RDX, _RSI, _RDI, _ORIG_RAX, _RIP, _R10, _R8 = 10, 12, 13, 14, 15, 16, 7, 9  # user_regs_struct, x86_64
_PRCTL, _PR_SET_DUMPABLE = 157, 4


def init_reachable() -> bool:
    """Whether this process (and so a test, of the same user) can open init's memory."""
    try:
        os.close(os.open("/proc/1/mem", os.O_RDONLY))
    except OSError:
        return False
    return True


def _syscall_instruction() -> int:
    """The address of a `syscall` instruction (0f 05) in init's executable memory."""
    with open("/proc/1/maps") as maps, open("/proc/1/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "x" not in perms:
                continue
            start, end = (int(value, 16) for value in span.split("-"))
            mem.seek(start)
            found = mem.read(min(end - start, 4 << 20)).find(b"\x0f\x05")
            if found >= 0:
                return start + found
    raise OSError("no syscall instruction in init")


def _call(libc: Any, request: int, data: Any = None) -> None:
    if libc.ptrace(request, 1, None, data) != 0:
        raise OSError(ctypes.get_errno(), f"ptrace({request}) on init failed")


def seal_init() -> str:
    """Make init non-dumpable; "" once it is out of a test's reach, else why not."""
    if not init_reachable():
        return ""
    if os.uname().machine != "x86_64":
        return f"init is reachable and cannot be sealed on {os.uname().machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    saved, regs = (ctypes.c_ulong * 27)(), (ctypes.c_ulong * 27)()
    try:
        address = _syscall_instruction()
        _call(libc, _SEIZE)
    except OSError as exc:
        return f"init could not be sealed: {exc}"
    try:
        _call(libc, _INTERRUPT)
        os.waitpid(1, _WALL)
        _call(libc, _GETREGS, ctypes.addressof(saved))
        ctypes.memmove(regs, saved, ctypes.sizeof(saved))
        regs[_RIP], regs[_RAX], regs[_ORIG_RAX] = address, _PRCTL, 2**64 - 1  # no syscall restart on resume
        regs[_RDI], regs[_RSI], regs[_RDX], regs[_R10], regs[_R8] = _PR_SET_DUMPABLE, 0, 0, 0, 0
        _call(libc, _SETREGS, ctypes.addressof(regs))
        _call(libc, _SINGLESTEP)
        os.waitpid(1, _WALL)
        _call(libc, _SETREGS, ctypes.addressof(saved))
    except OSError as exc:
        return f"init could not be sealed: {exc}"
    finally:
        libc.ptrace(_DETACH, 1, None, None)
    return "init is still reachable after its seal" if init_reachable() else ""
