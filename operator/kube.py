"""A small, synchronous Kubernetes client for the handful of resources the operator touches.

Paths are built from a fixed table (no discovery round-trips); every write of a child is a
server-side apply under the field manager `tandem-operator`, forced, so the operator owns the
fields it sets (replicas included) and a hand edit of them is reverted at the next reconcile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tandem.operator import api

FIELD_MANAGER = "tandem-operator"
Obj = dict[str, Any]

# (apiVersion, kind) -> plural
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("v1", "Secret"): "secrets",  # only the kvTransfer.secure keypair: get and create, never list or apply
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (api.API_VERSION, api.KIND): api.PLURAL,
    (api.API_VERSION, api.POOL_KIND): api.POOL_PLURAL,
}


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def load_configuration(kubeconfig: str | None = None) -> k8s.Configuration:
    """In-cluster credentials inside a pod, else the kubeconfig file (explicit, $KUBECONFIG or ~/.kube/config)."""
    configuration = k8s.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration)
    return configuration


def _path(api_version: str, kind: str, namespace: str, name: str | None = None, subresource: str = "") -> str:
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {kind} ({api_version})") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


class Kube:
    def __init__(self, configuration: k8s.Configuration, timeout: float = 15.0) -> None:
        self._client = k8s.ApiClient(configuration)
        self._timeout = timeout

    def _request(self, method: str, path: str, query: list[tuple[str, str]] | None = None,
                 body: Any = None, content_type: str = "application/json") -> Obj:
        request = self._client.param_serialize(
            method, path, query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body, auth_settings=["BearerToken"],
        )
        try:
            response = self._client.call_api(*request, _request_timeout=self._timeout)
            response.read()  # type: ignore[no-untyped-call]
            if not 200 <= response.status <= 299:
                self._client.response_deserialize(response, {})  # raises ApiException with the body
            data = response.data
        except ApiException as exc:
            raise KubeError(exc.status or 0, f"{method} {path}: {_message(exc)}") from exc
        except OSError as exc:  # connection refused, timeouts (urllib3 errors subclass OSError or are wrapped)
            raise KubeError(0, f"{method} {path}: {exc}") from exc
        parsed: Any = json.loads(data) if data else {}
        return parsed if isinstance(parsed, dict) else {}

    def apply(self, manifest: Mapping[str, Any]) -> Obj:
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        return self._request("PATCH", path, query, dict(manifest), "application/apply-patch+yaml")

    def create(self, manifest: Mapping[str, Any]) -> Obj:
        """A plain create (POST): the fields it sets are not owned by the operator's server-side applies."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        return self._request("POST", path, [("fieldManager", FIELD_MANAGER)], dict(manifest))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        try:
            return self._request("GET", _path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]) -> list[Obj]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        items = self._request("GET", _path(api_version, kind, namespace), query).get("items") or []
        return [item for item in items if isinstance(item, dict)]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object by name; False when it was already gone."""
        try:
            self._request("DELETE", _path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> Obj:
        """JSON merge patch of an object's main resource."""
        path = _path(api_version, kind, namespace, name)
        return self._request("PATCH", path, None, dict(body), "application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any], kind: str = api.KIND) -> None:
        """JSON merge patch of a DisaggregatedModel's (or DisaggregatedPool's) status: keys not given are kept."""
        path = _path(api.API_VERSION, kind, namespace, name, "status")
        self._request("PATCH", path, None, {"status": dict(status)}, "application/merge-patch+json")

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]
