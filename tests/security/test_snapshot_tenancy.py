"""Snapshots as a tenant boundary with a cap, over MCP and HTTP (issue #36): each bearer token owns its snapshots
(another token cannot list, restore or delete them: a not-found), one token's snapshots never use up another's
cap, a delete removes the snapshot's files from disk, and an expired snapshot cannot be restored and is gone.

Judged from outside: the real `mcp` client against `nbexec mcp` over HTTP with two tokens, HTTP against a real
node, and the snapshot folder on disk (NBEXEC_SNAPSHOT_DIR).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import threading
import time
import types
from pathlib import Path
from typing import Any

import anyio
import nbformat
import pytest

import nbexec
from nbexec.engine import snapshots
from nbexec.engine.snapshots import SnapshotStore
from nbexec.errors import SessionLimitError
from nbexec.files import transfer
from nbexec.service.settings import ServerSettings

from ..conftest import IMAGE
from ..test_server import TOKEN_A, TOKEN_B, running
from .test_mcp import McpProcess, _client, _short, _start_http, _stop_and_clean, _text

MCP_A, MCP_B = "alice-token-0123456789abcdef", "mallory-token-0123456789abcdef"


def folders(store: Path) -> set[str]:
    """The snapshots on disk: one folder each, named by the random half of its id."""
    return {p.name for p in store.iterdir() if re.fullmatch(r"[0-9a-f]{32}", p.name)} if store.exists() else set()


def _mcp_server(tmp_path: Path, **env: str) -> tuple[McpProcess, Path]:
    tmp = _short(tmp_path)
    store = tmp / "snaps"
    (tmp / "tokens").write_text(f"{MCP_A}\n{MCP_B}\n")
    server = _start_http(tmp, "--token-file", str(tmp / "tokens"), env={"NBEXEC_SNAPSHOT_DIR": str(store), **env})
    return server, store


def test_mcp_snapshots_belong_to_the_token_that_made_them(docker_ready: None, tmp_path: Path) -> None:
    server, store = _mcp_server(tmp_path)

    async def attack() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with _client(server.url, MCP_A) as alice, _client(server.url, MCP_B) as mallory:
            await alice.call_tool("execute_python", {"code": "secret = 'a-secret'\nopen('s.txt', 'w').write('file')"})
            made = await alice.call_tool("snapshot_session", {})
            assert not made.is_error, _text(made)
            snapshot = _text(made).strip()
            seen["listed_by_b"] = _text(await mallory.call_tool("list_snapshots", {}))
            stolen = await mallory.call_tool("restore_session", {"snapshot_id": snapshot})
            seen["restore_by_b"] = (stolen.is_error, _text(stolen))
            if not stolen.is_error:
                seen["read_by_b"] = _text(await mallory.call_tool("execute_python", {
                    "code": "print(secret, open('s.txt').read())"}))
            removed = await mallory.call_tool("delete_snapshot", {"snapshot_id": snapshot})
            seen["delete_by_b"] = (removed.is_error, _text(removed))
            seen["on_disk_after_b"] = folders(store)
            # B fills its own cap; A can still snapshot.
            await mallory.call_tool("execute_python", {"code": "y = 1"})
            seen["b_made"] = [not (await mallory.call_tool("snapshot_session", {})).is_error for _ in range(8)]
            again = await alice.call_tool("snapshot_session", {})
            seen["a_again"] = (again.is_error, _text(again))
            seen["listed_by_a"] = _text(await alice.call_tool("list_snapshots", {}))
            deleted = await alice.call_tool("delete_snapshot", {"snapshot_id": snapshot})
            seen["delete_by_a"] = (deleted.is_error, _text(deleted))
            seen["on_disk_after_a"] = folders(store)
            gone = await alice.call_tool("restore_session", {"snapshot_id": snapshot})
            seen["restore_deleted"] = (gone.is_error, _text(gone))
            seen["snapshot"] = snapshot
        return seen

    try:
        seen = anyio.run(attack)
    finally:
        assert _stop_and_clean(server) == []
    raw = seen["snapshot"].split(".")[0]
    assert seen["snapshot"] not in seen["listed_by_b"], seen["listed_by_b"]
    assert seen["restore_by_b"][0] and "no snapshot" in seen["restore_by_b"][1], seen
    assert "read_by_b" not in seen
    assert seen["delete_by_b"][0] and "no snapshot" in seen["delete_by_b"][1], seen["delete_by_b"]
    assert raw in seen["on_disk_after_b"]
    assert seen["b_made"] == [True] * 8, "one token's snapshots counted against the other's cap"
    assert not seen["a_again"][0], seen["a_again"]
    assert seen["snapshot"] in seen["listed_by_a"]
    assert not seen["delete_by_a"][0], seen["delete_by_a"]
    assert raw not in seen["on_disk_after_a"], "a deleted snapshot's files stayed on disk"
    assert seen["restore_deleted"][0] and "no snapshot" in seen["restore_deleted"][1]


def test_mcp_snapshot_expires(docker_ready: None, tmp_path: Path) -> None:
    server, store = _mcp_server(tmp_path, NBEXEC_SNAPSHOT_TTL="3")

    async def wait_out() -> dict[str, Any]:
        async with _client(server.url, MCP_A) as alice:
            await alice.call_tool("execute_python", {"code": "x = 1"})
            snapshot = _text(await alice.call_tool("snapshot_session", {})).strip()
            kept = folders(store)
            await anyio.sleep(4)
            late = await alice.call_tool("restore_session", {"snapshot_id": snapshot})
            return {"kept": kept, "late": (late.is_error, _text(late)), "after": folders(store),
                    "listed": _text(await alice.call_tool("list_snapshots", {})), "snapshot": snapshot}

    try:
        seen = anyio.run(wait_out)
    finally:
        assert _stop_and_clean(server) == []
    assert seen["snapshot"].split(".")[0] in seen["kept"]
    assert seen["late"][0] and "no snapshot" in seen["late"][1], seen["late"]
    assert seen["after"] == set(), "an expired snapshot's files stayed on disk"
    assert seen["snapshot"] not in seen["listed"]


@pytest.fixture
def node(docker_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    store = tmp_path / "snaps"
    monkeypatch.setenv("NBEXEC_SNAPSHOT_DIR", str(store))
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=2)
    with running(ServerSettings(config=config, tokens=(TOKEN_A, TOKEN_B), max_sessions_per_token=2)) as service:
        yield service, store


def snapshot_of(client: Any) -> str:
    """A snapshot of a new session of ``client``'s (one cell run in it); the session is deleted after."""
    session = client.post("/v1/sessions").json()["id"]
    try:
        assert client.post(f"/v1/sessions/{session}/execute", json={"code": "x = 1"}).json()["ok"]
        snapshot: str = client.post(f"/v1/sessions/{session}/snapshot").json()["snapshot"]
    finally:
        client.delete(f"/v1/sessions/{session}")
    return snapshot


def test_http_snapshots_list_delete_per_token(node: Any) -> None:
    service, store = node
    with service.client(TOKEN_A) as alice, service.client(TOKEN_B) as mallory:
        snapshot = snapshot_of(alice)
        listed_b = mallory.get("/v1/snapshots")
        assert listed_b.status_code == 200 and snapshot not in listed_b.text, listed_b.text
        assert mallory.delete(f"/v1/snapshots/{snapshot}").status_code == 404
        assert snapshot.split(".")[0] in folders(store)
        listed_a = alice.get("/v1/snapshots").json()["snapshots"]
        assert [s["id"] for s in listed_a] == [snapshot] and listed_a[0]["expires"] > time.time()
        assert alice.delete(f"/v1/snapshots/{snapshot}").status_code == 204
        assert folders(store) == set(), "a deleted snapshot's files stayed on disk"
        assert alice.post("/v1/sessions", json={"from_snapshot": snapshot}).status_code == 404
        assert alice.delete(f"/v1/snapshots/{snapshot}").status_code == 404


def test_http_snapshot_expires(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    service, store = node
    monkeypatch.setenv("NBEXEC_SNAPSHOT_TTL", "2")
    with service.client(TOKEN_A) as alice:
        snapshot = snapshot_of(alice)
        assert snapshot.split(".")[0] in folders(store)
        time.sleep(3)
        late = alice.post("/v1/sessions", json={"from_snapshot": snapshot})
        assert late.status_code == 404, late.text
        assert folders(store) == set(), "an expired snapshot's files stayed on disk"
        assert snapshot not in alice.get("/v1/snapshots").text


class _SlowCopy:
    """The one handle method a take calls, slow as a copy of a full /mnt/data: takes overlap for a second."""

    def snapshot(self, files: Any, limits: Any) -> Any:
        time.sleep(1.0)
        return types.SimpleNamespace(skipped=[], files=[])


def test_concurrent_takes_stay_within_the_owners_cap(tmp_path: Path) -> None:
    """Attack (#36, found by the attacker's read): ten takes at once by one owner (HTTP's threads, MCP's calls) all
    passed max_snapshots=2 (count, then write; a folder being made counts for nobody): ten were kept."""
    store = SnapshotStore(tmp_path / "snaps", max_snapshots=2, key=b"k" * 32)
    outcomes: list[str] = []

    def take() -> None:
        try:
            store.take("token-a", nbexec.SandboxConfig(), nbformat.v4.new_notebook(), _SlowCopy())  # type: ignore[arg-type]
            outcomes.append("made")
        except SessionLimitError:
            outcomes.append("refused")

    threads = [threading.Thread(target=take) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outcomes.count("made") == 2 and outcomes.count("refused") == 8, outcomes
    assert store.count("token-a") == 2 and store.count("token-b") == 0


class _SlowFiles:
    """A copy of /mnt/data that writes one file and takes ``seconds``: longer than the store's TTL."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.copying = seconds, threading.Event()

    def snapshot(self, files: Any, limits: Any) -> Any:
        transfer.replace(files, "kept.txt", b"kept")
        self.copying.set()
        time.sleep(self.seconds)
        entry = types.SimpleNamespace(name="kept.txt", sha256=hashlib.sha256(b"kept").hexdigest(), size=4)
        return types.SimpleNamespace(skipped=[], files=[entry])


def test_expiry_never_judges_a_snapshot_being_made(tmp_path: Path) -> None:
    """Attack (#36, attacker's read): a take slower than the TTL while another owner's listing runs expiry. Before:
    the half-made folder was judged by its mtime and removed under the take, whose id then named nothing."""
    store = SnapshotStore(tmp_path / "snaps", key=b"k" * 32, ttl=1.5)
    copy = _SlowFiles(3.5)
    made: list[str] = []
    taker = threading.Thread(target=lambda: made.append(store.take("token-a", nbexec.SandboxConfig(),
                                                                   nbformat.v4.new_notebook(), copy)))  # type: ignore[arg-type]
    taker.start()
    assert copy.copying.wait(10)
    while taker.is_alive():  # expiry runs over and over while the take is under way
        assert store.listing("token-a") == [], "a half-made snapshot was listed"
        time.sleep(0.2)
    taker.join()
    restored = store.open("token-a", made[0])
    with restored.open_file("kept.txt") as handle:
        assert handle.read() == b"kept"
    assert [s.id for s in store.listing("token-a")] == made


def test_a_take_that_died_is_swept_once_unlocked_and_old(tmp_path: Path) -> None:
    """A folder left by a take whose process died goes after the TTL; one a live take holds stays."""
    store = SnapshotStore(tmp_path / "snaps", key=b"k" * 32, ttl=1.0)
    store.listing("token-a")
    dead, live = (store.root / f"{name * 32}{snapshots.MAKING}" for name in "ab")
    for folder in (dead, live):
        folder.mkdir(mode=0o700)
        os.utime(folder, (time.time() - 60, time.time() - 60))
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        store.listing("token-b")
        assert (dead.exists(), live.exists()) == (False, True)
    finally:
        os.close(held)
