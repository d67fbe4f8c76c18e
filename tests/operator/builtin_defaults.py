"""The API server's defaulting of the built-in kinds the operator writes (``SetDefaults_*``).

A real API server stores a Deployment with ``strategy``, ``revisionHistoryLimit``,
``progressDeadlineSeconds`` and every container's ``imagePullPolicy`` and
``terminationMessagePath`` filled in, a Service with ``sessionAffinity``, ``ipFamilies``
and a ``clusterIP``. The operator reads these objects back and compares them with what
it renders, so the emulator stores them the same way: :func:`default_object`.

Only the defaults of the kinds the operator writes or reads are here (Deployment,
StatefulSet, Job, Pod, Service, PersistentVolumeClaim, HorizontalPodAutoscaler,
NetworkPolicy), taken from the Kubernetes 1.30 API reference. A CRD's embedded pod
template (a LeaderWorkerSet's) gets only its schema's defaults, as on a real cluster.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
from typing import Any

_PROBE = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}
_MODE = 0o644  # 420: defaultMode of configMap, secret, projected and downwardAPI volumes
_CLUSTER_IPS = (str(ipaddress.ip_address("10.96.0.10") + n) for n in itertools.count())


def default_object(obj: dict) -> dict:
    """``obj`` with the defaults the API server fills in for its kind (a copy; other kinds as given)."""
    defaulter = _BY_KIND.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if defaulter is None or not isinstance(obj.get("spec"), dict):
        return obj
    defaulted = copy.deepcopy(obj)
    try:
        defaulter(defaulted["spec"])
    except (AttributeError, TypeError):  # a field of the wrong type: the schema check that follows refuses it
        return obj
    return defaulted


def _fill(target: dict, defaults: dict) -> None:
    for key, value in defaults.items():
        target.setdefault(key, copy.deepcopy(value))


def pull_policy(image: str) -> str:
    """``Always`` for an image without a tag or tagged ``latest`` (and no digest), else ``IfNotPresent``."""
    if "@" in image:
        return "IfNotPresent"
    name = image.rsplit("/", 1)[-1]
    tag = name.split(":", 1)[1] if ":" in name else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _container(container: dict) -> None:
    _fill(container, {"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"})
    container.setdefault("imagePullPolicy", pull_policy(container.get("image", "")))
    for port in container.get("ports") or []:
        port.setdefault("protocol", "TCP")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container.get(name)
        if isinstance(probe, dict):
            _fill(probe, _PROBE)
            if isinstance(probe.get("httpGet"), dict):
                probe["httpGet"].setdefault("scheme", "HTTP")
    for env in container.get("env") or []:
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            field_ref.setdefault("apiVersion", "v1")


def _volume(volume: dict) -> None:
    for source in ("configMap", "secret", "projected", "downwardAPI"):
        if isinstance(volume.get(source), dict):
            volume[source].setdefault("defaultMode", _MODE)


def pod_spec(spec: dict) -> None:
    """A pod's (or pod template's) spec defaulted in place."""
    _fill(
        spec,
        {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "enableServiceLinks": True,
        },
    )
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        _container(container)
    for volume in spec.get("volumes") or []:
        _volume(volume)


def _template(spec: dict) -> None:
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        pod_spec(template["spec"])


def deployment(spec: dict) -> None:
    _fill(spec, {"replicas": 1, "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600})
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        _fill(strategy.setdefault("rollingUpdate", {}), {"maxUnavailable": "25%", "maxSurge": "25%"})
    _template(spec)


def stateful_set(spec: dict) -> None:
    _fill(spec, {"replicas": 1, "revisionHistoryLimit": 10, "podManagementPolicy": "OrderedReady"})
    _fill(spec, {"persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"}})
    strategy = spec.setdefault("updateStrategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        strategy.setdefault("rollingUpdate", {}).setdefault("partition", 0)
    for claim in spec.get("volumeClaimTemplates") or []:
        if isinstance(claim.get("spec"), dict):
            claim["spec"].setdefault("volumeMode", "Filesystem")
    _template(spec)


def job(spec: dict) -> None:
    if "completions" not in spec and "parallelism" not in spec:
        spec["completions"] = 1
    _fill(spec, {"parallelism": 1, "backoffLimit": 6, "completionMode": "NonIndexed", "suspend": False})
    _template(spec)


def service(spec: dict) -> None:
    _fill(spec, {"type": "ClusterIP", "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"})
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if spec["type"] == "ExternalName":
        return
    if "clusterIP" not in spec:
        spec["clusterIP"] = next(_CLUSTER_IPS)
    _fill(spec, {"clusterIPs": [spec["clusterIP"]], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack"})
    if spec["type"] in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")


def claim(spec: dict) -> None:
    spec.setdefault("volumeMode", "Filesystem")


def autoscaler(spec: dict) -> None:
    spec.setdefault("minReplicas", 1)
    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}
    if not spec.get("metrics"):
        spec["metrics"] = [cpu]


def network_policy(spec: dict) -> None:
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"]
    for rule in (spec.get("ingress") or []) + (spec.get("egress") or []):
        for port in rule.get("ports") or []:
            port.setdefault("protocol", "TCP")


_BY_KIND: dict[tuple[str, str], Any] = {
    ("apps/v1", "Deployment"): deployment,
    ("apps/v1", "StatefulSet"): stateful_set,
    ("batch/v1", "Job"): job,
    ("v1", "Pod"): pod_spec,
    ("v1", "Service"): service,
    ("v1", "PersistentVolumeClaim"): claim,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): autoscaler,
    ("networking.k8s.io/v1", "NetworkPolicy"): network_policy,
}
