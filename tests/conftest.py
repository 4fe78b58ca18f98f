"""Shared fixtures. Tests that need Docker use the real engine and the real runtime image; when either is
missing they fail with a message saying how to get it (they never skip silently).

Several nbexec processes (other test runs, services) may share this machine, so nothing here scans the host:
containers are attributed by the owner label of this process, working folders by this pid, output folders by a
temporary folder private to this test session (TMPDIR), and processes by being children of this process.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import docker
import pytest
from hypothesis import settings

import nbexec
from nbexec import judgelangs
from nbexec.errors import ImageNotFoundError
from nbexec.files import mounts
from nbexec.files.folders import work_root
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.docker import daemon, image, judgeimage, kernels, pool
from nbexec.sandbox.docker.container import Sandbox

from . import azurite as azurite_module
from . import (
    cloudstores,
    fuzzing,  # noqa: F401  (registers the hypothesis profiles)
)
from .changes import changed

# The property-based tests run the bounded, derandomized profile unless another is asked for (tests/fuzzing.py).
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

FILES = Path(__file__).parent / "files"
IMAGE = os.environ.get("NBEXEC_IMAGE", nbexec.SandboxConfig().image)
# the R, Deno and Bash kernels on IMAGE (the `kernels_image` fixture)
KERNELS = os.environ.get("NBEXEC_KERNELS_IMAGE", nbexec.SandboxConfig().kernels_image)
JUDGE = os.environ.get("NBEXEC_JUDGE_IMAGE", judgelangs.IMAGE)  # the compilers on IMAGE (the `judge_image` fixture)
JUDGE_BUILD_S = 1800  # how long a test process waits for another's build of the judge image
T = TypeVar("T")
LONG_LIVED_CHILDREN: set[int] = set()  # child processes a session fixture keeps (Azurite), not leaks


# Tiers come from what a test needs, read off its fixtures (scripts/test.sh names the commands). A test that uses
# the engine without a fixture says so with `pytest.mark.usefixtures("docker_ready")`. The fast tier runs with the
# engine unreachable, so a test that forgets fails there instead of passing by luck.
_DOCKER_FIXTURES = frozenset({"docker_ready"})
_TOOL_FIXTURES = frozenset({"azurite", "browser"})  # Node's Azurite, Debian's Chromium: installed after the fast tier
# A Ray cluster of three nodes (about 1.4 GB and its own CPU): one at a time, after the parallel part, so that
# worker processes do not each start one.
_ALONE_FIXTURES = frozenset({"ray_cluster"})


def _tier(item: pytest.Item) -> str | None:
    names = set(getattr(item, "fixturenames", ()))
    if names & _DOCKER_FIXTURES:
        return "docker"
    callspec = getattr(item, "callspec", None)
    # A store parametrized by kind asks for Azurite by name at run time (request.getfixturevalue).
    if names & _TOOL_FIXTURES or (callspec is not None and "azure" in map(str, callspec.params.values())):
        return "tools"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier it needs; then the tests that take minutes run first: spread over processes
    (scripts/test.sh), the rest fills around them instead of one process ending the run alone with them."""
    for item in items:
        tier = _tier(item)
        if tier:
            item.add_marker(tier)
        if set(getattr(item, "fixturenames", ())) & _ALONE_FIXTURES:
            item.add_marker("alone")
    _changed_only(config, items)
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


_FILE_SECONDS: dict[str, float] = {}  # worker seconds per test file (set-up, call and tear-down)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = report.nodeid.split("::")[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The files that took the most worker time: where CI's time goes (docs/development.md)."""
    if len(_FILE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", f"worker time by file: {sum(_FILE_SECONDS.values()) / 60:.1f} min in all")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda pair: -pair[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")


def _changed_only(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test module with ``COVERS`` (paths) re-runs what other modules test, under another runtime: in CI it runs
    only when one of those paths changed since the last landed commit (scripts/changed.py)."""
    found = changed.changed()
    if found is None:
        return
    skipped = [item for item in items if (covers := getattr(getattr(item, "module", None), "COVERS", None))
               is not None and not changed.touches(found, covers)]
    if skipped:
        gone = set(skipped)
        items[:] = [item for item in items if item not in gone]
        config.hook.pytest_deselected(items=skipped)
        print(f"\n{len(skipped)} tests deselected: nothing they cover changed since ${changed.VARIABLE}",
              file=sys.stderr)


def wait_until(predicate: Callable[[], T], timeout: float, message: str, *, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true and return that; fail with ``message`` after
    ``timeout`` seconds. Tests wait on conditions, never for a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{message} (waited {timeout:g} s)", pytrace=False)
        time.sleep(interval)


def settle(predicate: Callable[[], bool], timeout: float) -> None:
    """Poll ``predicate`` until true or ``timeout`` passes, without failing (the caller judges)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def own_containers(*, include_pool: bool = False, role: str | None = None) -> list[str]:
    """Names of nbexec containers made by this test process (optionally of one role)."""
    found = _listed(f"{daemon.LABEL_OWNER}={daemon.owner()}")
    return [name for name, labels in found if (include_pool or labels.get(daemon.LABEL_ROLE) != "pool")
            and (role is None or labels.get(daemon.LABEL_ROLE) == role)]


def _listed(label: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of the containers with ``label``, from the list call alone (sparse): a container removed
    while it is listed cannot fail a per-container inspect."""
    found = daemon.connect().containers.list(all=True, sparse=True, filters={"label": label})
    return [((c.attrs.get("Names") or ["/"])[0].lstrip("/"), c.attrs.get("Labels") or {}) for c in found]


class Created:
    """The ids of the containers created while it is open, from Docker's live event stream.

    The engine's event history holds only its last 256 events, which a loaded machine (every exec is three
    events) overwrites within one run, so a lookup of past events can miss a container that was there. A live
    subscription misses nothing: it starts with what the history still holds from this second, then follows."""

    def __init__(self, label: str) -> None:
        self._seen: list[tuple[str, dict[str, str]]] = []
        self._stream = daemon.connect().events(since=int(time.time()), decode=True, filters={
            "type": "container", "event": "create", "label": label})
        self._reader = threading.Thread(target=self._read, name="created-containers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # the stream closed under it
            for event in self._stream:
                self._seen.append((event["id"], event.get("Actor", {}).get("Attributes", {})))

    def close(self) -> None:
        self._stream.close()
        self._reader.join(30)
        assert not self._reader.is_alive(), "Docker's event stream did not close"

    def ids(self, owner: str | None = None) -> list[str]:
        """Ids seen so far, of any owner the label allowed or only ``owner``'s."""
        return [cid for cid, labels in self._seen if owner is None or labels.get(daemon.LABEL_OWNER) == owner]


@contextlib.contextmanager
def created(label: str | None = None) -> Iterator[Created]:
    """Watch the containers created (by default, by this test process) until the block ends."""
    watch = Created(label or f"{daemon.LABEL_OWNER}={daemon.owner()}")
    try:
        yield watch
    finally:
        watch.close()


def owned_by(pid: int) -> list[str]:
    """Names of nbexec containers made by process ``pid`` of this machine (e.g. an `nbexec` subprocess)."""
    label = f"{daemon.LABEL_OWNER}={daemon.owner().rsplit(':', 1)[0]}:{pid}"
    return [name for name, _ in _listed(label)]


def own_workdirs(pid: int | None = None) -> list[Path]:
    """Working folders of sandboxes made by this process (or by ``pid``)."""
    prefix = f"nbexec-{os.getpid() if pid is None else pid}-"
    return sorted(p for p in work_root().iterdir() if p.name.startswith(prefix))


def waiting_sandboxes() -> list[Sandbox]:
    """Sandboxes waiting in this process's pools: the pool keeps them until it closes, so they are not leaks.
    (A pooled sandbox handed to a session or a one-shot still carries the pool role label, so labels alone
    cannot tell; the pools themselves can.)"""
    with pool._lock:
        pools = list(pool._pools.values())
    return [s for p in pools for s in list(p._ready)]


def pools_starting() -> int:
    """Sandboxes this process's pools are starting now: each ends waiting (not a leak) or destroyed, within its own
    bounds (a mount's 30 s, the start-up limit), so the ledger waits for them before it counts."""
    with pool._lock:
        pools = list(pool._pools.values())
    return sum(p._starting for p in pools)


def unaccounted_containers() -> list[str]:
    """This process's containers that no pool is keeping: sessions and executions not yet torn down."""
    waiting = {s.container.name for s in waiting_sandboxes() if s.container is not None}
    return [name for name in own_containers(include_pool=True) if name not in waiting]


def pool_workdirs() -> set[Path]:
    """Working folders of this process's waiting pool sandboxes."""
    return {s.workdir for s in waiting_sandboxes()}


CONTAINER_ID = "import re\nprint(re.search(r'/containers/([0-9a-f]{64})/', open('/proc/self/mountinfo').read())[1])"


def container_id(stdout: str) -> str:
    """The container id printed by CONTAINER_ID run in a sandbox (Docker's bind mount of /etc/hostname names it)."""
    found = re.search(r"\b[0-9a-f]{64}\b", stdout)
    assert found, f"no container id in {stdout!r}"
    return found[0]


def output_root() -> Path:
    """Where execute_notebook() puts output folders when none is given (inside this session's TMPDIR)."""
    return work_root().parent / "nbexec-output"


def children_of(pid: int) -> dict[int, str]:
    """Live (not zombie) child processes of ``pid``, from the kernel's list of each of its threads' children (no
    scan of the machine's processes): pid -> command line."""
    children = {}
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            pids = [int(p) for p in Path(task).read_text().split()]
        except OSError:
            continue
        for child in pids:
            try:
                if (Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split() or ["Z"])[0] == "Z":
                    continue
                children[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
    return children


def own_children() -> dict[int, str]:
    """Live child processes of this test process: pid -> command line."""
    return children_of(os.getpid())


@pytest.fixture(scope="session", autouse=True)
def _private_tmp() -> Iterator[Path]:
    """A TMPDIR private to this test session, so working and output folders of this run are told apart from
    those of any other nbexec on the machine (subprocesses inherit it)."""
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    root = Path(tempfile.mkdtemp(prefix=f"nbexec-suite-{os.getpid()}-"))
    root.chmod(0o755)  # the sandbox user (not us when we are root) reaches its bind mounts through it
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = str(root)
    yield root
    tempfile.tempdir = saved_dir
    if saved_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved_env
    remove_tree(root)


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """Fail (not skip) with instructions when Docker or the image is missing."""
    try:
        client = daemon.connect()
    except nbexec.DockerUnavailableError as exc:
        pytest.fail(f"these tests need a running Docker engine: {exc}", pytrace=False)
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"these tests need the runtime image {IMAGE}: run `nbexec image build` "
                    "(or `nbexec image build --debootstrap` without a registry)", pytrace=False)


@contextlib.contextmanager
def checkout_image(base: str, files: tuple[str, ...], steps: str, purpose: str) -> Iterator[str]:
    """``base`` with ``files`` of this checkout's environments/jupyter put in by ``steps`` (Dockerfile lines, run as
    root; the build context holds the files). The images the suite runs are built once per machine, so a change to
    a script they carry (a mutation of the register among them) reaches a test only through such an overlay.
    Tagged by content and by this process (another worker's or another run's teardown never removes the image a
    test here runs); removed at the end."""
    client = daemon.connect()
    overlay = f"ARG BASE_IMAGE\nFROM ${{BASE_IMAGE}}\nUSER 0:0\n{steps.strip()}\nUSER 1000:1000\n"
    digest = hashlib.sha256(overlay.encode() + client.images.get(base).id.encode())
    with tempfile.TemporaryDirectory(prefix="nbexec-overlay-") as context:
        for name in files:
            content = (image.context_dir() / name).read_bytes()
            (Path(context) / name).write_bytes(content)
            digest.update(name.encode() + content)
        (Path(context) / "Dockerfile").write_text(overlay)
        tag = f"nbexec-jupyter:{purpose}-{os.getpid()}-{digest.hexdigest()[:12]}"
        for chunk in client.api.build(path=context, tag=tag, buildargs={"BASE_IMAGE": base}, rm=True,
                                      forcerm=True, decode=True, pull=False):
            if "error" in chunk:
                pytest.fail(f"the {purpose} overlay of {base} did not build: {chunk['error']}", pytrace=False)
    try:
        yield tag
    finally:
        with contextlib.suppress(docker.errors.APIError):
            client.images.remove(tag, noprune=False)


@pytest.fixture(scope="session")
def kernels_image(docker_ready: None) -> str:
    """The kernels image on the tests' runtime image, tagged as the config's kernels_image (built when missing or
    stale: `scripts/setup.sh --test` builds it first, so this is Docker's cache answering)."""
    if not {"r", "deno", "bash"} <= set(_kernels_of(KERNELS)):
        kernels.build(("r", "deno", "bash"), base=IMAGE, tag=KERNELS, progress=lambda line: None,
                      options=kernels.image.BuildOptions())
    return KERNELS


@pytest.fixture(scope="session")
def judge_image(docker_ready: None) -> str:
    """The judge image on the tests' runtime image (`nbexec image build --kernels judge`), built at each test
    session's first use: Docker's cache answers in seconds when nothing it is built from changed; a first build
    takes minutes (Debian's compilers; docs/images.md). One build at a time on this machine (a lock file), as every
    pytest-xdist worker has its own session."""
    with open(f"/tmp/nbexec-judge-build-{os.getuid()}.lock", "w") as lock:
        deadline = time.monotonic() + JUDGE_BUILD_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another test process built the judge image for over {JUDGE_BUILD_S} s",
                                pytrace=False)
                time.sleep(1)
        judgeimage.build(base=IMAGE, tag=JUDGE, progress=lambda line: None, options=image.BuildOptions())
    return JUDGE


@pytest.fixture
def judge_config(cleanup_ledger: None, judge_image: str) -> nbexec.SandboxConfig:
    """The default limits on the judge image, without a pool or warm imports (the compilers are what is measured)."""
    return nbexec.SandboxConfig(image=judge_image, pool_size=0, warm_imports=())


def _kernels_of(tag: str) -> tuple[str, ...]:
    try:
        return kernels.of_image(tag)
    except ImageNotFoundError:
        return ()


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers_at_end(_private_tmp: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    pool.shutdown()
    nbexec.engine.reaper.close_all()
    pool.wait_for_teardown()
    # Test folders are outside this session's TMPDIR when pytest-xdist gives them: a data filesystem a test left
    # mounted there would outlive the run (and stop pytest from deleting its old folders).
    base = tmp_path_factory.getbasetemp()
    mounted = mounts.unmount_all(base)
    assert mounted == [], f"data filesystems left mounted under the tests' folders: {mounted}"
    try:
        left = own_containers(include_pool=True)
    except nbexec.NbexecError:
        return
    assert left == [], f"containers left after the test session: {left}"
    assert own_workdirs() == [], "working folders left after the test session"


def _leaked_workdirs() -> list[Path]:
    # An in-process service keeps one root folder for its life (results wait there for their TTL); it is
    # judged when the service stops, not after each test.
    return [p for p in own_workdirs() if p not in pool_workdirs() and "-serve-" not in p.name]


def _empty_new_outputs(before: set[Path]) -> list[Path]:
    root = output_root()
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p not in before and p.is_dir() and not any(p.iterdir())]


def _sweep(containers: list[str], workdirs: list[Path], outputs: list[Path], children: dict[int, str]) -> None:
    for name in containers:
        with contextlib.suppress(docker.errors.NotFound):
            daemon.connect().containers.get(name).remove(force=True)
    for path in workdirs + outputs:
        remove_tree(path)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cleanup_ledger(docker_ready: None) -> Iterator[None]:
    """Fail the test that leaked, and remove what it leaked: containers of this process (sandboxes waiting in
    a pool excepted), working folders of this pid (pool ones excepted), output folders left empty by an execution that
    failed, and child processes it started."""
    children_before = set(own_children()) | LONG_LIVED_CHILDREN
    outputs_before = set(output_root().iterdir()) if output_root().is_dir() else set()
    yield
    pool.wait_for_teardown()
    settle(lambda: not pools_starting(), 90)
    # A one-shot's sandbox is removed in the background: a loaded engine (CI) has taken over 10 s to remove one.
    settle(lambda: not unaccounted_containers(), 30)
    # A pool sandbox being started has its folder before its container: give it time to show up as one.
    settle(lambda: not _leaked_workdirs(), 30)
    settle(lambda: not set(own_children()) - children_before - LONG_LIVED_CHILDREN, 10)
    containers, workdirs = unaccounted_containers(), _leaked_workdirs()
    outputs = _empty_new_outputs(outputs_before)
    children = {p: c for p, c in own_children().items() if p not in children_before | LONG_LIVED_CHILDREN}
    _sweep(containers, workdirs, outputs, children)
    assert (containers, workdirs, outputs, children) == ([], [], [], {}), (
        f"the test leaked: containers {containers}, working folders {workdirs}, "
        f"empty output folders {outputs}, processes {children}")


@pytest.fixture
def config(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """A config for fast tests: a small warm pool without warm imports, a short time limit."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=2, warm_imports=(), timeout=30, interrupt_grace=3)


@pytest.fixture
def cold(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """A config without a pool: every execution starts its own sandbox."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, timeout=30, interrupt_grace=3)


@pytest.fixture(scope="session")
def azurite() -> Iterator[azurite_module.Azurite]:
    """A real Azure Blob API (Azurite), started once for the test session."""
    binary = azurite_module.find_binary()
    if binary is None:
        pytest.fail("these tests need Azurite: run scripts/setup.sh --test",
                    pytrace=False)
    server = azurite_module.start(binary)
    LONG_LIVED_CHILDREN.add(server.process.pid)
    yield server
    server.stop()
    LONG_LIVED_CHILDREN.discard(server.process.pid)


def _long_lived(start: Callable[[], cloudstores.Server]) -> Iterator[cloudstores.Server]:
    server = start()
    LONG_LIVED_CHILDREN.add(server.process.pid)
    try:
        yield server
    finally:
        server.stop()
        LONG_LIVED_CHILDREN.discard(server.process.pid)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[cloudstores.Server]:
    """A real S3 API (moto's server), started once for the test session; IAM authentication off."""
    yield from _long_lived(cloudstores.start_moto)


@pytest.fixture(scope="session")
def moto_s3_auth() -> Iterator[tuple[cloudstores.Server, tuple[str, str]]]:
    """moto's S3 server with IAM authentication on (every signed request's key and signature are checked),
    a bucket ``checked`` and the one key pair it accepts."""
    for server in _long_lived(cloudstores.start_moto):
        key = cloudstores.enable_moto_auth(server.url)
        cloudstores.make_bucket(server.url, "checked", *key)
        yield server, key


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[cloudstores.Server]:
    """A real GCS JSON/XML API (gcp-storage-emulator), started once for the test session."""
    yield from _long_lived(cloudstores.start_gcs)


@pytest.fixture(scope="session")
def gcs_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A service-account key file made for the session (signs GCS links) and its public key."""
    return cloudstores.service_account_key(tmp_path_factory.mktemp("gcs-key"))

