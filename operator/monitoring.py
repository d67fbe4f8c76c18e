"""Rendering what Prometheus needs to scrape the servers' ``/metrics``.

- A Prometheus Operator ``PodMonitor`` (``monitoring.coreos.com/v1``), applied only where
  the cluster serves that kind.
- ``prometheus.io/scrape|port|path`` annotations on the pods, read by the common
  annotation-driven scrape configurations of Prometheus without the operator.

NOTE: the annotations are on every pod template, whether a PodMonitor exists or not: the
template must not depend on which CRDs the cluster has, or installing the Prometheus
Operator would restart every model server (a new template is a rollout). Prometheus
Operator setups ignore these annotations unless configured to read them.
"""

from __future__ import annotations

METRICS_PATH = "/metrics"
SCRAPE_INTERVAL = "15s"
POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"


def scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": METRICS_PATH}


def render_pod_monitor(name: str, selector: dict[str, str], port_name: str, labels: dict[str, str]) -> dict:
    """Scrape the pods matching ``selector`` on their named port.

    ``labels`` are what the cluster's Prometheus selects PodMonitors by (kube-prometheus-stack
    picks only those labelled ``release: <its release>`` unless told otherwise).
    """
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "podMetricsEndpoints": [{"port": port_name, "path": METRICS_PATH, "interval": SCRAPE_INTERVAL}],
        },
    }
