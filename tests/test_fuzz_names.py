"""Property-based tests of the names and rules made from sandbox- or client-controlled text: allowlist entries and
the judgement of a destination (`egress`), the proxy's request heads (`egress.request`), link rewriting (`links`),
wheel member names and the RECORD written (`wheelinstall`), router ids (`service.identity`), file names into and out
of /mnt/data (`files.transfer`, `sandbox.remote.files`), `.env` files (`cli.envfile`) and output cleaning
(`notebook.outputs`).

Properties: never an exception but the documented one; never a host, address or path outside the one judged
(checked from outside: what the resolver was asked, what the upstream head names, where files landed); CPU time
linear in the input (tests/fuzzing.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from nbexec import egress
from nbexec import names as hostnames
from nbexec.cli import envfile
from nbexec.egress import request
from nbexec.errors import ConfigError, FileTransferError
from nbexec.files import folders, transfer
from nbexec.notebook import links, outputs
from nbexec.packages import wheelinstall
from nbexec.sandbox.remote import files as node_files
from nbexec.service import identity

from .fuzzing import assert_linear

# -- egress rules ----------------------------------------------------------------------------------------------

labels = st.from_regex(r"\A[a-z0-9_-]{1,8}\Z") | st.sampled_from(["*", "-a", "a-", "", "ex ample", "é"])
names = st.lists(labels, min_size=1, max_size=4).map(".".join) | st.text(max_size=20)
addresses = st.ip_addresses().map(str)
entries = st.tuples(names | addresses | addresses.map(lambda a: f"[{a}]"),
                    st.sampled_from(["", ":80", ":443", ":*", ":0", ":65536", ":x", ":8080"])).map("".join)


@given(entry=entries)
def test_an_allowlist_entry_is_a_rule_or_a_config_error(entry: str) -> None:
    try:
        rule = egress.parse_rule(entry)
    except ConfigError:
        return
    assert hostnames.normal_host(rule.host) == rule.host  # kept in its normal form: compared as it is later
    assert rule.ports is None or all(0 < p < 65536 for p in rule.ports)


@given(rules=st.lists(entries, max_size=3), host=names | addresses, port=st.sampled_from([80, 443, 22, 8080]),
       answer=st.lists(addresses, max_size=3))
def test_a_destination_is_reached_only_as_judged(rules: list[str], host: str, port: int, answer: list[str]) -> None:
    asked: list[tuple[str, int]] = []

    def resolver(name: str, at: int) -> list[str]:
        asked.append((name, at))
        return answer

    parsed = []
    for entry in rules:
        with contextlib.suppress(ConfigError):
            parsed.append(egress.parse_rule(entry))
    allowlist = egress.Allowlist(parsed, resolver)
    reached, reason = allowlist.judge(host, port)
    assert (reached == []) == (reason is not None)
    normal = hostnames.normal_host(host)
    rule = allowlist.match(normal, port) if normal is not None else None
    assert asked in ([], [(normal, port)])  # the resolver is asked about the judged name only, once
    if not reached:
        return
    assert rule is not None and normal is not None
    if rule.address is not None:
        assert reached == [normal] == [rule.host] and asked == []  # listed by address: exactly that one
    else:
        assert normal == rule.host or (rule.host.startswith("*.") and normal.endswith(rule.host[1:]))
        assert reached == answer and all(
            egress.address_problem(ipaddress.ip_address(a.split("%", 1)[0])) is None for a in reached)


def test_a_name_that_resolves_differently_the_second_time_is_judged_again() -> None:
    answers = iter([["93.184.216.34"], ["127.0.0.1"], ["169.254.169.254"]])
    allowlist = egress.Allowlist([egress.parse_rule("example.com")], lambda name, port: next(answers))
    assert allowlist.judge("example.com", 443) == (["93.184.216.34"], None)
    for _ in range(2):  # rebinding to loopback, then to the metadata address
        reached, reason = allowlist.judge("example.com", 443)
        assert reached == [] and reason is not None and "resolves to" in reason


@pytest.mark.parametrize(("address", "problem"), [
    ("127.0.0.1", "a loopback address"), ("169.254.169.254", "a link-local address (cloud metadata)"),
    ("0.0.0.0", "an unspecified address"), ("224.0.0.1", "a multicast address"), ("10.0.0.1", "a private address"),
    ("4000::1", "a reserved address"), ("fec0::1", "a site-local address"), ("100.64.0.1", "not a public address"),
    ("::ffff:10.0.0.1", "a private address (inside an IPv6 address)"),
    ("2002:a00:1::", "a private address (inside an IPv6 address)"),  # 6to4 of 10.0.0.1
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "a private address (inside an IPv6 address)"),  # Teredo client 10.0.0.1
    ("93.184.216.34", None), ("2606:4700::1111", None)])
def test_each_kind_of_address_is_named(address: str, problem: str | None) -> None:
    assert egress.address_problem(ipaddress.ip_address(address)) == problem


def test_judgement_is_linear_in_the_rules() -> None:
    assert_linear(lambda n: egress.Allowlist([egress.parse_rule(f"h{i}.example.com") for i in range(n)],
                                             lambda name, port: ["93.184.216.34"]),
                  lambda allowlist: [allowlist.judge("nothere.example.org", 443)  # type: ignore[attr-defined]
                                     for _ in range(20)], 200)


# -- the proxy's request heads ---------------------------------------------------------------------------------

header_lines = st.lists(st.sampled_from([b"Accept: */*", b"Host: evil.example", b"Proxy-Authorization: x",
                                         b"Connection: keep-alive", b"X-A: 1\nHost: evil.example", b"X-B: 2\r",
                                         b"no colon", b"Bad Name: 1", b"Upgrade: h2c", b"TE: trailers",
                                         b"Content-Length: 0"]), max_size=5)
targets = st.sampled_from(["http://allowed.example/", "http://allowed.example:8080/a?b=c",
                           "http://u:p@allowed.example/",
                           "http://evil.example@allowed.example/", "https://allowed.example/", "allowed.example:443",
                           "[::1]:443", "http://[::1]:80/", "http://allowed.example:0/", "http://allowed.example:x/",
                           "/relative", "http://", "allowed.example:99999", ":443"]) | st.text(max_size=20)
heads = st.builds(lambda method, target, version, lines: b"\r\n".join(
    [method + b" " + target.encode("utf-8", "surrogatepass") + b" " + version, *lines]),
    st.sampled_from([b"GET", b"POST", b"CONNECT", b"G ET", b"", b"GET\x00"]), targets,
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b""]), header_lines) | st.binary(max_size=200)


@given(head=heads)
def test_a_request_head_names_one_judged_host_upstream(head: bytes) -> None:
    judged = request.parse(head)
    if isinstance(judged, str):  # refused, with the reason the client is told
        assert judged
        return
    method, host, port, forward = judged.method, judged.host, judged.port, judged.forward
    assert host and 0 < port < 65536
    if method == "CONNECT":
        assert forward is None
        return
    assert forward is not None and forward.endswith(b"\r\n\r\n")
    lines = forward[:-4].split(b"\r\n")
    assert not any(b"\r" in line or b"\n" in line for line in lines)  # no line of the client's making upstream
    hosts = [line for line in lines if line.lower().startswith(b"host:")]
    assert len(hosts) == 1 and urlsplit("http://" + hosts[0][5:].strip().decode()).hostname == host
    assert lines[-1] == b"Connection: close"  # the proxy's own: one request per connection
    assert not any(line.split(b":", 1)[0].lower() in {b"proxy-authorization", b"connection", b"upgrade", b"te"}
                   for line in lines[1:-1])  # the client's hop-by-hop headers stay here
    assert lines[0].split(b" ")[1].startswith(b"/")


def test_a_request_head_is_parsed_in_linear_time() -> None:
    assert_linear(lambda n: b"GET http://a.example/ HTTP/1.1\r\n" + b"\r\n".join([b"X-A: 1"] * n),
                  lambda head: request.parse(head), 100)  # type: ignore[arg-type]


# -- link rewriting ------------------------------------------------------------------------------------------

link_text = st.lists(st.sampled_from(["/mnt/data/", "sandbox:", "a.csv", "b c", "%20", ".", ",", ")", "(", " ",
                                      "x/y.png", "\n", "`", "é"]), max_size=12).map("".join)


@given(text=link_text, produced=st.dictionaries(st.sampled_from(["a.csv", "x/y.png", "b c", "a.csv."]),
                                                st.sampled_from(["U1", "U2"]).map(lambda u: f"\x00{u}\x00"),
                                                max_size=3))
def test_links_rewrite_only_produced_names(text: str, produced: dict[str, str]) -> None:
    out = links.rewrite(text, produced)
    if not produced:
        assert out == text
    pieces = out.split("\x00")
    assert all(piece in ("U1", "U2") for piece in pieces[1::2])  # every URL whole, and only produced ones
    assert "".join(pieces[::2]).replace("sandbox:", "").count("/mnt/data/") <= text.count("/mnt/data/")


def test_link_rewriting_is_linear() -> None:
    assert_linear(lambda n: "/mnt/data/" + "." * n,
                  lambda text: links.rewrite(text, {"a": "u"}), 2000)  # type: ignore[arg-type]


# -- wheel members and the RECORD ------------------------------------------------------------------------------

segments = st.sampled_from(["pkg", "x.py", "", ".", "..", "a:b", "a\\b", "nul\0l", "bad-1.0.data", "purelib",
                            "scripts", "data", "elsewhere", "bad-1.0.dist-info", "RECORD", "é"])
members = st.lists(st.tuples(st.lists(segments, min_size=1, max_size=6).map("/".join),
                             st.sampled_from([0, stat.S_IFREG, stat.S_IFLNK, stat.S_IFDIR, stat.S_IFIFO]),
                             st.booleans()), max_size=5)
WHEEL = "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def build_wheel(path: Path, entries: list[tuple[str, int, bool]]) -> None:
    with zipfile.ZipFile(path, "w") as archive, contextlib.suppress(UserWarning):
        archive.writestr("bad-1.0.dist-info/WHEEL", WHEEL)
        for name, kind, absolute in entries:
            info = zipfile.ZipInfo(("/" if absolute else "") + name)
            info.external_attr = (kind | 0o755) << 16
            archive.writestr(info, "#!python\nx")


def everything_under(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            yield Path(folder) / name


@given(entries=members)
def test_a_wheel_writes_only_inside_its_prefix_or_nothing(entries: list[tuple[str, int, bool]]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "wheels").mkdir()
        wheel = root / "wheels" / "bad-1.0-py3-none-any.whl"
        build_wheel(wheel, entries)
        places = wheelinstall.paths(str(root / "prefix"))
        try:
            written = wheelinstall.unpack(str(wheel), places)
        except wheelinstall.UnsafeWheel:
            assert sorted(everything_under(root)) == [root / "wheels", wheel]  # refused whole: nothing written
            return
        prefix = root / "prefix"
        for path in everything_under(root):
            assert path in (root / "wheels", wheel, prefix) or prefix in path.parents, f"{path} is outside"
            assert not path.is_symlink()
        site = Path(places["purelib"])
        for row in written:  # RECORD's paths, relative to site-packages, all land inside the prefix
            assert prefix in (site / row).resolve().parents


@given(name=st.lists(segments, min_size=1, max_size=5).map("/".join),
       kind=st.sampled_from([0, stat.S_IFREG, stat.S_IFLNK, stat.S_IFDIR, stat.S_IFCHR]))
def test_a_member_is_placed_inside_its_scheme_or_refused(name: str, kind: int) -> None:
    places = wheelinstall.paths("/prefix")
    info = zipfile.ZipInfo("x")
    info.external_attr = (kind | 0o644) << 16
    try:
        where, scheme = wheelinstall.target(name, info, "bad-1.0.dist-info", places, "purelib")
    except wheelinstall.UnsafeWheel:
        return
    assert kind in (0, stat.S_IFREG)
    assert os.path.normpath(where).startswith(os.path.normpath(places[scheme]) + "/")


# -- router ids --------------------------------------------------------------------------------------------------

hex_ids = st.from_regex(r"\A[0-9a-f]{1,64}\Z")
node_names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")  # identity.NAME: what --nodes allows
KEY, OTHER_KEY = identity.id_key(b"node-token-" + b"x" * 16), identity.id_key(b"other-token-" + b"y" * 16)


@given(who=st.text(max_size=8), node=node_names, instance=hex_ids, raw=hex_ids, edit=st.integers(0),
       char=st.characters())
def test_a_router_id_parses_only_for_its_client_unchanged(who: str, node: str, instance: str, raw: str, edit: int,
                                                          char: str) -> None:
    public = identity.public_id(KEY, who, node, instance, raw)
    assert identity.parse_id(KEY, who, public) == (node, instance, raw)
    assert identity.parse_id(KEY, who + "x", public) is None  # another client
    assert identity.parse_id(OTHER_KEY, who, public) is None  # another cluster's routers
    index = edit % len(public)
    changed = public[:index] + char + public[index + 1:]
    assume(changed != public)
    assert identity.parse_id(KEY, who, changed) is None  # any one character changed
    assert identity.parse_id(KEY, who, public[:index]) is None  # truncated


@given(node=st.text(max_size=12), instance=st.text(max_size=12), raw=st.text(max_size=12))
@example(node="no name", instance="ab", raw="cd")  # only the node name is off
@example(node="n", instance="zz", raw="cd")  # only the instance
@example(node="n", instance="ab", raw="zz")  # only the node's id
def test_an_id_with_a_part_of_the_wrong_shape_never_parses(node: str, instance: str, raw: str) -> None:
    """Signed with the right key, but a node name, instance or node id no router would issue."""
    public = identity.public_id(KEY, "alice", node, instance, raw)
    parsed = identity.parse_id(KEY, "alice", public)
    shaped = bool(identity.NAME.fullmatch(node)) and all(
        re.fullmatch(r"[0-9a-f]{1,64}", part) for part in (instance, raw))
    assert parsed == ((node, instance, raw) if shaped else None)


def test_a_router_id_carries_a_96_bit_signature() -> None:
    signature = identity.public_id(KEY, "alice", "n", "ab", "c0ffee").rsplit(".", 1)[1]
    assert len(signature) == 24 and int(signature, 16) >= 0


@given(public=st.text(max_size=120))
def test_an_id_the_router_did_not_make_is_refused(public: str) -> None:
    assert identity.parse_id(KEY, "alice", public) is None


# -- file names into and out of /mnt/data ------------------------------------------------------------------------

file_names = st.lists(st.sampled_from(["a", "b.csv", "", ".", "..", "...", "é", "x\0y", "c\\d", "\x07", "n" * 300]),
                      min_size=1, max_size=4).map("/".join) | st.text(max_size=20)


@pytest.mark.parametrize(("name", "parts"), [
    ("a\\b/./c//d", (b"a", b"b", b"c", b"d")), ("é.csv", ("é.csv".encode(),)), ("x" * 1024, (b"x" * 1024,)),
    ("a/" + "y" * 1022, (b"a", b"y" * 1022)),  # 1,024 bytes with its separator: the limit counts the name as given
    ("../x", "'../x' is not a plain relative name inside /mnt/data"), ("", "'' is not a plain relative name"),
    ("a/..", "is not a plain relative name"), ("./.", "is not a plain relative name"),
    ("a/\x07", "'a/\\x07': name contains control characters"), ("x" * 1025, "name is longer than 1024 bytes"),
    ("a/" + "y" * 1023, "name is longer than 1024 bytes"), ("\udcff", "name is not UTF-8"),
    # absolute: under /mnt/data it is that name; anywhere else it is refused, never taken as relative
    ("/mnt/data/a/b.csv", (b"a", b"b.csv")), ("\\mnt\\data\\c", (b"c",)),
    ("/etc/x", "'/etc/x' is outside /mnt/data: give a name relative to it, like 'x'"),
    ("\\etc\\x", "is outside /mnt/data"), ("/mnt/database", "is outside /mnt/data"), ("/", "is outside /mnt/data"),
    # the suggestion is the name's last part, a trailing slash and all; with no last part, data.csv
    ("/etc/x/", "'/etc/x/' is outside /mnt/data: give a name relative to it, like 'x'"),
    ("/tmp/notesX//", "'/tmp/notesX//' is outside /mnt/data: give a name relative to it, like 'notesX'"),
    ("/", "'/' is outside /mnt/data: give a name relative to it, like 'data.csv'"),
    ("/mnt/database", "'/mnt/database' is outside /mnt/data: give a name relative to it, like 'database'"),
    ("/mnt/data", "is not a plain relative name"), ("/mnt/data/../x", "is not a plain relative name")])
def test_relative_names_in_each_shape(name: str, parts: tuple[bytes, ...] | str) -> None:
    if isinstance(parts, tuple):
        assert transfer.relative_parts(name) == parts
    else:
        with pytest.raises(FileTransferError) as refused:
            transfer.relative_parts(name)
        assert parts in str(refused.value)


def test_valid_name_says_what_is_wrong() -> None:
    assert transfer.valid_name(b"a/b.csv") is None and transfer.valid_name(b"x" * 1024) is None
    assert transfer.valid_name(b"\xff") == "name is not UTF-8"
    assert transfer.valid_name(b"a\x1b[31m") == "name contains control characters"
    assert transfer.valid_name(b"x" * 1025) == "name is longer than 1024 bytes"


@given(name=file_names)
def test_a_relative_name_stays_inside_the_data_folder(name: str) -> None:
    try:
        parts = transfer.relative_parts(name)
    except FileTransferError:
        return
    assert parts and all(p not in (b"", b".", b"..") and b"/" not in p and b"\0" not in p for p in parts)
    assert os.path.normpath(os.path.join(b"/mnt/data", *parts)).startswith(b"/mnt/data/")


@given(name=file_names)
def test_a_name_a_node_gives_lands_inside_the_output_folder_or_nowhere(name: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "out"
        with folders.OutputFolder.open(folders.make_output_dir(root, may_exist=True)) as out:
            try:
                kept = node_files.save(out, name, iter([b"x"]), 0)
            except FileTransferError:
                assert list(everything_under(Path(scratch))) in ([root], [])
                return
        landed = [p for p in everything_under(root) if p.is_file()]
        assert landed == [root / name] and Path(kept.path) == root / name


# -- .env files --------------------------------------------------------------------------------------------------

env_lines = st.lists(st.sampled_from(["NBEXEC_FUZZ_A=1", "NBEXEC_FUZZ_KEEP=changed", "export NBEXEC_FUZZ_B='x y'",
                                      'NBEXEC_FUZZ_C="${NBEXEC_FUZZ_KEEP}"', "=novalue", "NBEXEC_FUZZ_D", "# c",
                                      "NBEXEC_FUZZ_E=\"unclosed", "\x00", "NBEXEC_FUZZ_KEEP", ""]), max_size=6)


@contextlib.contextmanager
def saved_environment() -> Iterator[dict[str, str]]:
    before = dict(os.environ)
    try:
        yield before
    finally:
        os.environ.clear()
        os.environ.update(before)


@given(content=env_lines.map("\n".join).map(str.encode) | st.binary(max_size=60))
def test_a_env_file_only_adds_what_the_environment_lacks(content: bytes) -> None:
    with saved_environment(), tempfile.TemporaryDirectory() as scratch:
        os.environ["NBEXEC_FUZZ_KEEP"] = "kept"
        before = dict(os.environ)
        (Path(scratch) / ".env").write_bytes(content)
        try:
            added = envfile.load(Path(scratch))
        except ConfigError:
            assert dict(os.environ) == before  # refused whole: nothing set
            return
        assert {k: v for k, v in os.environ.items() if k in before} == before  # nothing overridden
        assert sorted(set(os.environ) - set(before)) == added


def test_a_env_file_is_parsed_in_linear_time() -> None:
    def load(folder: object) -> None:
        with saved_environment():
            envfile.load(folder)  # type: ignore[arg-type]

    with tempfile.TemporaryDirectory() as small, tempfile.TemporaryDirectory() as large:
        for folder, count in ((small, 150), (large, 2400)):
            (Path(folder) / ".env").write_text("".join(f"NBEXEC_FUZZ_{i}=v{i}\n" for i in range(count)))
        sizes = {150: Path(small), 2400: Path(large)}
        assert_linear(lambda n: sizes[n], load, 150)


# -- output cleaning ---------------------------------------------------------------------------------------------

CONTROLS = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\t", "\n"}


@given(text=st.text(st.characters(codec=None, categories=None), max_size=80)
       | st.lists(st.sampled_from(["\x1b[", "\x1b]", "\x1b", "31m", "\x07", "\x1b\\", "\r", "\r\n", "a", "\ud800",
                                   "\x9b", "0;", "\x00"]), max_size=20).map("".join))
def test_cleaned_text_carries_no_terminal_control(text: str) -> None:
    cleaned = outputs.clean(text)
    assert not CONTROLS & set(cleaned)
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in cleaned)
    cleaned.encode("utf-8")


@pytest.mark.parametrize("shape", ["\x1b[" + "0" * 50, "\x1b]" + "a" * 50, "\r" * 50, "\x1b[1;" * 20, "\x00\x9b" * 20])
def test_cleaning_is_linear(shape: str) -> None:
    assert_linear(lambda n: shape * n, lambda text: outputs.clean(text), 100)  # type: ignore[arg-type]


@given(ename=st.integers(0, 3000), evalue=st.integers(0, 100_000), lines=st.lists(st.integers(0, 80_000), max_size=30))
def test_a_trimmed_error_fits_its_limit(ename: int, evalue: int, lines: list[int]) -> None:
    limit = 256 * 1024
    name, value, kept = outputs.trim_error("E" * ename, "v" * evalue, ["t" * n for n in lines], limit)
    size = len(name.encode()) + len(value.encode()) + sum(len(line.encode()) + 1 for line in kept)
    assert size <= limit
    assert not lines or kept[0].startswith("t" * min(lines[0], 100))  # the first line is kept (its head at least)
