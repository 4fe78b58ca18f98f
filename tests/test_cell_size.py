"""Attack (#36): a cell too large to run is a usage error said before any sandbox starts, not a misbehaving
sandbox after one did (the kernel echoes each cell, and the host reads that echo whole or not at all)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import nbexec
from nbexec import Session
from nbexec.errors import ConfigError
from nbexec.service.settings import ServerSettings

from .conftest import IMAGE, own_containers

SMALL = {"max_output": "64k", "max_display": "64k"}


def _config(**changes: str) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=30, interrupt_grace=3,
                                **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "size"), [(SMALL, 300_000), ({}, 2_000_000)], ids=["small-output", "default"])
def test_a_cell_over_the_limit_starts_no_sandbox(cleanup_ledger: None, changes: dict[str, str], size: int) -> None:
    before = set(own_containers(include_pool=True))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"over the [\d,]+-byte limit of one cell.*max_output"):
        nbexec.execute_notebook("x = 1\n" + "#" * size, config=_config(**changes))
    session = Session(_config(**changes))  # not entered: entering starts the sandbox
    try:
        with pytest.raises(ConfigError, match="limit of one cell"):
            session.run("y = 2  # " + "é" * (size // 2))
    finally:
        session.close()
    took = time.monotonic() - started
    assert set(own_containers(include_pool=True)) <= before and took < 5, took


def test_a_cell_within_the_limit_runs(cleanup_ledger: None) -> None:
    config = _config(**SMALL)
    result = nbexec.execute_notebook("x = 'a'\n" + "#" * 150_000, config=config)  # limit: 128 KiB + 63 KiB
    assert result.ok, result.error


def test_nbexec_run_says_it_as_a_usage_error(cleanup_ledger: None, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nbexec.cli.main import main

    script = tmp_path / "big.py"
    script.write_text("x = 1\n" + "#" * 300_000)
    before = set(own_containers(include_pool=True))
    done = CliRunner().invoke(main, ["run", "--max-output", "64k", "--output-dir", str(tmp_path / "out"),
                                     str(script)],
                              env={"NBEXEC_MAX_DISPLAY": "64k", "NBEXEC_POOL_SIZE": "0", "NBEXEC_IMAGE": IMAGE})
    assert done.exit_code == 2 and "limit of one cell" in done.output, done.output
    assert set(own_containers(include_pool=True)) <= before


def test_the_http_api_answers_413_before_any_sandbox(cleanup_ledger: None) -> None:
    from .test_server import TOKEN_A, TOKEN_B, running

    settings = ServerSettings(config=_config(**SMALL), tokens=(TOKEN_A, TOKEN_B), max_body=4 * 1024 * 1024)
    with running(settings) as service, service.client() as client:
        before = set(own_containers(include_pool=True))
        response = client.post("/v1/execute", json={"code": "x = 1\n" + "#" * 300_000})
        assert response.status_code == 413 and "limit of one cell" in response.json()["detail"], response.text
        assert set(own_containers(include_pool=True)) <= before


def test_a_tool_call_tells_the_model_to_split_its_code(cleanup_ledger: None) -> None:
    from nbexec.integrations.toolcall import handle_openai_tool_call

    reply = handle_openai_tool_call({"id": "c", "function": {"name": "run", "arguments": json.dumps(
        {"code": "x = 1\n" + "#" * 300_000})}}, config=_config(**SMALL))
    assert "limit of one cell" in reply["content"] and "unavailable" not in reply["content"], reply["content"][:300]
