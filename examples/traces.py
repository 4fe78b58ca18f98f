"""Print the OpenTelemetry trace of one execution (needs the otel extra: pip install 'nbexec-sandbox[otel]').

nbexec never configures OpenTelemetry: the caller sets its tracer provider up, here the SDK's with an in-memory
exporter (an OTLP exporter to Jaeger, Tempo or Honeycomb is set up the same way), and every execution then
reports its spans to it.

    python examples/traces.py
"""

from __future__ import annotations

import nbformat
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import nbexec

CELLS = ["import json\nnumbers = list(range(10))\nprint(sum(numbers))",
         "with open('/mnt/data/numbers.json', 'w') as handle:\n    json.dump(numbers, handle)"]


def show(spans: tuple[ReadableSpan, ...]) -> None:
    """Each span under its parent: name, milliseconds, attributes."""
    first = min(s.start_time or 0 for s in spans)
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in spans:
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)

    def walk(parent: int | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            start = ((span.start_time or 0) - first) / 1e6
            took = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
            status = "" if span.status.is_unset else f" [{span.status.status_code.name} {span.status.description}]"
            attributes = " ".join(f"{k.removeprefix('nbexec.')}={v}" for k, v in (span.attributes or {}).items())
            print(f"{'  ' * depth}{span.name:<{26 - 2 * depth}} +{start:7.1f} ms {took:8.1f} ms  {attributes}{status}")
            walk(span.context.span_id, depth + 1)

    walk(None, 0)


def main() -> None:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in CELLS])
    result = nbexec.execute_notebook(notebook, pool_size=0)
    print(f"ok={result.ok} stdout={result.stdout!r} files={[f.name for f in result.files]}\n")
    show(exporter.get_finished_spans())


if __name__ == "__main__":
    main()
