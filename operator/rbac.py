"""Exactly what the operator may do in the Kubernetes API, as ClusterRole rules.

docs/operator.md lists the same rules (a unit test keeps the two in step); the Helm chart's RBAC
is generated from them; integration tests run the operator under a ServiceAccount bound to
nothing but these, and check that removing any one rule breaks something.

Not needed, so not here: namespaces (with exact --namespace names the operator turns kopf's scanning
off; kopf lists and watches namespaces only for glob patterns in --namespace: add get/list/watch on
namespaces if you use globs), events.k8s.io (kopf posts core/v1 Events),
disaggregatedmodels/finalizers (children's owner references do not set blockOwnerDeletion).
"""

from __future__ import annotations

from typing import Any

from tandem.operator import api

READ = ["get", "list", "watch"]
APPLY = ["create", "patch"]  # server-side apply is a PATCH; one that creates the object also needs create

# (apiGroup, resources, verbs, why)
RULES: tuple[tuple[str, tuple[str, ...], list[str], str], ...] = (
    (api.GROUP, (api.PLURAL,), ["get", "list", "watch", "patch"],
     "read and watch the resources; kopf patches in its finalizer and annotations (tandem.dev/...)"),
    (api.GROUP, (api.POOL_PLURAL,), ["list", "watch", "create", "patch"],
     "one DisaggregatedPool per pool (its scale subresource): create it, watch it for kubectl scale/HPA/KEDA, "
     "patch spec.replicas once when a pool is handed over to an external scaler"),
    (api.GROUP, (f"{api.PLURAL}/status", f"{api.POOL_PLURAL}/status"), ["patch"],
     "write status (merge patch) of the resources and their DisaggregatedPools"),
    ("apps", ("deployments",), ["list", "watch", *APPLY],
     "apply the pools' and router's Deployments; watch them to revert edits and follow readiness"),
    ("", ("services", "serviceaccounts"), APPLY, "worker and router Services; the router's ServiceAccount"),
    ("policy", ("poddisruptionbudgets",), APPLY, "one PodDisruptionBudget per pool"),
    ("networking.k8s.io", ("networkpolicies",), ["list", *APPLY, "delete"],
     "the model's ingress NetworkPolicies (router, prefill, decode); with `--no-network-policy`, list and delete "
     "the ones it made before"),
    ("rbac.authorization.k8s.io", ("roles", "rolebindings"), APPLY,
     "the router's Role and RoleBinding (endpoint discovery)"),
    ("", ("secrets",), ["get", "create"],
     "read the worker control token Secret `<dm>-control-token` and, with kvTransfer.secure, the keypair Secret "
     "`<dm>-kv-keys`; create them when missing; read spec.router.apiKeySecret's Secret for the fingerprint that "
     "rolls the routers; no list or watch (the operator never reads Secrets in bulk) and "
     "no patch or update (it never overwrites a token or keys)"),
    ("", ("pods",), READ, "watch for unschedulable worker pods (Degraded); also granted to the router"),
    ("", ("endpoints",), READ, "granted to the router (a Role may only grant what its writer holds)"),
    ("discovery.k8s.io", ("endpointslices",), READ, "granted to the router"),
    ("", ("events",), ["create"], "Events on DisaggregatedModels (kopf posts core/v1 Events)"),
    ("apiextensions.k8s.io", ("customresourcedefinitions",), ["list", "watch"],
     "kopf notices the CRD being (re)installed"),
)


def cluster_role_rules() -> list[dict[str, Any]]:
    return [{"apiGroups": [group], "resources": list(resources), "verbs": list(verbs)}
            for group, resources, verbs, _ in RULES]


def cluster_role(name: str = "tandem-operator") -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name}, "rules": cluster_role_rules()}


def markdown_table() -> str:
    rows = ["| API group | Resources | Verbs | Why |", "|---|---|---|---|"]
    for group, resources, verbs, why in RULES:
        group_cell = f"`{group}`" if group else '`""` (core)'
        rows.append(f"| {group_cell} | {', '.join(f'`{r}`' for r in resources)} | {', '.join(verbs)} | {why} |")
    return "\n".join(rows)
