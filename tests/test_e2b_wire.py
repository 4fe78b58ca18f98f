"""The E2B door's pure parts: error shapes, bounded bodies, the list query's metadata filter, page tokens, and the
Connect envelope reader under every shape of a hostile body (no Docker)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator
from urllib.parse import quote, urlencode

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbexec.sandbox.docker.supervisor.events import End, Output
from nbexec.service.e2b import connect, wire
from nbexec.service.e2b.envd import _event


def test_errors_are_in_e2b_shape_with_retry_advice() -> None:
    capped = wire.E2bError(429, "full", retry=False)
    assert json.loads(capped.body()) == {"code": 429, "message": "full"}
    assert capped.headers() == {"Should-Retry": "false"}
    assert wire.E2bError(503, "busy", after=5).headers() == {"Retry-After": "5"}


@pytest.mark.parametrize("raw,status", [(b"x" * (wire.MAX_JSON + 1), 413), (b"{", 400), (b"[1]", 400),
                                        (b"[" * 50_000, 400), (b'"s"', 400)])
def test_bodies_are_sized_then_parsed(raw: bytes, status: int) -> None:
    with pytest.raises(wire.E2bError) as caught:
        wire.parse_json(raw)
    assert caught.value.status == status


def test_empty_body_is_an_empty_object() -> None:
    assert wire.parse_json(b"  ") == {}


def test_metadata_filter_reads_what_the_sdk_sends() -> None:
    wanted = {"a b": "c&d", "é=": "x y"}
    # The SDK quotes each key and value, joins them as a query string, and sends that as one parameter.
    sent = urlencode({quote(k): quote(v) for k, v in wanted.items()})
    assert wire.metadata_filter(sent) == wanted


@given(st.text(max_size=300))
def test_metadata_filter_never_raises_an_undocumented_error(raw: str) -> None:
    try:
        found = wire.metadata_filter(raw)
    except wire.E2bError:
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in found.items())


def test_maps_of_strings_are_bounded() -> None:
    with pytest.raises(wire.E2bError):
        wire.strings({str(i): "" for i in range(65)}, "metadata", count=64, size=10**6)
    with pytest.raises(wire.E2bError):
        wire.strings({"a": "x" * 100}, "metadata", count=64, size=50)
    with pytest.raises(wire.E2bError):
        wire.strings({"A-B": "x"}, "envVars", count=8, size=100, names=wire.ENV_NAME)
    with pytest.raises(wire.E2bError):
        wire.strings({"A": "x\x00y"}, "envVars", count=8, size=100, names=wire.ENV_NAME)
    assert wire.strings({"A_1": "v"}, "envVars", count=8, size=100, names=wire.ENV_NAME) == {"A_1": "v"}


def test_page_tokens_belong_to_their_owner() -> None:
    pages = wire.Pages()
    token = pages.make("alice", "sandbox-9")
    assert pages.read("alice", token) == "sandbox-9"
    for owner, given_token in (("bob", token), ("alice", token[:-1] + ("1" if token[-1] == "0" else "0")),
                               ("alice", "sandbox-9"), ("alice", "." * 300)):
        with pytest.raises(wire.E2bError):
            pages.read(owner, given_token)
    assert pages.read("alice", None) is None and wire.Pages().make("a", "p") != token


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _read_one(parts: list[bytes], limit: int = connect.MAX_MESSAGE) -> dict[str, object]:
    async def go() -> dict[str, object]:
        return await connect.Envelopes(_chunks(parts), limit=limit).only(time.monotonic() + 5)
    return asyncio.run(go())


def test_one_envelope_is_read_whole_across_chunks() -> None:
    data = connect.envelope({"process": {"cmd": "/bin/bash"}})
    assert _read_one([data[:2], data[2:7], data[7:]]) == {"process": {"cmd": "/bin/bash"}}


@pytest.mark.parametrize("parts,code", [
    ([struct.pack(">BI", 0, 2**32 - 1)], "resource_exhausted"),  # refused by its length, nothing allocated
    ([struct.pack(">BI", 0, 100) + b"{}"], "invalid_argument"),  # shorter than it says
    ([struct.pack(">BI", 1, 2) + b"{}"], "invalid_argument"),  # compressed
    ([b"\x00\x00"], "invalid_argument"),  # stops inside the header
    ([], "invalid_argument"),  # no message
    ([connect.envelope({}) + connect.envelope({})], "invalid_argument"),  # two on a server-streaming call
    ([struct.pack(">BI", 0, 3) + b"[1]"], "invalid_argument"),  # not an object
    ([struct.pack(">BI", 0, 1) + b"{"], "invalid_argument"),  # not JSON
])
def test_hostile_envelopes_get_connect_codes(parts: list[bytes], code: str) -> None:
    with pytest.raises(connect.ConnectError) as caught:
        _read_one(parts)
    assert caught.value.code == code


def test_a_body_that_stops_coming_ends_at_the_deadline() -> None:
    async def stalled() -> AsyncIterator[bytes]:
        yield b"\x00\x00\x00"
        await asyncio.sleep(3600)

    async def go() -> None:
        reader = connect.Envelopes(stalled())
        await reader.next(time.monotonic() + 0.2)
    with pytest.raises(connect.ConnectError) as caught:
        asyncio.run(asyncio.wait_for(go(), 10))
    assert caught.value.code == "deadline_exceeded"


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_the_envelope_reader_never_raises_an_undocumented_error(parts: list[bytes]) -> None:
    with contextlib.suppress(connect.ConnectError):
        _read_one(parts, limit=64)


def test_timeouts_are_capped_and_checked() -> None:
    assert connect.timeout_ms("2500", 60) == 2.5 and connect.timeout_ms("0", 60) is None
    assert connect.timeout_ms(None, 60) is None and connect.timeout_ms("9" * 10, 60) == 60
    for raw in ("-1", "1e3", "9" * 11, ""):
        with pytest.raises(connect.ConnectError):
            connect.timeout_ms(raw, 60)


def test_a_gzip_body_is_inflated_only_up_to_the_cap() -> None:
    """100 MiB of zeros in about 100 KiB: at most the cap comes out before 507 (the sandbox's writer caps again)."""
    import gzip

    from nbexec.service.e2b import envfiles

    bomb = gzip.compress(b"\0" * (100 * 1024**2), compresslevel=9)

    async def go() -> int:
        out = 0
        async for chunk in envfiles._inflated(_chunks([bomb[i:i + 65536] for i in range(0, len(bomb), 65536)]),
                                               8 * 1024**2):
            out += len(chunk)
        return out
    with pytest.raises(wire.E2bError) as caught:
        asyncio.run(go())
    assert caught.value.status == 507


def test_output_is_kept_to_the_byte_of_the_allowance_and_the_rest_is_said() -> None:
    """A chunk that crosses the allowance keeps its head: what is kept depends on the allowance, not on how the
    sandbox's output happened to be cut into chunks (a loaded host reads bigger ones)."""
    kept = [0, 0]
    shapes = [_event(Output("stdout", b"x" * 6), kept, 10), _event(Output("stdout", b"y" * 6), kept, 10),
              _event(Output("stderr", b"z" * 3), kept, 10)]
    sent = [base64.b64decode(m["event"]["data"]["stdout"]) for m in shapes if m is not None]
    assert sent == [b"x" * 6, b"y" * 4] and shapes[2] is None and kept == [10, 5]
    end = _event(End(0, True, "exit status 0", None), kept, 10)
    assert end is not None and end["event"]["end"]["exitCode"] == 0
    assert "5 bytes of output were dropped" in end["event"]["end"]["error"]
