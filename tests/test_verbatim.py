"""A display's large values are kept with the text they came in, and written back as that text: the notebook,
its size for the session's bound, a durable record and an HTTP answer never encode them again (issue #36 item 4).
Pure: parsed messages and encoders, no sandbox."""

from __future__ import annotations

import json

import pytest
from nbformat import NotebookNode

from nbexec import notebook
from nbexec.errors import ProtocolError
from nbexec.notebook import verbatim
from nbexec.sandbox.messages import MAX_MEMBERS, parse, parse_header
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


def test_an_http_answer_writes_display_values_as_they_came_and_leaves_nan_to_fastapi() -> None:
    content = parse(_display(AS_SENT), "display_data", bundle=True)
    body = {"ok": True, "outputs": [{"output_type": "display_data", **content}]}
    answer = answered(body)
    assert AS_SENT.encode() in answer.body and json.loads(answer.body)["outputs"][0]["data"] == content["data"]
    with_nan = parse(_display(AS_SENT.replace("[1,", "[NaN,")), "display_data", bundle=True)
    assert answered({"outputs": [with_nan]}) == {"outputs": [with_nan]}  # FastAPI writes NaN as null


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
