"""Scale from zero without dropping requests: KEDA's HTTP add-on holds them while a pod starts.

With ``autoscaling.minReplicas: 0`` and an operator started with ``--keda-http-interceptor``
(the chart's ``kedaHttpAddOn.enabled``), the autoscaler is an ``HTTPScaledObject`` instead of
the Prometheus-triggered ``ScaledObject``, and clients use a second Service in front::

    client -> NAME-http (ExternalName) -> the add-on's interceptor proxy -> NAME (the pods' Service)
                                          counts in-flight requests per host; at zero replicas it
                                          holds each request until NAME has a ready endpoint

The add-on's own operator turns the ``HTTPScaledObject`` into a ScaledObject on its external
scaler: replicas follow the in-flight requests the interceptor sees (``concurrency``, target
``autoscaling.target`` per replica), ``0..maxReplicas``, idle for ``scaleDownDelaySeconds``
before going back to zero. The interceptor routes by the ``Host`` header (port stripped), so
``hosts`` lists every in-cluster spelling of ``NAME-http``.

While a pod starts (scheduling, image pull, model download and load: minutes), a request waits
at the interceptor up to ``timeouts.conditionWait`` (here ``startupTimeoutSeconds`` plus a
margin); if no pod is ready by then it gets HTTP 504 ("backend not ready"). Once a pod is ready
the request goes through with ``X-KEDA-HTTP-Cold-Start: true`` on its response. A
non-streaming completion sends its headers only when it is done: ``timeouts.responseHeader``
is long enough for a long generation.
"""

from __future__ import annotations

from pagedllm.operator.spec import PagedLLMSpec, SpecError

API_VERSION = "http.keda.sh/v1alpha1"
KIND = "HTTPScaledObject"
CRD = "httpscaledobjects.http.keda.sh"
SERVICE_SUFFIX = "-http"
COLD_START_MARGIN_SECONDS = 600  # scheduling, image pull and the download come before the startup budget
RESPONSE_HEADER_SECONDS = 900


def parse_interceptor(value: str) -> tuple[str, str, int]:
    """``SERVICE.NAMESPACE:PORT`` -> (service, namespace, port); ``ValueError`` naming the flag otherwise."""
    host, _, port = value.rpartition(":")
    service, _, namespace = host.partition(".")
    if not (service and namespace and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"--keda-http-interceptor={value!r} is not allowed: SERVICE.NAMESPACE:PORT of the add-on's "
            "interceptor proxy, e.g. keda-add-ons-http-interceptor-proxy.keda:8080"
        )
    return service, namespace.removesuffix(".svc"), int(port)


def wants_http_scaling(spec: PagedLLMSpec, interceptor: str | None) -> bool:
    return interceptor is not None and spec.autoscaling is not None and spec.autoscaling.min_replicas == 0


def proxy_service_name(name: str) -> str:
    return name + SERVICE_SUFFIX


def render_http_scaled_object(name: str, namespace: str, spec: PagedLLMSpec) -> dict:
    """The add-on's scaler and route for the Deployment ``name`` behind its Service ``name``."""
    scaling = spec.autoscaling
    if scaling is None:
        raise SpecError("spec.autoscaling is required to scale from zero")
    proxy = proxy_service_name(name)
    hosts = [proxy, f"{proxy}.{namespace}", f"{proxy}.{namespace}.svc", f"{proxy}.{namespace}.svc.cluster.local"]
    wait = spec.startup_timeout_seconds + COLD_START_MARGIN_SECONDS
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "hosts": hosts,
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": name,
                "service": name,
                "port": spec.port,
            },
            "replicas": {"min": 0, "max": scaling.max_replicas},
            "scaledownPeriod": scaling.scale_down_delay_seconds,
            "scalingMetric": {"concurrency": {"targetValue": max(1, round(scaling.target))}},
            "timeouts": {"conditionWait": f"{wait}s", "responseHeader": f"{RESPONSE_HEADER_SECONDS}s"},
        },
    }


def render_proxy_service(name: str, interceptor: str) -> dict:
    """``NAME-http``: the address that holds requests, a DNS alias of the interceptor proxy."""
    service, namespace, port = parse_interceptor(interceptor)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": proxy_service_name(name)},
        "spec": {
            "type": "ExternalName",
            "externalName": f"{service}.{namespace}.svc.cluster.local",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        },
    }
