"""`Session.shell`: a shell command run by the sandbox's own kernel, as one cell of the session's notebook.

No new door into the sandbox: a fixed Python snippet (below) starts the command as a normal cell. So the command
has the sandbox's limits, its /mnt/data as working directory, and the cell's budgets. Its stdout and stderr go to
the kernel's own streams, where every byte is charged like any cell output. A flood is dropped past max_output and
counted.

The command runs in its own process group (``/bin/sh -c``). When it exits, times out or is interrupted, the whole
group is killed with SIGKILL. A child left in the background, or one that ignores SIGTERM, goes with it.
The result says what came of it: ``exit_code``, and ``error.kind`` "exit" (a non-zero status) or "timeout".
It works over any sandbox source, because it is built on `Session.run`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from nbexec.errors import ConfigError
from nbexec.kinds import ErrorKind
from nbexec.result import CellError, ExecutionResult

Runner = Callable[..., ExecutionResult]  # Session.run: (code, *, timeout) -> the cell's result

GRACE_S = 5.0  # the host's limit is the command's plus this: the kernel's own kill answers first
_EXIT = re.compile(r"exit status (-?\d{1,4})")
_MAX_COMMAND = 64 * 1024

# Runs in the kernel, in a namespace of its own, so nothing is left in the user's variables. It reads the two pipes
# in the kernel's main thread, because output printed from other threads may reach another cell. When the shell
# exits it kills the group, then every process that appeared while it ran. That catches one that left the group
# with setsid or a double fork: gVisor has no child subreaper to catch those.
_RUNNER = r'''
import codecs, os, selectors, signal, subprocess, sys, time

class ShellExit(Exception):
    pass

class ShellTimeout(Exception):
    pass

def _kill(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

def _processes():
    """Every process of the sandbox now, by pid (from /proc: the container's pid namespace)."""
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}

def _reap(before):
    """Kill every process that appeared during the command and is still there.

    This also finds one that left the command's group (setsid, a double fork). The kernel's children are reaped."""
    for _ in range(64):
        gained = _processes() - before
        if not gained:
            return
        for pid in gained:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # not the kernel's child: its parent (tini, pid 1) reaps it
                pass
        time.sleep(0.01)

def _pump(command, limit):
    before = _processes() | {os.getpid()}
    try:
        _run(command, limit)
    finally:
        _reap(before)

def _run(command, limit):
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd="/mnt/data", stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    streams = {proc.stdout: (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
               proc.stderr: (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace"))}
    selector = selectors.DefaultSelector()
    for pipe in streams:
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ)
    deadline, exited_at, timed_out = time.monotonic() + limit, None, False
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = proc.poll() is None
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                _kill(proc.pid)  # the shell is done: whatever it left running in its group goes now
            if exited_at is not None and now - exited_at > 1.0:
                break  # a child that left the group holds a pipe open: stop reading it
            for key, _ in selector.select(timeout=0.1):
                chunk = os.read(key.fileobj.fileno(), 65536)
                out, decoder = streams[key.fileobj]
                if not chunk:
                    selector.unregister(key.fileobj)
                    out.write(decoder.decode(b"", final=True))
                    continue
                out.write(decoder.decode(chunk))
                out.flush()
    finally:
        _kill(proc.pid)
        proc.wait()
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
        sys.stdout.flush()
        sys.stderr.flush()
    if timed_out:
        raise ShellTimeout(f"the command ran past its {limit:g} s time limit; its process group was killed")
    if proc.returncode != 0:
        raise ShellExit(f"exit status {proc.returncode}")
'''


def code_for(command: str, limit: float) -> str:
    """The cell that runs ``command`` with a time limit of ``limit`` seconds (a fixed snippet and two literals)."""
    return (f"__nbexec_shell = {{}}\nexec(compile({_RUNNER!r}, '<nbexec shell>', 'exec'), __nbexec_shell)\n"
            f"try:\n    __nbexec_shell['_pump']({command!r}, {float(limit)!r})\nfinally:\n    del __nbexec_shell")


def run(run_cell: Runner, default_timeout: float, command: str, timeout: float | None = None) -> ExecutionResult:
    """Run ``command`` as a cell through ``run_cell`` (a session's ``run``) and return the cell's result.

    The result carries the command's exit code, or None when it never finished (a timeout, interrupt, dead kernel)."""
    if not isinstance(command, str) or not command.strip():
        raise ConfigError("shell() needs a command (a non-empty string)")
    if "\0" in command or len(command.encode("utf-8", "surrogatepass")) > _MAX_COMMAND:
        raise ConfigError(f"the command must hold no NUL byte and be at most {_MAX_COMMAND // 1024} KiB")
    limit = timeout or default_timeout
    if limit <= 0:
        raise ConfigError("the shell timeout must be a positive number of seconds")
    result = run_cell(code_for(command, limit), timeout=limit + GRACE_S)
    return settle(result)


def settle(result: ExecutionResult) -> ExecutionResult:
    """The cell's result with the command's outcome.

    Exit code 0 is ok. A non-zero status is kind "exit" (kept in ``exit_code``); the command's own limit is
    "timeout". Any other failure (the host's timeout, an interrupt, a dead kernel) stays as the cell reported it."""
    error = result.error
    if error is None:
        return dataclasses.replace(result, exit_code=0)
    found = _EXIT.fullmatch(error.evalue) if error.ename == "ShellExit" else None
    if found is not None:
        status = int(found.group(1))
        return dataclasses.replace(result, exit_code=status,
                                   error=_rekind(error, "exit", f"the command ended with exit status {status}"))
    if error.ename == "ShellTimeout":
        return dataclasses.replace(result, error=_rekind(error, "timeout", error.evalue))
    return result


def _rekind(error: CellError, kind: ErrorKind, evalue: str) -> CellError:
    return dataclasses.replace(error, kind=kind, evalue=evalue, traceback=(f"{error.ename}: {evalue}",))
