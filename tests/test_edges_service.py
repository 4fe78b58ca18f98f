"""Exact edges of the service's doors that the property tests (tests/test_fuzz_service.py) leave loose. Each case
pins a boundary, a message or a rule that a one-character change would move (the mutants of scripts/mutants.py
found them). Covered: the router's file paths and signed header, the SSE re-framer, the proxy's request framing
and budgets, the widget state and report copy, wheel METADATA, the kernel's last-error report, a cell's output
budget and how stores serve what they store."""

from __future__ import annotations

import base64
import grp
import json
import logging
import os
import pwd
import resource
from pathlib import Path

import nbformat
import pytest

from nbexec.cli import envfile
from nbexec.egress import budget, request
from nbexec.errors import ConfigError, FileTransferError, ShuttingDownError
from nbexec.notebook import viewer
from nbexec.sandbox import lasterror
from nbexec.sandbox.remote import paths
from nbexec.service import held, identity, runs, sse
from nbexec.stores import serving


def _relayed(chunks: list[bytes], max_event: int = 1000) -> bytes:
    framer = sse.Framer(max_event)
    return b"".join(sse.encode(piece) for chunk in chunks for piece in framer.feed(chunk))


def test_an_empty_read_inside_a_crlf_ends_one_line_only() -> None:
    assert _relayed([b"data: x\r", b"", b"\ndata: y\n\n"]) == b"data: x\ndata: y\n\n"


def test_a_line_after_an_overlong_field_name_is_read_on_its_own() -> None:
    assert _relayed([b"x" * 33 + b"\ndata: a\n\n"]) == b"data: a\n\n"
    assert _relayed([b"x" * 20, b"x" * 20 + b"\rdata: b\r\r"]) == b"data: b\n\n"


DATA_X = [("data-start", b""), ("data", b"x"), ("data-end", b"")]


@pytest.mark.parametrize(("chunks", "pieces"), [
    ([b"data: x\n\n"], [*DATA_X, ("dispatch", b"message")]),  # no event name: "message"
    ([b"event: a\n\n"], [("event", b"a"), ("dispatch", b"")]),  # an event without data: no name to dispatch
    ([b": keep\n\n"], [("comment", b""), ("dispatch", b"")]),
    ([b"data\n\n"], [("data-start", b""), ("data-end", b""), ("dispatch", b"message")]),  # a field name alone
    ([b"data: x", b"\n\n"], [*DATA_X, ("dispatch", b"message")]),  # a chunk may start with the line's end
    ([b"data: x\r", b"\n", b"\n"], [*DATA_X, ("dispatch", b"message")]),  # a CRLF split, then a blank line
    ([b"data:", b" x\n\n"], [*DATA_X, ("dispatch", b"message")]),  # the value's first space, in the next chunk
    ([b"data: x", b" y\n\n"], [("data-start", b""), ("data", b"x"), ("data", b" y"), ("data-end", b""),
                                ("dispatch", b"message")]),  # only the value's first space is cut
    ([b"event: a\ndata: x\n\ndata: x\n\n"],
     [("event", b"a"), *DATA_X, ("dispatch", b"a"), *DATA_X, ("dispatch", b"message")]),  # a name is one event's
    ([b"event: " + b"n" * 32 + b"\n\n"], [("event", b"n" * 32), ("dispatch", b"")]),  # the longest name
    ([b"data: x\n\n: c\n\n"], [*DATA_X, ("dispatch", b"message"), ("comment", b""), ("dispatch", b"")]),
], ids=["message", "no-data", "comment", "name-alone", "lf-first", "crlf-split", "space-next", "space-once",
        "name-resets", "name-32", "data-resets"])
def test_the_framer_gives_each_piece_as_it_is(chunks: list[bytes], pieces: list[sse.Piece]) -> None:
    framer = sse.Framer(1000)
    assert [piece for chunk in chunks for piece in framer.feed(chunk)] == pieces


def test_an_event_of_exactly_the_cap_passes_and_the_count_starts_again_at_each_event() -> None:
    framer = sse.Framer(len(b"data: x"))
    assert framer.feed(b"data: x\n\ndata: x\n\n") == [*DATA_X, ("dispatch", b"message")] * 2
    with pytest.raises(sse.EventError, match=r"^a node sent an event over 7 bytes$"):
        framer.feed(b"data: xy\n")


def test_a_line_read_is_pending_until_its_event_is_dispatched() -> None:
    framer = sse.Framer(1000)
    assert not framer.pending
    framer.feed(b"data: x\n")
    assert framer.pending
    framer.feed(b"\n")
    assert not framer.pending


@pytest.mark.parametrize("chunks", [[b"event: " + b"n" * 33 + b"\n"], [b"event: a b\n"], [b"event: " + b"n" * 40],
                                    [b"event:\n"]], ids=["33", "space", "long-in-one-part", "empty"])
def test_a_malformed_event_name_is_refused_in_those_words(chunks: list[bytes]) -> None:
    framer = sse.Framer(1000)
    with pytest.raises(sse.EventError, match=r"^a node sent a malformed event name$"):
        for chunk in chunks:
            framer.feed(chunk)


# -- how stores serve what they store ------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "mime", "expected"), [
    ("run/a.csv", "text/csv", ("text/csv", None)),
    ("run/a.csv", "text/csv; charset=utf-8", ("text/csv; charset=utf-8", None)),
    ("run/a.csv", "text/csv;charset=utf-8", ("text/csv;charset=utf-8", None)),
    ("run/chart.png", "image/png", ("image/png", None)),
    ("run/a.json", "application/json", ("application/json", None)),
    ("run/page.html", "text/html", ("application/octet-stream", "attachment")),
    ("run/notes.txt", "text/html; charset=utf-8", ("application/octet-stream", "attachment")),
    ("run/looks-plain.html", "text/plain", ("application/octet-stream", "attachment")),
    ("run/feed.xml", "text/plain", ("application/octet-stream", "attachment")),
    ("run/noext", "image/SVG+XML", ("application/octet-stream", "attachment")),
    ("run/a.html/b.csv", "text/csv", ("text/csv", None)),  # the name's last part is what a browser saves
    ("run/t.parquet", "application/vnd.apache.parquet", ("application/vnd.apache.parquet", "attachment")),
    ("run/x.bin", "text/plain\r\nX-Injected: 1", ("application/octet-stream", "attachment")),
    ("run/x.txt", "text/plain;  charset=utf-8", ("application/octet-stream", "attachment")),
    ("run/x.txt", "", ("application/octet-stream", "attachment")),
    ("run/x.txt", "text/", ("application/octet-stream", "attachment")),
    ("run/x.txt", "/plain", ("application/octet-stream", "attachment")),
    ("run/x.txt", "text/plain; a=b; c=d", ("text/plain; a=b; c=d", None)),
    ("run/x.txt", "text/plain; a=", ("application/octet-stream", "attachment")),
    ("run/song.midi", "text/plain", ("text/plain", "attachment")),  # a type only the non-strict table knows
    ("a.csv", "text/csv", ("text/csv", None)),  # a name of one part
    # A name is judged by its last part, never read as a URL: the whole name, or all after its first slash, would
    # be a data: URL of type text/html here (the last part has no type: text/plain alone decides).
    ("data:text/html,a", "text/plain", ("text/plain", None)),
    ("run/data:text/html,a", "text/plain", ("text/plain", None)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_file_is_served_as_its_type_says(name: str, mime: str, expected: tuple[str, str | None]) -> None:
    assert serving.served(name, mime) == serving.Served(*expected)


@pytest.mark.parametrize(("seconds", "maximum", "problem"), [
    (1.0, None, None), (0.001, None, None), (604800.0, serving.MAX_SIGNED_LINK_S, None),
    (0.0, None, "NBEXEC_LINK_EXPIRY must be above 0 seconds"), (-1.0, None, "must be above 0"),
    (float("nan"), None, "must be above 0"),
    (604801.0, serving.MAX_SIGNED_LINK_S,
     "NBEXEC_LINK_EXPIRY is 604801 s; signed links live at most 604800 s (7 days)"),
])
def test_a_link_lifetime_is_above_0_and_within_its_maximum(seconds: float, maximum: float | None,
                                                         problem: str | None) -> None:
    if problem is None:
        assert serving.link_expiry(seconds, maximum=maximum) == seconds
    else:
        with pytest.raises(ConfigError) as refused:
            serving.link_expiry(seconds, maximum=maximum)
        assert problem in str(refused.value)
    with pytest.raises(ConfigError, match=r"^AZURE_X must be above 0 seconds$"):
        serving.link_expiry(0.0, variable="AZURE_X")


@pytest.mark.parametrize(("text", "shown"), [
    ("AccountName=a;AccountKey=c2VjcmV0;EndpointSuffix=x", "AccountName=a;AccountKey=<redacted>;EndpointSuffix=x"),
    ("https://a/b?sv=1&sig=abc%2F&se=2", "https://a/b?sv=1&sig=<redacted>&se=2"),
    ("X-Amz-Signature=abc X-Amz-Credential=AKIA/x", "X-Amz-Signature=<redacted> X-Amz-Credential=<redacted>"),
    ("x-amz-security-token: tok,next", "x-amz-security-token: <redacted>,next"),
    ("x-amz-security-token=tok'", "x-amz-security-token=<redacted>'"),
    ('Authorization: Bearer abc"', 'Authorization: Bearer <redacted>"'),
    ("accountkey=abc", "accountkey=<redacted>"),
    ("X-Goog-Signature=ab&X-Goog-Credential=c", "X-Goog-Signature=<redacted>&X-Goog-Credential=<redacted>"),
    ("Signature=s AWSAccessKeyId=k upload_id=u SharedAccessSignature=q",
     "Signature=<redacted> AWSAccessKeyId=<redacted> upload_id=<redacted> SharedAccessSignature=<redacted>"),
    ("nothing secret here", "nothing secret here"),
])
def test_keys_and_signatures_are_cut_from_messages(text: str, shown: str) -> None:
    assert serving.redact(text) == shown


def test_the_log_filter_cuts_known_secrets_and_marked_values() -> None:
    name = "nbexec.tests.serving-filter"
    logger = logging.getLogger(name)
    try:
        serving.guard_logs([name, name], "topsecret", None, "")
        serving.guard_logs([name])
        assert logger.filters.count(serving._FILTER) == 1 and "" not in serving._FILTER.secrets
        assert serving.SecretFilter().secrets == set()  # a new filter knows no secret yet
        record = logger.makeRecord(name, logging.DEBUG, "f", 1, "key %s sig=%s", ("topsecret", "abc"), None)
        assert serving._FILTER.filter(record) is True
        assert (record.msg, record.args) == ("key <redacted> sig=<redacted>", None)
        plain = logger.makeRecord(name, logging.DEBUG, "f", 1, "count %d", (3,), None)
        assert serving._FILTER.filter(plain) is True and (plain.msg, plain.args) == ("count %d", (3,))
    finally:
        logger.removeFilter(serving._FILTER)
        serving._FILTER.secrets.discard("topsecret")


@pytest.mark.parametrize(("error", "line"), [
    (ValueError("first\nsecond"), "first"), (ValueError(""), "ValueError"), (KeyError(), "KeyError"),
    (RuntimeError("  \n"), "RuntimeError"), (OSError("sig=abc failed\nmore"), "sig=<redacted> failed"),
])
def test_an_error_is_shown_by_its_first_line_redacted(error: BaseException, line: str) -> None:
    assert serving.first_line(error) == line


@pytest.mark.parametrize(("environ", "older", "expected"), [
    ({}, None, 3600.0), ({"NBEXEC_LINK_EXPIRY": "120"}, None, 120.0), ({"NBEXEC_LINK_EXPIRY": ""}, None, 3600.0),
    ({}, ("AZURE_SAS_EXPIRY", "60"), 60.0), ({"NBEXEC_LINK_EXPIRY": "5"}, ("AZURE_SAS_EXPIRY", "60"), 5.0),
    ({}, ("AZURE_SAS_EXPIRY", None), 3600.0), ({}, ("AZURE_SAS_EXPIRY", ""), 3600.0),
    ({"NBEXEC_LINK_EXPIRY": "soon"}, None, "NBEXEC_LINK_EXPIRY must be a number of seconds, not 'soon'"),
    ({}, ("AZURE_SAS_EXPIRY", "later"), "AZURE_SAS_EXPIRY must be a number of seconds, not 'later'"),
])
def test_the_link_lifetime_is_read_from_the_environment(environ: dict[str, str], older: tuple[str, str | None] | None,
                                                        expected: float | str) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as refused:
            serving.expiry_from(environ, older=older)
        assert str(refused.value) == expected
    else:
        assert serving.expiry_from(environ, older=older) == expected
    assert serving.prefix_from({}) == serving.prefix_from({"NBEXEC_BLOB_PREFIX": ""}) == "nbexec"
    assert serving.prefix_from({"NBEXEC_BLOB_PREFIX": "runs"}) == "runs"


# -- the report copy and the outputs a viewer is handed -----------------------------------------------------------

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def test_a_report_copy_keeps_sources_and_plain_outputs_and_no_metadata() -> None:
    markdown = nbformat.v4.new_markdown_cell(["# a ", "title"], metadata={"tags": ["x"]})
    markdown.attachments = {"a.png": {"image/png": PNG, "image/svg+xml": "<svg/>"}, "b.svg": {"image/svg+xml": "<s/>"},
                            "c.png": {"image/png": "not base64!"}, "d": "not a mapping", "e.gif": {"image/gif": 5}}
    bare = nbformat.v4.new_markdown_cell("no attachments")
    bare.attachments = {"b.svg": {"image/svg+xml": "<s/>"}}
    code = nbformat.v4.new_code_cell("print(1)", execution_count=3, metadata={"jupyter": {"source_hidden": True}})
    code.outputs = [
        {"output_type": "stream", "name": "stderr", "text": ["a", "b"]},
        {"output_type": "stream", "name": "other", "text": 5},
        {"output_type": "error", "ename": "E", "evalue": ["v", "w"], "traceback": ["t1", 2]},
        {"output_type": "error", "ename": 1, "evalue": "v", "traceback": "not a list"},
        {"output_type": "execute_result", "execution_count": "7", "metadata": {"a": 1},
         "data": {"text/plain": "r", "application/javascript": "x()", "image/png": PNG + "!"}},
        {"output_type": "execute_result", "execution_count": 7, "data": {"text/latex": "$x$"}},
        {"output_type": "display_data", "data": {"image/svg+xml": "<svg/>"}},
        {"output_type": "display_data", "data": "not a mapping"},
        {"output_type": "display_data", "data": {"image/jpeg": ["/9j", "/4A"], "text/markdown": ["*a*", 1]}},
        {"output_type": "update_display_data", "data": {"text/plain": "u"}},
        "not an output",
    ]
    uncounted = nbformat.v4.new_code_cell("x", execution_count=None)
    uncounted.execution_count = "3"
    raw_html = nbformat.v4.new_raw_cell("<b>x</b>", metadata={"raw_mimetype": "text/html", "other": 1})
    raw_tex = nbformat.v4.new_raw_cell("\\x", metadata={"raw_mimetype": "text/latex"})
    raw_bare = nbformat.v4.new_raw_cell("y")
    nb = nbformat.from_dict({"nbformat": 4, "nbformat_minor": 5, "metadata": {"title": "t", "widgets": {"x": 1}},
                             "cells": [markdown, bare, code, uncounted, raw_html, raw_tex, raw_bare,
                                       {"cell_type": "unknown", "id": "u", "source": "z"}]})  # as a client may send
    copy = viewer.report_copy(nb)
    assert copy.metadata == {"language_info": {"name": "python"}}
    assert [c.cell_type for c in copy.cells] == ["markdown", "markdown", "code", "code", "raw"]
    first, second, ran, other, raw = copy.cells
    assert first.source == "# a title" and first.metadata == {} and first.attachments == {"a.png": {"image/png": PNG}}
    assert "attachments" not in second
    assert (ran.source, ran.execution_count, ran.metadata) == ("print(1)", 3, {})
    assert other.execution_count is None
    assert ran.outputs == [
        {"output_type": "stream", "name": "stderr", "text": "ab"},
        {"output_type": "stream", "name": "stdout", "text": ""},
        {"output_type": "error", "ename": "E", "evalue": "vw", "traceback": ["t1", ""]},
        {"output_type": "error", "ename": "", "evalue": "v", "traceback": []},
        {"output_type": "execute_result", "execution_count": None, "metadata": {}, "data": {"text/plain": "r"}},
        {"output_type": "execute_result", "execution_count": 7, "metadata": {}, "data": {"text/latex": "$x$"}},
        {"output_type": "display_data", "metadata": {}, "data": {"image/jpeg": "/9j/4A"}},
    ]
    assert (raw.source, raw.metadata) == ("<b>x</b>", {"raw_mimetype": "text/html"})


def test_an_output_widget_keeps_its_view_references_and_plain_data_only() -> None:
    view = "application/vnd.jupyter.widget-view+json"
    outputs = viewer._plain_outputs([
        {"output_type": "display_data", "data": {view: {"model_id": "m1", "version_major": 9, "x": 1}}},
        {"output_type": "display_data", "data": {view: {"model_id": 5}, "text/plain": "t"}},
        {"output_type": "display_data", "data": {view: "m1"}},
        {"output_type": "display_data", "data": {"text/html": "<b>"}},
    ], viewer._OUTPUT_WIDGET_MIMES)
    assert outputs == [
        {"output_type": "display_data", "metadata": {}, "data": {view: {"version_major": 2, "version_minor": 0,
                                                                        "model_id": "m1"}}},
        {"output_type": "display_data", "metadata": {}, "data": {"text/plain": "t"}},
    ]
    assert viewer._plain_outputs("not a list", viewer.REPORT_MIMES) == []


# -- the kernel's last-error report ------------------------------------------------------------------------------

def _asked(text: object, status: object = "ok") -> dict[str, object]:
    return {"user_expressions": {lasterror.KEY: {"status": status, "data": {"text/plain": text}}}}


def _quoted(report: object) -> str:
    return "'" + base64.b64encode(json.dumps(report).encode()).decode() + "'"


def test_a_report_keeps_its_lines_without_their_line_ends_only() -> None:
    report = {"raised": True, "ename": "KeyError", "evalue": "'k'", "traceback": ["a\n", "bX\n\n", "c"]}
    assert lasterror.read(_asked(_quoted(report))) == lasterror.LastError(True, "KeyError", "'k'", ("a", "bX", "c"))
    assert lasterror.from_reply({"status": "error", **report}) == lasterror.LastError(True, "KeyError", "'k'",
                                                                                     ("a", "bX", "c"))


@pytest.mark.parametrize("reply", [
    {}, {"user_expressions": []}, {"user_expressions": {lasterror.KEY: "x"}}, _asked(_quoted({"raised": True}), "x"),
    {"user_expressions": {lasterror.KEY: {"status": "ok", "data": []}}}, _asked(5), _asked("abc"), _asked("''"),
    _asked("'" + base64.b64encode(b"not json").decode() + "'"), _asked("'YWJj'"), _asked("'ab=c'"),
    _asked("'=" + _quoted({"raised": False})[1:]),  # a report behind padding: base64 read strictly, refused
    _asked(_quoted([1])), _asked(_quoted({"raised": "yes"})), _asked(_quoted({"raised": True, "ename": "E"})),
    _asked(_quoted({"raised": True, "ename": "E", "evalue": 1, "traceback": []})),
    _asked(_quoted({"raised": True, "ename": "E", "evalue": "v", "traceback": "t"})),
], ids=["empty", "not-a-mapping", "not-an-answer", "not-ok", "data-not-a-mapping", "not-text", "not-quoted",
        "empty-quoted", "not-json", "not-an-object-json", "bad-padding", "leading-padding", "a-list",
        "raised-not-a-bool", "no-value", "value-not-text", "traceback-not-a-list"])
def test_a_malformed_answer_tells_nothing(reply: dict[str, object]) -> None:
    assert lasterror.read(reply) is None


def test_a_reply_with_another_status_says_which_cut_at_100_characters() -> None:
    assert lasterror.from_reply({"status": "s" * 150}) == lasterror.LastError(
        True, "KernelError", f"The kernel answered the cell with status {'s' * 100!r}.")
    assert lasterror.from_reply({}).evalue == "The kernel answered the cell with status 'None'."  # type: ignore[union-attr]
    assert lasterror.from_reply({"status": "error"}) is None  # it did not say what: the kernel is asked
    assert lasterror.read(_asked(_quoted({"raised": False, "ename": 5}))) == lasterror.LastError(False)


# -- the egress proxy's budgets and pace -------------------------------------------------------------------------

def test_a_budget_charges_up_to_its_capacity_read_at_each_charge() -> None:
    capacity = [4]
    shared = budget.Budget(lambda: capacity[0])
    assert shared.take(4) and not shared.take(1) and shared.used == 4
    capacity[0] = 6  # a raised limit (ulimit -n) counts from the next charge
    assert shared.capacity == 6 and shared.take(2) and not shared.take(1) and shared.used == 6
    shared.give(6)
    assert shared.used == 0 and not budget.Budget(1).take(2)


@pytest.mark.parametrize(("soft", "capacity"), [(100, 50), (101, 50), (16384, 8192), (20000, budget.HOST_MOST)])
def test_the_proxies_share_half_the_descriptor_limit_and_at_most_host_most(soft: int, capacity: int) -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft > before[1]:
        pytest.fail(f"this test needs a hard descriptor limit of {soft} (it is {before[1]})", pytrace=False)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        assert budget.host_capacity() == capacity
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_pace_judges_each_window_at_its_exact_end() -> None:
    pace = budget.Pace(window=2.0, least=10, now=100.0)
    assert pace.wait(100.5) == 1.5 and pace.check(101.999) is None
    pace.moved(10, 101.0)  # exactly the least: enough
    assert pace.wait(101.5) == 0.5  # the window's end comes before the idle deadline
    assert pace.check(102.0) is None and pace.ends == 104.0 and pace.count == 0
    assert pace.wait(104.5) == 0.0  # a deadline in the past: no wait
    pace.moved(9, 102.5)
    assert pace.check(104.0) == ("closed: 9 bytes moved in 2 s, fewer than the 10 the minimum rate asks "
                                 "(egress_min_rate)")
    pace.moved(1000, 104.5)
    assert pace.check(200.0).startswith("closed: 9 bytes")  # type: ignore[union-attr]  # once found, it stays


def test_an_idle_tunnel_is_closed_exactly_after_the_window() -> None:
    pace = budget.Pace(window=2.0, least=0, now=0.0)
    pace.moved(5, 1.0)
    assert pace.check(2.999) is None and pace.check(3.0) == "closed after 2 s without traffic"


def test_windows_that_passed_unchecked_start_a_fresh_one() -> None:
    pace = budget.Pace(window=1.0, least=1, now=0.0)
    pace.moved(5, 0.5)
    pace.moved(5, 1.4)  # judged the first window (5 bytes) on the way; the second starts at 1.0
    assert pace.ends == 2.0 and pace.count == 5
    pace.moved(5, 2.3)
    pace.moved(5, 3.2)  # the window ending at 3.0 had 5; the next ends at 4.0
    assert pace.ends == 4.0 and pace.reason is None
    quiet = budget.Pace(window=1.0, least=0, now=0.0)
    quiet.last = 9.5  # traffic was seen (not counted) while nothing judged the windows
    assert quiet.check(10.0) is None and quiet.ends == 11.0  # not 2.0: the windows that passed are skipped
    edge = budget.Pace(window=1.0, least=0, now=0.0)
    edge.last = 1.5
    assert edge.check(2.0) is None and edge.ends == 3.0  # a window ending exactly now has passed too


def test_the_first_window_counts_from_nothing() -> None:
    pace = budget.Pace(window=1.0, least=5, now=0.0)
    pace.moved(4, 0.5)
    assert pace.check(1.0) == "closed: 4 bytes moved in 1 s, fewer than the 5 the minimum rate asks (egress_min_rate)"


def test_no_descriptor_limit_still_caps_the_proxies_at_host_most(monkeypatch: pytest.MonkeyPatch) -> None:
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(budget.resource, "getrlimit", lambda kind: unlimited)
    assert budget.host_capacity() == budget.HOST_MOST


# -- the router's own events and .env folders ---------------------------------------------------------------------

def test_an_event_the_router_writes_itself_is_one_whole_event() -> None:
    written = sse.frame("result", b'{"ok": true}')
    assert written == b'event: result\ndata: {"ok": true}\n\n'
    framer = sse.Framer(1000)
    assert framer.feed(written) == [("event", b"result"), ("data-start", b""), ("data", b'{"ok": true}'),
                                    ("data-end", b""), ("dispatch", b"result")]


def test_a_env_folder_writable_by_your_own_private_group_still_loads(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A umask of 002 with user private groups (Debian's default for users) is no reason to refuse a .env."""
    user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid())
    if group.gr_name != user or set(group.gr_mem) - {user}:
        pytest.fail(f"this test needs a private group named {user} (run it as root, as CI does)", pytrace=False)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / ".env").write_text("NBEXEC_EDGE_PRIVATE=1\n")
    os.chmod(folder, 0o775)
    os.chmod(folder / ".env", 0o664)
    monkeypatch.delenv("NBEXEC_EDGE_PRIVATE", raising=False)
    assert envfile.load(folder) == ["NBEXEC_EDGE_PRIVATE"]
    assert not envfile._private_group(os.getgid() + 1) and not envfile._private_group(2**31 - 2)


# -- the signed client header and router ids ---------------------------------------------------------------------

NODE_TOKEN = b"node-token-" + b"n" * 24


def _signed_at(stamp: str, *, client: str = "alice", node: str = "n1", nonce: str = "0" * 32,
               method: str = "GET", target: str = "/v1/sessions/a") -> bytes:
    mac = identity._mac(identity._request_key(NODE_TOKEN), method, target, client, node, stamp, nonce)
    return ";".join((client, node, stamp, nonce, mac)).encode()


@pytest.mark.parametrize(("fields", "problem"), [
    ({"client": "c" * 64}, None), ({"client": "c" * 65}, "the client is malformed"),
    ({"client": ""}, "the client is malformed"), ({"node": "n" * 63}, None),
    ({"node": "n" * 64}, "the node name is malformed"), ({"node": ".n"}, "the node name is malformed"),
    ({"nonce": "f" * 32}, None), ({"nonce": "f" * 31}, "the nonce is malformed"),
    ({"nonce": "F" * 32}, "the nonce is malformed"),
])
def test_each_field_of_the_header_is_held_to_its_form(fields: dict[str, str], problem: str | None) -> None:
    stamp = "1000000"
    header = _signed_at(stamp, **fields)
    if problem is None:
        assert identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", header, now=1000000.0).client
    else:
        with pytest.raises(identity.SignatureError, match=rf"^{problem}$"):
            identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", header, now=1000000.0)


def test_the_header_is_sized_before_it_is_read() -> None:
    header = _signed_at("1000000", client="c" * 64, node="n" * 63)
    header = header + b" " * (identity.MAX_HEADER - len(header))  # exactly the limit: read (and refused as malformed)
    with pytest.raises(identity.SignatureError, match=r"^the signature is malformed$"):
        identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", header, now=1000000.0)
    with pytest.raises(identity.SignatureError, match=r"^the header is over 512 bytes$"):
        identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", header + b" ", now=1000000.0)
    with pytest.raises(identity.SignatureError, match=r"^the header needs five fields: client;node;time;nonce;"):
        identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", b"a;b;c;d", now=1000000.0)
    with pytest.raises(identity.SignatureError, match=r"^the time is malformed$"):
        identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/a", _signed_at("1" * 13), now=1000000.0)


def test_nonces_are_remembered_for_twice_the_window_and_up_to_the_capacity() -> None:
    verifier = identity.Verifier(window=60, capacity=2)
    verifier._remember("a" * 32, 0.0)
    verifier._remember("b" * 32, 10.0)
    with pytest.raises(identity.SignatureError, match=r"^too many signed calls at once; try again shortly$"):
        verifier._remember("c" * 32, 120.0)  # "a" is exactly twice the window old: still kept
    verifier._remember("c" * 32, 120.5)  # now it is forgotten, "b" is not
    with pytest.raises(identity.SignatureError, match=r"^the call was replayed$"):
        verifier._remember("b" * 32, 121.0)
    assert list(verifier._seen) == ["b" * 32, "c" * 32]


@pytest.mark.parametrize(("now", "fresh"), [(1000060.0, True), (999940.0, True), (1000061.0, False),
                                           (999939.0, False)])
def test_a_call_is_fresh_to_the_second_of_its_window_and_stale_past_it(now: float, fresh: bool) -> None:
    verifier = identity.Verifier(window=60)
    if fresh:
        assert verifier.verify(NODE_TOKEN, "GET", "/v1/sessions/a", _signed_at("1000000"), now=now).client == "alice"
        return
    with pytest.raises(identity.SignatureError, match=r"^the call is stale or from the future \(are the clocks of "
                                                      r"router and node set\?\)$"):
        verifier.verify(NODE_TOKEN, "GET", "/v1/sessions/a", _signed_at("1000000"), now=now)


def test_a_signature_for_another_call_is_refused_in_so_many_words() -> None:
    with pytest.raises(identity.SignatureError, match=r"^the signature does not match the call$"):
        identity.Verifier().verify(NODE_TOKEN, "GET", "/v1/sessions/b", _signed_at("1000000"), now=1000000.0)


def test_the_signatures_are_the_wire_format_every_release_agrees_on() -> None:
    """Known answers: a router and a node of different releases must derive the same keys and sign the same
    message (X-Nbexec-For, version nbexec-for/1), and a client's ids must outlive an upgrade. A change here is a
    change of the protocol."""
    token = b"node-token"
    assert identity._request_key(token).hex() == "c72933cc4e369cf4899bdc43960923677f7e31b16c032ea29dabbac914549d31"
    assert identity.id_key(token).hex() == "a860d957c83907f0504e43b9bfe7b7a73f8bc16b532c201b0ed9e284399f30d8"
    assert identity._mac(identity._request_key(token), "GET", "/v1/sessions/a", "alice", "n1", "1000000",
                         "f" * 32) == "029214d2744cc1600a25b0cfce2a8dee638e232dffc50d7c91d416e10d6b71a5"
    public = identity.public_id(identity.id_key(token), "alice", "n1", "0a", "c0ffee")
    assert public == "n1.0a.c0ffee.f8db9b36f1e0628cefef79f5"


def test_only_the_ids_a_node_made_are_rendered_for_the_caller() -> None:
    key = identity.id_key(NODE_TOKEN)
    view = identity.View(identity.For("alice", "n1", key), "0a")
    data = {"id": 5, "execution_id": None, "node": "host", "other": "cafe"}
    assert view.outward(dict(data), "cafe") == {**data, "node": "n1"}  # not text: left as it was
    assert view.outward({"id": "beef"}, "cafe") == {"id": "beef"}  # not this node's id


# -- the proxy's request heads and bodies -------------------------------------------------------------------------

NOT_HTTP = "not an HTTP/1.x proxy request"
NOT_PLAIN = "only CONNECT and http:// URLs without credentials go through this proxy"
BAD_LINE = "a header line that is not name: value (or one with a control character)"
BOTH = "Transfer-Encoding and Content-Length together (a request-smuggling pattern)"
CODING = "only one Transfer-Encoding: chunked, in HTTP/1.1, is relayed"


@pytest.mark.parametrize(("head", "reason"), [
    (b"", NOT_HTTP), (b"GET http://a/ HTTP/2", NOT_HTTP), (b"GET  http://a/ HTTP/1.1", NOT_HTTP),
    (b"G(ET http://a/ HTTP/1.1", NOT_HTTP), (b"GET http://a/", NOT_HTTP),
    (b"GET http://a/ HTTP/1.1\r\nX: a\nb", "a bare CR or LF in the request head"),
    (b"GET http://a/\r HTTP/1.1", "a bare CR or LF in the request head"),
    (b"CONNECT a.example:0 HTTP/1.1", "CONNECT needs host:port"),
    (b"CONNECT a.example:65536 HTTP/1.1", "CONNECT needs host:port"),
    (b"CONNECT a.example HTTP/1.1", "CONNECT needs host:port"), (b"CONNECT :443 HTTP/1.1", "CONNECT needs host:port"),
    (b"CONNECT []:443 HTTP/1.1", "CONNECT needs host:port"), (b"CONNECT a:x HTTP/1.1", "CONNECT needs host:port"),
    (b"GET https://a/ HTTP/1.1", NOT_PLAIN), (b"GET http://u:p@a/ HTTP/1.1", NOT_PLAIN),
    (b"GET http://u@a/ HTTP/1.1", NOT_PLAIN), (b"GET http://a:0/ HTTP/1.1", NOT_PLAIN),
    (b"GET http://a:99999/ HTTP/1.1", NOT_PLAIN), (b"GET http:///x HTTP/1.1", NOT_PLAIN),
    (b"GET /relative HTTP/1.1", NOT_PLAIN),
    (b"GET http://a/ HTTP/1.1\r\nno colon", BAD_LINE), (b"GET http://a/ HTTP/1.1\r\nBad Name: 1", BAD_LINE),
    (b"GET http://a/ HTTP/1.1\r\nX: a\x01b", BAD_LINE), (b"GET http://a/ HTTP/1.1\r\nX: a\x7f", BAD_LINE),
    (b"GET http://a/ HTTP/1.1\r\n: empty name", BAD_LINE),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", BOTH),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: gzip", CODING),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: Xchunked", CODING),
    (b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked", CODING),
    (b"POST http://a/ HTTP/1.0\r\nTransfer-Encoding: chunked", CODING),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1", "more than one Content-Length"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: " + b"1" * 19,
     "a Content-Length that is not a number of at most 18 digits"),
    (b"POST http://a/ HTTP/1.1\r\nContent-Length: 0x1", "a Content-Length that is not a number of at most 18 digits"),
])
def test_each_refused_head_says_why(head: bytes, reason: str) -> None:
    assert request.parse(head) == reason


@pytest.mark.parametrize(("head", "expected"), [
    (b"CONNECT a.example:443 HTTP/1.1", request.Request("CONNECT", "a.example", 443)),
    (b"CONNECT [::1]:1 HTTP/1.1", request.Request("CONNECT", "::1", 1)),
    (b"CONNECT a.example:65535 HTTP/1.0", request.Request("CONNECT", "a.example", 65535)),
    (b"GET http://a.example HTTP/1.0\r\nX-A: tab\there",
     request.Request("GET", "a.example", 80, b"GET / HTTP/1.0\r\nHost: a.example\r\nX-A: tab\there\r\n"
                                            b"Connection: close\r\n\r\n", 0)),
    (b"POST http://a.example:8080/p?q=1 HTTP/1.1\r\nHost: evil\r\nX-A: 1\r\nContent-Length: 05\r\n"
     b"Connection: Keep-Alive , X-B\r\nX-B: 2\r\nProxy-Authorization: x\r\nTE: trailers",
     request.Request("POST", "a.example", 8080, b"POST /p?q=1 HTTP/1.1\r\nHost: a.example:8080\r\nX-A: 1\r\n"
                                                 b"Content-Length: 5\r\nConnection: close\r\n\r\n", 5)),
    (b"PUT http://a.example/ HTTP/1.1\r\nTransfer-Encoding:  Chunked ",
     request.Request("PUT", "a.example", 80, b"PUT / HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n"
                                            b"Connection: close\r\n\r\n", None)),
    (b"POST http://a.example/ HTTP/1.1\r\nContent-Length: " + b"9" * 18,
     request.Request("POST", "a.example", 80, b"POST / HTTP/1.1\r\nHost: a.example\r\nContent-Length: "
                                             + b"9" * 18 + b"\r\nConnection: close\r\n\r\n", 10**18 - 1)),
    (b"GET http://a.example:1/ HTTP/1.1\r\nConnection: X-A,X-B\r\nX-A: 1\r\nX-B: 2\r\nReferer: http://b/c:d",
     request.Request("GET", "a.example", 1, b"GET / HTTP/1.1\r\nHost: a.example:1\r\nReferer: http://b/c:d\r\n"
                                           b"Connection: close\r\n\r\n", 0)),
    (b"GET http://@a.example/ HTTP/1.1",  # an empty user part: no credentials, and not in the Host either
     request.Request("GET", "a.example", 80, b"GET / HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n", 0)),
    (b"CONNECT [a.example:443 HTTP/1.1", request.Request("CONNECT", "[a.example", 443)),  # judged as it is
])
def test_a_judged_head_is_rebuilt_for_the_upstream(head: bytes, expected: request.Request) -> None:
    assert request.parse(head) == expected


def test_a_request_knows_how_its_body_is_framed() -> None:
    assert isinstance(request.Request("POST", "a", 80, b"", None).body(), request.Chunked)
    sized = request.Request("POST", "a", 80, b"", 3).body()
    assert isinstance(sized, request.Length) and not sized.done and sized.feed(b"abcd") == b"abc" and sized.done
    empty = request.Request("GET", "a", 80, b"").body()
    assert empty.done and empty.feed(b"GET /next") == b""


@pytest.mark.parametrize(("body", "sent", "problem"), [
    (b"5;" + b"a" * 4092 + b"\r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", None),  # a size line of 4,096
    (b"5;" + b"a" * 4093 + b"\r\nhello\r\n0\r\n\r\n", b"", "an overlong line in a chunked body"),
    (b"0000000000000005\r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", None),
    (b"00000000000000005\r\nhello\r\n0\r\n\r\n", b"", "a chunk size that is not 1 to 16 hex digits"),
    (b"A\r\n0123456789\r\n0\r\n\r\n", b"a\r\n0123456789\r\n0\r\n\r\n", None),
    (b"5\r\nhelloX\r\n0\r\n\r\n", b"", "an overlong line in a chunked body"),
    (b"5\r\nhello\n0\r\n\r\n", b"", "a bare CR or LF in a chunked body"),
    (b"5\r\nhello\r\n0\r\nX: " + b"v" * 4000 + b"\r\n" + (b"Y: " + b"v" * 4000 + b"\r\n") * 3 + b"Z: " + b"v" * 369
     + b"\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", None),  # trailers of exactly 16 KiB
    (b"5\r\nhello\r\n0\r\nX: " + b"v" * 4000 + b"\r\n" + (b"Y: " + b"v" * 4000 + b"\r\n") * 3 + b"Z: " + b"v" * 370
     + b"\r\n\r\n", b"", "a malformed trailer in a chunked body"),
    (b"0\r\nno colon\r\n\r\n", b"", "a malformed trailer in a chunked body"),
    (b"0\r\nNoColon\r\n\r\n", b"", "a malformed trailer in a chunked body"),
    (b"0\r\nX: a\x01\r\n\r\n", b"", "a malformed trailer in a chunked body"),
    (b"0\r\nX-Time: 10:30:00\r\n\r\n", b"0\r\n\r\n", None),
    (b"0\r\nX: a\rb\r\n\r\n", b"", "a bare CR or LF in a chunked body"),
], ids=["size-line-4096", "size-line-4097", "16-digits", "17-digits", "upper-hex", "data-too-long",
        "bare-lf-after-data", "trailers-16k", "trailers-over-16k", "trailer-without-colon",
        "trailer-a-token-without-colon", "trailer-control-character", "trailer-value-with-colons",
        "trailer-bare-cr"])
def test_each_chunked_body_edge(body: bytes, sent: bytes, problem: str | None) -> None:
    chunked = request.Chunked()
    assert chunked.feed(body) == sent
    assert chunked.problem == problem and chunked.done == (problem is None)


# -- file names in a node's URLs ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "why"), [
    ("a//b", "an empty, '.' or '..' segment"), ("%2e%2e/x", "an empty, '.' or '..' segment"),
    ("a\\b", "a NUL, a backslash or an encoded slash in a segment"),
    ("a%2Fb", "a NUL, a backslash or an encoded slash in a segment"),
    ("%2525252e", "a segment percent-encoded over and over"),
])
def test_a_refused_name_says_which_segment_rule_it_breaks(name: str, why: str) -> None:
    with pytest.raises(FileTransferError) as refused:
        paths.encode(name)
    assert str(refused.value) == (
        f"{name!r} is not a plain relative name: it has {why}. Name a file inside /mnt/data with segments that are "
        "not empty, '.' or '..' and hold no NUL or backslash (also percent-encoded).")


def test_a_node_shutting_down_refuses_new_work_with_503_and_retry_after() -> None:
    """A run or a sandbox asked for once shutdown began is not the request's fault: 503 with Retry-After (another
    node, or this one after its restart, takes it), not 409 as for a cap the caller reached."""
    released: list[object] = []
    holding = held.Held(lambda handle, wait: released.append(handle), ttl=60)
    holding.close()
    with pytest.raises(ShuttingDownError) as refused:
        holding.add("a", object(), "sandbox")  # type: ignore[arg-type]
    assert len(released) == 1  # the handle given was released, not kept
    answer = runs.http_error(refused.value)
    assert answer.status_code == 503 and answer.headers == {"Retry-After": "5"}
