"""OpenTelemetry traces (the ``otel`` extra): each execution's span tree, read with the SDK's in-memory exporter from
a tracer provider the test sets up as a user would; nothing of the code, its output or its secrets in any span; and
nothing imported or made without it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

import nbexec
from nbexec.engine import traces

from . import cluster
from .conftest import IMAGE, wait_until

SECRET = "printed-secret-4f1c9a"
TOKEN = "env-token-8d2e77b0"
CODE_MARK = "distinctive_code_name_31"
ROOT = Path(__file__).resolve().parent.parent

try:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
except ImportError as exc:  # the test extra installs it: a missing one fails, it does not skip
    raise ImportError("tests/test_traces.py needs the otel extra: pip install -e '.[test]'") from exc


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The SDK's in-memory exporter on the global tracer provider (set once per process, as a user sets it)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    found = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(found))
    return found


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter
    exporter.clear()


def _notebook(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# a title")] + [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


def _tree(found: tuple[ReadableSpan, ...]) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    """The one root of ``found`` and its children by name; every span in the root's trace, under the root."""
    roots = [s for s in found if s.parent is None]
    assert [s.name for s in roots] == ["nbexec.execute"], [s.name for s in found]
    root = roots[0]
    children: dict[str, list[ReadableSpan]] = {}
    for item in found:
        if item is root:
            continue
        assert item.context.trace_id == root.context.trace_id
        assert item.parent is not None and item.parent.span_id == root.context.span_id, item.name
        children.setdefault(item.name, []).append(item)
    return root, children


def _clean(found: tuple[ReadableSpan, ...]) -> None:
    """No span carries the code, what it printed or raised, or the sandbox's environment values."""
    for item in found:
        text = item.to_json()
        for needle in (SECRET, TOKEN, CODE_MARK):
            assert needle not in text, f"{needle} in span {item.name}: {text}"


def test_one_execution_is_one_tree(spans: InMemorySpanExporter, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60, env={"API_TOKEN": TOKEN})
    nb = _notebook(f"{CODE_MARK} = 1\nprint('{SECRET}')",
                   "import os\nprint(os.environ['API_TOKEN'])\nopen('/mnt/data/out.txt', 'w').write('x')")
    result = nbexec.execute_notebook(nb, config=config)
    assert result.ok and SECRET in result.stdout and TOKEN in result.stdout, result.error
    found = spans.get_finished_spans()
    root, children = _tree(found)
    assert sorted(children) == ["nbexec.acquire", "nbexec.cell", "nbexec.collect", "nbexec.packages",
                                "nbexec.upload"]
    assert {k: len(v) for k, v in children.items()}["nbexec.cell"] == 2
    attributes = dict(root.attributes or {})
    assert attributes == {"nbexec.session_hash": attributes["nbexec.session_hash"], "nbexec.image": IMAGE,
                          "nbexec.runtime": "default", "nbexec.execution_hash": traces.pseudonym(result.execution_id),
                          "nbexec.ok": True, "nbexec.node": "", "nbexec.error_kind": ""}
    assert root.status.status_code == trace.StatusCode.UNSET
    cells = [dict(c.attributes or {}) for c in children["nbexec.cell"]]
    assert cells == [{"nbexec.cell.index": 1, "nbexec.cell.status": "ok"},
                     {"nbexec.cell.index": 2, "nbexec.cell.status": "ok"}]
    assert dict(children["nbexec.upload"][0].attributes or {}) == {"nbexec.files": 1, "nbexec.images": 0}
    assert dict(children["nbexec.acquire"][0].attributes or {}) == {"nbexec.purpose": "oneshot"}
    order = [s.name for s in sorted(found, key=lambda s: s.start_time or 0)]
    assert order == ["nbexec.execute", "nbexec.acquire", "nbexec.packages", "nbexec.cell", "nbexec.cell",
                     "nbexec.collect", "nbexec.upload"]
    _clean(found)


def test_a_failed_run_marks_its_spans(spans: InMemorySpanExporter, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    nb = _notebook("print('fine')", f"raise ValueError('{SECRET}')", "print('never')")
    result = nbexec.execute_notebook(nb, config=config)
    assert not result.ok and result.error is not None and SECRET in result.error.evalue
    found = spans.get_finished_spans()
    root, children = _tree(found)
    assert result.error.kind == "exception"
    assert root.status.status_code == trace.StatusCode.ERROR and root.status.description == "exception"
    assert dict(root.attributes or {})["nbexec.ok"] is False
    assert dict(root.attributes or {})["nbexec.error_kind"] == "exception"
    cells = children["nbexec.cell"]
    assert [(dict(c.attributes or {})["nbexec.cell.status"], c.status.status_code) for c in cells] == [
        ("ok", trace.StatusCode.UNSET), ("error", trace.StatusCode.ERROR)], "the cell after the failure ran"
    _clean(found)


def test_a_session_acquires_once(spans: InMemorySpanExporter, cleanup_ledger: None) -> None:
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    session = nbexec.Session(config)  # started by its first run: the acquisition is in that run's trace
    try:
        session.run("x = 1")
        first = spans.get_finished_spans()
        spans.clear()
        second = session.run("print(x)")
    finally:
        session.close()
    _, before = _tree(first)
    root, after = _tree(spans.get_finished_spans())
    assert "nbexec.acquire" in before and "nbexec.acquire" not in after
    assert dict(root.attributes or {})["nbexec.execution_hash"] == traces.pseudonym(second.execution_id)
    assert dict(before["nbexec.acquire"][0].attributes or {}) == {"nbexec.purpose": "session"}


def test_a_session_started_before_its_runs_acquires_in_a_trace_of_its_own(spans: InMemorySpanExporter,
                                                                          cleanup_ledger: None) -> None:
    """`with Session(...)` (or start()) acquires before any run: that acquisition is one span of its own, never
    in a run's tree, and the first run's tree holds no acquisition."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    with nbexec.Session(config) as session:
        acquired = spans.get_finished_spans()
        spans.clear()
        result = session.run("print(1)")
        ran = spans.get_finished_spans()
    assert [(s.name, s.parent) for s in acquired] == [("nbexec.acquire", None)], [s.name for s in acquired]
    assert dict(acquired[0].attributes or {}) == {"nbexec.purpose": "session"}
    root, children = _tree(ran)
    assert "nbexec.acquire" not in children and dict(root.attributes or {})["nbexec.execution_hash"] == (
        traces.pseudonym(result.execution_id))
    assert root.context.trace_id != acquired[0].context.trace_id


def test_no_span_carries_a_session_or_execution_id(spans: InMemorySpanExporter, cleanup_ledger: None) -> None:
    """Attack (#36): ids in clear let whoever reads the traces name (and, over the API, reach for) a session; spans
    carry a keyed hash of each instead, the same for one session's runs so they still correlate."""
    config = nbexec.SandboxConfig(image=IMAGE, pool_size=0, warm_imports=(), timeout=60)
    session = nbexec.Session(config)
    try:
        first = session.run("x = 1")
        second = session.run("print(x)")
    finally:
        session.close()
    found = spans.get_finished_spans()
    ids = (session.id, first.execution_id, second.execution_id)
    for item in found:
        text = item.name + json.dumps(dict(item.attributes or {}))
        assert not [i for i in ids if i in text], f"an id in clear in span {item.name}: {text}"
    roots = [dict(s.attributes or {}) for s in found if s.parent is None and s.name == "nbexec.execute"]
    assert [r["nbexec.session_hash"] for r in roots] == [traces.pseudonym(session.id)] * 2
    assert [r["nbexec.execution_hash"] for r in roots] == [traces.pseudonym(first.execution_id),
                                                           traces.pseudonym(second.execution_id)]


def test_a_remote_run_gives_the_library_side_spans(spans: InMemorySpanExporter, docker_ready: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from nbexec.sandbox.remote import source as remote

    tmp = Path(tempfile.mkdtemp(prefix="t-"))
    tmp.chmod(0o755)
    node = cluster.node(0, tmp, tag="t")
    node.env["NBEXEC_POOL_SIZE"] = "0"
    node.start()
    monkeypatch.setenv("NBEXEC_NODES", node.url)
    monkeypatch.setenv("NBEXEC_NODE_TOKEN", cluster.NODE_TOKEN)
    remote.forget_all()
    try:
        cluster.wait_ready([node])
        config = nbexec.SandboxConfig(image=IMAGE, source="remote", timeout=60)
        result = nbexec.execute_notebook(_notebook(f"print('{SECRET}')"), config=config)
        assert result.ok and result.node == node.name, result.error
        root, children = _tree(spans.get_finished_spans())
        assert dict(root.attributes or {})["nbexec.node"] == node.name
        assert sorted(children) == ["nbexec.acquire", "nbexec.cell", "nbexec.collect", "nbexec.packages",
                                    "nbexec.upload"]
        _clean(spans.get_finished_spans())
    finally:
        remote.forget_all()
        node.kill(signal.SIGTERM)
        wait_until(lambda: not node.containers(), 60, "the node left containers behind")


def test_without_opentelemetry_nothing_is_imported_or_made(cleanup_ledger: None) -> None:
    """In a fresh process that never imported OpenTelemetry: importing nbexec and running code import none of it."""
    script = (
        "import sys, json, nbexec\n"
        "from nbexec.engine import traces\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        f"result = nbexec.execute_notebook('print(6 * 7)', config=nbexec.SandboxConfig(image={IMAGE!r}, "
        "pool_size=0, warm_imports=(), timeout=60))\n"
        "print(json.dumps([loaded, [m for m in sys.modules if m.startswith('opentelemetry')], result.stdout]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded: list[Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == [[], [], "42\n"], loaded


def test_the_example_prints_one_calls_trace(cleanup_ledger: None) -> None:
    """examples/traces.py, as docs/traces.md shows it: the tree of one call, each span under its parent."""
    done = subprocess.run([sys.executable, "examples/traces.py"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ok=True stdout='45\\n' files=['numbers.json']")
    assert [line.split()[0] for line in lines[2:]] == ["nbexec.execute", "nbexec.acquire", "nbexec.packages",
                                                       "nbexec.cell", "nbexec.cell", "nbexec.collect",
                                                       "nbexec.upload"]
    assert [len(line) - len(line.lstrip()) for line in lines[2:]] == [0, 2, 2, 2, 2, 2, 2]
