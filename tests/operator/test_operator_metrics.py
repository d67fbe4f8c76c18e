"""The operator's /metrics: reconciles, their duration, resources by phase, leadership."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.operator.metrics import OperatorMetrics
from tests.support import free_port


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_passes_and_phases_are_counted_and_served():
    metrics = OperatorMetrics()
    metrics.passed("spec", "ok", 0.02)
    metrics.passed("event", "ok", 0.3)
    metrics.passed("event", "retry", 0.01)
    metrics.phase(("ml", "a"), "Pending")
    metrics.phase(("ml", "b"), "Pending")
    metrics.phase(("ml", "a"), "Ready")  # moved on
    metrics.phase(("ml", "c"), "Degraded")
    metrics.phase(("ml", "c"), None)  # deleted
    metrics.leader.set(1)
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        found = samples(response.read().decode())
    assert found[("pagedllm_operator_reconciles_total", (("result", "ok"), ("trigger", "event")))] == 1
    assert found[("pagedllm_operator_reconciles_total", (("result", "retry"), ("trigger", "event")))] == 1
    assert found[("pagedllm_operator_reconciles_total", (("result", "ok"), ("trigger", "spec")))] == 1
    assert found[("pagedllm_operator_reconcile_duration_seconds_count", (("trigger", "event"),))] == 2
    assert found[("pagedllm_operator_reconcile_duration_seconds_bucket", (("le", "0.05"), ("trigger", "event")))] == 1
    phases = {
        p: found[("pagedllm_operator_managed_resources", (("phase", p),))]
        for p in ("Pending", "Ready", "Degraded", "Progressing")
    }
    assert phases == {"Pending": 1, "Ready": 1, "Degraded": 0, "Progressing": 0}
    assert found[("pagedllm_operator_leader", ())] == 1
