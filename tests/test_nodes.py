"""The pure parts of running on nodes: placement, backoff, the router's event re-framer, router ids, the signed
header, file names in URLs, the config, and how downloaded files are kept. No Docker, no network."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbexec.errors import ConfigError, FileTransferError
from nbexec.files import folders
from nbexec.hostconfig import host_from_env
from nbexec.sandbox.remote import files, paths
from nbexec.sandbox.remote.nodes import BACKOFF_MAX, Capacity, Health, rank
from nbexec.service import identity
from nbexec.service.fleet import members
from nbexec.service.sse import EventError, Framer, encode


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
    key = identity.id_key(b"node-token-" + b"x" * 16)
    public = identity.public_id(key, "alice", "node.with.dots", "0123abcd", "deadbeef")
    assert public.startswith("node.with.dots.0123abcd.deadbeef.")
    assert identity.parse_id(key, "alice", public) == ("node.with.dots", "0123abcd", "deadbeef")
    assert identity.parse_id(key, "bob", public) is None  # another client
    assert identity.parse_id(key, "alice", public.replace("deadbeef", "deadbeee")) is None  # another session
    assert identity.parse_id(key, "alice", "plain-id") is None
    other = identity.id_key(b"another-token-" + b"y" * 16)
    assert identity.parse_id(other, "alice", public) is None  # routers of another cluster


def test_a_node_renders_ids_only_for_a_signed_call() -> None:
    key = identity.id_key(b"t" * 16)
    signed = identity.View(identity.For("alice", "n1", key), "0a1b")
    public = identity.public_id(key, "alice", "n1", "0a1b", "cafe")
    result = {"execution_id": "cafe-3", "id": "cafe", "node": "host-name", "stdout": "cafe"}
    assert signed.outward(dict(result), "cafe") == {"execution_id": public + "-3", "id": public, "node": "n1",
                                                    "stdout": "cafe"}  # what the code printed stays as it was
    assert identity.View(None, "0a1b").outward(dict(result), "cafe") == result
    assert signed.id("cafe") == public and identity.View(None, "0a1b").id("cafe") == "cafe"


TOKEN = b"node-token-" + b"n" * 24


def _header(**changes: object) -> tuple[str, str, bytes]:
    """(method, target, header) of a call signed with TOKEN, then changed as ``changes`` say."""
    method, target = str(changes.get("method", "GET")), str(changes.get("target", "/v1/sessions/ab?stream=true"))
    value = identity.sign(TOKEN, method, target, str(changes.get("client", "alice")), str(changes.get("node", "n1")))
    return str(changes.get("sent_method", method)), str(changes.get("sent_target", target)), value.encode()


def _flipped(header: bytes) -> bytes:
    return header[:-1] + (b"1" if header.endswith(b"0") else b"0")


TARGET = "/v1/sessions/ab?stream=true"
BAD_SIGNATURES = {
    "other-method": _header(sent_method="PUT"),
    "other-target": _header(sent_target="/v1/sessions/ab/../cd?stream=true"),
    "other-query": _header(sent_target="/v1/sessions/ab?stream=false"),
    "bad-client": _header(client="al;ice"),
    "bad-node": _header(node="-n1"),
    "empty": ("GET", TARGET, b""),
    "truncated": ("GET", TARGET, _header()[2].rsplit(b";", 1)[0]),
    "extra-field": ("GET", TARGET, _header()[2] + b";x"),
    "oversized": ("GET", TARGET, b"a" * 600),
    "not-hex": ("GET", TARGET, _header()[2][:-1] + b"g"),
    "flipped": ("GET", TARGET, _flipped(_header()[2])),
    "latin-1": ("GET", TARGET, "\u00e9;n1;1;".encode("latin-1") + b"0" * 32 + b";" + b"0" * 64),
}


@pytest.mark.parametrize("shape", list(BAD_SIGNATURES))
def test_a_bad_signature_is_refused(shape: str) -> None:
    with pytest.raises(identity.SignatureError):
        identity.Verifier().verify(TOKEN, *BAD_SIGNATURES[shape])


def test_a_signature_holds_once_within_its_window() -> None:
    method, target, header = _header()
    verifier = identity.Verifier(window=60)
    assert verifier.verify(TOKEN, method, target, header) == identity.For("alice", "n1", identity.id_key(TOKEN))
    with pytest.raises(identity.SignatureError, match="replayed"):
        verifier.verify(TOKEN, method, target, header)
    with pytest.raises(identity.SignatureError, match="stale"):
        identity.Verifier().verify(TOKEN, method, target, header, now=time.time() + 120)
    with pytest.raises(identity.SignatureError, match="signature"):
        identity.Verifier().verify(b"another-token-" + b"x" * 16, method, target, header)
    full = identity.Verifier(capacity=1)
    full.verify(TOKEN, *_header()[:2], _header()[2])
    with pytest.raises(identity.SignatureError, match="too many"):
        full.verify(TOKEN, *_header()[:2], _header()[2])


@pytest.mark.parametrize("name", ["../x", "a/../../b", "./a", "a//b", "a/", "", "a\\b", "x\0y", "%2e%2e/x",
                                  "%2E%2e", "a%2Fb", "a%5cb", "%00", "%252e%252e", "%25252e%25252e", "%2525252e"])
def test_paths_refuse_names_that_could_leave_their_folder(name: str) -> None:
    with pytest.raises(FileTransferError, match="segment"):
        paths.encode(name)


@pytest.mark.parametrize(("name", "route"), [
    ("a.txt", "a.txt"), ("sub/d.txt", "sub/d.txt"), ("q?x#y.txt", "q%3Fx%23y.txt"), ("p%41.txt", "p%2541.txt"),
    ("s p.txt", "s%20p.txt"), ("\u00e9.txt", "%C3%A9.txt"), ("..a", "..a"), ("a..b/...", "a..b/..."),
])
def test_paths_encode_every_byte_a_library_could_rewrite(name: str, route: str) -> None:
    assert paths.encode(name) == route
    assert httpx.URL(f"http://node/v1/sessions/x/files/{route}").raw_path.endswith(route.encode())


@pytest.mark.parametrize(("entries", "named"), [
    (("http://a:1", "https://b:2/"), [("a-1", "http://a:1"), ("b-2", "https://b:2")]),
    (("n1=http://a:1", " n2 = http://b:2"), [("n1", "http://a:1"), ("n2", "http://b:2")]),
], ids=["from-urls", "given"])
def test_nodes_are_named_by_the_configuration(entries: tuple[str, ...], named: list[tuple[str, str]]) -> None:
    assert [(m.name, m.url) for m in members(entries)] == named


@pytest.mark.parametrize("entries", [("a:1",), ("http://a:1/path",), ("n=http://a:1", "n=http://b:1"),
                                     ("http://a:1", "http://a:1"), ("bad name=http://a:1",), ("http://u@a:1",)],
                         ids=["no-scheme", "a-path", "same-name", "same-url", "bad-name", "userinfo"])
def test_bad_node_lists_are_refused(entries: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError):
        members(entries)


FRAMES = [  # (chunks as a node sends them, what the client receives)
    ([b"event: output\ndata: {}\n\n"], b"event: output\ndata: {}\n\n"),
    ([b"event: out", b"put\r", b"\ndata: {\"a\"", b": 1}\r\n\r\n"], b"event: output\ndata: {\"a\": 1}\n\n"),
    ([b": ping\n\n"], b": keep-alive\n\n"),
    ([b"data: x\rdata: y\r\r"], b"data: x\ndata: y\n\n"),
    ([b"id: 7\nretry: 1\ndata:z\n\n"], b"data: z\n\n"),
    ([b"\n\n\n"], b""),
    ([b"event: result\ndata: a\revent: error\ndata: b\n\n"], b"event: result\ndata: a\nevent: error\ndata: b\n\n"),
]


@pytest.mark.parametrize(("chunks", "relayed"), FRAMES, ids=["plain", "split-crlf", "comment", "bare-cr",
                                                           "other-fields", "blank", "cr-injection"])
def test_events_are_reframed_as_they_arrive(chunks: list[bytes], relayed: bytes) -> None:
    framer = Framer(1024)
    assert b"".join(encode(p) for chunk in chunks for p in framer.feed(chunk)) == relayed
    assert not framer.pending


def test_events_are_capped_while_they_are_read() -> None:
    framer = Framer(100)
    assert framer.feed(b"data: " + b"x" * 90) and framer.pending
    with pytest.raises(EventError, match="over 100 bytes"):
        framer.feed(b"x" * 20)
    with pytest.raises(EventError, match="event name"):
        Framer(100).feed(b"event: a b\n")
    with pytest.raises(EventError):
        Framer(10**6).feed(b": " + b"x" * 10**6 + b"yy")  # comments count too


@given(st.lists(st.binary(max_size=64), max_size=40))
@settings(max_examples=300, deadline=None, database=None)
def test_the_framer_never_fails_but_with_its_own_error(chunks: list[bytes]) -> None:
    framer = Framer(256)
    relayed = b""
    try:
        for chunk in chunks:
            relayed += b"".join(encode(p) for p in framer.feed(chunk))
    except EventError:
        return
    assert b"\r" not in relayed
    lines = relayed.split(b"\n")
    assert all(line == b"" or line.startswith((b"event: ", b"data: ", b": keep-alive")) for line in lines)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "", "a//b", "a/./b", "x\0y"])
def test_downloaded_names_stay_inside_the_folder(tmp_path: Path, name: str) -> None:
    with folders.OutputFolder.open(folders.make_output_dir(tmp_path / "out", may_exist=True)) as out, \
            pytest.raises(FileTransferError):
        files.save(out, name, iter([b"x"]), 0)
    assert os.listdir(tmp_path / "out") == []


def test_downloaded_files_are_private_capped_and_never_follow_links(tmp_path: Path) -> None:
    with folders.OutputFolder.open(folders.make_output_dir(tmp_path / "out", may_exist=True)) as out:
        kept = files.save(out, "sub/a.csv", iter([b"1,2\n", b"3,4\n"]), 0)
        assert Path(kept.path).read_bytes() == b"1,2\n3,4\n" and kept.size == 8 and kept.mime == "text/csv"
        assert stat.S_IMODE(os.stat(kept.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "out" / "sub").st_mode) == 0o700
        with pytest.raises(FileTransferError, match="cap"):
            files.save(out, "big.bin", iter([b"x" * 6, b"x" * 6]), 10)
        assert not (tmp_path / "out" / "big.bin").exists()
        os.symlink("/etc", tmp_path / "out" / "link")
        with pytest.raises(FileTransferError):
            files.save(out, "link/passwd", iter([b"owned"]), 0)
    assert sorted(os.listdir(tmp_path / "out")) == ["link", "sub"]


def test_a_host_folder_cannot_be_mounted_on_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbexec

    monkeypatch.setenv("NBEXEC_NODES", "http://127.0.0.1:9")
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", "t" * 16)
    with pytest.raises(ConfigError, match="input_dir"):
        nbexec.execute_notebook("print(1)", input_dir=str(tmp_path))


def test_an_event_without_a_name_is_a_message_after_a_named_one() -> None:
    """The name an `event:` line gave lasts for its own event only: the next one without it is a "message"."""
    pieces = Framer(1000).feed(b"event: output\ndata: a\n\ndata: b\n\n")
    assert [value for kind, value in pieces if kind == "dispatch"] == [b"output", b"message"]
