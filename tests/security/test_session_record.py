"""A session's notebook and durable record stay within a stated bound with its code included, and a record too
large to read back is an error that names itself (issue #36).

Judged from outside: the sizes of the session's notebook file and of its record in the state folder, and what
`Session.resume` says about a record made too large (written as a huge session would leave it).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import nbexec
from nbexec import Session
from nbexec.engine import durable
from nbexec.errors import ConfigError, SessionNotFoundError
from nbexec.files import statefolder

from ..conftest import IMAGE

MIB = 1024**2


def test_notebook_and_record_stay_within_the_bound_with_large_code(tmp_path: Path, cleanup_ledger: None) -> None:
    """12 runs, each ~1 MB of code (a cell just under the one-cell limit): the notebook file and the record stay
    within 2 x (max_output + max_display) + 8 MiB; runs past the session's code allowance are refused, and a
    small cell still runs."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, max_output="1m",
                                  max_display="64k")
    bound = 2 * (config.max_output_bytes + config.max_display_bytes) + 8 * MIB
    code = "x = 1\n" + ("# " + "a" * 97 + "\n") * 10_000  # 1,000,006 bytes, 1,010,008 as the kernel echoes it
    state = tmp_path / "state"
    refused: list[str] = []
    with Session(config, state_dir=state, output_dir=tmp_path / "out") as session:
        for _ in range(12):
            try:
                assert session.run(code).ok
            except ConfigError as exc:
                refused.append(str(exc))
        notebook_size = (tmp_path / "out" / "session.ipynb").stat().st_size
        record_size = (state / f"{session.id}{durable.SUFFIX}").stat().st_size
        assert session.run("print(x + 1)").stdout == "2\n"
    assert notebook_size <= bound, f"the notebook is {notebook_size / MIB:.2f} MiB, the bound {bound / MIB:.2f} MiB"
    assert record_size <= bound + MIB, f"the record is {record_size / MIB:.2f} MiB"
    assert refused and "code" in refused[0], refused[:1]


def test_a_record_too_large_to_read_back_names_itself(tmp_path: Path) -> None:
    """A record past the limit (as a huge session would leave it) is an error naming the record and its size,
    never "no session"."""
    folder = durable.hold(tmp_path / "state")
    session_id = uuid.uuid4().hex
    size = statefolder.MAX_RECORD + 4096
    folder.write(session_id + durable.SUFFIX, b"{" + b" " * (size - 2) + b"}")
    with pytest.raises(nbexec.NbexecError) as caught:
        Session.resume(session_id, state_dir=tmp_path / "state")
    assert not isinstance(caught.value, SessionNotFoundError), str(caught.value)
    assert session_id + durable.SUFFIX in str(caught.value) and f"{size:,}" in str(caught.value), str(caught.value)
