"""Interrupt over HTTP, attacked: a real `nbexec serve` node and a real router in front of it (tests/cluster.py), runs
that would sleep for 600 s. Judged from outside: the run's own answer (never ok; KeyboardInterrupt), the next call
on the same session answering at once (the client's read timeout is far below the sleep), another token's
interrupt refused as for an id that does not exist (404), an idle session or an ended run answered 409."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..cluster import CLIENT_TOKEN, NODE_TOKEN, OTHER_TOKEN, Server, client, node, nodes_up, router, stop, wait_ready
from ..conftest import wait_until

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(600)\nprint('never')"


@pytest.fixture(scope="module")
def pair(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """One node (it takes the two client tokens too, for direct calls) and a router in front of it."""
    tmp = tmp_path_factory.mktemp("interrupt")
    tmp.chmod(0o755)
    member = node(0, tmp, running=2, sessions=2, timeout=600, tag="i")
    member.env["NBEXEC_API_TOKENS"] = f"{NODE_TOKEN},{CLIENT_TOKEN},{OTHER_TOKEN}"
    member.start()
    front = router([member]).start()
    try:
        wait_ready([member])
        wait_until(lambda: nodes_up(front) == 1, 60, "the router never saw its node up", interval=0.2)
        yield member, front
    finally:
        stop(front, member)
        wait_until(lambda: not member.containers(), 60, f"{member.name} left containers behind")


def _target(pair: tuple[Server, Server], via: str) -> Server:
    return pair[1] if via == "router" else pair[0]


def _events(response: httpx.Response, stop: list[float]) -> Iterator[tuple[str, Any]]:
    """The stream's events; fails when the run goes on 90 s after ``stop`` (its first item: when the interrupt
    was sent) - the sleep would last 600 s. Keep-alive comments (every 15 s) wake the check up."""
    kind = ""
    for line in response.iter_lines():
        assert not stop or time.monotonic() - stop[0] < 90, "the run went on after its interrupt"
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])


def _started(kind: str, data: Any) -> bool:
    """The sleeper's own first line (not an error output quoting its source)."""
    return kind == "output" and data.get("output_type") == "stream" and "started" in str(data.get("text"))


@pytest.mark.parametrize("via", ["node", "router"])
def test_a_session_run_is_interrupted_by_its_owner_only(pair: tuple[Server, Server], via: str) -> None:
    server = _target(pair, via)
    with client(server, timeout=120) as owner, client(server, OTHER_TOKEN) as other:
        session_id = owner.post("/v1/sessions").json()["id"]
        try:
            assert owner.post(f"/v1/sessions/{session_id}/interrupt").status_code == 409  # new: nothing runs
            answer: dict[str, Any] = {}
            with owner.stream("POST", f"/v1/sessions/{session_id}/execute?stream=true",
                              json={"code": SLEEPER}) as response:
                sent: list[float] = []
                for kind, data in _events(response, sent):
                    if _started(kind, data):
                        assert other.post(f"/v1/sessions/{session_id}/interrupt").status_code == 404
                        sent.append(time.monotonic())
                        assert owner.post(f"/v1/sessions/{session_id}/interrupt").json() == {"interrupted": True}
                    if kind in ("result", "error"):
                        answer = {"kind": kind, **data}
            assert answer["kind"] == "result" and answer["ok"] is False, answer
            assert answer["error"]["ename"] == "KeyboardInterrupt" and "never" not in answer["stdout"]
            after = owner.post(f"/v1/sessions/{session_id}/execute", json={"code": "print(6 * 7)"})
            assert after.json()["stdout"] == "42\n"
            assert owner.post(f"/v1/sessions/{session_id}/interrupt").status_code == 409  # idle: left as it is
        finally:
            owner.delete(f"/v1/sessions/{session_id}")
        assert owner.post(f"/v1/sessions/{session_id}/interrupt").status_code in (404, 410)


@pytest.mark.parametrize("via", ["node", "router"])
def test_a_one_shot_run_is_interrupted_by_its_id(pair: tuple[Server, Server], via: str) -> None:
    server = _target(pair, via)
    with client(server, timeout=120) as owner, client(server, OTHER_TOKEN) as other:
        answer: dict[str, Any] = {}
        with owner.stream("POST", "/v1/execute?stream=true", json={"code": SLEEPER}) as response:
            execution_id = response.headers["X-Nbexec-Execution-Id"]  # before the first event
            sent: list[float] = []
            for kind, data in _events(response, sent):
                if _started(kind, data):
                    assert other.post(f"/v1/executions/{execution_id}/interrupt").status_code == 404
                    sent.append(time.monotonic())
                    assert owner.post(f"/v1/executions/{execution_id}/interrupt").json() == {"interrupted": True}
                if kind in ("result", "error"):
                    answer = {"kind": kind, **data}
        assert answer["kind"] == "result" and answer["ok"] is False, answer
        assert answer["error"]["ename"] == "KeyboardInterrupt" and answer["execution_id"] == execution_id
        assert owner.post(f"/v1/executions/{execution_id}/interrupt").status_code == 409  # ended
        assert other.post(f"/v1/executions/{execution_id}/interrupt").status_code == 404


def test_unknown_and_malformed_ids_are_refused(pair: tuple[Server, Server]) -> None:
    """Unknown and malformed ids are refused the same way as another owner's."""
    member, front = pair
    with client(member) as direct, client(front) as routed:
        assert direct.post("/v1/executions/0123456789abcdef/interrupt").status_code == 404
        assert direct.post("/v1/sessions/0123456789abcdef0123456789abcdef/interrupt").status_code == 404
        assert routed.post("/v1/executions/0123456789abcdef/interrupt").status_code in (400, 404)
        assert routed.post("/v1/sessions/not-an-id/interrupt").status_code in (400, 404)


def test_a_node_cannot_smuggle_a_header_through_the_router() -> None:
    """The router passes on only a plain id in X-Nbexec-Execution-Id (pure: the relay's filter)."""
    from nbexec.service import relay

    class Fake:
        def __init__(self, *values: str) -> None:
            self.response = httpx.Response(200, headers=[("X-Nbexec-Execution-Id", v) for v in values])

    assert relay.execution_header(Fake("abc-123")) == {"X-Nbexec-Execution-Id": "abc-123"}  # type: ignore[arg-type]
    for values in (("a b",), ("x" * 129,), ("a", "b"), (), ("a;b",), ("../x",)):
        assert relay.execution_header(Fake(*values)) == {}, values  # type: ignore[arg-type]
