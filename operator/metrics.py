"""The operator's own Prometheus metrics, served on ``--metrics-port`` at ``/metrics``.

    pagedllm_operator_reconciles_total{trigger,result}       passes of the reconcile
    pagedllm_operator_reconcile_duration_seconds{trigger}    how long a pass took
    pagedllm_operator_managed_resources{phase}               PagedLLM resources by status.phase
    pagedllm_operator_leader                                 1 while this replica leads

``trigger`` is spec (created, changed, resumed), event (a child or pod) or periodic;
``result`` is ok, retry (transient API trouble, tried again later) or error. A pass whose
resource is ``Degraded`` is ok here: the resource's condition says why, not this counter.
Everything lives in one registry per operator, no module globals.
"""

from __future__ import annotations

from collections.abc import Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PHASES = ("Pending", "Progressing", "Ready", "Degraded")
TRIGGERS = ("spec", "event", "periodic")
RESULTS = ("ok", "retry", "error")
# A pass reads a handful of objects and may apply a dozen: tens of milliseconds to seconds.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """Counters of reconcile passes and the resources' phases, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "pagedllm_operator_reconciles",
            "Reconcile passes of PagedLLM resources, by what triggered them and how they ended.",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "pagedllm_operator_reconcile_duration_seconds",
            "Duration of a reconcile pass.",
            ["trigger"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.resources = Gauge(
            "pagedllm_operator_managed_resources",
            "PagedLLM resources this replica reconciled, by status.phase.",
            ["phase"],
            registry=self.registry,
        )
        self.leader = Gauge("pagedllm_operator_leader", "1 while this replica leads.", registry=self.registry)
        self._phases: dict[Hashable, str] = {}
        for phase in PHASES:
            self.resources.labels(phase=phase).set(0)

    def passed(self, trigger: str, result: str, seconds: float) -> None:
        """Count one pass."""
        self.reconciles.labels(trigger=trigger, result=result).inc()
        self.duration.labels(trigger=trigger).observe(seconds)

    def phase(self, key: Hashable, phase: str | None) -> None:
        """``key``'s resource is now in ``phase`` (``None``: gone)."""
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for name in PHASES:
            self.resources.labels(phase=name).set(sum(1 for p in self._phases.values() if p == name))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` from a background thread."""
        start_http_server(port, addr=address, registry=self.registry)
