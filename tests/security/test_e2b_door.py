"""Attacks on the E2B door from outside, with raw HTTP: who can reach it (an API token on /e2b, a sandbox's own
access token on /e2b/sandbox) and every shape of a hostile request. Judged by the status, what ran, the sandboxes
left, and the bytes that came back."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .. import e2bsdk
from ..conftest import wait_until
from ..test_server import TOKEN_A, TOKEN_B, Running

INTERPRETER = "49999"


@pytest.fixture(scope="module")
def door(docker_ready: None) -> Iterator[Running]:
    with e2bsdk.door({"timeout": 20, "max_output": "64k", "max_data": "8m"}, max_body=256 * 1024,
                     e2b_max_timeout=120) as service:
        yield service


def control(door: Running, token: str = TOKEN_A) -> httpx.Client:
    return httpx.Client(base_url=f"{door.url}/e2b", headers={"X-API-KEY": token}, timeout=60)


@pytest.fixture
def made(door: Running) -> Iterator[dict[str, Any]]:
    """A sandbox of token A, as the create answer gives it."""
    with control(door) as client:
        answer = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
        assert answer.status_code == 201, answer.text
        yield answer.json()
        client.delete(f"/sandboxes/{answer.json()['sandboxID']}")


def execute(door: Running, sandbox_id: str, token: str | None, code: str, **headers: str) -> httpx.Response:
    sent = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": INTERPRETER, **headers}
    if token is not None:
        sent["X-Access-Token"] = token
    return httpx.post(f"{door.url}/e2b/sandbox/execute", json={"code": code}, headers=sent, timeout=60)


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines()]


def test_a_sandbox_token_opens_its_own_sandbox_only(door: Running, made: dict[str, Any]) -> None:
    with control(door, TOKEN_B) as other:
        theirs = other.post("/v2/sandboxes", json={"templateID": "base"}).json()
    try:
        probe = "open('/mnt/data/reached', 'w').write('x')"
        for token in (made["envdAccessToken"], made["trafficAccessToken"], TOKEN_B, "", "x" * 64,
                      made["envdAccessToken"][:-1], made["envdAccessToken"] + "0"):
            refused = execute(door, theirs["sandboxID"], token or None, probe)
            assert refused.status_code == 401 and refused.json()["code"] == 401, (token[:8], refused.text)
        own = execute(door, theirs["sandboxID"], theirs["envdAccessToken"],
                      "import os; os.path.exists('/mnt/data/reached')")
        assert lines(own)[0]["text"] == "False"  # nothing ran in B's sandbox
    finally:
        with control(door, TOKEN_B) as other:
            assert other.delete(f"/sandboxes/{theirs['sandboxID']}").status_code == 204


def test_unknown_ended_and_closed_ports_are_not_found(door: Running, made: dict[str, Any]) -> None:
    token = made["envdAccessToken"]
    assert execute(door, "0" * 32, token, "1").status_code == 502
    assert execute(door, made["sandboxID"], token, "1", **{"E2b-Sandbox-Port": "22"}).status_code == 502
    assert execute(door, made["sandboxID"], token, "1", **{"E2b-Sandbox-Port": "x"}).status_code == 400
    with control(door) as client:
        assert client.delete(f"/sandboxes/{made['sandboxID']}").status_code == 204
    gone = execute(door, made["sandboxID"], token, "1")
    assert gone.status_code == 502 and "was not found" in gone.json()["message"]


def test_the_api_key_is_not_a_data_plane_credential_nor_the_reverse(door: Running, made: dict[str, Any]) -> None:
    assert execute(door, made["sandboxID"], TOKEN_A, "1").status_code == 401
    with httpx.Client(base_url=f"{door.url}/e2b", headers={"X-API-KEY": made["envdAccessToken"]}) as client:
        assert client.get(f"/sandboxes/{made['sandboxID']}").status_code == 401
    bearer = httpx.get(f"{door.url}/e2b/sandboxes/{made['sandboxID']}", headers={"Authorization": f"Bearer {TOKEN_A}"})
    assert bearer.status_code == 401 and bearer.json() == {"code": 401, "message": bearer.json()["message"]}


@pytest.mark.parametrize("body,status", [
    (b"{", 400), (b"[]", 400), (b'{"code": 5}', 400), (b'{"code": "1", "language": "java"}', 400),
    (b'{"code": "1", "language": "python", "context_id": "python"}', 400),
    (b'{"code": "1", "env_vars": {"A": 1}}', 400), (b'{"code": "1", "env_vars": {"A-B": "x"}}', 400),
    (b"[" * 100_000, 400),
])
def test_hostile_execute_bodies_are_refused_before_anything_runs(door: Running, made: dict[str, Any], body: bytes,
                                                                 status: int) -> None:
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": INTERPRETER,
               "X-Access-Token": made["envdAccessToken"], "Content-Type": "application/json"}
    answer = httpx.post(f"{door.url}/e2b/sandbox/execute", content=body, headers=headers, timeout=30)
    assert answer.status_code == status and answer.json()["code"] == status


def test_a_body_past_max_body_is_refused_by_its_size(door: Running, made: dict[str, Any]) -> None:
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": INTERPRETER,
               "X-Access-Token": made["envdAccessToken"]}

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length to refuse by
        yield b'{"code": "'
        for _ in range(64):
            yield b"#" * 65536
        yield b'"}'
    answer = httpx.post(f"{door.url}/e2b/sandbox/execute", content=chunks(), headers=headers, timeout=30)
    assert answer.status_code == 413


def test_an_output_flood_comes_back_within_the_output_allowance(door: Running, made: dict[str, Any]) -> None:
    answer = execute(door, made["sandboxID"], made["envdAccessToken"], "for i in range(200_000): print('x' * 100)")
    assert answer.status_code == 200
    assert len(answer.content) < 64 * 1024 * 2 + 16 * 1024  # 20 MB printed; the allowance and its markers came back
    assert lines(answer)[-1] == {"type": "end_of_execution"}


def test_hostile_control_bodies(door: Running, made: dict[str, Any]) -> None:
    many = {f"k{i}": "v" for i in range(65)}
    with control(door) as client:
        for body in ({"templateID": "base", "metadata": many}, {"templateID": "base", "metadata": {"a": 1}},
                     {"templateID": "base", "envVars": {"1BAD": "x"}}, {"templateID": "base", "timeout": "x"},
                     {"templateID": "base", "timeout": -1}, {"templateID": ["base"]},
                     {"templateID": "base", "envVars": {"A": "x" * 70_000}}):
            answer = client.post("/v2/sandboxes", json=body)
            assert answer.status_code == 400 and answer.json()["code"] == 400, body
        for body in ({"templateID": "base", "mcp": {"x": 1}}, {"templateID": "base", "volumeMounts": [{"a": 1}]},
                     {"templateID": "base", "network": {"allowOut": ["1.1.1.1"]}}):
            assert client.post("/v2/sandboxes", json=body).status_code == 403
        sandbox = made["sandboxID"]
        for count in (0, 21, "2", True):
            assert client.post(f"/sandboxes/{sandbox}/fork", json={"count": count}).status_code == 400
        assert client.post(f"/sandboxes/{sandbox}/timeout", json={"timeout": 10**9}).status_code == 204
        end = client.get(f"/sandboxes/{sandbox}").json()["endAt"]
        assert time.strptime(end[:19], "%Y-%m-%dT%H:%M:%S") <= time.gmtime(time.time() + 121)  # the operator's max
        assert client.get("/v2/sandboxes", params={"limit": 0}).status_code == 400
        assert client.get("/v2/sandboxes", params={"state": "dead"}).status_code == 400


def test_a_page_token_is_bound_to_its_owner(door: Running) -> None:
    with control(door) as a, control(door, TOKEN_B) as b:
        made = [a.post("/v2/sandboxes", json={"templateID": "base"}).json()["sandboxID"] for _ in range(2)]
        try:
            page = a.get("/v2/sandboxes", params={"limit": 1})
            token = page.headers["X-Next-Token"]
            assert a.get("/v2/sandboxes", params={"nextToken": token}).status_code == 200
            assert b.get("/v2/sandboxes", params={"nextToken": token}).status_code == 400
            tampered = token[:-1] + ("1" if token.endswith("0") else "0")
            assert a.get("/v2/sandboxes", params={"nextToken": tampered}).status_code == 400
        finally:
            for sandbox in made:
                a.delete(f"/sandboxes/{sandbox}")


def test_concurrent_creates_and_forks_keep_the_token_cap(door: Running, made: dict[str, Any]) -> None:
    def create(_: int) -> int:
        with control(door) as client:
            return client.post("/v2/sandboxes", json={"templateID": "base"}).status_code
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(create, range(8)))
    with control(door) as client:
        live = client.get("/v2/sandboxes").json()
        assert len(live) == 3 and statuses.count(201) == 2 and statuses.count(429) == 6, (statuses, len(live))
        forks = client.post(f"/sandboxes/{made['sandboxID']}/fork", json={"count": 3}).json()
        assert [f["error"]["code"] for f in forks] == [429, 429, 429]
        for sandbox in live:
            if sandbox["sandboxID"] != made["sandboxID"]:
                client.delete(f"/sandboxes/{sandbox['sandboxID']}")
        wait_until(lambda: len(client.get("/v2/sandboxes").json()) == 1, 20, "sandboxes were left")


def test_a_gzip_bomb_upload_stops_at_the_file_cap(door: Running, made: dict[str, Any]) -> None:
    """100 MiB of zeros in about 100 KiB of gzip: inflated only up to max_data (8 MiB here), then 507, nothing kept."""
    import gzip

    bomb = gzip.compress(b"\0" * (100 * 1024**2), compresslevel=9)
    headers = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": "49983",
               "X-Access-Token": made["envdAccessToken"], "Content-Type": "application/octet-stream",
               "Content-Encoding": "gzip"}
    answer = httpx.post(f"{door.url}/e2b/sandbox/files", params={"path": "bomb.bin"}, content=bomb, headers=headers,
                        timeout=60)
    assert answer.status_code == 507 and answer.json()["code"] == 507
    listing = execute(door, made["sandboxID"], made["envdAccessToken"], "import os; os.listdir('/mnt/data')")
    assert lines(listing)[0]["text"] == "[]"
