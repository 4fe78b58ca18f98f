"""One contract for every sandbox backend (`nbexec.sandbox.source`): the fake (fast tier, no Docker), this host's
Docker engine and a remote node (Docker tier) pass the same tests, through the seam only.

The required core: a cell runs and its outputs arrive as sized messages; an error is the cell's, not the
host's; a deadline interrupts; /mnt/data takes files in, lists them, snapshots and streams them, and refuses
unsafe names; a hidden run shares the kernel and answers its reply; a killed sandbox says so and runs nothing
more. Each capability a backend does not define raises NotOfferedError naming the backend and the capability;
those it defines work (sleep keeps /mnt/data and drops memory, a describe record finds the sandbox again).
A new backend joins by adding itself to `BACKENDS` (docs/design/backends.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import nbexec
from nbexec.engine import judge, sources
from nbexec.errors import ConfigError, FileTransferError, NotOfferedError, SandboxError
from nbexec.files import artifacts
from nbexec.files.folders import OutputFolder, make_output_dir
from nbexec.sandbox.capabilities import CAPABILITIES, Capability
from nbexec.sandbox.fake import FakeSource
from nbexec.sandbox.messages import Message
from nbexec.sandbox.source import SandboxHandle, SandboxSource

from . import cluster
from .conftest import IMAGE

# How each backend's cell waits forever: the fake's kernel runs in this process and ends a wait only at an
# interrupt (`hang`); the real ones sleep as any code would.
HANG = {"fake": "hang()", "local": "import time\ntime.sleep(600)", "remote": "import time\ntime.sleep(600)",
        "ray": "import time\ntime.sleep(600)"}
# "ray" runs inside tests/test_ray.py's cluster (its own network namespace, RAY_ADDRESS set); elsewhere it skips.
BACKENDS = ["fake", pytest.param("local", marks=pytest.mark.docker), pytest.param("remote", marks=pytest.mark.docker),
            pytest.param("ray", marks=pytest.mark.docker)]
OFFERS_NEITHER_SLEEP_NOR_DURABLE = {"ray"}  # the refusal test holds them to saying so by name


@dataclass
class Backend:
    name: str
    source: SandboxSource
    config: nbexec.SandboxConfig


@pytest.fixture(scope="module")
def conformance_node(request: pytest.FixtureRequest) -> Iterator[cluster.Server]:
    request.getfixturevalue("docker_ready")
    # An interrupt's grace long enough for a loaded machine: "interrupted" is the contract, not the speed.
    with cluster.running_node("cf", {"NBEXEC_POOL_SIZE": "0", "NBEXEC_INTERRUPT_GRACE": "10"}) as server:
        yield server


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    name = request.param
    if name == "fake":
        fake = FakeSource()
        sources.register_for_tests("fake", fake)
        try:
            yield Backend(name, fake, nbexec.SandboxConfig(source="fake", pool_size=0, timeout=10,
                                                           interrupt_grace=2))
        finally:
            sources.register_for_tests("fake", None)
            fake.close()
        return
    if name == "ray":
        if not os.environ.get("RAY_ADDRESS"):
            pytest.skip("the Ray backend is tested in tests/test_ray.py's cluster, in a network namespace of its "
                        "own (RAY_ADDRESS is set there): Ray is never started outside one")
        request.getfixturevalue("docker_ready")
        config = nbexec.SandboxConfig(image=IMAGE, source="ray", pool_size=0, warm_imports=(), timeout=60,
                                      interrupt_grace=10)
        yield Backend(name, sources.for_config(config), config)
        sources.for_config(config).close()
        return
    if name == "local":
        config = request.getfixturevalue("config").replace(pool_size=0, interrupt_grace=10)
        yield Backend(name, sources.for_config(config), config)
        return
    from nbexec.sandbox.remote import source as remote  # the registry picks it; here only to forget its clients

    node = request.getfixturevalue("conformance_node")
    monkeypatch.setenv("NBEXEC_NODES", node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    config = nbexec.SandboxConfig(image=IMAGE, source="remote", pool_size=0, warm_imports=(), timeout=60,
                                  interrupt_grace=10)
    yield Backend(name, sources.for_config(config), config)
    remote.forget_all()


@pytest.fixture
def sandbox(backend: Backend) -> Iterator[SandboxHandle]:
    handle = backend.source.acquire(backend.config, purpose="session")
    try:
        yield handle
    finally:
        backend.source.release(handle, wait=True)


def run(handle: SandboxHandle, code: str, limit: float = 30) -> tuple[str, list[Message], str]:
    """(status, the output messages, what stdout said)."""
    seen: list[Message] = []
    done = handle.run(code, deadline=time.monotonic() + limit, on_output=seen.append)
    text = "".join(str(m.content().get("text", "")) for m in seen if m.msg_type == "stream")
    return done.status, seen, text


@pytest.fixture
def output(tmp_path: Path) -> Iterator[OutputFolder]:
    folder = OutputFolder.open(make_output_dir(tmp_path / "out", may_exist=False))
    try:
        yield folder
    finally:
        os.close(folder.fd)


# -- the required core ---------------------------------------------------------------------------------------

def test_a_cell_runs_and_its_outputs_arrive_as_sized_messages(sandbox: SandboxHandle) -> None:
    status, seen, text = run(sandbox, "x = 6 * 7\nprint('answer', x)")
    assert (status, text) == ("ok", "answer 42\n")
    assert seen and all(m.size >= len(m.raw_content) for m in seen)  # charged at least for the bytes kept
    status, seen, _ = run(sandbox, "x + 1")
    assert status == "ok"
    results = [m.content() for m in seen if m.msg_type == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["43"]


def test_an_error_in_the_cell_is_the_cells(sandbox: SandboxHandle) -> None:
    status, seen, _ = run(sandbox, "raise ValueError('boom')")
    assert status == "error"
    errors = [m.content() for m in seen if m.msg_type == "error"]
    assert [(e["ename"], e["evalue"]) for e in errors] == [("ValueError", "boom")]
    assert run(sandbox, "print('still here')")[0] == "ok"


def test_a_deadline_interrupts_the_cell(backend: Backend, sandbox: SandboxHandle) -> None:
    started = time.monotonic()
    done = sandbox.run(HANG[backend.name], deadline=started + 1, on_output=lambda m: None)
    assert (done.status, done.stop) == ("timeout", "interrupted")
    assert time.monotonic() - started < 1 + backend.config.interrupt_grace + 5
    assert run(sandbox, "print('after')")[2] == "after\n"


def test_files_go_in_and_come_out_of_mnt_data(sandbox: SandboxHandle, output: OutputFolder) -> None:
    sandbox.put_file("given.txt", b"from the host")
    status, _, text = run(sandbox, "print(open('/mnt/data/given.txt').read())\n"
                                   "open('/mnt/data/made.txt', 'w').write('by the cell')")
    assert (status, text) == ("ok", "from the host\n")
    listed = sandbox.list_files(artifacts.Limits())
    assert sorted(f.name for f in listed.files) == ["given.txt", "made.txt"]
    copied = sandbox.snapshot(output.child("data"), artifacts.Limits())
    made = next(f for f in copied.files if f.name == "made.txt")
    assert made.path is not None and Path(made.path).read_bytes() == b"by the cell"
    size, chunks = sandbox.open_file("made.txt")
    assert (size, b"".join(chunks)) == (11, b"by the cell")


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "a/../../b", ""])
def test_an_unsafe_name_is_refused(sandbox: SandboxHandle, name: str) -> None:
    with pytest.raises(FileTransferError):
        sandbox.put_file(name, b"x")


def test_a_file_over_the_callers_cap_is_not_streamed(sandbox: SandboxHandle) -> None:
    sandbox.put_file("big.bin", b"x" * 4096)
    with pytest.raises(FileTransferError):
        sandbox.open_file("big.bin", max_bytes=1024)


def test_a_hidden_run_shares_the_kernel_and_answers_its_reply(sandbox: SandboxHandle) -> None:
    assert run(sandbox, "y = 5")[0] == "ok"
    reply = sandbox.run_hidden("z = y * 2", 30)
    assert reply is not None and reply["status"] == "ok"
    failed = sandbox.run_hidden("raise KeyError('k')", 30)
    assert failed is not None and failed["status"] == "error"
    assert run(sandbox, "print(z)")[2] == "10\n"


def test_a_killed_sandbox_says_so_and_runs_nothing_more(sandbox: SandboxHandle) -> None:
    assert sandbox.state().running
    sandbox.kill()
    deadline = time.monotonic() + 30
    while sandbox.state().running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandbox.state().running
    try:  # the next run ends at once, as "gone" (or a kernel that closed its sockets: a SandboxError)
        status = sandbox.run("print('no')", deadline=time.monotonic() + 10, on_output=lambda m: None).status
    except SandboxError:
        status = "gone"
    assert status in ("gone", "timeout")


# -- capabilities --------------------------------------------------------------------------------------------

def test_what_a_backend_does_not_offer_says_so_by_name(backend: Backend, sandbox: SandboxHandle,
                                                       tmp_path: Path) -> None:
    calls = {
        "freeze": lambda: sandbox.freeze(), "provide_wheels": lambda: sandbox.provide_wheels([]),
        "change_egress": lambda: sandbox.change_egress([], []), "sleep": lambda: sandbox.sleep(),
        "awake": lambda: sandbox.awake(), "describe": lambda: sandbox.describe(),
        "adopt": lambda: backend.source.adopt(backend.config, {}),
        "abandon": lambda: backend.source.abandon(backend.config, {}),
        "hibernate": lambda: backend.source.hibernate(sandbox, tmp_path),
        "wake": lambda: backend.source.wake(backend.config, {}, tmp_path),
        "discard": lambda: backend.source.discard({}, tmp_path),
        "judge": lambda: sandbox.judge({}, 1.0),
    }
    refused = 0
    for capability, (on_handle, on_source) in CAPABILITIES.items():
        for method in on_handle + on_source:
            offered = (sandbox if method in on_handle else backend.source).offers(capability)
            if offered:
                continue
            with pytest.raises(NotOfferedError) as caught:
                calls[method]()
            assert capability.value in str(caught.value) and backend.source.backend in str(caught.value)
            refused += 1
    assert refused or backend.name != "fake", "the fake offers less than the real backends: something must refuse"


def test_a_program_is_judged_by_hidden_code_or_by_name(backend: Backend, sandbox: SandboxHandle) -> None:
    """Judging goes through the seam: by the runner's code where run_hidden takes code (this host, Ray), as data
    where the backend judges by name (a remote node), else refused by name before any file is sent."""
    job = judge.Job.of("print(int(input()) + 1)", [nbexec.Test("1", expected="2"), nbexec.Test("1", expected="3")],
                       "python", "whitespace", None)
    if not (sandbox.hidden_code or sandbox.offers(Capability.JUDGE)):
        with pytest.raises(NotOfferedError, match=Capability.JUDGE.value):
            judge.judged_in(sandbox, backend.config, job)
        return
    judged, _ = judge.judged_in(sandbox, backend.config, job)
    assert [test.verdict for test in judged.tests] == ["accepted", "wrong_answer"], judged.to_dict()


def test_sleep_keeps_the_files_and_drops_the_memory(backend: Backend, sandbox: SandboxHandle) -> None:
    if backend.name in OFFERS_NEITHER_SLEEP_NOR_DURABLE:
        pytest.skip(f"{backend.name} does not offer SLEEP: the refusal test checks it says so by name")
    if not sandbox.offers(Capability.SLEEP):
        pytest.fail("every backend in BACKENDS offers SLEEP; one that does not is tested by the refusal test")
    assert run(sandbox, "kept = 1\nopen('/mnt/data/kept.txt', 'w').write('kept')")[0] == "ok"
    sandbox.sleep()
    sandbox.awake()
    status, _, text = run(sandbox, "print(open('/mnt/data/kept.txt').read(), 'kept' in globals())")
    assert (status, text) == ("ok", "kept False\n")


def test_a_describe_record_finds_the_sandbox_again(backend: Backend, sandbox: SandboxHandle) -> None:
    if backend.name in OFFERS_NEITHER_SLEEP_NOR_DURABLE:
        pytest.skip(f"{backend.name} does not offer DURABLE: the refusal test checks it says so by name")
    assert sandbox.offers(Capability.DURABLE) and backend.source.offers(Capability.DURABLE)
    assert run(sandbox, "remembered = 'yes'")[0] == "ok"
    record = json.loads(json.dumps(sandbox.describe()))  # a record is JSON: it goes to a state folder
    found = backend.source.adopt(backend.config, record)
    assert run(found, "print(remembered)")[2] == "yes\n"


def test_a_released_sandbox_cannot_be_adopted(backend: Backend) -> None:
    if backend.name in OFFERS_NEITHER_SLEEP_NOR_DURABLE:
        pytest.skip(f"{backend.name} does not offer DURABLE: the refusal test checks it says so by name")
    handle = backend.source.acquire(backend.config, purpose="session")
    record = handle.describe()
    backend.source.release(handle, wait=True)
    with pytest.raises(SandboxError):
        backend.source.adopt(backend.config, record)


# -- through the one engine ----------------------------------------------------------------------------------

def test_the_engine_runs_a_notebook_on_the_backend(backend: Backend) -> None:
    result = nbexec.execute_notebook("print('engine')\nopen('/mnt/data/r.txt', 'w').write('r')",
                                     config=backend.config)
    assert result.ok and result.stdout == "engine\n"
    assert [f.name for f in result.files] == ["r.txt"]



# -- the boundary itself (no backend needed) -----------------------------------------------------------------

def test_a_half_defined_capability_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match="defines sleep but not awake"):
        class HalfAsleep(SandboxHandle):
            def sleep(self) -> None:
                """Sleeps, but nothing would ever wake it."""


def test_the_fake_is_unreachable_from_config_until_a_test_registers_it() -> None:
    with pytest.raises(ConfigError, match="source must be one of local, remote"):
        nbexec.SandboxConfig(source="fake")
    with pytest.raises(ValueError, match="names a real source"):
        sources.register_for_tests("local", FakeSource())


_LAYERS = Path(__file__).resolve().parent.parent / "scripts" / "layers.py"


def test_only_the_registry_and_the_cli_import_a_backend() -> None:
    if not _LAYERS.is_file():
        pytest.skip("scripts/ is not in this copy of the tree (mutmut's); CI runs it in the checkout")
    spec = importlib.util.spec_from_file_location("nbexec_layers", _LAYERS)
    assert spec is not None and spec.loader is not None
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    for this, target in [("nbexec.engine.session", "nbexec.sandbox.docker.pool"),
                         ("nbexec.service.held", "nbexec.sandbox.docker.container"),
                         ("nbexec.integrations.toolcall", "nbexec.sandbox.remote.source"),
                         ("nbexec.packages", "nbexec.sandbox.fake")]:
        assert layers.backend_import(this, target) is not None, (this, target)
    for this, target in [("nbexec.engine.sources", "nbexec.sandbox.docker.local"),
                         ("nbexec.cli.commands", "nbexec.sandbox.docker.pool"),
                         ("nbexec.sandbox.docker.pool", "nbexec.sandbox.docker.container"),
                         ("nbexec.engine.session", "nbexec.files.workdir")]:
        assert layers.backend_import(this, target) is None, (this, target)
    assert not [p for p in layers.check() if "a backend package" in p]
