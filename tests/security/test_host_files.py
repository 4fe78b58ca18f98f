"""Sparse and huge files in /mnt/data cost the host nothing, on every path that reads them after a run.

Collection already stopped at the caps (tests/security/test_datafs.py). These tests attack every *other* host read
of sandbox files: `Session.download` / `open_file`, `Session.files()`, the HTTP listing and download of
`nbexec serve`, MCP resources, a remote session's listing and download through a real node, a hostile node's
answers, and uploads to a real store (Azurite). Each is judged from outside: the bytes the reading process read
from files (``rchar`` of /proc/<pid>/io), its peak Python allocations or resident high-water mark, the host
disk it wrote, and what the caller got (a clear error or a capped answer, never the whole file).

A 16 TiB sparse file ("huge") would take about eight hours to hash and cannot be held in memory; each test first
attacks with a file of a few GiB (which a reader without a cap does read, in seconds) so that it fails on code
without the caps instead of hanging, then with the 16 TiB one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import nbexec
from nbexec.errors import FileTransferError, NbexecError
from nbexec.files import artifacts
from nbexec.sandbox.docker import pool
from nbexec.sandbox.remote import source
from nbexec.stores import uploads

from .. import cluster, seamnode
from ..azurite import Azurite
from ..conftest import IMAGE
from ..test_storage import store_for
from .test_mcp import _client, _start_http, _stop_and_clean
from .test_service import TOKEN_A, start_serve, stop

MiB = 1024**2
GiB = 1024**3
HUGE = (16 << 40) - 4096  # ext4's largest file with 4 KiB blocks (max_data >= 512 MiB makes 4 KiB blocks)
SMALL_READ = 64 * MiB  # what a bounded path may read at most in these tests (the small files, Python, ...)


def sparse(*files: tuple[str, int]) -> str:
    """Code that makes sparse files of the given apparent sizes in /mnt/data (nothing written into them)."""
    return "".join(f"with open('/mnt/data/{name}', 'wb') as f:\n    f.truncate({size})\n" for name, size in files)


SMALL_FILES = ("import os, hashlib\nfor i in range(30):\n    open(f'/mnt/data/f{i:02d}.txt', 'w').write(str(i) * 100)\n"
               "real = os.urandom(8 << 20)\nopen('/mnt/data/data.bin', 'wb').write(real)\n"
               "print(hashlib.sha256(real).hexdigest())\n")


def forget_nodes() -> None:
    """Drop the process's node clients (closing their connections), so the next test starts from NBEXEC_NODES."""
    source.forget_all()


def rchar(pid: int | str = "self") -> int:
    """Bytes process ``pid`` has read with read(2) and friends so far (files, pipes, sockets)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"])


def high_water_kib(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0])


@dataclass
class Cost:
    seconds: float = 0.0
    read: int = 0  # bytes read by this process
    peak: int = 0  # peak Python allocations, bytes


@contextlib.contextmanager
def cost() -> Iterator[Cost]:
    """What the code inside costs this process: time, bytes read, peak Python allocations. Sandboxes of earlier
    tests still being torn down in the background are waited for first: their reads are not the code's."""
    pool.wait_for_teardown()
    found = Cost()
    tracemalloc.start()
    read, started = rchar(), time.monotonic()
    try:
        yield found
    finally:
        found.seconds, found.read = time.monotonic() - started, rchar() - read
        found.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


@contextlib.contextmanager
def cost_of(pid: int) -> Iterator[Cost]:
    """What another process spends meanwhile: time, bytes it read, growth of its resident high-water mark."""
    found = Cost()
    read, peak, started = rchar(pid), high_water_kib(pid), time.monotonic()
    yield found
    found.seconds, found.read = time.monotonic() - started, rchar(pid) - read
    found.peak = (high_water_kib(pid) - peak) * 1024


@pytest.fixture
def roomy(cleanup_ledger: None) -> nbexec.SandboxConfig:
    """A session's sandbox with a 600 MiB /mnt/data (4 KiB blocks: room for a 16 TiB sparse file) and 20 files."""
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, interrupt_grace=3,
                                max_data="600m", max_files=20)


# -- the library: Session.download, Session.open_file, Session.files() ------------------------------------------

def test_download_never_reads_past_max_data(roomy: nbexec.SandboxConfig) -> None:
    with nbexec.Session(roomy) as session:
        made = session.run(sparse(("gig", GiB), ("huge", HUGE)) + SMALL_FILES)
        assert made.ok, made.error
        for name in ("gig", "huge"):  # gig first: a reader without a cap reads it whole in a second or two
            for read in (session.download, session.open_file):
                with cost() as spent, pytest.raises(FileTransferError, match=r"larger than .*max_data") as refused:
                    read(name)
                assert spent.read < MiB and spent.peak < 4 * MiB, (name, read.__name__, spent)
                assert "600m" in str(refused.value)
        with pytest.raises(FileTransferError, match="larger than"):
            session.open_file("gig", max_bytes=10 * GiB)  # a caller's cap above max_data does not lift it
        content = session.download("data.bin")
        assert hashlib.sha256(content).hexdigest() == made.stdout.strip()
        assert session.download("f07.txt") == b"7" * 100


def test_listing_never_hashes_past_the_caps(roomy: nbexec.SandboxConfig) -> None:
    with nbexec.Session(roomy) as session:
        made = session.run(sparse(("eight", 8 * GiB)) + SMALL_FILES)
        assert made.ok, made.error
        with cost() as first:
            listed = session.files()
        print(f"\nfiles() beside an 8 GiB sparse file: {first.seconds * 1000:.0f} ms, read {first.read:,} bytes")
        assert 8 * MiB <= first.read < SMALL_READ, first  # data.bin is hashed; the 8 GiB not (~15 s uncapped)
        names = {f.name for f in listed}
        assert "eight" not in names and len(listed) == roomy.max_files, sorted(names)
        assert all(len(f.sha256) == 64 for f in listed)
        listing = session.listing()
        assert any(s.name == "eight" and "apparent size" in s.reason for s in listing.skipped), listing.skipped
        assert any("max_files" in note for note in listing.notes), listing.notes

        made = session.run(sparse(("huge", HUGE)))
        assert made.ok, made.error
        with cost() as again:
            relisted = session.files()
        assert again.read < MiB, again  # unchanged files are not hashed again; huge and eight not at all
        assert [(f.name, f.sha256) for f in relisted] == [(f.name, f.sha256) for f in listed]


def test_a_changed_file_is_hashed_again(roomy: nbexec.SandboxConfig) -> None:
    """The listing's memory of hashes never hides a change: same size, same mtime, other bytes."""
    with nbexec.Session(roomy) as session:
        assert session.run("open('/mnt/data/a.txt', 'w').write('one')").ok
        before = {f.name: f.sha256 for f in session.files()}
        swap = ("import os\nst = os.stat('/mnt/data/a.txt')\nopen('/mnt/data/a.txt', 'w').write('two')\n"
                "os.utime('/mnt/data/a.txt', ns=(st.st_atime_ns, st.st_mtime_ns))")
        assert session.run(swap).ok
        after = {f.name: f.sha256 for f in session.files()}
        assert before["a.txt"] == hashlib.sha256(b"one").hexdigest()
        assert after["a.txt"] == hashlib.sha256(b"two").hexdigest()


# -- nbexec serve: the HTTP listing and download --------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_roomy(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("hostfiles-serve")
    server = start_serve(tmp, env={"NBEXEC_MAX_DATA": "600m", "NBEXEC_MAX_FILES": "20", "NBEXEC_POOL_SIZE": "0"})
    try:
        yield server
    finally:
        stop(server)


def test_http_listing_and_download_are_bounded(serve_roomy: Any) -> None:
    pid = serve_roomy.proc.pid
    with serve_roomy.client(TOKEN_A) as http:
        session = http.post("/v1/sessions").json()["id"]
        try:
            made = http.post(f"/v1/sessions/{session}/execute",
                             json={"code": sparse(("eight", 8 * GiB)) + SMALL_FILES}).json()
            assert made["ok"], made
            with cost_of(pid) as spent:
                listed = http.get(f"/v1/sessions/{session}/files")
            assert listed.status_code == 200, listed.text
            print(f"\nHTTP listing beside an 8 GiB sparse file: {spent.seconds * 1000:.0f} ms, the server read "
                  f"{spent.read:,} bytes")
            assert spent.read < SMALL_READ and spent.peak < SMALL_READ, spent
            body = listed.json()
            assert len(body["files"]) == 20 and "eight" not in {f["name"] for f in body["files"]}
            assert any(s["name"] == "eight" and "apparent size" in s["reason"] for s in body["skipped_files"]), body
            assert any("max_files" in n for n in body["notes"]), body["notes"]

            assert http.post(f"/v1/sessions/{session}/execute", json={"code": sparse(("huge", HUGE))}).json()["ok"]
            for name in ("eight", "huge"):
                with cost_of(pid) as spent:
                    answer = http.get(f"/v1/sessions/{session}/files/{name}")
                assert answer.status_code == 413, (answer.status_code, answer.text[:300])
                assert "max_data" in answer.json()["detail"] and spent.read < MiB, (answer.text, spent)
            with cost_of(pid) as spent:
                again = http.get(f"/v1/sessions/{session}/files")
            assert again.status_code == 200 and spent.read < 4 * MiB, spent
            real = http.get(f"/v1/sessions/{session}/files/data.bin")
            assert hashlib.sha256(real.content).hexdigest() == made["stdout"].strip()
        finally:
            http.delete(f"/v1/sessions/{session}")


# -- MCP resources ----------------------------------------------------------------------------------------------

def test_mcp_resources_never_read_past_their_cap(docker_ready: None, tmp_path: Path) -> None:
    folder = tmp_path / "t"
    folder.mkdir(mode=0o700)
    server = _start_http(folder, env={"NBEXEC_MAX_DATA": "600m"})

    async def attack() -> dict[str, str]:
        from mcp.shared.exceptions import MCPError

        seen: dict[str, str] = {}
        async with _client(server.url) as client:
            code = sparse(("gig", GiB), ("huge", HUGE)) + "open('/mnt/data/big.bin', 'wb').write(b'b' * (1 << 20))\n" \
                "open('/mnt/data/ok.txt', 'w').write('fine')\n"
            await client.call_tool("execute_python", {"code": code})
            listed = {str(r.uri) for r in (await client.list_resources()).resources}
            seen["listed"] = " ".join(sorted(listed))
            for name in ("gig", "huge", "big.bin", "ok.txt"):
                try:
                    found = await client.read_resource(f"nbexec://files/{name}")
                    seen[name] = "read " + str(len(getattr(found.contents[0], "blob", "")))
                except MCPError as exc:
                    seen[name] = str(exc)
        return seen

    try:
        with cost_of(server.process.pid) as spent:
            seen = anyio.run(attack)
    finally:
        leaked = _stop_and_clean(server)
    assert leaked == []
    assert seen["listed"] == "nbexec://files/big.bin nbexec://files/ok.txt", seen
    assert "Unknown resource" in seen["gig"] and "Unknown resource" in seen["huge"], seen
    assert "larger than" in seen["big.bin"] and seen["ok.txt"] == "read 8", seen
    assert spent.read < SMALL_READ and spent.peak < SMALL_READ, spent


# -- a remote session through a real node -----------------------------------------------------------------------

@pytest.fixture
def one_node(docker_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[cluster.Server]:
    server = cluster.node(0, tmp_path)
    server.env.update({"NBEXEC_MAX_DATA": "600m", "NBEXEC_MAX_FILES": "20", "NBEXEC_POOL_SIZE": "0"})
    server.start()
    try:
        cluster.wait_ready([server])
        monkeypatch.setenv("NBEXEC_NODES", server.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
        forget_nodes()
        yield server
    finally:
        forget_nodes()
        if server.process is not None and server.process.poll() is None:
            server.kill(signal.SIGTERM)  # a node cleans up (containers, data filesystems) when told to stop
        assert server.containers() == [], "the node left containers"


def test_remote_listing_and_download_are_bounded(one_node: cluster.Server, tmp_path: Path) -> None:
    node_pid = one_node.process.pid if one_node.process else 0
    config = nbexec.SandboxConfig(image=IMAGE, max_data="600m", max_files=20, source="remote")
    with nbexec.Session(config, output_dir=tmp_path / "out") as session:
        made = session.run(sparse(("eight", 8 * GiB)) + SMALL_FILES)
        assert made.ok, made.error
        with cost_of(node_pid) as on_node, cost() as here:
            listed = session.files()
        print(f"\nremote files() beside an 8 GiB sparse file: {on_node.seconds * 1000:.0f} ms, the node read "
              f"{on_node.read:,} bytes")
        assert on_node.read < SMALL_READ and here.read < SMALL_READ, (on_node, here)
        assert len(listed) == 20 and "eight" not in {f.name for f in listed}
        assert session.run(sparse(("huge", HUGE))).ok
        with cost_of(node_pid) as on_node:
            assert [f.name for f in session.files()] == [f.name for f in listed]
        assert on_node.read < MiB, on_node
        for name in ("eight", "huge"):
            with cost_of(node_pid) as on_node, cost() as here, pytest.raises(FileTransferError, match="larger than"):
                session.download(name)
            assert on_node.read < MiB and here.read < MiB and here.peak < 4 * MiB, (name, on_node, here)
        assert hashlib.sha256(session.download("data.bin")).hexdigest() == made.stdout.strip()


# -- a hostile node ---------------------------------------------------------------------------------------------

@functools.cache
def _million_entries() -> bytes:
    """A file listing of a million entries (120 MB of JSON), made once per test run."""
    entry = {"size": 1, "mime": "text/plain", "sha256": "0" * 64, "url": None}
    return json.dumps({"sandbox": seamnode.SANDBOX,
                       "files": [dict(entry, name=f"{i:07d}") for i in range(1_000_000)]}).encode()


# file -> (the size its listing says, the size its download says, the bytes sent)
RUN_FILES = {"exact": (1, 32 * MiB, 32 * MiB), "late": (1, 64 * MiB, 64 * MiB), "more": (512 * MiB,) * 3,
             "chunked": (1, 1, 512 * MiB)}


def _file(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> seamnode.Reply:
    """A file whose body is larger than max_data: "sized" says so (512 MiB), "chunked" says 1 byte and sends
    512 MiB; a run's files lie in their listing ("exact" fills max_data, "late" would pass it)."""
    name = rest.rsplit("/", 1)[1]
    _, said, sent = RUN_FILES.get(name, (0, 512 * MiB if name == "sized" else 1, 512 * MiB))
    if name == "understated":  # says 1 byte, and a Content-Length of what it sends: 512 MiB
        return seamnode.Reply(200, seamnode.zeros(sent), {"X-Nbexec-Size": "1", "Content-Length": str(sent)}, False)
    return seamnode.Reply(200, seamnode.zeros(sent), {"X-Nbexec-Size": str(said)})


def _listing(method: str, rest: str, query: dict[str, list[str]], body: bytes) -> seamnode.Reply:
    if method != "GET":
        return seamnode.Reply(404)
    if _HostileNode.listing == "million":
        listing = _million_entries()
        return seamnode.Reply(200, [listing], {"Content-Type": "application/json",
                                               "Content-Length": str(len(listing))}, False)
    files = [{"name": name, "size": sizes[0], "mime": "application/octet-stream", "sha256": "0" * 64, "url": None}
             for name, sizes in RUN_FILES.items()]
    return seamnode.json_reply({"sandbox": seamnode.SANDBOX, "files": files, "skipped_files": [], "notes": []})


class _HostileNode:
    """A loopback "node" (`tests/seamnode.py`) that answers the node protocol, then lies about files: endless
    bodies, a listing of a million entries, and a run whose files add up to far more than max_data."""

    listing = "run"


@pytest.fixture
def hostile_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[seamnode.SeamNode]:
    with seamnode.SeamNode() as server:
        server.answers.update({"/files/*": _file, "/files": _listing})
        monkeypatch.setenv("NBEXEC_NODES", server.url)
        monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
        forget_nodes()
        try:
            yield server
        finally:
            forget_nodes()
            _HostileNode.listing = "run"


def _host_bytes(root: Path) -> int:
    return sum(os.lstat(Path(d) / f).st_blocks * 512 for d, _, names in os.walk(root) for f in names)


@pytest.fixture
def small_remote(hostile_node: seamnode.SeamNode, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    out = tmp_path / "out"
    config = nbexec.SandboxConfig(image=IMAGE, max_data="32m", max_files=20, source="remote")
    with nbexec.Session(config, output_dir=out) as session:
        yield session, out


@pytest.mark.parametrize("name", ["sized", "chunked", "understated"],
                         ids=["content-length-over-the-cap", "no-length", "size-understated-with-a-length"])
def test_a_hostile_nodes_download_stops_at_max_data(small_remote: tuple[Any, Path], name: str) -> None:
    session, _ = small_remote
    with cost() as here, pytest.raises(FileTransferError, match="larger than"):
        session.download(name)
    print(f"\na hostile node's 512 MiB {name} body under a 32 MiB cap: peak {here.peak:,} bytes")
    assert here.peak < 40 * MiB, here


def test_a_hostile_nodes_listing_is_refused_unparsed(small_remote: tuple[Any, Path]) -> None:
    session, _ = small_remote
    _million_entries()  # made by the "node" before the client's cost is measured
    _HostileNode.listing = "million"
    with cost() as here, pytest.raises(NbexecError, match="listing"):
        session.files()
    assert here.peak < 64 * MiB, here  # a million entries (120 MB of JSON) are never read whole nor parsed


def test_a_hostile_nodes_run_files_stay_within_max_data(small_remote: tuple[Any, Path]) -> None:
    """"exact" fills max_data exactly; "late" (past the spent budget), "more" (512 MiB) and "chunked" (larger than
    it says) must not get past it."""
    session, out = small_remote
    with cost() as here:
        result = session.run("pass")
    kept = {f.name: f.size for f in result.files}
    assert sum(kept.values()) <= 32 * MiB and _host_bytes(out) <= 33 * MiB, (kept, _host_bytes(out))
    assert here.peak < 64 * MiB, here
    assert {s.name for s in result.skipped_files} >= {"late", "more", "chunked"}, result.skipped_files


# -- uploads to a real store ------------------------------------------------------------------------------------

def test_uploads_never_read_a_sparse_file(config: nbexec.SandboxConfig, azurite: Azurite) -> None:
    store = store_for(azurite)
    # No pool: a refill's Docker answers, read by its threads meanwhile, would count as this process's reads.
    roomy = config.replace(max_data="600m", pool_size=0)
    code = sparse(("eight", 8 * GiB), ("huge", HUGE)) + "open('/mnt/data/ok.bin', 'wb').write(b'k' * 1000)\n"
    with cost() as spent:
        result = nbexec.execute_notebook(code, config=roomy, store=store)
    assert result.ok, result.error
    assert {u.name: u.status for u in result.uploads if u.kind == "file"} == {"ok.bin": "uploaded"}, result.uploads
    assert spent.read < SMALL_READ, spent
    again_store = store_for(azurite)  # made outside the measure: a client reads its certificates as it starts
    with cost() as spent:  # publishing it again (what a remote run does with a node's result) reads only ok.bin
        again = uploads.publish(result, again_store)
    assert [u.name for u in again.uploads if u.status == "uploaded"] == ["ok.bin"] and spent.read < MiB, spent
    assert artifacts.get(Path(result.output_dir) / "data", "ok.bin") == b"k" * 1000
