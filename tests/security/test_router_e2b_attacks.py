"""An attacker's read of E2B's door through the router (issue #40), beside tests/security/test_router_e2b.py.

A node is not trusted by the router: whatever it answers is parsed within caps, and every sandbox id in it is
signed for the caller, one HMAC after another on the router's event loop, which every client's call shares.

Judged from outside: the router's answer and the CPU its process spent on one call (from /proc).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..cluster import CLIENT_TOKEN, Server, fake_behind_router
from ..fakenode import Behaviour, FakeNode


@pytest.fixture
def front() -> Iterator[tuple[FakeNode, Server]]:
    """A fake node and a router in front of it."""
    with fake_behind_router() as pair:
        yield pair


def _cpu(server: Server) -> float:
    assert server.process is not None
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_nodes_answer_full_of_sandbox_ids_is_not_signed_id_by_id(front: tuple[FakeNode, Server]) -> None:
    """Before: a node answering a create with 419,000 sandbox ids (8 MiB, within the router's cap) had each one
    signed for the caller (two HMACs each): 2.5 s of the router's event loop, every other client's call stalled,
    and 58 MiB of ids sent to the client. After: past MAX_IDS ids in one answer the router stops and answers 502."""
    fake, router = front
    fake.behaviour = Behaviour(e2b="id-flood")
    before = _cpu(router)
    with httpx.Client(base_url=f"{router.url}/e2b", headers={"X-API-KEY": CLIENT_TOKEN}, timeout=120) as control:
        answer = control.post("/v2/sandboxes", json={"templateID": "base"})
    spent = _cpu(router) - before
    print(f"status {answer.status_code}, {len(answer.content):,} bytes, router CPU {spent:.2f} s")
    assert answer.status_code == 502, f"{answer.status_code}: {len(answer.content):,} bytes of signed ids"
