"""Parity, proven: the public API run over both sandbox sources, this host's Docker engine and a real node on
loopback (`nbexec serve`, `tests/cluster.py`), by the one engine. Every test runs on both; a result of a remote
run has every field of a local one, of the same kind (`test_a_result_has_the_same_shape_on_both`).

The node and the local config share one policy: egress through the allowlist proxy to a web server on loopback,
packages from a package index on loopback (`tests/pyindex.py`), resolved by this host (the library's) under its own
policy and uploaded to the node's sandbox.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from nbformat import v4

import nbexec
from nbexec.result import ExecutionResult, json_schema
from nbexec.sandbox.remote import source as remote

from . import cluster
from .conftest import IMAGE, wait_until
from .pyindex import Index

WEB_REPLY = b"hello from the allowed server"


class _Web(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the name http.server calls
        self.send_response(200)
        self.send_header("Content-Length", str(len(WEB_REPLY)))
        self.end_headers()
        self.wfile.write(WEB_REPLY)

    def log_message(self, format: str, *args: Any) -> None:  # the base class's names
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Web)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Index]:
    served = Index(tmp_path_factory.mktemp("index"))
    served.add("nbexec-tiny", "1.0", "VALUE = 42\n", requires=("nbexec-dep>=2",))
    served.add("nbexec-dep", "2.0", "X = 2\n")
    yield served
    served.close()


@pytest.fixture(scope="module")
def node(docker_ready: None, web: int) -> Iterator[cluster.Server]:
    with cluster.running_node("p", {"NBEXEC_NETWORK": "allowlist", "NBEXEC_ALLOWED_HOSTS": f"127.0.0.1:{web}",
                                    "NBEXEC_POOL_SIZE": "0", "NBEXEC_MAX_DATA": "64m"}) as server:
        yield server


def _config(where: str, web: int, index: Index, cache: Path) -> nbexec.SandboxConfig:
    return nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, interrupt_grace=2,
                                max_data="64m", network="allowlist", allowed_hosts=(f"127.0.0.1:{web}",),
                                package_index=index.url, allowed_packages=("nbexec-tiny", "nbexec-dep"),
                                package_cache=str(cache), source=where)


@pytest.fixture(params=["local", "remote"])
def config(request: pytest.FixtureRequest, node: cluster.Server, web: int, index: Index, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[nbexec.SandboxConfig]:
    monkeypatch.setenv("NBEXEC_NODES", node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    made = _config(request.param, web, index, tmp_path / "wheels")
    yield made
    remote.forget_all()


def _node(config: nbexec.SandboxConfig, node: cluster.Server) -> str | None:
    return node.name if config.source == "remote" else None


# -- one result, two sources ---------------------------------------------------------------------------------

EVERYTHING = """
import sys, urllib.request, matplotlib.pyplot as plt
print('out')
print('err', file=sys.stderr)
open('/mnt/data/made.csv', 'w').write('a,b\\n1,2\\n')
print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=10).read().decode())
plt.plot([1, 2, 3]); plt.show()
import nbexec_tiny
print(nbexec_tiny.VALUE)
"""


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_a_result_has_the_same_shape_on_both(node: cluster.Server, web: int, index: Index, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBEXEC_NODES", node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    results = {}
    for where in ("local", "remote"):
        config = _config(where, web, index, tmp_path / "wheels")
        results[where] = nbexec.execute_notebook(EVERYTHING.format(port=web), config=config, packages=["nbexec-tiny"],
                                                 files={"in.txt": b"given"}, output_dir=tmp_path / where)
    local, far = results["local"], results["remote"]
    assert local.ok and far.ok, (local.error, far.error)
    assert (local.node, far.node) == (None, node.name)
    shapes = {where: _shape(r.to_dict()) for where, r in results.items()}
    shapes["local"]["node"] = "str"  # the one field that differs in kind: where it ran
    assert shapes["remote"] == shapes["local"]
    for field in ("stdout", "stderr", "text", "truncated_bytes", "skipped_files"):
        assert getattr(far, field) == getattr(local, field), field
    assert [(f.name, f.size, f.sha256) for f in far.files] == [(f.name, f.size, f.sha256) for f in local.files]
    assert [(p.name, p.status, p.version) for p in far.packages] == [(p.name, p.status, p.version)
                                                                      for p in local.packages]
    assert [(c.host, c.port, c.allowed) for c in far.connections] == [(c.host, c.port, c.allowed)
                                                                       for c in local.connections]
    assert len(far.images) == len(local.images) == 1
    assert [re.sub(r"[\d.]+ s", "N s", n) for n in far.notes] == [re.sub(r"[\d.]+ s", "N s", n) for n in local.notes]
    assert set(far.timings) == set(local.timings)
    for result in results.values():  # files and images are on this host, private
        for item in (*result.files, *result.images):
            assert Path(item.path).is_file() and os.stat(item.path).st_mode & 0o077 == 0


def test_a_result_round_trips_through_its_json(config: nbexec.SandboxConfig, node: cluster.Server,
                                               tmp_path: Path) -> None:
    result = nbexec.execute_notebook("print(1)\nraise KeyError('k')", config=config, output_dir=tmp_path / "out")
    data = json.loads(result.to_json())
    assert ExecutionResult.from_dict(data).to_dict() == data
    jsonschema.validate(data, json_schema())
    jsonschema.validate(result.to_dict(public=True), json_schema(public=True))
    assert not result.ok and result.error is not None and result.error.ename == "KeyError"
    assert result.node == _node(config, node)


# -- the public API, on each source ----------------------------------------------------------------------------

def test_run_notebook_stops_at_the_first_failure(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    nb = v4.new_notebook(cells=[v4.new_markdown_cell("# title"), v4.new_code_cell("x = 1\nprint('one')"),
                                v4.new_code_cell("print('two')\n1 / 0"), v4.new_code_cell("print('never')")])
    with nbexec.Session(config, output_dir=tmp_path / "out") as session:
        result = session.run_notebook(nb)
        assert not result.ok and result.error is not None
        assert (result.error.ename, result.error.cell_index) == ("ZeroDivisionError", 2)
        assert result.stdout == "one\ntwo\n"
        saved = json.loads(Path(result.notebook_path or "").read_text())
        assert saved["cells"][3]["outputs"] == [] and saved["metadata"]["nbexec"]["ok"] is False
        assert session.run("print(x)").stdout == "1\n"  # the session goes on


def test_a_session_keeps_state_files_and_packages(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    with nbexec.Session(config, output_dir=tmp_path / "out") as session:
        assert session.run("x = 1").ok
        installed = session.install("nbexec-tiny")
        assert sorted((p.name, p.status) for p in installed) == [("nbexec-dep", "provided"),
                                                                 ("nbexec-tiny", "installed")]
        assert session.run("import nbexec_tiny\nprint(nbexec_tiny.VALUE + x)").stdout == "43\n"
        assert session.upload(b"a,b\n", "sub/in.csv") == "/mnt/data/sub/in.csv"
        ran = session.run("open('/mnt/data/out.txt', 'w').write(open('/mnt/data/sub/in.csv').read().upper())")
        assert {f.name for f in ran.files} == {"sub/in.csv", "out.txt"}
        assert session.download("out.txt") == b"A,B\n"
        assert sorted(f.name for f in session.files()) == ["out.txt", "sub/in.csv"]
        with pytest.raises(nbexec.FileTransferError):
            session.download("../escape")
        session.restart()
        after = session.run("print('x' in globals())\nprint(open('/mnt/data/out.txt').read(), end='')")
        assert after.stdout == "False\nA,B\n", after  # variables gone, files kept


def test_a_session_sleeps_and_wakes_with_its_rules(config: nbexec.SandboxConfig, web: int, tmp_path: Path) -> None:
    """Sleep (runc: by replay) on both sources, with an allowlist whose change must outlive the sleep."""
    fetch = (f"import urllib.request, urllib.error\ntry:\n    urllib.request.urlopen('http://127.0.0.1:{web}/', "
             "timeout=10)\n    print('reached')\nexcept urllib.error.HTTPError as exc:\n    print(exc.code)\n")
    with nbexec.Session(config, output_dir=tmp_path / "out") as session:
        assert session.run("x = 41\nopen('kept.txt', 'w').write('k')\n" + fetch).stdout == "reached\n"
        session.deny_hosts(f"127.0.0.1:{web}")
        assert session.hibernate() and session.status == "asleep"
        woke = session.run("print(x + 1, open('kept.txt').read())\n" + fetch)
        assert woke.restored == "replay" and woke.stdout == "42 k\n403\n", (woke.stdout, woke.notes)


def test_interrupt_stops_the_running_cell(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    started = threading.Event()
    with nbexec.Session(config, output_dir=tmp_path / "out") as session:
        session.start()
        found: list[nbexec.ExecutionResult] = []
        runner = threading.Thread(target=lambda: found.append(session.run(
            "import time\nprint('started', flush=True)\ntime.sleep(120)",
            on_output=lambda index, output: started.set())))
        runner.start()
        wait_until(started.is_set, 60, "the cell never started")
        session.interrupt()
        runner.join(timeout=90)
        assert found and found[0].error is not None and found[0].error.ename == "KeyboardInterrupt", found
        assert session.run("print('still here')").stdout == "still here\n"


def test_a_timeout_is_a_failed_run(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    result = nbexec.execute_notebook("print('spin', flush=True)\nwhile True: pass", config=config, timeout=3,
                                     output_dir=tmp_path / "out")
    assert not result.ok and result.error is not None and result.error.kind == "timeout"
    assert result.stdout == "spin\n"


def test_errors_images_and_widgets(config: nbexec.SandboxConfig, node: cluster.Server, tmp_path: Path) -> None:
    code = ("import ipywidgets as w, matplotlib.pyplot as plt\ns = w.IntSlider(value=3)\ndisplay(s)\ns.value = 7\n"
            "plt.plot([1, 2]); plt.show()\nraise ValueError('after all that')")
    result = nbexec.execute_notebook(code, config=config, output_dir=tmp_path / "out")
    assert not result.ok and result.error is not None
    assert (result.error.ename, result.error.kind, result.error.cell_index) == ("ValueError", "exception", 0)
    assert "ValueError" in result.error.traceback[-1]
    assert len(result.images) == 1 and Path(result.images[0].path).read_bytes()[:4] == b"\x89PNG"
    saved = json.loads(Path(result.notebook_path or "").read_text())
    models = saved["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert [m["state"]["value"] for m in models.values() if m["model_name"] == "IntSliderModel"] == [7]
    assert saved["metadata"]["nbexec"].get("node") == _node(config, node)


def test_an_exit_and_papermill_metadata(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    nb = v4.new_notebook(cells=[v4.new_code_cell("print('ran')\nimport sys\nsys.exit(0)"),
                                v4.new_code_cell("print('not run')")])
    result = nbexec.execute_notebook(nb, config=config, output_dir=tmp_path / "out")
    assert result.ok and result.stdout == "ran\n" and any("SystemExit" in n for n in result.notes), result
    saved = json.loads(Path(result.notebook_path or "").read_text())
    assert saved["metadata"]["papermill"]["duration"] is not None
    assert saved["metadata"]["nbexec"]["exit"]["cells_not_run"] == 1


def test_outputs_stream_and_input_files_arrive(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []
    result = nbexec.execute_notebook(
        "print(open('/mnt/data/in.csv').read().strip())\nprint('done')", config=config,
        files={"in.csv": b"1,2"}, on_output=lambda index, output: seen.append((index, output.get("text", ""))),
        output_dir=tmp_path / "out")
    assert result.ok and result.stdout == "1,2\ndone\n"
    assert "".join(text for _, text in seen) == "1,2\ndone\n" and {index for index, _ in seen} == {0}
    assert [f.name for f in result.files] == ["in.csv"]


def test_budgets_hold_on_both(config: nbexec.SandboxConfig, tmp_path: Path) -> None:
    """The output budget is charged where the result is kept (and, on a node, where the bytes first arrive)."""
    small = dataclasses.replace(config, max_output="10k", max_files=2)
    result = nbexec.execute_notebook("print('x' * 200_000)\nfor i in range(5):\n    open(f'/mnt/data/{i}', 'w')",
                                     config=small, output_dir=tmp_path / "out")
    assert result.ok and len(result.stdout) <= 10 * 1024 and result.truncated_bytes > 180_000
    assert len(result.files) == 2 and any("max_files" in note for note in result.notes), result.notes
