"""``pagedllm operator``: run the kopf operator for ``PagedLLM`` resources.

    pagedllm operator [--all-namespaces | --namespace NS ...] [--standalone]
                      [--liveness URL] [--default-image IMAGE] [-v | -d | -q]
                      [--autoscaler hpa|keda] [--prometheus-address URL]
                      [--pod-monitor-label KEY=VALUE ...]

Without ``--namespace`` it serves the whole cluster. With ``--leader-elect`` several
replicas may run: the one holding the ``coordination.k8s.io`` Lease reconciles, the
others stand by (:mod:`leader`); what the Helm chart does with its 2 replicas. Without
it, run exactly one replica (kopf's peering does not elect a leader: peers of equal
priority all pause).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from importlib import metadata

import kopf

from pagedllm.operator.autoscaling import AUTOSCALERS, HPA
from pagedllm.operator.elected import run_elected
from pagedllm.operator.endpoint_picker import DEFAULT_PICKER_IMAGE
from pagedllm.operator.handlers import build_registry, make_memo, operator_settings
from pagedllm.operator.kube import KubeClient
from pagedllm.operator.leader import LeaderElector, LeaseConfig
from pagedllm.operator.manifests import DEFAULT_PROMETHEUS, RenderConfig
from pagedllm.operator.metrics import OperatorMetrics
from pagedllm.operator.policy import AdminPolicy

DEFAULT_IMAGE_ENV = "PAGEDLLM_DEFAULT_IMAGE"
AUTOSCALER_ENV = "PAGEDLLM_AUTOSCALER"
PROMETHEUS_ENV = "PAGEDLLM_PROMETHEUS_ADDRESS"
PICKER_IMAGE_ENV = "PAGEDLLM_ENDPOINT_PICKER_IMAGE"
POD_NAMESPACE_ENV = "POD_NAMESPACE"
POD_NAME_ENV = "POD_NAME"
IMAGE_REPOSITORY = "ghcr.io/pagedllm/pagedllm"


def _default_image() -> str:
    try:
        version = metadata.version("pagedllm")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        version = "latest"
    return os.environ.get(DEFAULT_IMAGE_ENV) or f"{IMAGE_REPOSITORY}:{version}"


def label_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (KEY, VALUE); the operator's own app.kubernetes.io/ labels are not allowed."""
    key, sep, value = text.partition("=")
    if not sep or not key or key.startswith("app.kubernetes.io/"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: KEY=VALUE with a label key outside app.kubernetes.io/ (the operator's own)"
        )
    return key, value


def add_operator_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the operator's flags to ``parser``."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="Serve PagedLLM resources in every namespace (the default)."
    )
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="Serve only this namespace; repeat for several.",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="Run without kopf peering (one operator replica; what the chart does).",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="kopf peering object to coordinate through (needs kopf's peering CRDs).",
    )
    parser.add_argument(
        "-L",
        "--liveness",
        metavar="URL",
        default=None,
        help="Serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz.",
    )
    parser.add_argument(
        "--default-image",
        default=_default_image(),
        metavar="IMAGE",
        help=f"Server image for resources without spec.image (env {DEFAULT_IMAGE_ENV}; default: %(default)s).",
    )
    parser.add_argument(
        "--autoscaler",
        choices=list(AUTOSCALERS),
        default=os.environ.get(AUTOSCALER_ENV) or HPA,
        help="What spec.autoscaling renders to: hpa (a HorizontalPodAutoscaler on custom metrics) or keda "
        f"(a KEDA ScaledObject with a Prometheus trigger; allows minReplicas 0) (env {AUTOSCALER_ENV}; "
        "default: %(default)s).",
    )
    parser.add_argument(
        "--prometheus-address",
        default=os.environ.get(PROMETHEUS_ENV) or DEFAULT_PROMETHEUS,
        metavar="URL",
        help=f"Prometheus that KEDA's triggers query (env {PROMETHEUS_ENV}; default: %(default)s).",
    )
    parser.add_argument(
        "--endpoint-picker-image",
        default=os.environ.get(PICKER_IMAGE_ENV) or DEFAULT_PICKER_IMAGE,
        metavar="IMAGE",
        help="Image of the endpoint pickers deployed for spec.routing.endpointPicker.deploy "
        f"(env {PICKER_IMAGE_ENV}; default: %(default)s).",
    )
    parser.add_argument(
        "--pod-monitor-label",
        dest="pod_monitor_labels",
        type=label_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A label of every PodMonitor, for a Prometheus that selects them by label (kube-prometheus-stack: "
        "release=RELEASE); repeat for several.",
    )
    parser.add_argument(
        "--network-policies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Give each PagedLLM NetworkPolicies (API port from its namespace or spec.networkPolicy.apiClients, "
        "a multi-node group's ports from its own pods, egress only where downloads run); "
        "--no-network-policies renders none (default: on).",
    )
    parser.add_argument(
        "--network-policy-namespace",
        dest="network_policy_namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="A namespace whose pods may reach every PagedLLM's API port whatever its networkPolicy.apiClients "
        "(Prometheus scraping /metrics, a Gateway's proxies); repeat for several.",
    )
    parser.add_argument(
        "--operator-namespace",
        default=None,
        metavar="NS",
        help="The operator's own namespace: its pods (app.kubernetes.io/component=operator) may reach the API port "
        "of a PagedLLM with LoRA on, to load and unload adapters at run time (default: unset, no such rule).",
    )
    parser.add_argument(
        "--keda-http-interceptor",
        default=None,
        metavar="SERVICE.NAMESPACE:PORT",
        help="KEDA's HTTP add-on interceptor proxy (with --autoscaler keda): a PagedLLM with autoscaling.minReplicas "
        "0 gets an HTTPScaledObject and a NAME-http Service whose requests the interceptor holds while a pod "
        "starts (default: unset, the Prometheus-triggered ScaledObject).",
    )
    for flag, what in (
        ("--allowed-image", "an image pattern (fnmatch: ghcr.io/org/*) server and picker containers may run"),
        (
            "--allowed-service-account",
            "a spec.serviceAccountName resources may use besides 'default' (none "
            "given: only the namespace's default account)",
        ),
        ("--allowed-priority-class", "a spec.priorityClassName resources may use"),
        ("--allowed-runtime-class", "a spec.runtimeClassName resources may use"),
    ):
        parser.add_argument(
            flag,
            action="append",
            default=[],
            metavar="NAME",
            help=f"Allow {what}; repeat for several. None given: anything is allowed.",
        )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="Serve the operator's Prometheus metrics at http://0.0.0.0:PORT/metrics (0: off, the default).",
    )
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="Reconcile only while holding a coordination.k8s.io Lease, so several replicas may run "
        "(one leads, the others stand by); what the chart does.",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=os.environ.get(POD_NAMESPACE_ENV) or "default",
        metavar="NS",
        help=f"Namespace of the Lease (env {POD_NAMESPACE_ENV}; default: %(default)s).",
    )
    parser.add_argument(
        "--leader-election-id",
        default=os.environ.get(POD_NAME_ENV) or socket.gethostname(),
        metavar="ID",
        help=f"This replica's identity in the Lease (env {POD_NAME_ENV}, else the host name).",
    )
    parser.add_argument(
        "--lease-duration",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="How long a Lease not renewed stays its holder's (default: %(default)s).",
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="Log handler activity in detail.")
    verbosity.add_argument("-d", "--debug", action="store_true", help="Log everything, API calls included.")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="Log warnings and errors only.")
    parser.add_argument(
        "--log-format",
        choices=["plain", "full", "json"],
        default="full",
        help="Log line format (default: %(default)s).",
    )
    return parser


def run_operator(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit code."""
    if args.standalone and args.peering:
        raise ValueError("--standalone and --peering exclude each other: choose one")
    kopf.configure(
        debug=args.debug,
        verbose=args.verbose,
        quiet=args.quiet,
        log_format=kopf.LogFormat[args.log_format.upper()],
        log_prefix=True,
    )
    settings = operator_settings()
    config = RenderConfig(
        default_image=args.default_image,
        autoscaler=args.autoscaler,
        prometheus_address=args.prometheus_address,
        pod_monitor_labels=tuple(args.pod_monitor_labels),
        endpoint_picker_image=args.endpoint_picker_image,
        network_policies=args.network_policies,
        network_policy_namespaces=tuple(args.network_policy_namespaces),
        operator_namespace=args.operator_namespace,
        http_interceptor=args.keda_http_interceptor,
    )
    kube = KubeClient()
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    policy = AdminPolicy(
        images=tuple(args.allowed_image),
        service_accounts=tuple(args.allowed_service_account),
        priority_classes=tuple(args.allowed_priority_class),
        runtime_classes=tuple(args.allowed_runtime_class),
    )
    memo = make_memo(config, kube, metrics, policy)
    options = dict(
        registry=build_registry(args.autoscaler),
        settings=settings,
        memo=memo,
        standalone=True if args.standalone or args.leader_elect else None,
        peering_name=args.peering,
        clusterwide=not args.namespaces,
        namespaces=args.namespaces,
        liveness_endpoint=args.liveness,
    )
    if not args.leader_elect:
        metrics.leader.set(1)
        kopf.run(**options)
        return 0
    duration = args.lease_duration
    lease = LeaseConfig(
        namespace=args.leader_election_namespace,
        identity=args.leader_election_id,
        lease_duration=duration,
        renew_deadline=duration * 2 / 3,
        retry_period=duration * 2 / 15,
    )

    async def operate(stop: asyncio.Event) -> None:
        metrics.leader.set(1)
        try:
            await kopf.operator(stop_flag=stop, **options)
        finally:
            metrics.leader.set(0)

    return asyncio.run(run_elected(LeaderElector(KubeClient(), lease), args.liveness, operate))
