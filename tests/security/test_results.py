"""Results under every cap, end to end (issue #22): a run that raised is reported as failed whatever its error
cost, through every door (library, session, CLI, HTTP, a remote node, MCP, tool calls), and what the host keeps
of a run (image files, decoded images, the notebook, the result JSON, its own memory) stays within a small
multiple of what was charged. Judged from outside: the result and its renderings, exit codes, the files on the
host, the host's peak memory. tests/security/test_results_tables.py drives the same paths with a scripted kernel.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from nbformat import v4

import nbexec
from nbexec import ExecutionResult
from nbexec.cli import render
from nbexec.config import parse_size
from nbexec.engine import budget
from nbexec.files import transfer
from nbexec.files.folders import OutputFolder
from nbexec.integrations import toolcall, tools
from nbexec.notebook import outputs
from nbexec.sandbox import lasterror, zmtp

from ..cluster import NODE_TOKEN, Server, node, wait_ready
from ..conftest import IMAGE, checkout_image
from .test_mcp import _client, _start_http, _stop_and_clean, _text

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]
# A chained exception of 40 MB: its error message, and the kernel's reply, are larger than the whole output
# allowance (1 MiB + 32 MiB), so both are read past unkept.
HUGE = "cause = ValueError('x' * 20_000_000)\nraise KeyError('y' * 20_000_000) from cause"


def failed_honestly(result: dict[str, Any] | ExecutionResult) -> None:
    """ok False, and an error with its name, a trimmed value, the head and tail of the traceback, within the cap."""
    data = result.to_dict() if isinstance(result, ExecutionResult) else result
    error = data["error"]
    assert data["ok"] is False and error is not None, {k: data[k] for k in ("ok", "error", "truncated_bytes")}
    assert error["ename"] == "KeyError" and error["kind"] == "exception", error["ename"]
    assert "trimmed" in error["evalue"] and error["evalue"].startswith("'yyy"), error["evalue"][:200]
    traceback = error["traceback"]
    assert any("Traceback" in line for line in traceback) and "KeyError" in traceback[-1], traceback[-1][:80]
    assert "trimmed" in "".join(traceback)
    size = len((error["ename"] + error["evalue"] + "".join(traceback)).encode())
    assert size <= budget.MAX_ERROR, size


@pytest.fixture
def quick(cleanup_ledger: None) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, interrupt_grace=3)


# -- honest under every cap, through every door ------------------------------------------------------------

def test_a_huge_exception_fails_the_run(quick: nbexec.SandboxConfig) -> None:
    result = nbexec.execute_notebook(HUGE, config=quick)
    failed_honestly(result)
    saved = json.loads(Path(result.notebook_path or "").read_text())
    assert saved["metadata"]["nbexec"]["ok"] is False
    assert [o["ename"] for o in saved["cells"][0]["outputs"] if o["output_type"] == "error"] == ["KeyError"]
    assert len(result.to_json()) < 4 * MIB and result.truncated_bytes > 33 * MIB


def test_the_cli_exits_1(cleanup_ledger: None, tmp_path: Path) -> None:
    script = tmp_path / "huge.py"
    script.write_text(HUGE + "\n")
    env = {**os.environ, "NBEXEC_IMAGE": IMAGE, "NBEXEC_POOL_SIZE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("NBEXEC_NODES", None)
    for args in (["--json"], []):
        done = subprocess.run([sys.executable, "-m", "nbexec.cli", "run", str(script), *args], capture_output=True,
                              text=True, env=env, timeout=300, cwd=tmp_path)
        assert done.returncode == 1, (args, done.stdout[-1000:], done.stderr[-2000:])
        if args:
            failed_honestly(json.loads(done.stdout))
        else:
            assert "KeyError" in done.stderr, done.stderr[-2000:]


def test_a_sessions_later_runs_stay_honest(quick: nbexec.SandboxConfig) -> None:
    with nbexec.Session(quick) as session:
        assert session.run("print('first')").ok
        failed_honestly(session.run(HUGE))
        after = session.run("print('after')")
        assert after.ok and after.stdout == "after\n", after.error
        small = session.run("raise ValueError('small')")
        assert not small.ok and small.error is not None and small.error.ename == "ValueError"
        failed_honestly(session.run(HUGE))


# Each line flushed alone: one iopub message per line, many more than a kernel's send queue (1,000) holds. Deno
# queues them all and publishes its idle first: its flood is long enough that the host, reading about 15,000
# lines a second here, is still reading it well past the second it reads after idle. R prints about 500 lines a
# second through IRkernel (fewer under load): 6,000 still overflow its queue several times during the pause.
FLOOD_LINES = {"python": 20_000, "bash": 20_000, "r": 6_000, "deno": 50_000}
FLOOD = {  # per language: a line per message, then "after"
    "python": "for i in range({n}):\n    print(i, flush=True)\nprint('after')",
    "bash": "for i in $(seq 0 {last}); do echo $i; done; echo after",
    "r": "for (i in 0:{last}) {{ cat(i, '\\n', sep = ''); flush(stdout()) }}; cat('after\\n')",
    "deno": "for (let i = 0; i < {n}; i++) console.log(String(i)); console.log('after')",
}


# The kernels' launchers of this checkout on the kernels image (Python, R, Deno, Bash), so a change to them is
# judged here (the register mutates them).
LAUNCHERS = ("kernel_launcher.py", "iopub_nodrop.py", "bash_kernel_launcher.py", "nbexec-kernel-r")
LAUNCHER_STEPS = """\
COPY kernel_launcher.py iopub_nodrop.py bash_kernel_launcher.py /opt/nbexec/
COPY nbexec-kernel-r /usr/local/bin/nbexec-kernel-r
RUN chmod 0755 /usr/local/bin/nbexec-kernel-r && chmod 0644 /opt/nbexec/*.py
"""


@pytest.fixture(scope="module")
def launchers_image(kernels_image: str) -> Iterator[str]:
    with checkout_image(kernels_image, LAUNCHERS, LAUNCHER_STEPS, "launchers-test") as tag:
        yield tag


@pytest.mark.parametrize("language", sorted(FLOOD))
def test_a_host_that_reads_slowly_loses_no_output(quick: nbexec.SandboxConfig, launchers_image: str,
                                                   monkeypatch: pytest.MonkeyPatch, language: str) -> None:
    """The host stops reading the kernel's output for 5 s while the code prints thousands of lines, as a
    loaded host does: the kernel waits for it, and every line arrives, in order, with nothing counted as dropped
    and no note of output left unread (a kernel whose iopub socket drops past its queue loses thousands of them
    without a word)."""
    config = dataclasses.replace(quick, language=language, image=launchers_image, timeout=240)
    count = FLOOD_LINES[language]
    code = FLOOD[language].format(n=count, last=count - 1)
    fill, stalled = zmtp.Connection._fill, []

    def slow_fill(self: zmtp.Connection, timeout: float) -> bool:
        if self.socket_type == "SUB" and armed and not stalled:
            stalled.append(time.monotonic())
            time.sleep(5)
        return fill(self, timeout)

    armed = False
    monkeypatch.setattr(zmtp.Connection, "_fill", slow_fill)
    with nbexec.Session(config) as session:
        assert session.run("true" if language == "bash" else "1").ok
        armed = True
        result = session.run(code)
    assert stalled, "the host never stalled: the test proves nothing"
    lines = result.stdout.splitlines()
    assert result.ok and result.truncated_bytes == 0, (result.error, result.truncated_bytes)
    assert lines == [str(i) for i in range(count)] + ["after"], (len(lines), lines[-3:], result.stderr[-500:])
    assert not any("still printing" in note for note in result.notes), result.notes


@pytest.fixture(scope="module")
def one_node(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real `nbexec serve` process on loopback: a node, answering HTTP and NBEXEC_NODES clients."""
    tmp = tmp_path_factory.mktemp("node")
    tmp.chmod(0o755)
    server = node(0, tmp).start()
    try:
        wait_ready([server])
        yield server
    finally:
        server.kill(signal.SIGTERM)


def _events(response: httpx.Response) -> list[tuple[str, Any]]:
    events, kind = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:])))
    return events


def test_http_says_the_run_failed(one_node: Server) -> None:
    with httpx.Client(base_url=one_node.url, headers={"Authorization": f"Bearer {NODE_TOKEN}"}, timeout=300) as http:
        failed_honestly(http.post("/v1/execute", json={"code": HUGE}).json())
        with http.stream("POST", "/v1/execute", params={"stream": "true"}, json={"code": HUGE}) as response:
            events = _events(response)
        assert events[-1][0] == "result", events[-1]
        failed_honestly(events[-1][1])
        session = http.post("/v1/sessions").json()["id"]
        failed_honestly(http.post(f"/v1/sessions/{session}/execute", json={"code": HUGE}).json())
        assert http.post(f"/v1/sessions/{session}/execute", json={"code": "1"}).json()["ok"] is True
        http.delete(f"/v1/sessions/{session}")


def test_a_remote_run_keeps_the_nodes_error(one_node: Server, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("NBEXEC_NODES", one_node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", NODE_TOKEN)
    failed_honestly(nbexec.execute_notebook(HUGE, output_dir=tmp_path / "one-shot"))
    with nbexec.Session(output_dir=tmp_path / "session") as session:
        failed_honestly(session.run(HUGE))
        assert session.run("print(2)").ok


def test_mcp_tells_the_model_the_code_failed(docker_ready: None, tmp_path: Path) -> None:
    tmp = tmp_path / "t"
    tmp.mkdir(mode=0o700)
    server = _start_http(tmp)
    try:
        async def call() -> Any:
            async with _client(server.url) as client:
                return await client.call_tool("execute_python", {"code": HUGE})

        answer = anyio.run(call)
        assert answer.is_error and "KeyError" in _text(answer), _text(answer)[-2000:]
    finally:
        assert _stop_and_clean(server) == [], "the MCP server left containers"


def test_tool_calls_tell_the_model_the_code_failed(quick: nbexec.SandboxConfig) -> None:
    block = toolcall.handle_anthropic_tool_use({"id": "t1", "input": {"code": HUGE}}, config=quick)
    text = block["content"][0]["text"]
    assert block["is_error"] is True and "KeyError" in text and "Fix the code" in text, text[-2000:]
    message = toolcall.handle_openai_tool_call({"id": "c1", "function": {"arguments": json.dumps({"code": HUGE})}},
                                               config=quick)
    assert "Error (exception" in message["content"] and "KeyError" in message["content"], message["content"][-2000:]


# -- renderings of a failed run: the error is never what a budget cuts ---------------------------------------

def _failed(text: str, traceback: tuple[str, ...]) -> ExecutionResult:
    return ExecutionResult(
        ok=False, execution_id="x", stdout=text, stderr="", text=text,
        error=nbexec.CellError("KeyError", "'boom'", traceback, "exception", 0), outputs=(), images=(), files=(),
        skipped_files=(), notebook=v4.new_notebook(), notebook_path=None, output_dir="/o", duration_s=0.0, timings={})


@pytest.mark.parametrize("text, traceback", [
    ("t" * MIB, ("Cell In[1], line 1\n",) * 50_000 + ("KeyError: 'boom'",)),
    ("t" * MIB, ("x" * MIB,)),
    ("", ("Cell In[1], line 1\n" + "z" * MIB, "KeyError: 'boom'")),
], ids=["long-output-and-traceback", "one-long-traceback-line", "long-frame"])
def test_the_model_always_sees_the_error(text: str, traceback: tuple[str, ...]) -> None:
    shown = tools.render_for_llm(_failed(text, traceback), budget=8000)
    assert len(shown) <= 8000
    assert "Error (exception" in shown and "KeyError" in shown and "Fix the code" in shown, shown[-3000:]
    assert render.error_text(_failed(text, traceback))


# -- one charge, one copy -----------------------------------------------------------------------------------

def test_images_are_saved_once_and_capped(tmp_path: Path) -> None:
    """The same image shown by fifty outputs is one file; distinct images stop at the cap, the first ones kept, with
    a note. Decoded one at a time: the generator is never turned into a list."""
    def shown(count: int, distinct: bool) -> Iterator[outputs.ImageData]:
        for i in range(count):
            yield outputs.ImageData(0, "image/png", "png", (str(i) if distinct else "same").encode() * (256 * 1024))

    folder_path = tmp_path / "out"
    folder_path.mkdir(mode=0o700)
    with OutputFolder.open(folder_path) as folder:
        same, notes = transfer.save_images(shown(50, False), folder)
        assert len(same) == 50 and len({i.path for i in same}) == 1 and not notes
        capped, notes = transfer.save_images(shown(50, True), folder, max_bytes=4 * MIB)
    assert 0 < len(capped) < 50 and sum(i.size for i in capped) <= 4 * MIB and "not saved" in notes[0], notes
    assert sum(f.stat().st_size for f in (folder_path / "images").iterdir()) <= 5 * MIB


@pytest.mark.parametrize("answer", [
    {}, {"user_expressions": []}, {"user_expressions": {"nbexec_last_error": {"status": "error"}}},
    *({"user_expressions": {"nbexec_last_error": {"status": "ok", "data": {"text/plain": text}}}} for text in (
        "'not base64!'", "'" + base64.b64encode(b"[1, 2]").decode() + "'",
        "'" + base64.b64encode(b'{"raised": true, "ename": 1}').decode() + "'",
        "'" + base64.b64encode(b'{"raised": "yes"}').decode() + "'",
        "'" + base64.b64encode(b"\xff\xfe").decode() + "'", "'" + base64.b64encode(b"[" * 100000).decode() + "'",
        "x" * MIB)),
], ids=["empty", "not-a-dict", "failed", "not-base64", "not-an-object", "name-not-text", "raised-not-bool",
        "not-utf8", "too-deep", "not-quoted"])
def test_a_malformed_answer_from_the_kernel_tells_nothing(answer: dict[str, Any]) -> None:
    assert lasterror.read(answer) is None


# -- one charge, one copy, measured from outside -------------------------------------------------------------

MEASURE = textwrap.dedent(r'''
    import json, os, sys, nbexec
    def peak():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    config = nbexec.SandboxConfig(image=sys.argv[1], pool_size=0, warm_imports=(), timeout=120)
    codes = json.loads(sys.stdin.read())
    with nbexec.Session(config) as session:
        session.run("print(1)")  # imports, Docker client, the sandbox: not the attack's
        before, runs = peak(), []
        for code in codes:
            result = session.run(code)
            files = {image.path for image in result.images}  # this run's image files
            runs.append({"ok": result.ok, "error": result.error and result.error.ename,
                         "json": len(result.to_json()), "images": sum(os.path.getsize(f) for f in files),
                         "image_files": len(files), "notebook": os.path.getsize(result.notebook_path),
                         "truncated": result.truncated_bytes, "notes": result.notes})
        print(json.dumps({"growth": peak() - before, "runs": runs}))
''')
SHOW = ("import base64, os\nfrom IPython.display import display, update_display\n"
        "small = base64.b64encode(b'\\x89PNG' + b'0' * 100).decode()\n"
        "for i in range({count}):\n    display({{'image/png': small}}, raw=True, display_id='d')\n")
UPDATE = ("import base64, os\nfrom IPython.display import update_display\n"
          "big = base64.b64encode(b'\\x89PNG' + os.urandom(1536 * 1024)).decode()  # 2 MiB of base64\n"
          "update_display({'image/png': big}, raw=True, display_id='d')\nprint('updated')")
BUDGETS = parse_size(nbexec.SandboxConfig().max_output) + parse_size(nbexec.SandboxConfig().max_display)


def _measure(codes: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", MEASURE, IMAGE], input=json.dumps(codes), capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n{json.dumps(report)}")
    return report


def test_one_update_of_a_hundred_outputs_is_charged_a_hundred_times(cleanup_ledger: None) -> None:
    """The issue's case: 100 outputs under one display id, one 2 MiB image update, then the same again in later
    runs of the session. Kept whole it was 150 MiB of image files and a 200 MiB notebook per run."""
    report = _measure([SHOW.format(count=100) + UPDATE, UPDATE, UPDATE])
    for run in report["runs"]:
        assert run["ok"], run
        assert run["images"] <= 2 * MIB and run["json"] <= 2 * BUDGETS and run["notebook"] <= 2 * BUDGETS, run
    assert report["growth"] <= BUDGETS + 160 * MIB, report


def test_identical_images_are_kept_once(cleanup_ledger: None) -> None:
    """Ten outputs under one id and a 2 MiB update that fits the budget (20 MiB): ten outputs show it, one file
    holds it."""
    report = _measure([SHOW.format(count=10) + UPDATE])
    run = report["runs"][0]
    assert run["ok"] and run["image_files"] == 1 and run["images"] <= 2 * MIB, run


FILL = textwrap.dedent(r'''
    import base64, os, sys
    from IPython.display import display
    sys.stdout.write("\x00\x1b" * 2**20)  # control characters: six bytes each in JSON
    sys.stdout.flush()
    for i in range(1500):  # many small outputs whose text is control characters too
        display({"text/plain": "\x07" * 400}, raw=True)
    for i in range(24):  # more images than the display allowance holds
        display({"image/png": base64.b64encode(os.urandom(1536 * 1024)).decode()}, raw=True)
    raise ValueError("\x1b" * 2**20)  # an error of control characters, past every cap
''')


def test_what_a_run_keeps_is_a_small_multiple_of_its_budgets(cleanup_ledger: None) -> None:
    """Three runs of a session that fill every allowance with the costliest shapes: each run's result JSON, the
    session's notebook after each run and each run's image files stay within the multiples SECURITY.md states,
    and so does the host's peak memory (the notebook never grows past one run's budgets of older outputs)."""
    report = _measure([FILL, FILL, FILL])
    for run in report["runs"]:
        assert not run["ok"] and run["error"] == "ValueError", run
        assert run["json"] <= 2 * BUDGETS + 12 * MIB and run["notebook"] <= 2 * BUDGETS + 8 * MIB, run
        assert run["images"] <= parse_size(nbexec.SandboxConfig().max_display), run
    assert report["growth"] <= BUDGETS + 160 * MIB, report


DENSE = textwrap.dedent(r'''
    import functools
    from IPython.display import display
    shapes = {{"deep": [functools.reduce(lambda v, _: [v], range(59), [])] * 500,
               "floats": [i / 7 for i in range(3000)], "objects": [{{"k": i}} for i in range(6000)]}}
    value, sent = shapes["{shape}"], 0
    while sent < 40 * 2**20:  # past the display allowance (32 MiB)
        display({{"application/json": value}}, raw=True)
        sent += 61000
''')


def test_host_memory_of_dense_json_displays_stays_within_the_stated_multiple(cleanup_ledger: None) -> None:
    """Displays of the JSON that parses into the most objects per byte, past the default display allowance, in three
    runs of a session. Before: the first run (lists nested 60 deep) grew the host by 1,540 MiB, the allowance
    being charged by bytes. After: charged what holding them parsed costs, within the stated multiple."""
    report = _measure([DENSE.format(shape=shape) for shape in ("deep", "floats", "objects")])
    for run in report["runs"]:
        assert run["ok"] and run["truncated"] > 0, run
    assert report["growth"] <= BUDGETS + 160 * MIB, report
