"""A display's large values are kept with the text they came in, and written back as that text: the notebook,
its size for the session's bound, a durable record and an HTTP answer never encode them again (issue #36 item 4).
Pure: parsed messages and encoders, no sandbox."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from nbformat import NotebookNode

from nbexec import notebook
from nbexec.errors import ProtocolError
from nbexec.notebook import verbatim
from nbexec.sandbox.messages import FREE_OBJECTS, MAX_MEMBERS, Message, flat, objects, parse, parse_header
from nbexec.service.runs import answered

# Spaces and an order no encoder of nbexec writes: seen in the output only when the text was kept. Containers enough
# for the notebook to be written compact (a small one is indented, every value encoded).
AS_SENT = '{ "z" : [1,  2] , "a" : ' + json.dumps([[i] for i in range(20_500)]) + " }"


def _display(value_text: str, metadata_text: str = "{}") -> bytes:
    return f'{{"data": {{"application/json": {value_text}, "text/plain": "shown"}}, "metadata": {metadata_text}, ' \
           f'"transient": {{"display_id": "d"}}}}'.encode()


def _notebook(content: dict[str, object]) -> NotebookNode:
    nb = notebook.build("display(x)")
    nb.cells[0].outputs = [NotebookNode(output_type="display_data", data=NotebookNode(content["data"]),
                                        metadata=NotebookNode(content["metadata"]))]
    return nb


def test_a_large_display_value_is_written_as_it_came() -> None:
    content = parse(_display(AS_SENT), "display_data", bundle=True)
    value = content["data"]["application/json"]
    assert isinstance(value, dict) and value == json.loads(AS_SENT)  # a dict for everyone who reads it
    written = notebook.dumps(_notebook(content)).decode()
    assert AS_SENT in written
    assert json.loads(written)["cells"][0]["outputs"][0]["data"]["application/json"] == json.loads(AS_SENT)


def test_a_large_metadata_value_is_written_as_it_came_and_a_small_one_is_encoded() -> None:
    content = parse(_display("[1]", '{"big": ' + AS_SENT + ', "small" : [ 1 ]}'), "display_data", bundle=True)
    written = notebook.dumps(_notebook(content)).decode()
    assert AS_SENT in written and '"small" : [ 1 ]' not in written and '"small":[1]' in written


def test_a_string_shaped_like_a_placeholder_stays_a_string() -> None:
    """The placeholders carry a random nonce per encode: a sandbox's string cannot name another value's text."""
    fake = "\x00" + "0" * 32 + "0"
    content = parse(_display(AS_SENT).replace(b'"shown"', json.dumps(fake).encode()), "display_data", bundle=True)
    written = json.loads(verbatim.encode(_notebook(content), levels=notebook.LEVELS))
    assert written["cells"][0]["outputs"][0]["data"]["text/plain"] == fake


def test_the_sizes_measured_are_those_of_the_text_written() -> None:
    content = parse(_display(AS_SENT), "display_data", bundle=True)
    outputs = _notebook(content).cells[0].outputs
    assert len(verbatim.encode(outputs, levels=3)) == len(json.dumps(outputs, separators=(",", ":"))) \
        + len(AS_SENT) - len(json.dumps(json.loads(AS_SENT), separators=(",", ":")))


def test_an_http_answer_writes_display_values_as_they_came_and_nan_as_null() -> None:
    content = parse(_display(AS_SENT), "display_data", bundle=True)
    body = {"ok": True, "outputs": [{"output_type": "display_data", **content}]}
    answer = answered(body)
    assert AS_SENT.encode() in answer.body and json.loads(answer.body)["outputs"][0]["data"] == content["data"]
    for odd, read in (("[NaN,", None), ("[1e400,", None), ("[-Infinity,", None)):  # before: HTTP 500, result lost
        with_odd = parse(_display(AS_SENT.replace("[1,", odd)), "display_data", bundle=True)
        answer = answered({"outputs": [with_odd]})
        assert json.loads(answer.body)["outputs"][0]["data"]["application/json"]["z"] == [read, 2]


def test_a_repeated_key_is_refused() -> None:
    """Read member by member, 65 repeats of one key were each parsed, then all parsed again, and kept as one."""
    repeated = b'{"data": {' + b", ".join([b'"application/json": ' + AS_SENT.encode()] * 65) + b'}, "metadata": {}}'
    with pytest.raises(ProtocolError, match="repeats the key"):
        parse(repeated, "display_data", bundle=True)


@pytest.mark.parametrize("frame", [b'{"msg_id": "a", "pad": [[[]]]' + b", []" * 20 + b"}",
                                   b'{"msg_id": "' + b"{" * 17 + b'"}'])
def test_a_header_of_many_brackets_is_refused(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="flat object"):
        parse_header(frame, "header")


def test_a_display_of_too_many_members_is_read_whole_never_member_by_member() -> None:
    """The member-by-member read stops at MAX_MEMBERS; the whole parse that follows gives the same value, and
    the budget refuses it (tests/security/test_message_cost.py)."""
    many = {f"application/x{i}": [1] * 300 for i in range(MAX_MEMBERS + 1)}
    content = parse(json.dumps({"data": many, "metadata": {}}).encode(), "display_data", bundle=True)
    assert content["data"] == many
    assert not any(isinstance(v, verbatim.VerbatimList) for v in content["data"].values())


# -- a kept display is charged what holding it parsed costs ------------------------------------------------------

DENSE = {  # 256 KiB or so of the shapes that parse into the most objects per byte of text
    "lists-nested-60-deep": "[" + ",".join(["[" * 60 + "]" * 60] * 1000) + "]",
    "empty-lists": "[" + ",".join(["[]"] * 60_000) + "]",
    "empty-objects": "[" + ",".join(["{}"] * 60_000) + "]",
    "small-objects": "[" + ",".join(f'{{"k{i % 7}":"v{i}"}}' for i in range(20_000)) + "]",
    "floats": json.dumps([i / 7 for i in range(20_000)]),
    "ints": json.dumps(list(range(1000, 40_000))),
    "short-strings": json.dumps([f"s{i}" for i in range(40_000)]),
    "ascii-and-one-astral": json.dumps(["a" * 200_000 + "\U0001f600"], ensure_ascii=False),
    "ascii-and-one-escaped-astral": json.dumps(["a" * 200_000 + "\U0001f600"]),
    "ascii-and-one-wide": json.dumps(["a" * 200_000 + "\u0100"], ensure_ascii=False),
    "ascii-and-one-escaped-wide": json.dumps(["a" * 200_000 + "\u0100"]),
}


@pytest.mark.parametrize("shape", list(DENSE))
def test_the_objects_charged_are_never_fewer_than_a_parse_makes(shape: str) -> None:
    """Charged by their bytes, lists nested 60 deep held 40 times their text in host memory: 32 MiB of display
    allowance took 1.5 GB; one character past U+FFFF made a string of ASCII take 4 times its text. The estimate is
    made from counts in C, and is at least what the parse allocates."""
    text = DENSE[shape].encode()
    tracemalloc.start()
    try:
        value = parse(text, "display_data")
        made, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    charged = len(text) + objects(text) + 1024  # a parse's constant: within a message's FREE_OBJECTS
    assert value is not None and charged >= made, f"{charged:,} charged, {made:,} made"


def test_an_honest_display_is_charged_its_size() -> None:
    content = json.dumps({"data": {"text/plain": "<Figure>", "image/png": "iVBOR" * 20_000},
                          "metadata": {"image/png": {"width": 640, "height": 480}}}).encode()
    assert objects(content) <= FREE_OBJECTS


def test_a_message_too_costly_to_hold_is_judged_by_a_bounded_count() -> None:
    """Found by the attacker's read: 32 MiB of empty strings within the room by size was counted by splitting it
    whole, a bytes object per string (0.5-0.9 GiB for each message, and dropped messages charge nothing, so a
    kernel could send them again and again). Counted a chunk at a time, and only until past the room."""
    raw = b'{"data": {"application/json": [' + b'"",' * (10 * 2**20) + b'""]}, "metadata": {}}'
    message = Message("iopub", "display_data", "m", "p", len(raw), raw)
    room = 32 * 2**20
    tracemalloc.start()
    try:
        held = message.held(room)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held > room, held
    assert peak < 2 * len(raw) + 16 * 2**20, f"{peak / 2**20:.0f} MiB to count a {len(raw) / 2**20:.0f} MiB message"


def test_a_stream_content_of_many_strings_is_judged_with_bounded_memory() -> None:
    """A stream's content is judged flat before it is parsed, whatever the text allowance: 30 MiB of empty strings
    split whole took a bytes object each. Judged a chunk at a time, it costs about one copy of the message."""
    raw = b'{"name": "stdout", "text": ".", "pad": [' + b'"",' * (10 * 2**20) + b'""]}'
    tracemalloc.start()
    try:
        judged = flat(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not judged and peak < len(raw) + 16 * 2**20, f"{peak / 2**20:.0f} MiB"
