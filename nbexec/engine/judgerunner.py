"""The judge's runner: shipped as text into a judging sandbox and run in its kernel, never imported on the host.

It holds the tests and verdicts in the kernel's memory and runs each test as a subprocess, so nothing the
program does can reach them:
- Init (PID 1), which kill(-1) spares, is made non-dumpable too (`judgeinit`): no test can trace or write it.
- The kernel is made non-dumpable first: a process of the same uid cannot ptrace it or read its memory, its
  environment or its descriptors, so the kernel's key (to speak to it) and the expected outputs stay out of reach.
- The tests' files are opened and unlinked before any test runs: the program never reads an expected output.
- After each test every process of the sandbox but init and the kernel is killed (kill(-1); the fork server of
  `judgefork` is spared while single kills keep up): a child the program left behind never sees the next test.
  A test that leaves one that cannot be ended stops the judging.
- The verdicts go back to the host in the reply to the host's own request (user_expressions), a channel only
  the kernel writes; nothing a test prints or writes is read as a verdict.
- The kernel leaves /mnt/data (its folder and its import path) before the first test: a file a test plants is
  never imported by the kernel.
Each test is a `judgeprocess.Process`, run into this namespace first with `judgecompare`. Standard library only:
this runs on the sandbox's Python.
"""

import base64
import json
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # in the kernel, `judgecompare` and `judgeprocess` are run into this namespace first
    from nbexec.engine.judgecompare import compare, diff
    from nbexec.engine.judgeprocess import ENV, SPARED, Process, end_all, memfd

_PR_SET_DUMPABLE = 4


def _undumpable() -> None:
    import ctypes  # imported here, before any test runs (see sys.path below)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _leave_data() -> None:
    """Never import what a test could write: the kernel's cwd and import path leave writable places."""
    os.chdir("/")
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and not p.startswith(("/mnt", "/tmp", "/home"))]
    sys.path_importer_cache.clear()


def _encode(value: Any) -> str:
    return base64.b64encode(json.dumps(value, separators=(",", ":")).encode()).decode("ascii")


class Judge:
    """The tests of one program, held in the kernel's memory; `setup` once, then `run` each chunk."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.index: list[dict[str, Any]] = []
        self.blob = -1
        self.build = plan["build"]
        self.fork: Any = None
        self.clean = False  # the last sweep left no process, and none started since: no sweep before a test

    def setup(self, seal: Any = None, fork: Any = None, first: Any = None) -> str:
        """Seal the kernel, init (``seal``: judgeinit's, "" once sealed) and the tests; compile the program.
        ``fork``: judgefork's `current`, when Python tests may be forked from a warm server. ``first``: the
        arguments of a first `run` (its ``seconds`` counted from now), made in this request once the program is
        ready: a round trip fewer."""
        end = time.monotonic() + (first[2] if first else 0.0)
        answer = self._setup(seal, fork)
        if first and "compiled" in answer and (answer["compiled"] is None or answer["compiled"]["ok"]):
            answer.update(self._run(first[0], first[1], max(0.0, end - time.monotonic()), *first[3:]))
        return _encode(answer)

    def _setup(self, seal: Any, fork: Any) -> dict[str, Any]:
        self.fork = fork if self.plan.get("warm") is not None else None
        _undumpable()
        _leave_data()
        exposed = seal() if seal is not None else ""
        if exposed:
            return {"exposed": exposed}
        ENV.update(self.plan["env"])
        folder = self.plan["folder"]
        with open(os.path.join(folder, "index.json"), "rb") as handle:
            self.index = json.loads(handle.read())
        self.blob = os.open(os.path.join(folder, "tests.bin"), os.O_RDONLY | os.O_NOFOLLOW)
        os.unlink(os.path.join(folder, "index.json"))
        os.unlink(os.path.join(folder, "tests.bin"))
        for command in (self.plan["compile"], self.plan["run"]):
            tool = command[0] if command else "/"
            if not tool.startswith(("/", ".")) and shutil.which(tool, path=ENV["PATH"]) is None:
                return {"missing": command[0]}
        if not self.plan["compile"]:
            return {"compiled": None}
        end_all()
        stdin = memfd("stdin", [])
        try:
            run = Process(self.plan["compile"], self.build, stdin, self.plan["compile_limits"])
        finally:
            os.close(stdin)
        failed = run.verdict(int(self.plan["compile_limits"]["memory"]))
        if failed is None and self.plan["output"] and not os.path.isfile(os.path.join(self.build, self.plan["output"])):
            failed = "no_output"
        log = (bytes(run.out[-4096:]) + bytes(run.err)).decode("utf-8", "replace")[-4096:]
        return {"compiled": {"ok": failed is None, "why": failed, "log": log, "time": run.wall}}

    def _read(self, span: list[int] | None) -> bytes | None:
        if span is None:  # no expected output: never a sentinel an expected output could equal
            return None
        offset, length = span
        return os.pread(self.blob, length, offset) if length else b""

    def run(self, first: int, last: int, seconds: float, budget: int, after: Any = None) -> str:
        """Run tests ``first`` to ``last`` (excluded) within ``seconds``: their ``records``, ``budget`` bytes at
        most. ``after`` (the reset of reuse="batch") is called once all of them are judged, in this request: its
        answer, cut short, is ``after`` (None where it was not called)."""
        return _encode(self._run(first, last, seconds, budget, after))

    def _run(self, first: int, last: int, seconds: float, budget: int, after: Any = None) -> dict[str, Any]:
        records = self._records(first, last, seconds, budget)
        if after is None or len(records) < last - first or any(r.get("v") == "judge_error" for r in records):
            return {"records": records, "after": None}
        try:
            done = after()
        except Exception as exc:  # the test's verdicts stand; the sandbox is not reused
            done = [f"the reset failed: {exc}"]
        return {"records": records, "after": [str(line)[:300] for line in done[:8]] if isinstance(done, list) else None}

    def _records(self, first: int, last: int, seconds: float, budget: int) -> list[dict[str, Any]]:
        end, records, used, number = time.monotonic() + seconds, [], 0, first
        try:
            for number in range(first, last):
                if time.monotonic() >= end:
                    records.append({"v": "timeout", "why": "not run: the program's time limit was used up"})
                    continue
                record = self._fit(self._one(self.index[number], end), budget - used, last - number)
                used += len(json.dumps(record))
                records.append(record)
                if record.get("v") == "judge_error":
                    break
        except KeyboardInterrupt:  # the host's, or a test's SIGINT: the test under way is not judged
            end_all()
            records = [*records[:number - first], {"v": "judge_error", "why": "interrupted"}]
        return records

    @staticmethod
    def _fit(record: dict[str, Any], room: int, left: int) -> dict[str, Any]:
        if len(json.dumps(record)) * left > room:  # keep room for the rest: the details go first
            record.pop("diff", None)
            record.pop("err", None)
            if "why" in record:
                record["why"] = record["why"][:100]
        return record

    def _one(self, test: dict[str, Any], end: float) -> dict[str, Any]:
        limits = dict(self.plan["limits"])  # the program's limit ends a test whose own limit is longer
        limits["time"] = min(float(limits["time"]), max(0.01, end - time.monotonic()))
        zygote = self.fork(self.plan["warm"], dict(ENV)) if self.fork is not None else None
        SPARED[:] = [zygote.pid] if zygote is not None else []  # before any sweep, which must spare it
        if not self.clean:  # the kernel's start, a compile or a checker may have left processes
            if not end_all():
                return {"v": "judge_error", "why": "processes of an earlier test could not be ended"}
            if zygote is not None and self.fork(self.plan["warm"], dict(ENV)) is None:  # changed before the sweep
                zygote = None
                SPARED[:] = []  # it is gone: its pid may be a test's next
        self.clean = False
        given = self._read(test["stdin"]) or b""
        stdin = memfd("stdin", [given])
        try:
            run = Process([*self.plan["run"], *test["args"]], self.build, stdin, limits, zygote=zygote)
        except OSError as exc:
            if zygote is not None:  # the server was stopped or killed, most likely by a test: nothing is judged
                end_all()
                return {"v": "judge_error", "why": f"the fork server failed: {exc}"}
            return {"v": "runtime_error", "why": f"could not start: {exc.strerror}"}
        finally:
            os.close(stdin)
        record: dict[str, Any] = {"t": round(run.wall, 4), "cpu": round(run.cpu, 4), "mem": run.peak,
                                  "exit": run.exit_code, "err": bytes(run.err[-512:]).decode("utf-8", "replace")}
        failed = run.verdict(int(limits["memory"]))
        self.clean = run.swept
        if not run.swept:
            return {**record, "v": "judge_error", "why": "the test's processes could not be ended"}
        if failed is not None:
            return {**record, "v": failed}
        want = self._read(test["expected"])
        mode = self.plan["compare"]
        if mode == "checker":
            return {**record, **self._check(given, bytes(run.out), want)}
        if want is None:
            return {**record, "v": "accepted"}
        if compare(mode, bytes(run.out), want, float(self.plan["tolerance"])):
            return {**record, "v": "accepted"}
        return {**record, "v": "wrong_answer", "diff": diff(bytes(run.out), want)}

    def _check(self, given: bytes, output: bytes, want: bytes | None) -> dict[str, Any]:
        """Run the caller's check() in a subprocess of its own (the program's processes are gone by now)."""
        fds = [memfd(name, [data]) for name, data in (("checker", self.plan["checker"].encode()), ("input", given),
                                                       ("output", output), ("expected", want)) if data is not None]
        reader, writer = os.pipe()
        stdin = memfd("stdin", [])
        try:
            # -I: no folder a test could write (its cwd, ~/.local) is on the checker's import path.
            argv = [sys.executable, "-I", "-c", self.plan["checker_wrapper"], *map(str, fds),
                    *(() if want is not None else ("-",)), str(writer)]  # "-": no expected output
            run = Process(argv, "/", stdin, self.plan["checker_limits"], pass_fds=(*fds, writer))
            os.close(writer)
            writer = -1
            os.set_blocking(reader, False)
            try:
                answer = os.read(reader, 4096)
            except BlockingIOError:
                answer = b""
        finally:
            for fd in (*fds, stdin, reader, *((writer,) if writer >= 0 else ())):
                os.close(fd)
        self.clean = run.swept
        try:
            accepted, message = json.loads(answer) if run.status == 0 else (None, "")
        except ValueError:
            accepted, message = None, ""
        if accepted is None or not isinstance(accepted, bool) or not isinstance(message, str):
            tail = bytes(run.err[-400:]).decode("utf-8", "replace")
            return {"v": "checker_error", "why": f"the checker failed ({run.verdict(0) or 'no answer'}): {tail}"}
        return {"v": "accepted" if accepted else "wrong_answer", **({"why": message} if message else {})}
