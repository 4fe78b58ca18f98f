"""The E2B door with E2B's own SDKs (`e2b`, `e2b-code-interpreter` from PyPI, unmodified) against a real
`nbexec serve` and real sandboxes: only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY are set."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator

import e2b
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

import nbexec
from nbexec.service.settings import ServerSettings

from . import e2bsdk
from .conftest import IMAGE, own_containers, wait_until
from .test_server import TOKEN_A, TOKEN_B, Running, running


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door() as service:
        yield service


@pytest.fixture
def sdk(door: Running, monkeypatch: pytest.MonkeyPatch) -> Running:
    """The three variables, and nothing else of E2B's."""
    e2bsdk.point(monkeypatch, door.url, TOKEN_A)
    return door


@pytest.fixture
def sandbox(sdk: Running) -> Iterator[Sandbox]:
    made = Sandbox.create(timeout=120)
    try:
        yield made
    finally:
        made.kill()


def test_run_code_streams_output_results_and_errors(sandbox: Sandbox) -> None:
    seen: list[str] = []
    run = sandbox.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7",
                           on_stdout=lambda m: seen.append(m.line))
    assert run.logs.stdout == ["out\n"] and run.logs.stderr == ["err\n"] and seen == ["out\n"]
    assert run.text == "42" and run.results[0].is_main_result and run.error is None
    failed = sandbox.run_code("def f():\n    raise ValueError('nope')\nf()")
    assert failed.error is not None and failed.error.name == "ValueError" and failed.error.value == "nope"
    assert "ValueError" in failed.error.traceback and failed.execution_count == run.execution_count + 1
    state = sandbox.run_code("x = 41")
    assert sandbox.run_code("x + 1").text == "42" and state.error is None
    # Per-call envs: set for that call only, what was there before comes back.
    sandbox.run_code("import os; os.environ['KEPT'] = 'before'")
    seen = sandbox.run_code("os.environ['KEPT'], os.environ['ONLY_NOW']", envs={"KEPT": "now", "ONLY_NOW": "1"})
    assert seen.text == "('now', '1')"
    assert sandbox.run_code("os.environ['KEPT'], 'ONLY_NOW' in os.environ").text == "('before', False)"


def test_rich_results_keep_their_formats(sandbox: Sandbox) -> None:
    code = ("import matplotlib.pyplot as plt\nfrom IPython.display import "
            "HTML, display\ndisplay(HTML('<b>bold</b>'))\nplt.plot([1, 2, 3])\nplt.show()\n{'a': 1}")
    run = sandbox.run_code(code)
    assert run.error is None, run.error
    html = [r for r in run.results if r.html]
    png = [r for r in run.results if r.png]
    assert html and html[0].html == "<b>bold</b>" and not html[0].is_main_result
    assert png and base64.b64decode(png[0].png).startswith(b"\x89PNG")
    assert run.results[-1].is_main_result and run.results[-1].text == "{'a': 1}"


def test_a_client_time_limit_interrupts_the_cell(sandbox: Sandbox) -> None:
    """The SDKs have no interrupt call: the client hanging up at its own limit interrupts the kernel."""
    began = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sandbox.run_code("import time\nwhile True: time.sleep(0.1)", timeout=2)
    ran = wait_until(lambda: sandbox.run_code("'free'", timeout=20), 20, "the kernel stayed busy")
    assert ran.text == "'free'" and time.monotonic() - began < 25


def test_lifecycle_info_list_timeout_and_kill(sdk: Running) -> None:
    first = Sandbox.create(metadata={"team": "a b&c=d", "kind": "one"}, timeout=60)
    second = Sandbox.create(metadata={"team": "a b&c=d", "kind": "two"}, timeout=60)
    try:
        info = first.get_info()
        assert info.metadata == {"team": "a b&c=d", "kind": "one"} and info.state.value == "running"
        assert info.template_id == "code-interpreter-v1" and info.end_at > info.started_at
        pages = Sandbox.list(query=e2b.SandboxQuery(metadata={"team": "a b&c=d"}), limit=1)
        seen = pages.next_items() + pages.next_items()
        assert {s.sandbox_id for s in seen} == {first.sandbox_id, second.sandbox_id} and not pages.has_next
        only = Sandbox.list(query=e2b.SandboxQuery(metadata={"kind": "two"})).next_items()
        assert [s.sandbox_id for s in only] == [second.sandbox_id]
        assert first.is_running()
        first.set_timeout(1)
        wait_until(lambda: not first.is_running(), 15, "the sandbox outlived its timeout")
        with pytest.raises(e2b.NotFoundException):
            Sandbox.get_info(first.sandbox_id)
    finally:
        assert second.kill() is True
        assert Sandbox.kill(second.sandbox_id) is False  # gone: False, not an exception


def test_pause_and_connect_keep_state(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'value'")
    assert sandbox.pause() is True
    assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
    assert sandbox.pause() is False  # already paused
    again = Sandbox.connect(sandbox.sandbox_id)
    assert Sandbox.get_info(sandbox.sandbox_id).state.value == "running"
    assert again.run_code("kept").text == "'value'"


def test_snapshots_restore_and_fork(sandbox: Sandbox) -> None:
    sandbox.run_code("open('/mnt/data/note.txt', 'w').write('kept')\nseed = 7")
    snap = sandbox.create_snapshot()
    assert snap.snapshot_id in {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
    restored = Sandbox.create(template=snap.snapshot_id, timeout=60)
    try:
        assert restored.run_code("seed, open('/mnt/data/note.txt').read()").text == "(7, 'kept')"
    finally:
        restored.kill()
    forks = sandbox.fork(count=2, timeout=60)
    try:
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks)
        assert {f.run_code("seed * 6").text for f in forks} == {"42"}  # type: ignore[union-attr]
    finally:
        for fork in forks:
            if isinstance(fork, Sandbox):
                fork.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_async_sdk_runs_code_with_callbacks(sdk: Running) -> None:
    async def scenario() -> tuple[str | None, list[str]]:
        made = await AsyncSandbox.create(timeout=60)
        seen: list[str] = []
        try:
            run = await made.run_code("print('a')\n2 ** 10", on_stdout=lambda m: seen.append(m.line))
            return run.text, seen
        finally:
            await made.kill()
    assert asyncio.run(scenario()) == ("1024", ["a\n"])


def test_errors_come_in_e2b_shapes(sdk: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(e2b.SandboxException, match="template 'nope' not found"):
        Sandbox.create(template="nope")
    with pytest.raises(e2b.SandboxException, match="internet access is off"):
        Sandbox.create(allow_internet_access=True)
    monkeypatch.setenv("E2B_API_KEY", "wrong-token-" + "x" * 20)
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create()
    assert not own_containers()  # nothing was started for a refused call


def test_the_token_cap_is_a_fast_rate_limit(sdk: Running) -> None:
    """A full cap will not clear by waiting: 429 with Should-Retry false, so the SDK does not retry for minutes."""
    made = [Sandbox.create(timeout=60) for _ in range(3)]
    try:
        began = time.monotonic()
        with pytest.raises(e2b.RateLimitException):
            Sandbox.create()
        assert time.monotonic() - began < 5
    finally:
        for one in made:
            one.kill()


def test_one_token_never_reaches_another_tokens_sandbox(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", TOKEN_B)
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect(sandbox.sandbox_id)
    assert Sandbox.kill(sandbox.sandbox_id) is False
    assert sandbox.sandbox_id not in {s.sandbox_id for s in Sandbox.list().next_items()}
    monkeypatch.setenv("E2B_API_KEY", TOKEN_A)
    assert sandbox.run_code("'still here'").text == "'still here'"


def test_commands_run_stream_and_fail_as_e2b_says(sandbox: Sandbox) -> None:
    seen: list[str] = []
    done = sandbox.commands.run("echo out; echo err >&2; pwd", on_stdout=seen.append)
    assert done.stdout == "out\n/home/user\n" and done.stderr == "err\n" and done.exit_code == 0
    assert "".join(seen) == done.stdout
    with pytest.raises(e2b.CommandExitException) as failed:
        sandbox.commands.run("echo bad >&2; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "bad\n"
    moved = sandbox.commands.run("pwd; echo $GREETING", cwd="/tmp", envs={"GREETING": "hi"})
    assert moved.stdout == "/tmp\nhi\n"
    with pytest.raises(e2b.TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    with pytest.raises(e2b.SandboxException, match="never runs code as root"):
        sandbox.commands.run("id", user="root")


def test_background_processes_take_input_list_connect_and_die(sandbox: Sandbox) -> None:
    echo = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(echo.pid, "line\n")
    sandbox.commands.close_stdin(echo.pid)
    assert echo.wait().stdout == "line\n"
    sleeper = sandbox.commands.run("sleep 60", background=True)
    assert sleeper.pid in {p.pid for p in sandbox.commands.list()}
    again = sandbox.commands.connect(sleeper.pid)
    assert sandbox.commands.kill(sleeper.pid) is True
    with pytest.raises(e2b.CommandExitException):
        again.wait()
    assert sleeper.pid not in {p.pid for p in sandbox.commands.list()}
    assert sandbox.commands.kill(sleeper.pid) is False  # gone: False


def test_a_pty_takes_keys_and_resizes(sandbox: Sandbox) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    shell = sandbox.pty.create(PtySize(cols=80, rows=24))
    sandbox.pty.send_stdin(shell.pid, b"echo $((6*7)); stty size\n")
    text, resized = b"", False
    for _, _, chunk in shell:  # the pty's output as it comes; resized once the first size was printed
        text += chunk or b""
        if not resized and b"24 80" in text:
            sandbox.pty.resize(shell.pid, PtySize(cols=100, rows=30))
            sandbox.pty.send_stdin(shell.pid, b"stty size; exit\n")
            resized = True
    assert shell.wait().exit_code == 0
    assert b"42\r\n" in text and b"24 80" in text and b"30 100" in text


def test_files_write_read_list_move_and_remove(sandbox: Sandbox) -> None:
    import io

    written = sandbox.files.write("/home/user/a.txt", "hello")
    assert written.path == "/home/user/a.txt" and sandbox.files.read("a.txt") == "hello"
    sandbox.files.write("b/c.bin", io.BytesIO(b"x" * 300_000))  # octet-stream, streamed
    sandbox.files.write("g.txt", b"z" * 5000, gzip=True)
    assert len(sandbox.files.read("b/c.bin", format="bytes", gzip=True)) == 300_000
    assert sandbox.files.read("g.txt") == "z" * 5000
    both = sandbox.files.write_files([{"path": "m.txt", "data": "1"}, {"path": "/tmp/n.txt", "data": "2"}])
    assert [w.path for w in both] == ["/home/user/m.txt", "/tmp/n.txt"]
    assert {"a.txt", "b", "c.bin", "g.txt", "m.txt"} <= {e.name for e in sandbox.files.list("/home/user", depth=2)}
    info = sandbox.files.get_info("a.txt")
    assert info.size == 5 and info.type.value == "file" and info.permissions == "-rw-r--r--"
    assert sandbox.files.exists("a.txt") and not sandbox.files.exists("nope")
    assert sandbox.files.make_dir("d") is True and sandbox.files.make_dir("d") is False
    assert sandbox.files.rename("a.txt", "d/a.txt").path == "/home/user/d/a.txt"
    sandbox.files.remove("d")
    assert not sandbox.files.exists("d")
    # The same files through the interpreter: /home/user is the sandbox's /mnt/data.
    assert sandbox.run_code("open('/mnt/data/m.txt').read()").text == "'1'"
    with pytest.raises(e2b.FileNotFoundException):
        sandbox.files.read("nope.txt")
    with pytest.raises(e2b.SandboxException, match="Read-only"):
        sandbox.files.write("/usr/x", "y")


def test_async_sdk_watches_a_folder(sdk: Running) -> None:
    async def scenario() -> list[tuple[str, str]]:
        made = await AsyncSandbox.create(timeout=60)
        seen: list[tuple[str, str]] = []
        try:
            handle = await made.files.watch_dir("/home/user", lambda e: seen.append((e.name, e.type.value)))
            await made.files.write("w.txt", "x")
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.05)
            await handle.stop()
            return seen
        finally:
            await made.kill()
    assert ("w.txt", "create") in asyncio.run(scenario())


def test_a_command_flood_is_kept_within_the_allowance_and_said(sandbox: Sandbox) -> None:
    """A cap shortens what is kept, never what happened: the exit code stands and the end says what was dropped."""
    done = sandbox.commands.run("head -c 20000000 /dev/zero | tr '\\0' x; echo; exit 0", timeout=60)
    assert done.exit_code == 0 and 0 < len(done.stdout) <= 1024**2  # max_output
    assert done.error is not None and "bytes of output were dropped" in done.error
    assert sandbox.commands.run("echo after").stdout == "after\n"  # the sandbox is still usable


@pytest.fixture(scope="module")
def roomy(docker_ready: None) -> Iterator[Running]:
    """A door whose output allowance (64 MiB) is far above what the host queues for a slow reader."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="64m")
    with running(ServerSettings(config=config, tokens=(TOKEN_A,))) as service:
        yield service


def test_output_lost_to_a_slow_reader_is_said(roomy: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops reading loses what the host cannot queue for it: never silently."""
    monkeypatch.setenv("E2B_API_URL", f"{roomy.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{roomy.url}/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", TOKEN_A)
    made = Sandbox.create(timeout=120)
    stalled: list[bool] = []

    def slow(_: str) -> None:
        if not stalled:  # the first chunk stalls the reader while 50 MB are printed
            stalled.append(True)
            time.sleep(4)
    try:
        done = made.commands.run("head -c 50000000 /dev/zero | tr '\\0' x", on_stdout=slow, timeout=90)
        assert done.exit_code == 0 and len(done.stdout) < 50_000_000
        assert done.error is not None and "bytes of output were dropped" in done.error
    finally:
        made.kill()
