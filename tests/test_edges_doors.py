"""Exact edges of this round's new doors that the property tests (tests/test_fuzz_doors.py) leave loose: each case
pins a boundary, a message or a rule that a one-character change of the code would move (found by the machine-made
mutants of scripts/mutants.py). The router's file paths and signed header, the SSE re-framer, the proxy's request
framing and budgets, the widget state and report copy, wheel METADATA and the resolution, the kernel's last-error
report, a cell's output budget and how stores serve what they store."""

from __future__ import annotations

import logging

import pytest

from nbexec.errors import ConfigError
from nbexec.service import sse
from nbexec.stores import serving


def _relayed(chunks: list[bytes], max_event: int = 1000) -> bytes:
    framer = sse.Framer(max_event)
    return b"".join(sse.encode(piece) for chunk in chunks for piece in framer.feed(chunk))


def test_an_empty_read_inside_a_crlf_ends_one_line_only() -> None:
    assert _relayed([b"data: x\r", b"", b"\ndata: y\n\n"]) == b"data: x\ndata: y\n\n"


def test_a_line_after_an_overlong_field_name_is_read_on_its_own() -> None:
    assert _relayed([b"x" * 33 + b"\ndata: a\n\n"]) == b"data: a\n\n"
    assert _relayed([b"x" * 20, b"x" * 20 + b"\rdata: b\r\r"]) == b"data: b\n\n"


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
