"""`tandem operator`: kopf registration only. The work is in reconcile.py, autoscaler_run.py and the
pure modules they call.

Every trigger (resource created, changed or resumed; a periodic resync; a child Deployment or
DisaggregatedPool changed or deleted; a worker pod the scheduler cannot place) runs the same
level-based reconcile, so a missed event is repaired by the next one. The autoscaler is a second
timer per resource (--autoscale-interval) that writes its decision to status and then reconciles;
on every resource, autoscaled or not, it also sets the OutputVerified condition from the routers'
output canary (autoscaler_run.verify_output).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import click
import kopf
from kubernetes import client as k8s
from prometheus_client import start_http_server

from tandem.operator import api
from tandem.operator.autoscaler_run import autoscale_resource, signal_source, verify_output
from tandem.operator.autoscaler_timer import DEFAULT_INTERVAL_S, AutoscalerMetrics
from tandem.operator.builders import MANAGER
from tandem.operator.kube import Kube, KubeError, load_configuration
from tandem.operator.network_policy import (
    DEFAULT_METRICS_NAMESPACE_SELECTOR,
    DEFAULT_METRICS_POD_SELECTOR,
    NetworkPolicySettings,
    describe,
    settings_from_options,
)
from tandem.operator.reconcile import reconcile
from tandem.operator.telemetry import count_reconcile

ANNOTATION_PREFIX = "tandem.dev"
MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
RESYNC_SECONDS = float(os.environ.get("TANDEM_OPERATOR_RESYNC_SECONDS", "30"))
RETRY_SECONDS = 10.0
# A timer whose handler is running when its resource is deleted cannot be interrupted (sync handlers
# run in a thread); kopf keeps the finalizer until it returns and re-checks at this interval. kopf's
# default, 60 s, left such deletions in Terminating for a minute (tests/operator/test_deletion.py).
TIMER_EXIT_POLL_SECONDS = 1.0

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...]
    metrics_port: int
    health_port: int
    prometheus_url: str | None
    autoscale_interval: float
    kubeconfig: str | None
    network_policy: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)


_kube: Kube | None = None
# --kubeconfig, set by `command` before kopf starts. Both kopf's watches (the login handler below) and
# the operator's own client use it, so the two never run as different identities.
_kubeconfig: str | None = None
# --network-policy and its selectors, set by `command`: what every reconcile makes of the models' NetworkPolicies.
_network_policy = NetworkPolicySettings()


def _client() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube(load_configuration(_kubeconfig))
    return _kube


def connection_info(configuration: k8s.Configuration, trust_env: bool = False) -> kopf.ConnectionInfo:
    """kopf's view of a kubernetes client Configuration (what kopf's own login_via_client extracts)."""
    header = configuration.get_api_key_with_prefix("BearerToken") or \
        configuration.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        trust_env=trust_env,
    )


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials, from the same source as the operator's own client (kube.load_configuration):
    --kubeconfig, else in-cluster, else $KUBECONFIG or ~/.kube/config.

    Registering a login handler replaces kopf's defaults, which read $KUBECONFIG or ~/.kube/config
    and know nothing of --kubeconfig."""
    try:
        configuration = load_configuration(_kubeconfig)
    except Exception as exc:  # kubernetes' ConfigException, an unreadable file, ...
        raise kopf.LoginError(f"cannot load Kubernetes credentials: {exc}") from exc
    return connection_info(configuration, trust_env=settings.networking.trust_env)


def _emit(resource: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(dict(resource), type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]


def _reconcile(namespace: str, name: str) -> None:
    try:
        outcome = reconcile(_client(), namespace, name, _emit, _network_policy)
    except KubeError as exc:
        count_reconcile(namespace, name, failed=True)
        raise kopf.TemporaryError(str(exc), delay=RETRY_SECONDS) from exc
    count_reconcile(namespace, name, failed=outcome.apply_error is not None)
    if outcome.apply_error:
        raise kopf.TemporaryError(outcome.apply_error, delay=RETRY_SECONDS)


def exact_namespaces(namespaces: tuple[str, ...]) -> bool:
    """--namespace given, and every value a plain namespace name (no kopf glob or negation such as team-*)."""
    return bool(namespaces) and all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", ns) for ns in namespaces)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's add noise
    settings.watching.server_timeout = 120  # re-list now and then, in case a watch silently stalls
    settings.networking.request_timeout = 30
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
    # With exact --namespace names there is nothing to discover: kopf would otherwise list and watch
    # namespaces and CRDs cluster-wide, which the namespace-scoped Roles cannot grant (403s, then a
    # fallback to exactly these names). Cluster-wide, kopf keeps watching CRDs (a reinstalled CRD is noticed).
    options = memo.get("options")
    if isinstance(options, OperatorOptions) and exact_namespaces(options.namespaces):
        settings.scanning.disabled = True
    _client()


def autoscale(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The autoscaler timer (registered by `command` with the --autoscale-interval), on every resource.

    autoscale_resource does nothing for a resource that was never autoscaled; verify_output always
    sets the OutputVerified condition (the output canary), from the same Prometheus."""
    ns = namespace or ""
    try:
        options = memo.get("options")
        interval = options.autoscale_interval if isinstance(options, OperatorOptions) else DEFAULT_INTERVAL_S
        outcome = autoscale_resource(_client(), ns, name, memo.signals, _emit, memo.autoscaler_metrics,
                                     interval_s=interval)
        verify_output(_client(), ns, name, memo.signals, _emit)
    except KubeError as exc:
        raise kopf.TemporaryError(f"autoscaler: {exc}", delay=RETRY_SECONDS) from exc
    if outcome is not None and outcome.changed:
        _reconcile(ns, name)  # apply the new size now, not at the next resync


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def on_resource(namespace: str | None, name: str, **_: Any) -> None:
    _reconcile(namespace or "", name)


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(namespace: str | None, name: str, **_: Any) -> None:
    _reconcile(namespace or "", name)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def on_child_deployment(body: kopf.Body, **_: Any) -> None:
    """A child was edited, scaled, deleted or changed status: re-apply and refresh the owner's status."""
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("kind") == api.KIND and ref.get("apiVersion", "").startswith(f"{api.GROUP}/"):
            _reconcile(body.metadata.namespace or "", ref["name"])


def _pool_needs_reconcile(body: kopf.Body, type: str | None, **_: Any) -> bool:
    """Deleted (recreate it), or scaled while an external scaler owns it (apply the new size)."""
    status = body.get("status") or {}
    return type == "DELETED" or (
        status.get("scaledBy") == "external" and body.get("spec", {}).get("replicas") != status.get("desiredReplicas"))


@kopf.on.event(api.GROUP, api.VERSION, api.POOL_PLURAL, labels=MANAGED, when=_pool_needs_reconcile)
def on_pool_scaled(body: kopf.Body, **_: Any) -> None:
    """kubectl scale, an HPA or KEDA changed a DisaggregatedPool: apply it to the Deployment now."""
    _reconcile(body.metadata.namespace or "", body.spec.get("model") or "")


def _unschedulable(body: kopf.Body, **_: Any) -> bool:
    return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
               for c in body.get("status", {}).get("conditions") or [])


@kopf.on.event("v1", "pods", labels=MANAGED, when=_unschedulable)
def on_unschedulable_pod(body: kopf.Body, **_: Any) -> None:
    """The scheduler cannot place a worker: say so in the owner's Degraded condition now, not at the next resync."""
    owner = body.metadata.labels.get("tandem.dev/model")
    if owner:
        _reconcile(body.metadata.namespace or "", owner)


def _url_host(address: str) -> str:
    """An address as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


@click.command("operator")
@click.option("--namespace", "namespaces", multiple=True, help="Watch only this namespace (repeatable). Default: all.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Serve Prometheus metrics on this port (0: off).")
@click.option("--health-port", type=click.IntRange(1, 65535), default=8081, show_default=True,
              help="Serve GET /healthz (liveness and readiness) on this port.")
@click.option("--listen-address", default="0.0.0.0", show_default=True,
              help="Address the health and metrics endpoints listen on (127.0.0.1: this machine only).")
@click.option("--prometheus-url", default=None,
              help="Prometheus the autoscaler and the OutputVerified condition (output canary) query.")
@click.option("--autoscale-interval", type=click.FloatRange(1, 3600), default=15.0, show_default=True,
              help="Seconds between autoscaler decisions and OutputVerified updates.")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Kubeconfig file. Default: in-cluster credentials, else $KUBECONFIG or ~/.kube/config.")
@click.option("--network-policy/--no-network-policy", default=True, show_default=True,
              help="Give every model ingress NetworkPolicies (router: its port; workers: the model's router, its "
                   "prefill pool on decode's KV port, the metrics scrapers). Off: remove the ones made earlier.")
@click.option("--network-policy-metrics-namespace-selector", metavar="JSON",
              default=json.dumps(DEFAULT_METRICS_NAMESPACE_SELECTOR), show_default=True,
              help="Namespaces whose pods may scrape the workers' port (a LabelSelector as JSON; {}: all; null: leave out).")
@click.option("--network-policy-metrics-pod-selector", metavar="JSON",
              default=json.dumps(DEFAULT_METRICS_POD_SELECTOR, separators=(",", ":")), show_default=True,
              help="Pods that may scrape the workers' port (a LabelSelector as JSON; null: leave out). With a namespace "
                   "selector: those pods in those namespaces; alone: those pods in the model's namespace.")
@click.option("--network-policy-clients", metavar="JSON", default="[]", show_default=True,
              help="Who may reach the router's port: a JSON list of NetworkPolicyPeers ([]: anyone).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def command(namespaces: tuple[str, ...], metrics_port: int, health_port: int, listen_address: str,
            prometheus_url: str | None, autoscale_interval: float, kubeconfig: str | None, network_policy: bool,
            network_policy_metrics_namespace_selector: str, network_policy_metrics_pod_selector: str,
            network_policy_clients: str, verbose: bool) -> None:
    """Run the Kubernetes operator that turns DisaggregatedModel resources into pools and a router."""
    global _kubeconfig, _network_policy
    try:
        policies = settings_from_options(network_policy, network_policy_metrics_namespace_selector,
                                         network_policy_metrics_pod_selector, network_policy_clients)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if metrics_port == health_port:
        # Both would bind it: the metrics server first, and it answers every path with 200, so a
        # liveness probe would pass while kopf failed to start.
        raise click.UsageError(f"--metrics-port and --health-port are both {health_port}; give them different ports")
    # Not via $KUBECONFIG: the kubernetes library reads that once, when it is imported (already done).
    _kubeconfig = os.path.abspath(kubeconfig) if kubeconfig else None
    _network_policy = policies
    options = OperatorOptions(namespaces, metrics_port, health_port, prometheus_url, autoscale_interval, kubeconfig,
                              policies)
    kopf.configure(verbose=verbose)
    log.info("%s", describe(policies))
    if metrics_port:
        start_http_server(metrics_port, addr=listen_address)
    # sharp: ticks on a fixed grid, so windows and "within two intervals" mean what they say.
    kopf.timer(api.GROUP, api.VERSION, api.PLURAL, id="autoscaler", interval=autoscale_interval,
               initial_delay=autoscale_interval, sharp=True)(autoscale)
    kopf.run(
        standalone=True,  # one operator replica; no kopf peering CRDs needed
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=f"http://{_url_host(listen_address)}:{health_port}/healthz",
        memo=kopf.Memo(options=options, signals=signal_source(prometheus_url),
                       autoscaler_metrics=AutoscalerMetrics()),
    )
