"""The pure parts of E2B's API through a router: the sandbox ids it hands out (`e2b_ids`) and the caps on what a
node streams back (`e2b_frames`). Hostile input in every shape; the router itself is tested end to end in
tests/security/test_router_e2b.py."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbexec.service import e2b_frames, e2b_ids, identity

KEY = identity.id_key(b"node-token-" + b"n" * 24)
OTHER_KEY = identity.id_key(b"another-cluster-" + b"k" * 24)
RAW, INSTANCE = "0123456789abcdef0123456789abcdef", "abcdef012345"


def _envelope(message: dict[str, object], flag: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flag, len(data)) + data


@pytest.mark.parametrize("node", ["n1", "node-with-dashes", "Node_2.eu"])
def test_an_id_names_its_node_for_its_client_only(node: str) -> None:
    made = e2b_ids.public(KEY, "client-a", node, INSTANCE, RAW)
    assert e2b_ids.parse(KEY, made, "client-a") == e2b_ids.Named(node, INSTANCE, RAW, made.rsplit("-", 2)[1])
    assert e2b_ids.parse(KEY, made, None) is not None  # the data plane: any client's id this key made
    assert e2b_ids.parse(KEY, made, "client-b") is None
    assert e2b_ids.parse(OTHER_KEY, made, "client-a") is None and e2b_ids.parse(OTHER_KEY, made, None) is None


@given(st.text(max_size=300))
def test_no_string_but_a_made_id_parses(text: str) -> None:
    assert e2b_ids.parse(KEY, text, None) is None


@given(st.integers(min_value=0), st.characters(whitelist_categories=("Ll", "Nd"), max_codepoint=127))
def test_a_changed_character_unmakes_an_id(at: int, replacement: str) -> None:
    made = e2b_ids.public(KEY, "client-a", "n1", INSTANCE, RAW)
    at %= len(made)
    changed = made[:at] + replacement + made[at + 1:]
    if changed != made:
        assert e2b_ids.parse(KEY, changed, None) is None


@pytest.mark.parametrize("raw", ["", "UPPER", "has-dash", "a.b", "x" * 65])
def test_a_nodes_odd_id_is_not_passed_on(raw: str) -> None:
    with pytest.raises(ValueError):
        e2b_ids.public(KEY, "client-a", "n1", INSTANCE, raw)


def test_a_page_token_is_its_clients_and_unchanged() -> None:
    token = e2b_ids.page_token(KEY, "client-a", ("2026-01-01T00:00:00.000Z", "n1-x"))
    assert e2b_ids.read_page(KEY, "client-a", token) == ("2026-01-01T00:00:00.000Z", "n1-x")
    for who, shown in (("client-b", token), ("client-a", "W10" + token[3:]), ("client-a", token + "0"),
                       ("client-a", ""), ("client-a", "." * 5000)):
        with pytest.raises(ValueError):
            e2b_ids.read_page(KEY, who, shown)


STREAM = _envelope({"event": {"start": {"pid": 1}}}) + _envelope({"event": {"data": {"stdout": "eA=="}}}) \
    + _envelope({}, 2)


@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20))
def test_a_connect_stream_passes_unchanged_in_any_pieces(cuts: list[int]) -> None:
    framer = e2b_frames.Framer(e2b_frames.CONNECT_STREAM, max_frame=1024, max_total=0)
    out, at = b"", 0
    for size in [*cuts, len(STREAM)]:
        out += b"".join(framer.feed(STREAM[at:at + size] + (b"after the end" if at + size >= len(STREAM) else b"")))
        at += size
    assert out == STREAM and framer.done


@pytest.mark.parametrize(("stream", "frame", "total", "passed"), [
    (struct.pack(">BI", 0, 2**32 - 1), 1024, 0, b""),  # a length far over the cap: nothing of it passed on
    (struct.pack(">BI", 1, 2), 1024, 0, b""),  # compressed: never negotiated
    (_envelope({"a": 1}) * 100, 1024, 200, _envelope({"a": 1}) * (200 // len(_envelope({"a": 1})))),
], ids=["huge-length", "compressed-flag", "total"])
def test_a_connect_stream_is_cut_at_an_envelopes_boundary(stream: bytes, frame: int, total: int,
                                                          passed: bytes) -> None:
    framer = e2b_frames.Framer(e2b_frames.CONNECT_STREAM, max_frame=frame, max_total=total)
    out = b""
    with pytest.raises(e2b_frames.Cut) as cut:
        for byte in range(0, len(stream), 7):
            out += b"".join(framer.feed(stream[byte:byte + 7]))
    assert cut.value.boundary and out == passed


@pytest.mark.parametrize(("pieces", "cut"), [
    ([b'{"a": 1}\n', b"x" * 100, b"\n"], False),
    ([b"x" * 60, b"y" * 60], True),  # one line over 100 bytes, in two pieces
    ([b"x\n" + b"y" * 101 + b"\nz"], True),  # a long line in the middle of a piece
], ids=["short-lines", "long-across-pieces", "long-in-the-middle"])
def test_json_lines_are_cut_past_the_line_cap(pieces: list[bytes], cut: bool) -> None:
    framer = e2b_frames.Framer(e2b_frames.JSON_LINES, max_frame=100, max_total=0)
    if cut:
        with pytest.raises(e2b_frames.Cut):
            for piece in pieces:
                framer.feed(piece)
    else:
        assert b"".join(b"".join(framer.feed(p)) for p in pieces) == b"".join(pieces)
