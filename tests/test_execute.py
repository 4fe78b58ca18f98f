"""execute_notebook() against the real engine and image: results, limits and failure kinds."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest

import nbexec
from nbexec import execute_notebook

from .conftest import IMAGE


def test_print_and_result_shape(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook("print(12345 * 54321)\n6 * 7", config=config)
    assert result.ok and result.error is None
    assert result.stdout == "670592745\n"
    assert result.text == "670592745\n42\n"
    data = json.loads(result.to_json())
    for key in ("ok", "stdout", "stderr", "text", "error", "outputs", "images", "files", "notebook_path",
                "duration_s"):
        assert key in data
    assert [o["output_type"] for o in data["outputs"]] == ["stream", "execute_result"]
    assert Path(result.notebook_path).is_file()


def test_plot_and_files_come_back(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    code = (
        "import matplotlib.pyplot as plt, pandas as pd\n"
        "pd.DataFrame({'a': [1, 2]}).to_csv('/mnt/data/out.csv', index=False)\n"
        "import os; os.makedirs('/mnt/data/sub', exist_ok=True); open('/mnt/data/sub/x.bin', 'wb').write(b'\\0' * 10)\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
    )
    result = execute_notebook(code, config=config, output_dir=tmp_path / "out")
    assert result.ok, result.error
    assert len(result.images) == 1
    image = Path(result.images[0].path)
    assert image.read_bytes().startswith(b"\x89PNG") and image.parent == tmp_path / "out" / "images"
    files = {f.name: f for f in result.files}
    assert set(files) == {"out.csv", "sub/x.bin"}
    assert files["out.csv"].mime == "text/csv" and files["out.csv"].size == 6
    assert Path(files["out.csv"].path).read_text() == "a\n1\n2\n"
    import hashlib
    assert files["sub/x.bin"].sha256 == hashlib.sha256(b"\0" * 10).hexdigest()


def test_error_keeps_earlier_outputs_and_notebook(config: nbexec.SandboxConfig) -> None:
    nb = nbexec.notebook.from_script("# %%\nprint('before')\n# %%\n{}['missing']\n# %%\nprint('after')\n")
    result = execute_notebook(nb, config=config)
    assert not result.ok
    assert result.stdout == "before\n"
    assert result.error is not None
    assert (result.error.ename, result.error.kind, result.error.cell_index) == ("KeyError", "exception", 1)
    assert "'missing'" in result.error.traceback_text and "\x1b" not in result.error.traceback_text
    saved = json.loads(Path(result.notebook_path).read_text())
    assert saved["cells"][0]["outputs"][0]["text"] == "before\n"
    assert saved["cells"][2]["outputs"] == []  # never ran


def test_timeout_interrupts_and_reports(config: nbexec.SandboxConfig) -> None:
    started = time.monotonic()
    result = execute_notebook("print('start', flush=True)\nimport time\nwhile True: time.sleep(0.1)",
                              config=config, timeout=2)
    assert time.monotonic() - started < 15
    assert not result.ok and result.error is not None
    assert result.error.kind == "timeout" and "2 s time limit" in result.error.evalue
    assert result.stdout == "start\n"


def test_cell_timeout_applies_per_cell(config: nbexec.SandboxConfig) -> None:
    nb = nbexec.notebook.from_script("# %%\nimport time; time.sleep(0.2)\n# %%\ntime.sleep(30)\n")
    result = execute_notebook(nb, config=config, cell_timeout=1.5)
    assert result.error is not None and result.error.kind == "timeout" and result.error.cell_index == 1


def test_signal_ignoring_code_is_killed(config: nbexec.SandboxConfig) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    started = time.monotonic()
    result = execute_notebook(code, config=config, timeout=1, interrupt_grace=1)
    assert time.monotonic() - started < 10
    assert result.error is not None and result.error.kind == "timeout" and "killed" in result.error.evalue


@pytest.mark.parametrize(
    "code",
    ["import os; os._exit(3)", "import ctypes; ctypes.string_at(0)", "import os, signal; os.kill(os.getpid(), 9)"],
    ids=["os-exit", "segfault", "sigkill"],
)
def test_kernel_death_is_a_result(config: nbexec.SandboxConfig, code: str) -> None:
    # Output reaches the host once ZMQ has sent it; a process killed at once can lose its last messages.
    result = execute_notebook("print('alive', flush=True)\nimport time; time.sleep(0.3)\n" + code, config=config)
    assert not result.ok and result.error is not None
    assert result.error.kind == "kernel_died", result.error
    assert result.stdout == "alive\n"


def test_out_of_memory_is_named(config: nbexec.SandboxConfig) -> None:
    result = execute_notebook("blocks = []\nwhile True: blocks.append(bytearray(50 * 1024 * 1024))",
                              config=config, memory="256m")
    assert result.error is not None and result.error.kind in ("oom", "exception")
    if result.error.kind == "exception":  # Python may see the limit first
        assert result.error.ename == "MemoryError"
    else:
        assert "out of memory" in result.error.evalue and "256m" in result.error.evalue


def test_huge_output_is_capped_with_a_marker(config: nbexec.SandboxConfig) -> None:
    started = time.monotonic()
    result = execute_notebook("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(500): sys.stdout.write(chunk)\n"
                              "print('done')", config=config, timeout=120)
    assert time.monotonic() - started < 90
    assert result.ok
    assert len(result.stdout) <= (1 << 20) + 100
    assert result.truncated_bytes >= 499 * (1 << 20)
    assert "output truncated" in result.stderr and f"{result.truncated_bytes:,} bytes dropped" in result.stderr


def test_input_fails_at_once(config: nbexec.SandboxConfig) -> None:
    started = time.monotonic()
    result = execute_notebook("input('name? ')", config=config)
    assert time.monotonic() - started < 10
    assert result.error is not None and result.error.ename == "StdinNotImplementedError"


def test_data_cap_stops_the_cell(config: nbexec.SandboxConfig) -> None:
    code = "f = open('/mnt/data/big', 'wb')\nwhile True: f.write(b'x' * (1 << 20)); f.flush()"
    result = execute_notebook(code, config=config, max_data="20m")
    assert result.error is not None and result.error.kind == "limit" and "20m" in result.error.evalue


def test_output_dir_must_be_new_or_empty(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(nbexec.ConfigError, match="not an empty folder"):
        execute_notebook("1", config=config, output_dir=tmp_path / "taken")


def test_eight_at_once_each_sees_only_its_own_data(config: nbexec.SandboxConfig) -> None:
    from concurrent.futures import ThreadPoolExecutor

    code = "import os\nprint(sorted(os.listdir('/mnt/data')))\nopen('/mnt/data/mine-{n}', 'w').write('{n}')"
    with ThreadPoolExecutor(8) as workers:
        results = list(workers.map(lambda n: execute_notebook(code.format(n=n), config=config), range(8)))
    for n, result in enumerate(results):
        assert result.ok, result.error
        assert result.stdout == "[]\n"
        assert [f.name for f in result.files] == [f"mine-{n}"]


def test_a_missing_image_is_named_with_the_images_here(cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image="nbexec-missing:none", pool_size=0)
    with pytest.raises(nbexec.ImageNotFoundError, match=r"nbexec-missing:none is not here\. Images here: .*"
                       + re.escape(IMAGE)):
        execute_notebook("1", config=config)


def test_async_wrapper(config: nbexec.SandboxConfig) -> None:
    import asyncio

    async def main() -> list[str]:
        results = await asyncio.gather(*(nbexec.execute_notebook_async(f"print({n})", config=config)
                                         for n in range(3)))
        return [r.stdout for r in results]

    assert asyncio.run(main()) == ["0\n", "1\n", "2\n"]


def test_a_container_removed_from_outside_is_named(cold: nbexec.SandboxConfig) -> None:
    """`docker rm -f` while a cell runs: the result says the container went, not that the code crashed."""
    import threading

    from nbexec.sandbox.docker import daemon

    from .conftest import own_containers, wait_until

    started = threading.Event()
    outcome: list[nbexec.ExecutionResult] = []
    runner = threading.Thread(target=lambda: outcome.append(execute_notebook(
        "print('running', flush=True)\nimport time\ntime.sleep(60)", config=cold,
        on_output=lambda index, output: started.set())))
    runner.start()
    wait_until(started.is_set, 60, "the code never ran")
    names = own_containers(role="oneshot")
    assert len(names) == 1, names
    daemon.connect().containers.get(names[0]).remove(force=True)  # this test's own sandbox
    runner.join(60)
    result = outcome[0]
    assert result.error is not None and result.error.kind == "kernel_died"
    assert "removed from outside nbexec" in result.error.evalue and "exit code" not in result.error.evalue
    assert result.stdout == "running\n"


def test_standard_cell_tags_counts_timing_and_display_updates(config: nbexec.SandboxConfig) -> None:
    """What nbclient users expect: raises-exception goes on, skip-execution skips, counts and per-cell timing are in
    the executed notebook, and a display made by one cell is updated from a later one."""
    cells = [nbformat.v4.new_code_cell("raise ValueError('expected')", metadata={"tags": ["raises-exception"]}),
             nbformat.v4.new_code_cell("print('skipped')", metadata={"tags": ["skip-execution"]}),
             nbformat.v4.new_code_cell("from IPython.display import display\nh = display('old', display_id=True)"),
             nbformat.v4.new_code_cell("h.update('new')\nprint('done')")]
    result = nbexec.execute_notebook(nbformat.v4.new_notebook(cells=cells), config=config)
    assert result.ok, result.error
    executed = result.notebook.cells
    assert executed[0].outputs[0].output_type == "error" and executed[0].outputs[0].ename == "ValueError"
    assert executed[1].outputs == [] and "skipped" not in result.stdout and result.stdout == "done\n"
    assert executed[2].outputs[0].data["text/plain"] == "'new'"
    assert [c.execution_count for c in executed] == [1, None, 2, 3]
    assert {"iopub.status.busy", "iopub.execute_input", "shell.execute_reply", "iopub.status.idle"} \
        <= set(executed[3].metadata.execution)


def test_a_session_updates_a_display_of_an_earlier_run(config: nbexec.SandboxConfig) -> None:
    with nbexec.Session(config) as session:
        session.run("from IPython.display import display\nh = display('old', display_id=True)")
        assert session.run("h.update('new')").ok
        assert session.notebook.cells[0].outputs[0].data["text/plain"] == "'new'"
