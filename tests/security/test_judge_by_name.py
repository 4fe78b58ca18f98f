"""Judging on a remote node, by name: the host sends the job as data to the sandbox's node
(``POST /v1/sandboxes/{id}/judge``), the node judges with its own runner. Attacked from both sides: a client's
hostile job (refused as a batch's judge item is, its time within the node's), another token's sandbox, and a
node's hostile answer (every field checked on the host: never an ``accepted`` that was not judged)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import resource
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import nbexec
from nbexec import Test
from nbexec.engine import judge, judgenamed
from nbexec.engine.judgevalues import Limits
from nbexec.sandbox.remote import source as remote
from nbexec.service.judgeitems import JudgeBody

from .. import cluster
from ..conftest import IMAGE, wait_until

SUM = "a, b = map(int, input().split())\nprint(a + b)"
JOB = judge.Job.of(SUM, [Test("1 2", expected="3"), Test("2 2", expected="5")], "python", "whitespace", None)


def _judged(**changes: Any) -> dict[str, Any]:
    """What a node answers for JOB, with ``changes`` to it."""
    answer = judge.JudgeResult("python", (judge.TestResult(0, "accepted"), judge.TestResult(1, "wrong_answer")))
    return {**answer.to_dict(), **changes}


@pytest.mark.parametrize(("reply", "why"), [
    pytest.param(None, "not an object", id="null"),
    pytest.param([], "not an object", id="a-list"),
    pytest.param(_judged(tests=_judged()["tests"][:1]), "a test short", id="a-test-short"),
    pytest.param(_judged(tests=_judged()["tests"] * 2), "tests more", id="tests-more"),
    pytest.param(_judged(language="cpp"), "another language", id="another-language"),
    pytest.param(_judged(tests="accepted"), "tests not a list", id="tests-a-string"),
])
def test_a_node_answer_that_is_not_this_judgement_is_judge_error(reply: Any, why: str) -> None:
    judged = judgenamed.result(reply, JOB)
    assert [t.verdict for t in judged.tests] == ["judge_error", "judge_error"], why
    assert not judged.ok


@pytest.mark.parametrize("record", [
    {"index": 0, "verdict": "ACCEPTED"},
    {"index": 1, "verdict": "accepted"},  # another test's record in this test's place
    {"verdict": "accepted"},
    "accepted",
    {"index": 0, "verdict": ["accepted"]},
])
def test_a_node_record_that_is_malformed_is_that_tests_judge_error(record: Any) -> None:
    reply = _judged()
    reply["tests"][0] = record
    judged = judgenamed.result(reply, JOB)
    assert [t.verdict for t in judged.tests] == ["judge_error", "wrong_answer"]


def test_a_node_records_fields_are_checked_and_capped() -> None:
    reply = _judged()
    reply["tests"][1].update(time=math.inf, cpu=-1, memory=1e300, exit_code=1 << 40, diff="d" * 10**6,
                             stderr=["x"], message=7)
    reply.update(compile_log="c" * 10**6, notes=["n" * 1000] * 100)
    test = judgenamed.result(reply, JOB).tests[1]
    assert (test.time, test.cpu, test.exit_code, len(test.diff), test.stderr, test.message) == (
        0.0, 0.0, None, 2048, "", "")
    assert test.memory <= 2**62
    judged = judgenamed.result(reply, JOB)
    assert len(judged.compile_log) == 4096 and len(judged.notes) == 8 and all(len(n) <= 300 for n in judged.notes)


@pytest.mark.parametrize(("program", "test", "limits", "why"), [
    pytest.param(b"print('\xff')", Test(), None, "not UTF-8", id="program-bytes"),
    pytest.param(SUM, Test(b"\xff"), None, "not UTF-8", id="stdin-bytes"),
    pytest.param(SUM, Test("\udcff"), None, "not UTF-8", id="stdin-lone-surrogate"),
    pytest.param(SUM, Test(args=("\udcff",)), None, "not UTF-8", id="argument-lone-surrogate"),
    pytest.param(SUM, Test(expected="\ud800"), None, "not UTF-8", id="expected-lone-surrogate"),
    pytest.param(SUM, Test(), Limits(compile_time=5), "compile limits", id="compile-limits"),
    pytest.param("#" * (4 * 1024**2 - 1), Test("x" * (12 * 1024**2)), None, "MiB of JSON", id="past-a-body"),
])
def test_what_json_text_cannot_carry_is_refused_by_name(program: Any, test: Test, limits: Limits | None,
                                                         why: str) -> None:
    """Refused with NotOfferedError before anything is sent (a raw UnicodeEncodeError, a 413 or a 422 after)."""
    with pytest.raises(nbexec.NotOfferedError, match=why):
        judgenamed.body(judge.Job.of(program, [test], "python", "whitespace", limits), 30.0)


def test_the_job_sent_says_the_program_limit_this_host_would_give_it() -> None:
    sent = judgenamed.body(judge.Job.of(SUM, [Test()], "python", "whitespace", Limits(memory=512 * 1024**2)), 42.0)
    assert sent["limits"]["program"] == 42.0 and sent["limits"]["memory"] == str(512 * 1024**2)
    assert JudgeBody.model_validate(sent).job(600).limits.program == 42.0  # as the node reads it


@pytest.fixture
def hostile_node() -> Iterator[tuple[str, list[str]]]:
    """A node that answers a judging the way a hostile one might (the mode the test puts in the list)."""
    mode: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with contextlib.suppress(OSError):
                if mode[0] == "error-after-start":  # keep-alive spaces, then the error the judging ended with
                    self._chunk(b"  ")
                    self._chunk(b'{"sandbox": "s", "error": {"status": 400, "detail": "no g++ in this image"}}')
                elif mode[0] == "tiny-objects":  # 8 MiB of {} (parsed whole: hundreds of MiB)
                    self._chunk(b'{"sandbox": "s", "judge": {"tests": [')
                    for _ in range(64):
                        self._chunk(b"{}," * (128 * 1024 // 3))
                    self._chunk(b"{}]}}")
                else:  # a byte at a time, each well within the read timeout
                    self._chunk(b'{"sandbox": "s", "judge": {"tests": [], "language": "')
                    for _ in range(600):
                        self._chunk(b"x")
                        time.sleep(0.1)
                self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", mode
    finally:
        server.shutdown()
        server.server_close()


def _remote(url: str) -> Any:
    from nbexec.sandbox.remote.handle import RemoteHandle
    from nbexec.sandbox.remote.nodes import NodeClient

    return RemoteHandle(NodeClient(url, "t"), {"id": "s"}, nbexec.SandboxConfig(), "session")


def test_a_node_answer_is_read_within_what_this_job_can_need(hostile_node: tuple[str, list[str]]) -> None:
    """8 MiB of empty objects for a job of two tests: the read stops at this job's cap (two tests' records), so
    nothing near the 16 MiB a node may answer for 10,000 tests is held or parsed."""
    url, mode = hostile_node
    mode.append("tiny-objects")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(nbexec.errors.FileTooLargeError):
        _remote(url).judge(judgenamed.body(JOB, 5.0), 5.0)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grew < 32 * 1024**2, f"the client's peak memory grew by {grew / 1024**2:.0f} MiB"


def test_a_node_that_trickles_its_answer_is_given_up_by_the_calls_deadline(
        hostile_node: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.1 s keeps each read under the read timeout: the call still ends by its own deadline (here
    its 1 s and a slack of 2 s), not after the minutes the trickle lasts."""
    from nbexec.sandbox.remote import handle

    url, mode = hostile_node
    mode.append("trickle")
    monkeypatch.setattr(handle, "SLACK", 2.0)
    started = time.monotonic()
    with pytest.raises(nbexec.errors.SessionLostError, match="did not finish its answer"):
        _remote(url).judge(judgenamed.body(JOB, 1.0), 1.0)
    assert time.monotonic() - started < 10


def test_a_node_answer_past_its_budget_keeps_the_verdicts_and_drops_the_texts() -> None:
    answer = _judged()
    for test in answer["tests"]:
        test["stderr"] = "é" * 2000
    fitted = judgenamed.fit(answer, budget=2000)
    assert [t["verdict"] for t in fitted["tests"]] == ["accepted", "wrong_answer"]
    assert {t["stderr"] for t in fitted["tests"]} == {""} and "dropped" in fitted["notes"][-1]
    assert judgenamed.fit(_judged()) == _judged()  # within the budget: as it was


# -- on a real node ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judge_node(docker_ready: None) -> Iterator[cluster.Server]:
    env = {"NBEXEC_API_TOKENS": f"{cluster.NODE_TOKEN},{cluster.OTHER_TOKEN}", "NBEXEC_POOL_SIZE": "0",
           "NBEXEC_TIMEOUT": "20"}
    with cluster.running_node("jn", env, running=3) as server:
        yield server


@pytest.fixture
def on_node(judge_node: cluster.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[nbexec.SandboxConfig]:
    monkeypatch.setenv("NBEXEC_NODES", judge_node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    yield nbexec.SandboxConfig(image=IMAGE, source="remote", pool_size=0, warm_imports=(), timeout=60)
    remote.forget_all()


def test_judge_and_judge_many_run_on_a_remote_node(on_node: nbexec.SandboxConfig,
                                                   judge_node: cluster.Server) -> None:
    """The same verdicts as on this host; with reuse="batch" each program is judged in a sandbox of its own there
    (a node's hidden route takes no reset code), and the result says so."""
    tests = [Test("1 2", expected="3"), Test("2 2", expected="5"), Test("x", expected="")]
    judged = nbexec.judge(SUM, tests, config=on_node)
    assert [t.verdict for t in judged.tests] == ["accepted", "wrong_answer", "runtime_error"], judged.to_dict()
    assert "ValueError" in judged.tests[2].stderr and judged.mode == "fresh"
    slow = nbexec.judge("while True: pass", [Test()], limits=Limits(time=1), config=on_node)
    assert slow.verdict == "timeout"
    items = list(nbexec.judge_many([{"program": SUM, "tests": tests[:1]}] * 3, reuse="batch", concurrency=2,
                                   config=on_node))
    assert sorted(i.index for i in items) == [0, 1, 2]
    assert all(i.result is not None and i.result.ok and i.result.mode == "fresh" for i in items), items
    wait_until(lambda: not judge_node.containers(), 60, "the node kept the judged sandboxes")


def test_a_judging_sent_by_name_is_refused_as_a_batch_item_is(judge_node: cluster.Server) -> None:
    """The node checks the job as it checks a batch's judge item, keeps another token's sandbox to itself, and
    holds the program to its own timeout (a client asking for a day gets the node's 20 s)."""
    with cluster.client(judge_node, cluster.NODE_TOKEN, timeout=120) as http, \
            cluster.client(judge_node, cluster.OTHER_TOKEN) as other:
        made = http.post("/v1/sandboxes", json={"purpose": "session"})
        assert made.status_code == 201, made.text
        route = f"/v1/sandboxes/{made.json()['id']}/judge"
        try:
            for hostile in ({"program": "1", "tests": []}, {"program": "1", "tests": [{}], "language": "cobol"},
                            {"program": "1", "tests": [{"args": ["a\0"]}]}, {"program": "1", "tests": [{}], "x": 1},
                            {"code": "import os"}):
                assert http.post(route, json=hostile).status_code == 422, hostile
            assert other.post(route, json={"program": "print(1)", "tests": [{}]}).status_code == 404
            answer = http.post(route, json={"program": "import time\ntime.sleep(600)", "tests": [{}],
                                            "limits": {"time": 86_400, "program": 86_400}})
            assert answer.status_code == 200, answer.text
            assert answer.json()["judge"]["tests"][0]["verdict"] == "timeout"
            assert "cut to this node's 20 s" in answer.json()["judge"]["notes"][-1]
            assert answer.elapsed.total_seconds() < 60, "the node's timeout did not bound the program"
        finally:
            http.delete(f"/v1/sandboxes/{made.json()['id']}")
    wait_until(lambda: not judge_node.containers(), 60, "containers were left behind")


def test_an_error_after_the_answer_started_is_raised_as_the_nodes_http_error(
        hostile_node: tuple[str, list[str]]) -> None:
    url, mode = hostile_node
    mode.append("error-after-start")
    with pytest.raises(nbexec.NotOfferedError, match="no g\\+\\+ in this image"):
        _remote(url).judge(judgenamed.body(JOB, 5.0), 5.0)


def test_a_long_judging_sends_spaces_until_its_answer() -> None:
    """A router gives up on a node silent for a minute: a judging answers spaces while it runs, then its JSON,
    or the error it ended with in the body (the status was sent with the first space)."""
    from fastapi import HTTPException

    from nbexec.service.sandboxes import _judging

    async def answered(outcome: Any) -> bytes:
        async def work() -> Any:
            await asyncio.sleep(0.35)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return b"".join([part async for part in _judging(asyncio.ensure_future(work()), "s", 0.1)])

    body = asyncio.run(answered({"tests": []}))
    assert body.startswith(b"   ") and json.loads(body) == {"sandbox": "s", "judge": {"tests": []}}
    failed = json.loads(asyncio.run(answered(HTTPException(400, "no g++"))))
    assert failed == {"sandbox": "s", "error": {"status": 400, "detail": "no g++"}}
