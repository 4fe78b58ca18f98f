"""The pure parts of running on nodes: placement, backoff, the event-stream reader, router ids, the config, and
how downloaded files are kept. No Docker, no network."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from nbexec.config import host_from_env
from nbexec.errors import ConfigError, FileTransferError, NodeError
from nbexec.files import folders
from nbexec.sandbox.remote import noderun
from nbexec.sandbox.remote.nodes import BACKOFF_MAX, Capacity, EventReader, Health, rank
from nbexec.service.fleet import Fleet


def cap(name: str, pool_free: int, running: int = 0, sessions: int = 0) -> Capacity:
    return Capacity(name, "i" + name, sessions, pool_free, 2, running)


@pytest.mark.parametrize(("capacities", "inflight", "first"), [
    ({"a": cap("a", 0), "b": cap("b", 2)}, {}, "b"),
    ({"a": cap("a", 2), "b": cap("b", 2, running=3)}, {}, "a"),
    ({"a": cap("a", 2, sessions=5), "b": cap("b", 2, sessions=1)}, {}, "b"),
    ({"a": cap("a", 2), "b": cap("b", 1)}, {"a": 2}, "b"),  # calls sent since the capacity was read count
], ids=["free-pool", "fewest-running", "fewest-sessions", "in-flight"])
def test_rank_puts_the_most_free_node_first(capacities: dict[str, Capacity], inflight: dict[str, int],
                                            first: str) -> None:
    assert rank(capacities, inflight)[0] == first


def test_rank_spreads_ties() -> None:
    capacities = {name: cap(name, 1) for name in "abc"}
    assert {rank(capacities)[0] for _ in range(200)} == {"a", "b", "c"}


def test_health_backs_off_and_recovers() -> None:
    health = Health()
    assert not health.up and health.due()
    for _ in range(10):
        health.failed("refused")
    assert not health.due() and health.down_until - time.monotonic() <= BACKOFF_MAX
    health.ok(cap("a", 1))
    assert health.up and health.due() and health.failures == 0


@pytest.mark.parametrize(("lines", "events"), [
    (["event: output", 'data: {"a": 1}', ""], [("output", {"a": 1})]),
    ([": keep-alive", ""], [("comment", None)]),
    (["event: result", 'data: {"ok":', "data: true}", ""], [("result", {"ok": True})]),
    (["data: 1", ""], [("message", 1)]),
    (["", ""], []),
], ids=["output", "keep-alive", "multi-line", "unnamed", "blank"])
def test_event_reader(lines: list[str], events: list[tuple[str, Any]]) -> None:
    reader = EventReader()
    assert [e for line in lines if (e := reader.feed(line)) is not None] == events


def test_event_reader_refuses_malformed_and_oversized_events(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NodeError, match="malformed"):
        reader = EventReader()
        reader.feed("data: {not json")
        reader.feed("")
    monkeypatch.setattr("nbexec.sandbox.remote.nodes.MAX_EVENT", 10)
    with pytest.raises(NodeError, match="over 10 bytes"):
        EventReader().feed("data: " + "x" * 20)


@pytest.mark.parametrize(("environ", "nodes"), [
    ({}, ()),
    ({"NBEXEC_NODES": "http://a:1/, https://b:2", "NBEXEC_NODE_TOKEN": "t" * 16}, ("http://a:1", "https://b:2")),
], ids=["none", "two"])
def test_nodes_from_env(environ: dict[str, str], nodes: tuple[str, ...]) -> None:
    host = host_from_env(environ)
    assert host.nodes == nodes and "t" * 16 not in repr(host)


@pytest.mark.parametrize("environ", [
    {"NBEXEC_NODES": "a:1", "NBEXEC_NODE_TOKEN": "t" * 16},
    {"NBEXEC_NODES": "http://a:1/path", "NBEXEC_NODE_TOKEN": "t" * 16},
    {"NBEXEC_NODES": "http://a:1"},
], ids=["no-scheme", "a-path", "no-token"])
def test_bad_nodes_are_refused(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        host_from_env(environ)


def test_router_ids_name_their_node_and_bind_the_token() -> None:
    fleet = Fleet(("http://a:1",), "node-token-" + "x" * 16)
    fleet.health["http://a:1"].ok(Capacity("node.with.dots", "0123abcd", 0, 1, 1, 0))
    public = fleet.public_id("alice", "http://a:1", "deadbeef")
    assert public.startswith("node.with.dots.0123abcd.deadbeef.")
    assert fleet.parse_id("alice", public) == ("node.with.dots", "0123abcd", "deadbeef")
    assert fleet.parse_id("bob", public) is None  # another token
    assert fleet.parse_id("alice", public.replace("deadbeef", "deadbeee")) is None  # another session
    assert fleet.parse_id("alice", "plain-id") is None
    other = Fleet(("http://a:1",), "another-token-" + "y" * 16)
    other.health["http://a:1"].ok(Capacity("node.with.dots", "0123abcd", 0, 1, 1, 0))
    assert other.parse_id("alice", public) is None  # routers of another cluster
    asyncio.run(fleet.close())


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "", "a//b", "a/./b", "x\0y"])
def test_downloaded_names_stay_inside_the_folder(tmp_path: Path, name: str) -> None:
    with folders.OutputFolder.open(folders.make_output_dir(tmp_path / "out", may_exist=True)) as out, \
            pytest.raises(FileTransferError):
        noderun.save(out, name, iter([b"x"]), 0)
    assert os.listdir(tmp_path / "out") == []


def test_downloaded_files_are_private_capped_and_never_follow_links(tmp_path: Path) -> None:
    with folders.OutputFolder.open(folders.make_output_dir(tmp_path / "out", may_exist=True)) as out:
        kept = noderun.save(out, "sub/a.csv", iter([b"1,2\n", b"3,4\n"]), 0)
        assert Path(kept.path).read_bytes() == b"1,2\n3,4\n" and kept.size == 8 and kept.mime == "text/csv"
        assert stat.S_IMODE(os.stat(kept.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "out" / "sub").st_mode) == 0o700
        with pytest.raises(FileTransferError, match="cap"):
            noderun.save(out, "big.bin", iter([b"x" * 6, b"x" * 6]), 10)
        assert not (tmp_path / "out" / "big.bin").exists()
        os.symlink("/etc", tmp_path / "out" / "link")
        with pytest.raises(FileTransferError):
            noderun.save(out, "link/passwd", iter([b"owned"]), 0)
    assert sorted(os.listdir(tmp_path / "out")) == ["link", "sub"]


def test_a_host_folder_cannot_be_mounted_on_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbexec

    monkeypatch.setenv("NBEXEC_NODES", "http://127.0.0.1:9")
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", "t" * 16)
    with pytest.raises(ConfigError, match="input_dir"):
        nbexec.execute_notebook("print(1)", input_dir=str(tmp_path))
