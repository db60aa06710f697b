"""``pd-operator``: the operator process (kopf, in-process, with pd-operator's handlers only).

    pd-operator --all-namespaces                      # every namespace (ClusterRole)
    pd-operator --namespace team-a --namespace team-b # only these (Role per namespace)
    pd-operator -A --peering pd-operator              # several replicas: one active, the others standby

Without ``--peering`` the operator runs standalone (one replica). With it, every replica draws a
random peering priority: kopf keeps only the highest live one active. Kubernetes access comes from
the pod's service account, else from the current kubeconfig context.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from http import HTTPStatus

import kopf
import prometheus_client

from pdoperator.reconcile.handlers import HandlerSettings, record_event, register
from pdoperator.reconcile.kube import KubernetesApi
from pdoperator.reconcile.kvtransfer import service_dns_resolver, template_resolver
from pdoperator.reconcile.metrics_source import service_dns_metrics_urls, template_metrics_urls
from pdoperator.reconcile.reconciler import Reconciler
from pdoperator.render import OPERATOR_VERSION, RenderDefaults

LOG_FORMATS = {"full": kopf.LogFormat.FULL, "plain": kopf.LogFormat.PLAIN, "json": kopf.LogFormat.JSON}
USER_AGENT = f"pd-operator/{OPERATOR_VERSION}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-operator", description="Kubernetes operator for prefill/decode disaggregated vLLM services"
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="serve this namespace (repeatable)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="serve every namespace (the default)"
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object for several replicas (one active); standalone without it",
    )
    parser.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="peering priority; the highest live one is active (default: random, so replicas never tie)",
    )
    parser.add_argument(
        "--liveness", metavar="URL", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port"
    )
    parser.add_argument("--log-format", choices=sorted(LOG_FORMATS), default="full", help="log line format")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--cluster-domain",
        help=f"cluster DNS domain of Service names (default: {RenderDefaults.cluster_domain})",
    )
    parser.add_argument(
        "--kv-check-interval",
        type=float,
        default=HandlerSettings.kv_check_interval_seconds,
        metavar="SECONDS",
        help="how often each PDService's router /status is read for KVTransferVerified",
    )
    parser.add_argument(
        "--router-status-url",
        metavar="TEMPLATE",
        help="router /status URL with {name}, {namespace}, {port} (default: the router Service's DNS name)",
    )
    parser.add_argument(
        "--autoscale-interval",
        type=float,
        default=HandlerSettings.autoscale_interval_seconds,
        metavar="SECONDS",
        help="how often the autoscaler reads the metrics of each PDService with spec.autoscaling builtin",
    )
    parser.add_argument(
        "--router-metrics-url",
        metavar="TEMPLATE",
        help="router /metrics URL with {name}, {namespace}, {port} (default: the router Service's DNS name); "
        "with --engine-metrics-url",
    )
    parser.add_argument(
        "--engine-metrics-url",
        metavar="TEMPLATE",
        help="engine /metrics URL with {name}, {namespace}, {port}, {role}, {ordinal}, {pod} (default: the "
        "pod's DNS name)",
    )
    parser.add_argument(
        "--watch-timeout",
        type=int,
        default=HandlerSettings.watch_server_timeout_seconds,
        metavar="SECONDS",
        help="how long the API server keeps one watch open before the operator renews it (whole seconds)",
    )
    parser.add_argument(
        "--api-timeout",
        type=float,
        default=HandlerSettings.api_request_timeout_seconds,
        metavar="SECONDS",
        help="deadline of one Kubernetes API request",
    )
    return parser


def render_defaults(cluster_domain: str | None, environ: Mapping[str, str]) -> RenderDefaults:
    """Installation-wide rendering inputs: the Helm chart passes the default images through the
    environment."""
    defaults = RenderDefaults.from_environ(environ)
    defaults.operator_pods()  # a malformed label list fails here, at start-up, not in every reconcile
    return defaults if cluster_domain is None else replace(defaults, cluster_domain=cluster_domain)


def peering_priority(requested: int | None) -> int:
    """kopf pauses every operator of a peering whose top priority is shared, so replicas draw distinct ones:
    the highest live replica works, the others stand by and take over when its keep-alive expires."""
    return requested if requested is not None else secrets.randbelow(2**31 - 1) + 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.kv_check_interval, args.api_timeout, args.autoscale_interval, args.watch_timeout) <= 0:
        print(
            "pd-operator: --kv-check-interval, --autoscale-interval, --api-timeout and --watch-timeout "
            "must be positive",
            file=sys.stderr,
        )
        return 2
    if (args.router_metrics_url is None) != (args.engine_metrics_url is None):
        print("pd-operator: --router-metrics-url and --engine-metrics-url go together", file=sys.stderr)
        return 2
    kopf.configure(verbose=args.verbose, log_format=LOG_FORMATS[args.log_format])
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    try:
        defaults = render_defaults(args.cluster_domain, dict(os.environ))
    except ValueError as error:
        print(f"pd-operator: {error}", file=sys.stderr)
        return 2
    options = HandlerSettings(
        kv_check_interval_seconds=args.kv_check_interval,
        api_request_timeout_seconds=args.api_timeout,
        autoscale_interval_seconds=args.autoscale_interval,
        watch_server_timeout_seconds=args.watch_timeout,
    )
    metrics_urls = (
        template_metrics_urls(args.router_metrics_url, args.engine_metrics_url)
        if args.router_metrics_url
        else service_dns_metrics_urls(defaults.cluster_domain)
    )
    resolver = (
        template_resolver(args.router_status_url)
        if args.router_status_url
        else service_dns_resolver(args.cluster_domain)
    )
    try:
        api = KubernetesApi.from_environment(USER_AGENT, args.api_timeout)
    except Exception as e:  # the kubernetes config loaders raise several unrelated types
        print(f"pd-operator: no Kubernetes configuration (in-cluster or kubeconfig): {e}", file=sys.stderr)
        return 1
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(api, record_event, defaults), resolver, metrics_urls, options)
    log = logging.getLogger(__name__)
    log.info("pd-operator %s starting", OPERATOR_VERSION)
    try:
        kopf.run(
            registry=registry,
            clusterwide=not args.namespaces,
            namespaces=args.namespaces,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=peering_priority(args.priority) if args.peering else None,
            liveness_endpoint=args.liveness,
        )
    except Exception as error:
        if not resource_not_served(error):
            raise
        # A restarted API server answers 404 for a custom resource until its CRD handler is installed again;
        # kopf's watcher does not retry a 404 and its reactor ends. Start over, as a fresh process.
        log.warning("the API server does not serve a watched resource (%s); starting over", error)
        time.sleep(RESTART_AFTER_NOT_SERVED_S)
        os.execv(
            sys.executable, [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)]
        )
    return 0


MODULE = "pdoperator.cli.operator_main"
RESTART_AFTER_NOT_SERVED_S = 5.0


def resource_not_served(error: BaseException) -> bool:
    """kopf's API errors carry the HTTP status of the answer."""
    return getattr(error, "status", None) == HTTPStatus.NOT_FOUND


if __name__ == "__main__":
    sys.exit(main())
