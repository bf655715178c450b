"""Exactly what the operator may do in the Kubernetes API, as ClusterRole rules.

docs/operator.md lists the same rules (a unit test keeps the two in step) for the Helm chart's
RBAC, and an integration test runs the operator under a ServiceAccount bound to nothing but these.
"""

from __future__ import annotations

from typing import Any

from tandem.operator import api

READ = ["get", "list", "watch"]
WRITE = ["get", "list", "watch", "create", "update", "patch"]

# (apiGroup, resources, verbs, why)
RULES: tuple[tuple[str, tuple[str, ...], list[str], str], ...] = (
    (api.GROUP, (api.PLURAL,), ["get", "list", "watch", "patch", "update"],
     "watch the resources; kopf writes its finalizer and annotations (tandem.dev/...)"),
    (api.GROUP, (f"{api.PLURAL}/status",), ["get", "patch", "update"], "write status"),
    (api.GROUP, (f"{api.PLURAL}/finalizers",), ["update"],
     "owner references with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)"),
    ("apps", ("deployments",), WRITE, "prefill, decode and router Deployments (server-side apply)"),
    ("", ("services", "serviceaccounts"), WRITE, "worker and router Services; the router's ServiceAccount"),
    ("policy", ("poddisruptionbudgets",), WRITE, "one PodDisruptionBudget per pool"),
    ("rbac.authorization.k8s.io", ("roles", "rolebindings"), WRITE,
     "the router's Role and RoleBinding (endpoint discovery)"),
    ("", ("podsX",), READ, "find unschedulable worker pods (Degraded condition); granted to the router"),
    ("", ("endpoints",), READ, "granted to the router (a Role may only grant what its writer holds)"),
    ("discovery.k8s.io", ("endpointslices",), READ, "granted to the router"),
    ("", ("events",), ["create", "patch"], "Events on DisaggregatedModels"),
    ("events.k8s.io", ("events",), ["create", "patch"], "Events on DisaggregatedModels"),
    ("apiextensions.k8s.io", ("customresourcedefinitions",), READ, "kopf notices the CRD being (re)installed"),
    ("", ("namespaces",), READ, "kopf follows namespaces when it watches all or several"),
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
        rows.append(f"| `{group or 'core'}` | {', '.join(f'`{r}`' for r in resources)} | {', '.join(verbs)} | {why} |")
    return "\n".join(rows)
