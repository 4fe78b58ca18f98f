"""A hostile package index against the host's resolver (`nbexec.packages.wheelhouse`, `nbexec.packages.hostpip`),
judged from outside: a marker file a build backend would write, what the index was asked for, the resolver
process as the kernel describes it (/proc), its peak memory (getrusage of a child), and what reached the sandbox.

Every index here is real (pip talks HTTP to one on loopback, or reads a folder of wheels) and every request goes
through nbexec's public API (`Session.install`, `execute_notebook`), so the tests judge the same promise before
and after the resolver changed.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec.result import Package

from ..conftest import IMAGE, children_of, wait_until
from ..pyindex import Index, make_wheel

RESOLVER_MEMORY = 512 * 1024**2  # the resolver's default memory cap (SandboxConfig.package_resolver_memory)
BACKEND = """
import os, sys
with open(os.path.join({markers!r}, "ran-%d-%d" % (os.getuid(), os.getpid())), "w") as handle:
    handle.write(" ".join(sys.argv))
def get_requires_for_build_wheel(config_settings=None):
    return []
def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    raise RuntimeError("the build backend of a dependency ran on the host")
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("the build backend of a dependency ran on the host")
"""
PYPROJECT = '[build-system]\nrequires = []\nbuild-backend = "evil_backend"\nbackend-path = ["."]\n'


class World:
    """Files the attacks need, readable by any user (the resolver may run as another uid): a source tree whose
    build backend writes a marker into a folder anyone can write to, as an sdist (served and local), a plain
    folder and a git repository (served); wheels that depend on them; and a folder index holding those wheels."""

    def __init__(self, root: Path, index: Index) -> None:
        self.root, self.index = root, index
        self.markers = root / "markers"
        self.markers.mkdir()
        self.markers.chmod(0o1777)  # whoever runs the backend can leave its marker
        tree = root / "tree"
        tree.mkdir()
        (tree / "pyproject.toml").write_text(PYPROJECT)
        (tree / "evil_backend.py").write_text(BACKEND.format(markers=str(self.markers)))
        (tree / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: nbexec-evil-sdist\nVersion: 1.0\n")
        sdist = index.root / "files" / "nbexec_evil_sdist-1.0.tar.gz"
        sdist.parent.mkdir()
        with tarfile.open(sdist, "w:gz") as archive:
            archive.add(tree, arcname="nbexec_evil_sdist-1.0")
        self.local_sdist = root / "nbexec_evil_sdist-1.0.tar.gz"
        shutil.copy(sdist, self.local_sdist)
        repo = root / "repo"  # a git repository, served over HTTP by the index (git's "dumb" protocol)
        shutil.copytree(tree, repo)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-C", str(repo)]
        for step in (["init", "-q"], ["add", "."], ["commit", "-qm", "evil"]):
            subprocess.run([*git, *step], check=True, capture_output=True)
        served_repo = index.root / "files" / "repo.git"
        subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(served_repo)], check=True, capture_output=True)
        subprocess.run(["git", "-C", str(served_repo), "update-server-info"], check=True, capture_output=True)
        self.folder = root / "wheels"
        self.folder.mkdir()
        for path in (root, tree, repo, self.folder):
            for folder, _, names in os.walk(path):
                os.chmod(folder, 0o1777 if Path(folder) == self.markers else 0o755)
                for name in names:
                    os.chmod(os.path.join(folder, name), 0o644)

    def url(self, kind: str) -> str:
        return {"http": f"{self.index.base}/files/nbexec_evil_sdist-1.0.tar.gz",
                "file": f"file://{self.local_sdist}",
                "folder": f"file://{self.root / 'tree'}",
                "vcs": f"git+{self.index.base}/files/repo.git",
                "wheel": f"{self.index.base}/simple/nbexec-dep/nbexec_dep-2.0-py3-none-any.whl"}[kind]

    def add(self, name: str, requires: tuple[str, ...] = (), version: str = "1.0",
            extras: tuple[str, ...] = ()) -> None:
        """A wheel on both the HTTP index and the folder index."""
        wheel = self.index.add(name, version, "VALUE = 1\n", requires=requires, extras=extras)
        shutil.copy(wheel, self.folder / wheel.name)
        os.chmod(self.folder / wheel.name, 0o644)

    def add_file(self, name: str, path: Path) -> None:
        served = self.index.add_file(name, path)
        shutil.copy(served, self.folder / served.name)
        os.chmod(self.folder / served.name, 0o644)

    def ran(self) -> list[str]:
        return sorted(p.name for p in self.markers.iterdir())


def _public_folder(prefix: str) -> Path:
    """A folder other users can read (the resolver may run as another uid; pytest's tmp_path is 0700)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    root = _public_folder("nbexec-evil-index-")
    index = Index(root / "index")
    made = World(root, index)
    made.add("nbexec-dep", version="2.0")
    for kind in ("http", "file", "folder", "vcs", "wheel"):
        name = "nbexec-dep" if kind == "wheel" else "nbexec-evil-sdist"
        made.add(f"nbexec-evil-{kind}", requires=(f"{name} @ {made.url(kind)}",))
    made.add("nbexec-evil-mid", requires=(f"nbexec-evil-sdist @ {made.url('http')}",))
    made.add("nbexec-evil-deep", requires=("nbexec-evil-mid>=1",))
    made.add("nbexec-evil-extra", requires=(f"nbexec-evil-sdist @ {made.url('http')} ; extra == 'x'",), extras=("x",))
    made.add("nbexec-evil-never", requires=(f"nbexec-evil-sdist @ {made.url('http')} ; python_version < '3'",))
    made.add("nbexec-unlisted")
    made.add("nbexec-asks-unlisted", requires=("nbexec-unlisted",))
    made.add("nbexec-asks-listed", requires=("nbexec-dep>=2",))
    yield made
    index.close()
    shutil.rmtree(root)


def _config(source: str, cache: Path, **changes: object) -> nbexec.SandboxConfig:
    values: dict[str, object] = {"image": IMAGE, "pool_size": 0, "warm_imports": (), "timeout": 120,
                                 "package_index": source, "packages": "any", "package_cache": str(cache)}
    values.update(changes)
    return nbexec.SandboxConfig(**values)  # type: ignore[arg-type]


def _source(world: World, index_kind: str) -> str:
    return world.index.url if index_kind == "http-index" else str(world.folder)


def _wheels_in(session: nbexec.Session) -> list[str]:
    done = session.run("import os; print(sorted(os.listdir('/mnt/wheels')))")
    assert done.ok, done.error
    return [name for name in done.stdout.strip().strip("[]").replace("'", "").split(", ") if name]


def _refused(records: tuple[Package, ...], request: str) -> Package:
    mine = [r for r in records if r.name == request]
    assert mine and [r.status for r in records] == ["refused"] * len(records), records
    return mine[0]


# -- 1. no code of a package runs on the host, and dependencies obey the policy ------------------------------

@pytest.mark.parametrize("index_kind", ["http-index", "folder-index"])
@pytest.mark.parametrize(("request_text", "dependency"), [
    ("nbexec-evil-http", "nbexec-evil-sdist"),
    ("nbexec-evil-file", "nbexec-evil-sdist"),
    ("nbexec-evil-folder", "nbexec-evil-sdist"),
    ("nbexec-evil-vcs", "nbexec-evil-sdist"),
    ("nbexec-evil-wheel", "nbexec-dep"),
    ("nbexec-evil-deep", "nbexec-evil-sdist"),
    ("nbexec-evil-extra[x]", "nbexec-evil-sdist"),
], ids=["sdist-by-http-url", "sdist-by-file-url", "source-folder-by-path", "vcs-url", "wheel-by-url",
        "url-two-levels-down", "url-behind-an-extra"])
def test_a_direct_reference_anywhere_in_the_resolution_is_refused_before_anything_is_prepared(
        world: World, index_kind: str, request_text: str, dependency: str, cleanup_ledger: None) -> None:
    def fetched() -> list[str]:  # what a direct reference points at, as served by the HTTP index
        return [p for p in world.index.requests if p.startswith(("/files/", "/simple/nbexec-dep/nbexec_dep"))]

    before, ran = fetched(), world.ran()
    with nbexec.Session(_config(_source(world, index_kind), _public_folder("nbexec-evil-cache-") / "cache")) as session:
        records = session.install(request_text)
        assert world.ran() == ran, f"a build backend ran on the host: {sorted(set(world.ran()) - set(ran))}"
        assert fetched() == before, "the host fetched what a direct reference points at"
        refused = _refused(records, request_text)
        assert dependency in (refused.reason or "") and "direct reference" in (refused.reason or ""), refused.reason
        assert [w for w in _wheels_in(session) if w.startswith("nbexec_evil")] == [], "a wheel of it was provided"


@pytest.mark.parametrize("index_kind", ["http-index", "folder-index"])
def test_a_direct_reference_the_sandbox_would_not_install_is_ignored(world: World, index_kind: str,
                                                                      cleanup_ledger: None) -> None:
    ran = world.ran()
    with nbexec.Session(_config(_source(world, index_kind), _public_folder("nbexec-evil-cache-") / "cache")) as session:
        records = session.install("nbexec-evil-never")  # its marker excludes every Python 3
    assert [(r.name, r.status) for r in records] == [("nbexec-evil-never", "installed")], records
    assert world.ran() == ran


@pytest.mark.parametrize("index_kind", ["http-index", "folder-index"])
def test_a_dependency_off_the_allowlist_is_refused_before_it_is_fetched(world: World, index_kind: str,
                                                                        cleanup_ledger: None) -> None:
    config = _config(_source(world, index_kind), _public_folder("nbexec-evil-cache-") / "cache", packages="allowlist",
                     allowed_packages=("nbexec-asks-unlisted", "nbexec-asks-listed", "nbexec-dep"))
    fetched = len(world.index.fetched("nbexec-unlisted"))
    with nbexec.Session(config) as session:
        records = session.install("nbexec-asks-unlisted")
        refused = _refused(records, "nbexec-asks-unlisted")
        assert "nbexec-unlisted" in (refused.reason or "") and "allowlist" in (refused.reason or "")
        assert len(world.index.fetched("nbexec-unlisted")) == fetched, "a dependency off the allowlist was fetched"
        assert not [w for w in _wheels_in(session) if "unlisted" in w]
        listed = session.install("nbexec-asks-listed")  # a dependency on the list comes with it
        assert {(r.name, r.status) for r in listed} == {("nbexec-asks-listed", "installed"),
                                                        ("nbexec-dep", "provided")}, listed


# -- 2. the resolver runs unprivileged, with memory, CPU, file and process caps ------------------------------

def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _limits(pid: int) -> dict[str, str]:
    """Soft limit per resource, from /proc/<pid>/limits ("unlimited" or a number)."""
    found = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:].split()[0]
        found[name] = soft
    return found


def test_the_resolver_runs_unprivileged_within_kernel_limits(world: World, tmp_path: Path,
                                                            cleanup_ledger: None) -> None:
    reached, released = world.index.hold("nbexec-held-priv")
    config = _config(world.index.url, _public_folder("nbexec-evil-cache-") / "cache")
    with nbexec.Session(config) as session, concurrent.futures.ThreadPoolExecutor(1) as pool:
        session.run("pass")
        asked = pool.submit(session.install, "nbexec-held-priv")
        try:
            wait_until(reached.is_set, 120, "the host never asked the index for the held project")
            resolvers = {pid: line for pid, line in children_of(os.getpid()).items() if "pip" in line}
            assert len(resolvers) == 1, resolvers
            (pid,) = resolvers
            status, limits = _status(pid), _limits(pid)
        finally:
            released.set()
        asked.result(timeout=300)
    uid = os.geteuid()
    if uid == 0:
        nobody = pwd.getpwnam("nobody")
        assert status["Uid"].split() == [str(nobody.pw_uid)] * 4, status["Uid"]
        assert status["Gid"].split() == [str(nobody.pw_gid)] * 4, status["Gid"]
        assert status["Groups"] == "", status["Groups"]
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert limits["Max address space"] != "unlimited" and int(limits["Max address space"]) <= RESOLVER_MEMORY
    assert limits["Max cpu time"] != "unlimited"
    assert limits["Max file size"] != "unlimited"
    assert limits["Max processes"] != "unlimited" and int(limits["Max processes"]) <= 1
    assert limits["Max core file size"] == "0"


def _bomb(folder: Path) -> Path:
    """A 0.2 MiB wheel whose METADATA inflates to 200 MiB (a dependency list first, then the bomb)."""
    info = "nbexec_bomb-1.0.dist-info"
    path = folder / "nbexec_bomb-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("nbexec_bomb/__init__.py", "X = 1\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        with archive.open(f"{info}/METADATA", "w", force_zip64=True) as handle:
            handle.write(b"Metadata-Version: 2.1\nName: nbexec-bomb\nVersion: 1.0\nSummary: ")
            chunk = b"a" * (1 << 20)
            for _ in range(200):
                handle.write(chunk)
            handle.write(b"\n\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


_MEASURE = """
import json, resource, sys
import nbexec
config = nbexec.SandboxConfig(**json.loads(sys.argv[1]))
with nbexec.Session(config) as session:
    records = session.install("nbexec-bomb")
print(json.dumps({"records": [r.to_dict() for r in records],
                  "children_max_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def test_a_zip_bomb_in_a_wheel_stays_within_the_resolvers_memory_cap(world: World, tmp_path: Path,
                                                                    cleanup_ledger: None) -> None:
    world.add_file("nbexec-bomb", _bomb(tmp_path))
    values = {"image": IMAGE, "pool_size": 0, "warm_imports": (), "timeout": 120, "packages": "any",
              "package_index": world.index.url, "package_cache": str(_public_folder("nbexec-evil-cache-") / "c")}
    # A process of its own, so the peak RSS of its children is the host pip's (the kernel keeps it for us).
    done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(values)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    peak = shown["children_max_rss"]
    print(f"host resolver peak RSS for the zip bomb: {peak / 1024**2:,.0f} MiB")  # shown with -s
    assert peak < RESOLVER_MEMORY, f"the host's resolver reached {peak / 1024**2:,.0f} MiB"
    (record,) = shown["records"]
    assert record["status"] == "failed" and "memory" in record["reason"], record


# -- 3. failed requests are charged and remembered; pip time counts inside the time limit -----------------------

def test_hundreds_of_failing_pip_lines_start_a_bounded_number_of_host_pips(world: World,
                                                                          cleanup_ledger: None) -> None:
    config = _config(world.index.url, _public_folder("nbexec-evil-cache-") / "cache", max_packages=3, timeout=300)
    lines = [f"%pip install nbexec-missing-{i}" for i in range(120)] + ["%pip install nbexec-missing-0"] * 120
    before = len([p for p in world.index.requests if "/nbexec-missing-" in p])
    result = nbexec.execute_notebook("\n".join(lines) + "\nprint('ran')\n", config=config)
    asked = [p for p in world.index.requests if "/nbexec-missing-" in p][before:]
    print(f"index requests for 240 failing pip lines: {len(asked)}")  # shown with -s
    assert result.ok and "ran" in result.stdout, result.error
    assert len(asked) <= config.max_packages, f"{len(asked)} host pip requests for 240 failing lines"
    assert len(result.packages) == 240 and {p.status for p in result.packages} == {"failed"}
    assert sum("max_packages" in (p.reason or "") for p in result.packages) >= 237
    again = nbexec.execute_notebook("%pip install nbexec-missing-0\nprint('ran')\n",
                                    config=config.replace(max_packages=40))
    assert len([p for p in world.index.requests if "/nbexec-missing-" in p][before:]) == len(asked), \
        "a failure of a moment ago started another host pip"
    (record,) = again.packages
    assert record.status == "failed" and "nbexec-missing-0" in (record.reason or "")


@pytest.mark.parametrize("how", ["pip-line", "packages-argument"])
def test_host_pip_time_counts_inside_the_execution_time_limit(world: World, how: str,
                                                              cleanup_ledger: None) -> None:
    name = f"nbexec-held-{how}"
    reached, released = world.index.hold(name)
    config = _config(world.index.url, _public_folder("nbexec-evil-cache-") / "cache", timeout=10)
    code = f"%pip install {name}\nprint('ran')\n" if how == "pip-line" else "print('ran')\n"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(nbexec.execute_notebook, code, config=config,
                              packages=[name] if how == "packages-argument" else [])
        try:
            wait_until(reached.is_set, 120, "the host never asked the index for the held project")
            held = time.monotonic()
            # The index never answers: the execution must still end at its time limit (10 s) plus the
            # sandbox's start and teardown; 170 s is a bound the old code (pip's own retries) passed.
            result = running.result(timeout=170)
        finally:
            released.set()
    print(f"execution ended {time.monotonic() - held:.1f} s after pip reached the held page")  # shown with -s
    assert not result.ok and result.error is not None and result.error.kind == "timeout", result.error
    assert "ran" not in result.stdout
    (record,) = result.packages
    assert record.status == "failed" and "time limit" in (record.reason or ""), record


def test_an_interrupt_during_the_packages_after_a_wake_ends_the_run(world: World, cleanup_ledger: None) -> None:
    """A session woken by replay, then its pip line's host pip held by the index (#36): before, the interrupt was
    lost and the run waited for its whole limit (60 s). The bound proves "ends": pip stopped, no cell run."""
    name = "nbexec-held-after-wake"
    reached, released = world.index.hold(name)
    config = _config(world.index.url, _public_folder("nbexec-evil-cache-") / "cache", timeout=60, runtime="runc")
    session = nbexec.Session(config)
    try:
        assert session.run("x = 1").ok and session.hibernate() and session.status == "asleep"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(session.run, f"%pip install {name}\nprint('ran', x)\n")
            try:
                wait_until(reached.is_set, 120, "the host never asked the index for the held project")
                asked = time.monotonic()
                session.interrupt()
                result = running.result(timeout=90)
                took = time.monotonic() - asked
            finally:
                released.set()
    finally:
        session.close()
    print(f"the run ended {took:.2f} s after the interrupt")  # shown with -s
    assert took < 3, f"the run ended {took:.1f} s after the interrupt"
    assert not result.ok and "ran" not in result.stdout, result.stdout
    assert result.error is not None and "interrupted" in result.error.evalue, result.error


# -- hostile wheels: refused with a reason, nothing provided -----------------------------------------------------

def _wheel_shapes(folder: Path) -> dict[str, Path]:
    good = make_wheel(folder, "nbexec-shape", "1.0", "X = 1\n")
    data = good.read_bytes()
    shapes: dict[str, Path] = {}

    def variant(kind: str, content: bytes) -> None:
        place = folder / kind
        place.mkdir()
        shapes[kind] = place / good.name
        shapes[kind].write_bytes(content)

    variant("truncated", data[: len(data) // 2])
    variant("empty", b"")

    def rebuilt(kind: str, metadata: str | None) -> None:
        buffer = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(buffer, "w") as target:
            for item in source.infolist():
                if item.filename.endswith("/METADATA"):
                    if metadata is not None:
                        target.writestr(item.filename, metadata)
                else:
                    target.writestr(item, source.read(item))
        variant(kind, buffer.getvalue())

    rebuilt("no-metadata", None)
    rebuilt("another-name", "Metadata-Version: 2.1\nName: numpy\nVersion: 1.0\n")
    rebuilt("invalid-dependency", "Metadata-Version: 2.1\nName: nbexec-shape\nVersion: 1.0\n"
            "Requires-Dist: not a requirement!!\n")
    rebuilt("ten-thousand-dependencies", "Metadata-Version: 2.1\nName: nbexec-shape\nVersion: 1.0\n"
            + "".join(f"Requires-Dist: nbexec-d{i}\n" for i in range(10_000)))
    return shapes


@pytest.mark.parametrize("shape", ["truncated", "empty", "no-metadata", "another-name", "invalid-dependency",
                                   "ten-thousand-dependencies"])
def test_a_hostile_wheel_is_refused_with_a_reason_and_nothing_is_kept(shape: str, tmp_path: Path,
                                                                      cleanup_ledger: None) -> None:
    root = _public_folder("nbexec-shape-index-")
    try:
        folder = root / "wheels"
        folder.mkdir()
        folder.chmod(0o755)
        served = _wheel_shapes(tmp_path)[shape]
        shutil.copy(served, folder / served.name)
        os.chmod(folder / served.name, 0o644)
        cache = _public_folder("nbexec-evil-cache-") / "cache"
        with nbexec.Session(_config(str(folder), cache)) as session:
            records = session.install("nbexec-shape")
            (record,) = records
            assert record.status in ("failed", "refused") and record.reason, record
            assert _wheels_in(session) == []
        assert os.listdir(cache / "resolved") == []
    finally:
        shutil.rmtree(root)


# -- Session.install(): the host pip is out of the interrupt's and close()'s reach ------------------------------

def test_an_interrupt_or_close_ends_a_session_install(world: World, cleanup_ledger: None) -> None:
    """`Session.install` passes no stop to the packages (only `run` does). Before: with its project's page held by
    the index, install() ran on 10 s after interrupt() and close() had not returned either; it returned only once
    the index let go (without that, at the config's time limit: 30 s here, 60 s by default)."""
    name = "nbexec-held-install"
    reached, released = world.index.hold(name)
    config = _config(world.index.url, _public_folder("nbexec-evil-cache-") / "cache", timeout=30, runtime="runc")
    session = nbexec.Session(config)
    try:
        assert session.run("x = 1").ok
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            installing = pool.submit(session.install, name)
            closing: concurrent.futures.Future[None] | None = None
            try:
                wait_until(reached.is_set, 120, "the host never asked the index for the held project")
                asked = time.monotonic()
                session.interrupt()
                concurrent.futures.wait([installing], timeout=5)
                interrupted = installing.done()
                closing = pool.submit(session.close)
                concurrent.futures.wait([closing], timeout=5)
                closed = closing.done()
                waited = time.monotonic() - asked
            finally:
                released.set()
            assert closing is not None
            closing.result(timeout=90)
            closed_after = time.monotonic() - asked
    finally:
        session.close()
    assert interrupted and closed, f"{waited:.1f} s after interrupt(), install() had ended: {interrupted}; close() " \
                                   f"had returned: {closed} (it returned {closed_after:.1f} s after the interrupt)"
