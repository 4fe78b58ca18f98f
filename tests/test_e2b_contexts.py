"""The code interpreter's contexts through E2B's own SDK (`e2b-code-interpreter`, unmodified) against a real
`nbexec serve`: each context its own kernel state and working folder in the one sandbox, sharing its files; other
languages by ``language=``; and what a hostile sandbox or client can do to a context's start."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox

import nbexec
from nbexec.service.e2b.contexts import MAX_CONTEXTS
from nbexec.service.settings import ServerSettings

from . import e2bsdk
from .conftest import IMAGE
from .test_server import TOKEN_A, TOKEN_B, Running, running


def _door(config: nbexec.SandboxConfig) -> Iterator[Running]:
    settings = ServerSettings(config=config, tokens=(TOKEN_A, TOKEN_B), max_sessions_per_token=3,
                              max_running_per_token=3)
    with running(settings) as service:
        yield service


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    yield from _door(nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30,
                                          interrupt_grace=2))


@pytest.fixture(scope="module")
def polyglot(kernels_image: str) -> Iterator[Running]:
    """A server whose sandboxes start from the kernels image, offering its languages."""
    yield from _door(nbexec.SandboxConfig(image=kernels_image, languages=("r", "deno", "bash"), pool_size=0,
                                          warm_imports=(), timeout=60, interrupt_grace=2))


def _sdk(service: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    e2bsdk.point(monkeypatch, service.url, TOKEN_A)


@pytest.fixture
def sandbox(door: Running, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    with e2bsdk.sandbox(monkeypatch, door.url, TOKEN_A) as made:
        yield made


def test_each_context_has_its_own_state_and_folder_and_shares_the_files(sandbox: Sandbox) -> None:
    sandbox.run_code("x = 'own'\nopen('shared.txt', 'w').write('from the default context')")
    other = sandbox.create_code_context(cwd="/home/user")
    assert (other.language, other.cwd) == ("python", "/home/user")
    seen = sandbox.run_code("x", context=other)
    assert seen.error is not None and seen.error.name == "NameError"
    where = sandbox.run_code("import os\nos.getcwd(), open('/mnt/data/shared.txt').read()", context=other)
    assert where.text == "('/home/user', 'from the default context')", where
    sandbox.run_code("x = 'other'", context=other)
    assert sandbox.run_code("x").text == "'own'" and sandbox.run_code("x", context=other).text == "'other'"
    assert {c.id for c in sandbox.list_code_contexts()} == {"python", other.id}
    seen = sandbox.run_code("import os\nos.environ.get('ONLY_NOW')", context=other, envs={"ONLY_NOW": "1"})
    assert seen.text == "'1'" and sandbox.run_code("os.environ.get('ONLY_NOW')", context=other).text is None
    assert sandbox.commands.list() == []  # the context's kernel is not one of the user's processes
    sandbox.restart_code_context(other)
    assert sandbox.run_code("x", context=other).error.name == "NameError"  # type: ignore[union-attr]
    assert sandbox.run_code("x").text == "'own'"
    sandbox.remove_code_context(other)
    assert [c.id for c in sandbox.list_code_contexts()] == ["python"]
    with pytest.raises(SandboxException, match="not found"):
        sandbox.run_code("1", context=other)


def test_a_context_is_interrupted_by_its_time_limit_and_runs_on(sandbox: Sandbox) -> None:
    other = sandbox.create_code_context()
    sandbox.run_code("y = 5", context=other)
    started = time.monotonic()
    with pytest.raises(TimeoutException):  # the SDK hangs up at its timeout: that interrupts the cell
        sandbox.run_code("while True: pass", context=other, timeout=3)
    assert time.monotonic() - started < 20
    deadline = time.monotonic() + 30
    while True:  # the interrupt lands within the sandbox's grace; the context's state is kept
        try:
            after = sandbox.run_code("y + 1", context=other, timeout=10)
            break
        except Exception:
            assert time.monotonic() < deadline
    assert after.text == "6" and sandbox.run_code("1 + 1").text == "2"


def test_contexts_are_capped_per_sandbox(sandbox: Sandbox) -> None:
    made = [sandbox.create_code_context() for _ in range(MAX_CONTEXTS)]
    with pytest.raises(SandboxException, match="at most"):
        sandbox.create_code_context()
    assert len(sandbox.list_code_contexts()) == MAX_CONTEXTS + 1
    count = ("import os\nprint(sum(b'/run/nbexec/c' in open(f'/proc/{p}/cmdline', 'rb').read() "
             "for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()))")
    kernels = sandbox.commands.run(f"python3 -c \"{count}\"").stdout
    assert int(kernels) == MAX_CONTEXTS  # one process each, in the sandbox's own limits
    sandbox.remove_code_context(made[0])
    assert sandbox.run_code("2 + 2", context=sandbox.create_code_context()).text == "4"


def test_an_unoffered_language_is_refused_with_what_is_offered(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match="not offered"):
        sandbox.run_code("1 + 1", language="r")
    with pytest.raises(SandboxException, match="not a language"):
        sandbox.create_code_context(language="cobol")


def test_other_languages_run_in_contexts_of_their_own(polyglot: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    _sdk(polyglot, monkeypatch)
    box = Sandbox.create(timeout=120)
    try:
        assert box.run_code("console.log('from deno'); 6 * 7", language="js").logs.stdout == ["from deno\n"]
        assert box.run_code("cat(1 + 1)", language="r").logs.stdout == ["2"]
        shell = box.run_code("echo hi from $0 in $PWD", language="bash")
        assert shell.logs.stdout and "hi from" in shell.logs.stdout[0] and "/mnt/data" in shell.logs.stdout[0]
        box.run_code("writeLines('from r', 'r.txt')", language="r")
        assert box.run_code("open('r.txt').read()").text == "'from r\\n'"
        ids = {c.id: c.language for c in box.list_code_contexts()}
        assert ids == {"python": "python", "deno": "js", "r": "r", "bash": "bash"}
        ts = box.create_code_context(language="typescript")
        assert box.run_code("const n: number = 2; n * 21", context=ts).text == "42"
    finally:
        box.kill()


def test_a_name_planted_where_the_context_kernel_binds_is_never_followed(sandbox: Sandbox) -> None:
    """The sandbox's code races the new kernel to its socket folder and plants links to a host socket: the host
    refuses the context and never connects to what the links name."""
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "host.sock"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(target))
        listener.listen(8)
        listener.settimeout(0.2)
        accepted: list[int] = []
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0].fileno())
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        plant = (f"import os, threading\nseen = set(os.listdir('/run/nbexec'))\ndef plant():\n"
                 f"    for _ in range(200000):\n        for name in set(os.listdir('/run/nbexec')) - seen:\n"
                 f"            for port in (1, 2, 3, 4, 5):\n"
                 f"                try: os.symlink({str(target)!r}, f'/run/nbexec/{{name}}/kernel-{{port}}')\n"
                 f"                except OSError: pass\n            seen.add(name)\n"
                 f"threading.Thread(target=plant, daemon=True).start()")
        sandbox.run_code(plant)
        refused = 0
        try:
            for _ in range(6):  # a race: the links win it most times; each outcome must be honest
                try:
                    made = sandbox.create_code_context()
                except SandboxException as exc:
                    assert "other than its sockets" in str(exc) or "exited while starting" in str(exc), exc
                    refused += 1
                else:  # the kernel bound its names first: a working context of its own
                    assert sandbox.run_code("21 * 2", context=made).text == "42"
                    sandbox.remove_code_context(made)
        finally:
            stop.set()
            thread.join(5)
            listener.close()
        assert accepted == [] and refused, refused
    assert sandbox.run_code("1 + 1").text == "2"  # the sandbox's own kernel is untouched


def test_a_contexts_output_is_held_to_the_sandboxs_allowance(door: Running, sandbox: Sandbox) -> None:
    other = sandbox.create_code_context()
    allowance = nbexec.SandboxConfig(image=IMAGE).max_output_bytes
    flood = sandbox.run_code("for _ in range(40):\n    print('x' * 1_000_000)", context=other, timeout=60)
    kept = sum(len(line) for line in flood.logs.stdout)
    assert 0 < kept <= allowance + 64 * 1024, (kept, allowance)
    assert sandbox.run_code("1 + 2", context=other).text == "3"
