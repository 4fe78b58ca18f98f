"""A fake sandbox source for tests: no Docker, no node, no isolation. TESTS ONLY.

Its kernel (`FakeKernel`) answers code it finds in a table with the table's messages, and runs any other code
with Python's ``exec`` **in this process**, with this process's rights: it is no sandbox at all, and untrusted
code must never reach it. Nothing in nbexec imports this module, and no config or environment variable names it:
a test makes it reachable with ``nbexec.engine.sources.register_for_tests("fake", FakeSource())``.

What it is for: the engine's logic (budgets, replay decisions, durable records, file collection) runs against it
in the fast tier, and the conformance suite (tests/test_seam_conformance.py) holds it to the same contract as
the real backends. Its messages go through the same `messages.Message` and `execution.dispatch` as a real
kernel's. /mnt/data is a private folder of nbexec's working root: the text "/mnt/data" in a cell's code is that
folder, and it is turned back into "/mnt/data" in what the cell prints. Relative paths are this process's
working folder: cells should name /mnt/data.

Helpers a cell can call: ``hang()`` blocks until the cell is interrupted (a timeout that an interrupt ends);
``die()`` ends the kernel as a crash would (the sandbox stops); ``display(value)`` sends a display_data.

It offers the required core, SLEEP (a fresh namespace on `awake`: the engine replays) and DURABLE (records that
find a sandbox again within this process). It does not offer FREEZE, EGRESS, WHEELS nor CHECKPOINT, so the
engine's paths for a backend without them run too.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from nbexec import languages
from nbexec.config import SandboxConfig
from nbexec.errors import ConfigError, NotOfferedError, SandboxError
from nbexec.files import artifacts, transfer
from nbexec.files.folders import OutputFolder, work_root
from nbexec.files.workdir import WORKDIR_PREFIX, remove_tree

from .execution import Execution, dispatch
from .hidden import Named
from .messages import Message
from .source import DATA_MOUNT, ContainerState, SandboxHandle, SandboxSource

Script = Sequence[tuple[str, dict[str, Any]]]  # (msg_type, content) of each output message, in order
Emit = Callable[[str, dict[str, Any]], None]
_POLL = 0.05


class _Died(BaseException):
    """``die()`` was called: the kernel ends without a reply."""


class FakeKernel:
    """The fake's kernel (see the module docstring): one namespace, one execution count, an interrupt flag."""

    def __init__(self, table: Mapping[str, Script], data_dir: Path) -> None:
        self.table, self.data_dir = table, data_dir
        self.count = 0
        self.interrupted = threading.Event()
        self.namespace: dict[str, Any] = {}
        self._emit: Emit = lambda kind, content: None

    def execute(self, code: str, emit: Emit, *, silent: bool = False,
                expressions: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """Run ``code``, each output to ``emit``; the execute_reply's content, or None when the kernel died."""
        self.interrupted.clear()
        self._emit = emit
        if not silent:
            self.count += 1
            emit("execute_input", {"code": code, "execution_count": self.count})
        if code in self.table:
            errors = [content for kind, content in self.table[code] if kind == "error"]
            for kind, content in self.table[code]:
                emit(kind, content)
            return self._reply(errors[0] if errors else None)
        try:
            with warnings.catch_warnings():  # a cell's unclosed file is the cell's business, not this process's
                warnings.simplefilter("ignore", ResourceWarning)
                self._exec(code.replace(DATA_MOUNT, str(self.data_dir)), silent)
        except _Died:
            return None
        except BaseException as exc:  # what the cell raised is its result (KeyboardInterrupt, SystemExit too)
            error = {"ename": type(exc).__name__, "evalue": self._shown(str(exc)),
                     "traceback": [f"{type(exc).__name__}: {self._shown(str(exc))}"]}
            emit("error", error)
            return self._reply(error)
        return self._reply(None, self._expressions(expressions or {}))

    def _exec(self, code: str, silent: bool) -> None:
        if not self.namespace:
            self.namespace.update(__builtins__=self._builtins(), hang=self._hang, die=self._die, display=self._display)
        tree = ast.parse(code, "<cell>")
        last = tree.body[-1] if tree.body and not silent else None
        if isinstance(last, ast.Expr):  # its value is shown, as IPython shows a cell's last expression
            tree.body.pop()
        exec(compile(tree, "<cell>", "exec"), self.namespace)  # test code only (see the module docstring)
        if isinstance(last, ast.Expr):
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.namespace)
            if value is not None:
                self._emit("execute_result", {"data": {"text/plain": self._shown(repr(value))}, "metadata": {},
                                              "execution_count": self.count})

    def _reply(self, error: dict[str, Any] | None, expressions: dict[str, Any] | None = None) -> dict[str, Any]:
        if error is not None:
            return {"status": "error", "execution_count": self.count, **error}
        return {"status": "ok", "execution_count": self.count, "user_expressions": expressions or {}}

    def _expressions(self, expressions: Mapping[str, str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, text in expressions.items():
            try:
                value = eval(text, self.namespace)
                found[name] = {"status": "ok", "data": {"text/plain": repr(value)}, "metadata": {}}
            except Exception as exc:
                found[name] = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc), "traceback": []}
        return found

    def _builtins(self) -> dict[str, Any]:
        own = dict(vars(builtins))
        own["print"] = self._print
        return own

    def _print(self, *values: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
               flush: bool = False) -> None:
        name = "stderr" if file is sys.stderr else "stdout"
        text = (" " if sep is None else sep).join(map(str, values)) + ("\n" if end is None else end)
        self._emit("stream", {"name": name, "text": self._shown(text)})

    def _display(self, value: Any) -> None:
        self._emit("display_data", {"data": {"text/plain": self._shown(repr(value))}, "metadata": {}})

    def _hang(self) -> None:
        self.interrupted.wait()
        raise KeyboardInterrupt

    def _die(self) -> None:
        raise _Died

    def _shown(self, text: str) -> str:
        return text.replace(str(self.data_dir), DATA_MOUNT)


def _message(kind: str, content: dict[str, Any], parent: str) -> Message:
    raw = json.dumps(content).encode()
    return Message("iopub", kind, uuid.uuid4().hex, parent, len(raw), raw)


class FakeSandbox(SandboxHandle):
    """A fake sandbox: a `FakeKernel` and a private folder as /mnt/data (see the module docstring)."""

    backend = "fake"

    def __init__(self, config: SandboxConfig, table: Mapping[str, Script]) -> None:
        self.id, self.config = uuid.uuid4().hex[:16], config
        self.language_info = {"name": "python", "version": sys.version.split()[0]}
        self.folder = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-fake-", dir=work_root()))
        self.data_dir = self.folder / "data"
        self.data_dir.mkdir(mode=0o700)
        self.table = table
        self.kernel: FakeKernel | None = FakeKernel(table, self.data_dir)
        self.exit_code: int | None = None  # set when it stopped
        self.runs = 0  # cells run (replays included): tests read it

    def __repr__(self) -> str:
        return f"<FakeSandbox {self.id}>"

    # -- the kernel -----------------------------------------------------------------------------------

    def run(self, code: str, *, deadline: float, on_output: Callable[[Message], None]) -> Execution:
        run, kernel, parent = Execution(), self.kernel, uuid.uuid4().hex
        if kernel is None or self.exit_code is not None:
            run.status = "gone"
            return run
        self.runs += 1
        outbox: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        replies: list[dict[str, Any] | None] = []

        def work() -> None:
            try:
                replies.append(kernel.execute(code, lambda kind, content: outbox.put((kind, content))))
            finally:
                outbox.put(None)

        threading.Thread(target=work, name="nbexec-fake-kernel", daemon=True).start()
        dispatch(_message("status", {"execution_state": "busy"}, parent), run, on_output)
        give_up: float | None = None
        while True:
            now = time.monotonic()
            if give_up is None and now >= deadline:  # as the kernel client: interrupt, then kill after the grace
                self.interrupt()
                give_up = now + self.config.interrupt_grace
            if give_up is not None and now >= give_up:
                self.kill()
                run.status, run.stop = "timeout", "killed"
                return run
            try:
                item = outbox.get(timeout=_POLL)
            except queue.Empty:
                continue
            if item is None:
                break
            if give_up is None or item[0] != "error":  # an interrupt's KeyboardInterrupt is not the cell's error
                dispatch(_message(*item, parent), run, on_output)
        reply = replies[0] if replies else None
        if reply is None:  # die(): the kernel went away under the cell
            self.exit_code = 1
            run.status = "gone"
            return run
        if give_up is not None:
            run.status, run.stop = "timeout", "interrupted"
        else:
            run.reply = str(reply.get("status", ""))
            run.status = "error" if run.reply == "error" or run.status == "error" else "ok"
        dispatch(_message("status", {"execution_state": "idle"}, parent), run, on_output)
        return run

    def run_hidden(self, code: str, timeout: float, *, expressions: dict[str, str] | None = None,
                   named: Named | None = None) -> dict[str, Any] | None:
        kernel = self.kernel
        if kernel is None or self.exit_code is not None:
            return None
        replies: list[dict[str, Any] | None] = []
        worker = threading.Thread(target=lambda: replies.append(kernel.execute(
            code, lambda kind, content: None, silent=True, expressions=expressions)), daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive() or not replies:
            self.interrupt()
            return None
        return replies[0]

    def interrupt(self) -> None:
        if self.kernel is not None:
            self.kernel.interrupted.set()

    @property
    def kernel_lost(self) -> bool:
        return self.kernel is None or self.exit_code is not None

    # -- its life -------------------------------------------------------------------------------------

    def state(self) -> ContainerState:
        return ContainerState(running=self.exit_code is None, exit_code=self.exit_code, oom_killed=False)

    def kill(self) -> None:
        self.interrupt()
        if self.exit_code is None:
            self.exit_code = 137

    def destroy(self) -> None:
        self.kill()
        remove_tree(self.folder)

    def sleep(self) -> None:
        """Its kernel (and so its namespace) is dropped; /mnt/data stays."""
        self.interrupt()
        self.kernel = None

    def awake(self) -> None:
        if self.exit_code is not None:
            raise SandboxError("the fake sandbox was killed while asleep")
        self.kernel = FakeKernel(self.table, self.data_dir)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake", "id": self.id, "asleep": self.kernel is None}

    # -- /mnt/data ------------------------------------------------------------------------------------

    def put_file(self, name: str, content: bytes | BinaryIO) -> None:
        transfer.put(self.data_dir, name, content)

    def snapshot(self, target: OutputFolder, limits: artifacts.Limits,
                 known: artifacts.Known | None = None) -> artifacts.Collection:
        return artifacts.snapshot(self.data_dir, target, limits, known=known)

    def open_file(self, name: str, *, max_bytes: int = 0) -> tuple[int, transfer.FileChunks]:
        return transfer.open_stream(self.data_dir, name, max_bytes=max_bytes)

    def list_files(self, limits: artifacts.Limits, known: artifacts.Known | None = None) -> artifacts.Collection:
        return artifacts.snapshot(self.data_dir, None, limits, known=known)


class FakeSource(SandboxSource):
    """Fake sandboxes (see the module docstring); ``table``: code -> the messages it answers with."""

    backend = "fake"

    def __init__(self, table: Mapping[str, Script] | None = None) -> None:
        self.table = dict(table or {})
        self.live: dict[str, FakeSandbox] = {}
        self._lock = threading.Lock()

    def acquire(self, config: SandboxConfig, *, purpose: str, claim: str = "") -> SandboxHandle:
        if config.input_dir:
            raise ConfigError("input_dir is a host folder the fake source does not mount")
        if not languages.get(config.language).is_python:
            raise NotOfferedError(f"the fake sandbox backend runs Python only, not {config.language}")
        sandbox = FakeSandbox(config, self.table)
        with self._lock:
            self.live[sandbox.id] = sandbox
        return sandbox

    def release(self, sandbox: SandboxHandle, *, wait: bool) -> None:
        if not isinstance(sandbox, FakeSandbox):
            raise TypeError(f"{sandbox!r} is not a fake sandbox")
        with self._lock:
            self.live.pop(sandbox.id, None)
        sandbox.destroy()

    def adopt(self, config: SandboxConfig, record: dict[str, Any]) -> SandboxHandle:
        found = self._found(record)
        if found is None or found.exit_code is not None:
            raise SandboxError("the record names no live fake sandbox")
        return found

    def abandon(self, config: SandboxConfig, record: dict[str, Any]) -> None:
        found = self._found(record)
        if found is not None:
            self.release(found, wait=True)

    def close(self) -> None:
        with self._lock:
            found, self.live = list(self.live.values()), {}
        for sandbox in found:
            sandbox.destroy()

    def _found(self, record: dict[str, Any]) -> FakeSandbox | None:
        with self._lock:
            return self.live.get(str(record.get("id"))) if record.get("kind") == "fake" else None
