"""A durable session on network="allowlist" (issues #26 and #27.3): its egress rules, as its owner last changed them,
hold across every way a sandbox outlives a moment: a sleep and its wake (by replay), and
its owner's death and a new process's `Session.resume` (under runc: the allowlist is not available under
gVisor, docs/network.md). A host denied before is denied after; a host still allowed
is reached after (the proxy the sandbox talks to is there again).

Judged from outside: which loopback server a request from the sandbox reaches (its own log of paths), and what the
code is answered.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbexec
from nbexec import Session, egress
from nbexec.errors import ConfigError, SandboxError
from nbexec.files.workdir import remove_tree
from nbexec.sandbox.docker import egress as docker_egress

from ..conftest import IMAGE
from .test_durable import CHILDREN, claimed_containers, state_dir  # noqa: F401  (the fixture)
from .test_egress_live import KeepAlive

pytestmark = pytest.mark.usefixtures("docker_ready")  # owner processes and services reach the engine


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[KeepAlive]]:
    found = [KeepAlive(), KeepAlive()]
    yield found
    for server in found:
        server.close()


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short TMPDIR: the proxy's Unix socket lives below the working root."""
    folder = Path(tempfile.mkdtemp(prefix="de-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield folder
    remove_tree(folder)


def fetch(port: int, path: str) -> str:
    return ("import urllib.request, urllib.error\ntry:\n"
            f"    print({path!r}, urllib.request.urlopen('http://127.0.0.1:{port}/{path}', timeout=10).status)\n"
            "except urllib.error.HTTPError as exc:\n"
            f"    print({path!r}, exc.code)\n"
            "except OSError as exc:\n"
            f"    print({path!r}, 'failed', exc)\n")


def config_for(hosts: list[KeepAlive]) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                                allowed_hosts=tuple(h.rule for h in hosts))


def test_a_denied_host_stays_denied_after_a_sleep(hosts: list[KeepAlive], short_tmp: Path,
                                                  cleanup_ledger: None) -> None:
    """Under runc (the allowlist is not available under gVisor: docs/network.md)."""
    first, second = hosts
    with Session(config_for(hosts)) as session:
        assert "a1 200" in session.run(fetch(first.port, "a1")).stdout
        session.deny_hosts(first.rule)
        assert "a2 403" in session.run(fetch(first.port, "a2")).stdout
        seen = len(first.seen)
        assert session.hibernate()
        woke = session.run(fetch(first.port, "a3") + fetch(second.port, "b1"))
        assert woke.restored is not None, woke.notes
        assert first.seen[seen:] == [], "a host denied before the sleep was reached after it"
        assert "a3 403" in woke.stdout, woke.stdout
        assert "b1 200" in woke.stdout, woke.stdout  # the allowed one is reached: the proxy is back
        session.allow_hosts(first.rule)  # a change after the wake is kept as well
        assert "a4 200" in session.run(fetch(first.port, "a4")).stdout


OWNER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import nbexec
config = nbexec.SandboxConfig(image={image!r}, pool_size=0, warm_imports=(), timeout=60, network="allowlist",
                              allowed_hosts=({first!r}, {second!r}))
session = nbexec.Session(config, state_dir={state!r})
assert "o1 200" in session.run({fetch!r}).stdout, "the owner could not reach the host"
session.deny_hosts({first!r})
print(session.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_resumed_session_keeps_its_egress_and_its_rules(hosts: list[KeepAlive], short_tmp: Path,
                                                          state_dir: Path) -> None:  # noqa: F811
    first, second = hosts
    code = OWNER.format(root=str(Path(__file__).resolve().parents[2]), image=IMAGE, first=first.rule,
                        second=second.rule, state=str(state_dir), fetch=fetch(first.port, "o1"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    CHILDREN.append(child)
    assert child.stdout is not None
    session_id = child.stdout.readline().strip()
    assert child.wait(120) == -signal.SIGKILL and session_id
    assert len(claimed_containers(state_dir)) == 1
    seen = len(first.seen)
    session = Session.resume(session_id, state_dir=state_dir)
    try:
        result = session.run(fetch(first.port, "r1") + fetch(second.port, "r2"))
        assert first.seen[seen:] == [], "a host the dead owner denied was reached by its successor"
        assert "r1 403" in result.stdout, result.stdout
        assert "r2 200" in result.stdout, result.stdout  # its egress works again: a proxy answers it
    finally:
        session.close()


# -- the kept rules are checked again before a proxy judges by them -------------------------------------------------

FOREIGN = "^the kept allowlist holds a rule nbexec did not write$"
WIDER = "^the kept allowlist reaches past the hosts"
NOT_A_LIST = f"^the kept allowlist is not a list of at most {egress.MAX_RULES} rules$"


@pytest.mark.parametrize(("kept", "why"), [
    ([{"host": "127.0.0.1", "ports": None, "allow": True}], WIDER),  # every port: wider than one
    ([{"host": "evil.example", "ports": [443], "allow": True}], WIDER),
    ("[]", NOT_A_LIST),
    ([{"host": "127.0.0.1", "ports": [80], "allow": "yes"}], FOREIGN),
    ([{"host": "127.0.0.1", "ports": [], "allow": False}], FOREIGN),
    ([{"host": "127.0.0.1", "ports": [True], "allow": False}], FOREIGN),
    ([["127.0.0.1", [80], True]], FOREIGN),
    ([{"host": "not a host!", "ports": [80], "allow": False}], "not a host name"),
    ([{"host": "a.example", "ports": [80], "allow": False}] * (egress.MAX_RULES + 1), NOT_A_LIST),
], ids=["all-ports", "another-host", "a-string", "verdict-not-bool", "no-ports", "port-a-bool", "a-list",
        "bad-host", "too-many"])
def test_kept_rules_are_checked_again(kept: object, why: str, tmp_path: Path) -> None:
    first = ("127.0.0.1:8080",)
    with pytest.raises(ConfigError, match=why):
        egress.Allowlist.from_json(kept, first, widen=False)
    (tmp_path / docker_egress.RULES).write_text(json.dumps(kept))
    config = nbexec.SandboxConfig(network="allowlist", allowed_hosts=first)
    with pytest.raises(SandboxError, match="not nbexec's"):  # a wake or an adoption is refused, not widened
        docker_egress.kept_rules(tmp_path, config)


def test_kept_rules_round_trip_and_a_link_is_not_followed(tmp_path: Path) -> None:
    first = ("127.0.0.1:8080", "api.example.com", "[::1]:*", "*.example.org:443")
    rules = egress.Allowlist.of(first).changed(["127.0.0.1:8080"], ["api.example.com:443", "[::1]:*"])
    docker_egress.keep_rules(tmp_path, rules)
    assert (tmp_path / docker_egress.RULES).stat().st_mode & 0o777 == 0o600
    config = nbexec.SandboxConfig(network="allowlist", allowed_hosts=first)
    again = docker_egress.kept_rules(tmp_path, config)
    assert (again.rules, again.verdicts) == (rules.rules, rules.verdicts)
    assert not again.allows("api.example.com", 443) and again.allows("api.example.com", 80)
    (tmp_path / docker_egress.RULES).unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(egress.Allowlist.of(first).to_json()))
    (tmp_path / docker_egress.RULES).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(SandboxError):
        docker_egress.kept_rules(tmp_path, config)
