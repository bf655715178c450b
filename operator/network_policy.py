"""The ingress NetworkPolicies of one DisaggregatedModel: pure builders, the operator setting that shapes them
(`tandem operator --network-policy ...`), and their removal when that setting turns them off.

Who calls which port, as the code stands (docs/security.md, "Network policies"):

- the router's port (HTTP_PORT): clients (anyone, or `clients` when given), Prometheus, kubelet probes;
- a worker's HTTP port (HTTP_PORT; control API, /metrics and probes on one port): the model's router
  (worker/router: discovery, dispatch, tokenizer) and the metrics scrapers. Workers never call each
  other over HTTP and the operator never calls a worker (it reads Prometheus for the autoscaler);
- a decode worker's KV port (KV_PORT): the model's prefill workers, which open the transfer
  (tcp, and rdma's zmq control channel: RDMA WRITEs go NIC to NIC, beside the kernel's packet
  filter, so no NetworkPolicy sees them). Only decode workers listen on it; a prefill pod's KV port
  has no listener, so its policy opens nothing there.

Ingress only: egress stays open (model downloads, DNS, the router's API server calls). Kubelet
probes come from the pod's own node, which Kubernetes documents as always allowed, so no rule names
them. NetworkPolicy selects ports, not paths: a scraper allowed on a worker's port for /metrics
reaches its control routes too, where the worker control token still stops it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.builders import (
    HTTP_PORT,
    KV_PORT,
    MANAGER,
    Component,
    Manifest,
    Owner,
    _metadata,  # every child's metadata: labels and the controller owner reference
    child_name,
    instance_labels,
    selector_labels,
)
from tandem.operator.kube import Kube, KubeError

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
# The default scrapers: pods labelled as Prometheus (Prometheus Operator labels its Prometheus pods so), in any
# namespace. The chart's networkPolicy.metrics values default to the same.
DEFAULT_METRICS_NAMESPACE_SELECTOR: Manifest = {}
DEFAULT_METRICS_POD_SELECTOR: Manifest = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
SELECTOR_KEYS = {"matchLabels", "matchExpressions"}
PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}


@dataclass(frozen=True)
class NetworkPolicySettings:
    """`tandem operator --network-policy ...`, one setting for every model the operator serves.

    A metrics selector of None leaves that half out: namespace only -> every pod of those namespaces;
    pod only -> those pods in the model's own namespace (Kubernetes' meaning of a lone podSelector);
    both None -> no scraper is let in (pods on the worker's own node still are, as node traffic)."""

    enabled: bool = True
    metrics_namespace_selector: Manifest | None = field(
        default_factory=lambda: copy.deepcopy(DEFAULT_METRICS_NAMESPACE_SELECTOR))
    metrics_pod_selector: Manifest | None = field(default_factory=lambda: copy.deepcopy(DEFAULT_METRICS_POD_SELECTOR))
    clients: tuple[Manifest, ...] = ()  # NetworkPolicyPeers allowed to the router's port; () = from anywhere


def policy_name(owner: Owner, component: Component) -> str:
    return child_name(owner, component)


def metrics_peers(settings: NetworkPolicySettings) -> list[Manifest]:
    """The scrapers as one peer (both selectors: those pods in those namespaces), or none."""
    peer: Manifest = {}
    if settings.metrics_namespace_selector is not None:
        peer["namespaceSelector"] = copy.deepcopy(settings.metrics_namespace_selector)
    if settings.metrics_pod_selector is not None:
        peer["podSelector"] = copy.deepcopy(settings.metrics_pod_selector)
    return [peer] if peer else []


def _pods(owner: Owner, component: Component) -> Manifest:
    """A peer: the model's pods of one component, in the model's namespace (no namespaceSelector)."""
    return {"podSelector": {"matchLabels": selector_labels(owner, component)}}


def _port(number: int) -> Manifest:
    return {"protocol": "TCP", "port": number}


def _policy(owner: Owner, component: Component, ingress: list[Manifest]) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": _metadata(owner, policy_name(owner, component), component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner, component)},
            # Ingress only: listing Egress would cut DNS, model downloads and the router's API server calls.
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def router_policy(owner: Owner, settings: NetworkPolicySettings) -> Manifest:
    """Clients reach the router's port and nothing else; with `clients` given, only they (and the scrapers)."""
    rule: Manifest = {"ports": [_port(HTTP_PORT)]}
    if settings.clients:
        rule["from"] = [*copy.deepcopy(settings.clients), *metrics_peers(settings)]
    return _policy(owner, "router", [rule])


def worker_policy(owner: Owner, pool: Component, settings: NetworkPolicySettings) -> Manifest:
    """A pool's HTTP port from the model's router and the scrapers; decode's KV port from the model's prefill pool."""
    ingress: list[Manifest] = [{"from": [_pods(owner, "router"), *metrics_peers(settings)], "ports": [_port(HTTP_PORT)]}]
    if pool == "decode":
        ingress.append({"from": [_pods(owner, "prefill")], "ports": [_port(KV_PORT)]})
    return _policy(owner, pool, ingress)


def network_policies(owner: Owner, settings: NetworkPolicySettings) -> list[Manifest]:
    """The model's policies, in apply order (before any pod they select exists); none when turned off."""
    if not settings.enabled:
        return []
    return [router_policy(owner, settings), worker_policy(owner, "prefill", settings),
            worker_policy(owner, "decode", settings)]


# ---------------------------------------------------------------- turned off: remove what an earlier run made


def remove(kube: Kube, owner: Owner) -> list[str]:
    """Delete the model's NetworkPolicies (those it controls, found by its labels); the names deleted.

    A 403 on the list means the operator holds no right on NetworkPolicies (RBAC written without them where the
    switch is off): there is nothing it may delete, and that is not an error. Policies left from a time it held
    the right then stay until deleted by hand."""
    selector = {**instance_labels(owner), "app.kubernetes.io/managed-by": MANAGER}
    try:
        found = kube.list(API_VERSION, KIND, owner.namespace, selector)
    except KubeError as exc:
        if exc.status == 403:
            return []
        raise
    removed = []
    for policy in found:
        refs = policy["metadata"].get("ownerReferences") or []
        if not any(ref.get("uid") == owner.uid and ref.get("controller") for ref in refs):
            continue  # not this model's (a namesake left from an earlier resource, or someone else's)
        name = str(policy["metadata"]["name"])
        if kube.delete(API_VERSION, KIND, owner.namespace, name):
            removed.append(name)
    return removed


# ---------------------------------------------------------------- the command line's JSON values


def parse_label_selector(text: str, what: str) -> Manifest | None:
    """A LabelSelector as JSON (`{}` matches everything, `null` means none); ValueError naming `what`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not JSON ({exc.msg}): {text!r}") from None
    if value is None:
        return None
    _check_selector(value, what)
    return value  # type: ignore[no-any-return]


def _check_selector(value: Any, what: str) -> None:
    if not isinstance(value, dict) or not set(value) <= SELECTOR_KEYS:
        raise ValueError(f"{what}: a label selector is an object with matchLabels and/or matchExpressions, "
                         f"got {json.dumps(value)}")
    labels = value.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{what}: matchLabels maps label names to string values, got {json.dumps(labels)}")
    expressions = value.get("matchExpressions", [])
    if not isinstance(expressions, list) or not all(
            isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("operator"), str)
            for e in expressions):
        raise ValueError(f"{what}: matchExpressions is a list of {{key, operator, values}}, got {json.dumps(expressions)}")


def parse_peers(text: str, what: str) -> tuple[Manifest, ...]:
    """A JSON list of NetworkPolicyPeers ({podSelector, namespaceSelector} or {ipBlock}); ValueError naming `what`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not JSON ({exc.msg}): {text!r}") from None
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{what}: a JSON list of NetworkPolicyPeers, got {json.dumps(value)}")
    for peer in value:
        if not isinstance(peer, dict) or not peer or not set(peer) <= PEER_KEYS:
            raise ValueError(f"{what}: each peer is an object with podSelector, namespaceSelector or ipBlock, "
                             f"got {json.dumps(peer)}")
        for key in ("podSelector", "namespaceSelector"):
            if key in peer:
                _check_selector(peer[key], f"{what} {key}")
        if "ipBlock" in peer and not (isinstance(peer["ipBlock"], dict) and isinstance(peer["ipBlock"].get("cidr"), str)):
            raise ValueError(f"{what}: ipBlock needs a cidr, got {json.dumps(peer['ipBlock'])}")
    return tuple(value)


def settings_from_options(enabled: bool, metrics_namespace_selector: str, metrics_pod_selector: str,
                          clients: str) -> NetworkPolicySettings:
    """The setting from `tandem operator`'s flags (JSON texts); ValueError naming the flag at fault."""
    return NetworkPolicySettings(
        enabled=enabled,
        metrics_namespace_selector=parse_label_selector(metrics_namespace_selector,
                                                        "--network-policy-metrics-namespace-selector"),
        metrics_pod_selector=parse_label_selector(metrics_pod_selector, "--network-policy-metrics-pod-selector"),
        clients=parse_peers(clients, "--network-policy-clients"),
    )


def describe(settings: NetworkPolicySettings) -> str:
    """One line for the operator's start-up log."""
    if not settings.enabled:
        return "NetworkPolicies: off (existing ones of each model are removed)"
    peers = metrics_peers(settings)
    return (f"NetworkPolicies: on; router from {json.dumps(list(settings.clients)) if settings.clients else 'anywhere'}; "
            f"metrics scrapers {json.dumps(peers) if peers else 'none (node traffic only)'}")

