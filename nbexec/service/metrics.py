"""The service's Prometheus metrics, kept in a registry of each app's own (never the process-wide default)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Summary, generate_latest

from nbexec.result import ExecutionResult

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Executions by kind (``oneshot``, ``session``), failures by error kind, run time, live sessions, pool."""

    def __init__(self, live_sessions: Callable[[], float], pool_ready: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.executions = Counter("nbexec_executions", "Executions finished, by kind.", ["kind"],
                                  registry=self.registry)
        self.failures = Counter("nbexec_failures", "Executions whose code failed, by error kind.", ["kind"],
                                registry=self.registry)
        self.seconds = Summary("nbexec_execution_seconds", "Time an execution took, start to result.",
                               registry=self.registry)
        Gauge("nbexec_live_sessions", "Sessions live now.", registry=self.registry).set_function(live_sessions)
        Gauge("nbexec_pool_ready", "Warm sandboxes ready now.", registry=self.registry).set_function(pool_ready)

    def record(self, kind: str, result: ExecutionResult) -> None:
        self.executions.labels(kind=kind).inc()
        self.seconds.observe(result.duration_s)
        if result.error is not None:
            self.failures.labels(kind=result.error.kind).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
