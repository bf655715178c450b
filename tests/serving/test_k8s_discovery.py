"""The router's Kubernetes discovery against the real control plane.

kube-apiserver, controller-manager (its EndpointSlice controller fills the slices), scheduler and
kwok (fake GPU nodes: pods become Running/Ready with pod IPs but run no containers), plus
`tandem operator`, which turns a DisaggregatedModel into the pools' Deployments and headless
Services. KubernetesDiscovery reads those Services' EndpointSlices with the router pod's own
ServiceAccount token, so the operator's documented router RBAC is exercised too.

Not covered here, and why:
- method="dns": there is no cluster DNS on this machine, so `<svc>.<ns>.svc` cannot resolve.
- the KV layout check: the router learns each worker's layout hash (computed from the model it
  loaded) from its GET /info, and kwok pods serve no HTTP. What is checked is the part the cluster
  owns: the discovered pods carry the spec fingerprint as a label and are not given a hash to check
  (tests/operator/test_worker_args_run.py runs the exact worker command line as a process).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.router.discovery import KubernetesDiscovery

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_harness import OperatorProcess, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DM = "disc"
WORKER_PORT = 8000  # the worker pods' HTTP port (contract), which the headless Services expose as "http"
KWOK_POD_NET = ipaddress.ip_network("10.244.0.0/16")
ROLES = ("prefill", "decode")


class Pools:
    """One DisaggregatedModel reconciled by a running operator, and the router's view of its pools."""

    def __init__(self, cluster: Any, namespace: str, operator: OperatorProcess, router_kubeconfig: Path) -> None:
        self.cluster, self.namespace, self.operator = cluster, namespace, operator
        self.router_kubeconfig = router_kubeconfig

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return str(self.cluster.kubectl(*args, "-n", self.namespace, input=input).stdout)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def set_replicas(self, **replicas: int) -> None:
        patch = {"spec": {role: {"replicas": n} for role, n in replicas.items()}}
        self.kubectl("patch", "dm", DM, "--type=merge", "-p", json.dumps(patch))

    def pods(self, role: str) -> list[dict[str, Any]]:
        items = self.get("pods", "-l", f"app.kubernetes.io/instance={DM},tandem.dev/role={role}")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def ready_pod_urls(self, role: str) -> list[str]:
        """What discovery should list: pod IP + worker port of every live, Ready pod of the pool."""
        return sorted(f"http://{p['status']['podIP']}:{WORKER_PORT}" for p in self.pods(role)
                      if p["status"].get("podIP") and is_ready(p))

    def discovery(self, *roles: str) -> KubernetesDiscovery:
        return KubernetesDiscovery(self.namespace, [f"{DM}-{role}" for role in roles], port=WORKER_PORT,
                                   kubeconfig=self.router_kubeconfig)

    def discover(self, *roles: str) -> list[str]:
        return asyncio.run(self.discovery(*roles).urls())

    def wait_until_discovered(self, role: str, count: int, timeout: float = 40.0) -> list[str]:
        """Poll until discovery lists exactly the pool's `count` ready pods; return those URLs."""
        seen: dict[str, Any] = {}

        def matches() -> list[str] | None:
            seen["discovered"], seen["ready pods"] = self.discover(role), self.ready_pod_urls(role)
            ok = seen["discovered"] == seen["ready pods"] and len(seen["discovered"]) == count
            return list(seen["discovered"]) if ok else None

        what = f"discovery of {DM}-{role} to list exactly {count} ready pods"
        return list(wait_for(what, matches, timeout=timeout,
                             on_timeout=lambda: f"{seen}\n--- operator log (tail) ---\n{self.operator.log_tail()}"))

    def endpoint_ready(self, role: str, ip: str) -> bool | None:
        """The EndpointSlice controller's view of one address: its ready condition, None if absent."""
        slices = self.get("endpointslices", "-l", f"kubernetes.io/service-name={DM}-{role}")["items"]
        for sl in slices:
            for ep in sl.get("endpoints") or []:
                if ip in ep.get("addresses", []):
                    return bool((ep.get("conditions") or {}).get("ready"))
        return None

    def set_pod_ready(self, pod: str, ready: bool) -> None:
        """kwok sets Ready only on Pending pods, so a Running pod keeps what is written here."""
        condition = {"type": "Ready", "status": "True" if ready else "False", "reason": "SetByTest"}
        self.kubectl("patch", "pod", pod, "--subresource=status", "--type=strategic",
                     "-p", json.dumps({"status": {"conditions": [condition]}}))


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def token_kubeconfig(cluster: Any, token: str, path: Path) -> Path:
    """The cluster's kubeconfig with its user swapped for a ServiceAccount token."""
    config = json.loads(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "router", "user": {"token": token}}]
    config["contexts"] = [{"name": "router", "context": {"cluster": config["clusters"][0]["name"], "user": "router"}}]
    config["current-context"] = "router"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def pools(k8s_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    namespace = k8s_cluster.new_namespace("disc")
    workdir = tmp_path_factory.mktemp("k8s-discovery")
    k8s_cluster.install_crds()
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, workdir / "operator.log", k8s_cluster.env)
    operator.start()
    try:
        dm = {"apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "metadata": {"name": DM},
              "spec": {"model": {"name": "tiny-llama", "source": {"path": "/models/tiny-llama"}},
                       "prefill": {"replicas": 2}, "decode": {"replicas": 2}}}
        k8s_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dm))
        # The router's ServiceAccount and Role come from the operator (builders.router_access).
        wait_for(f"the operator to create ServiceAccount {DM}-router",
                 lambda: k8s_cluster.kubectl("get", "serviceaccount", f"{DM}-router", "-n", namespace,
                                             check=False).returncode == 0 or None,
                 timeout=30, on_timeout=operator.log_tail)
        token = k8s_cluster.kubectl("create", "token", f"{DM}-router", "-n", namespace,
                                    "--duration=1h").stdout.strip()
        yield Pools(k8s_cluster, namespace, operator, token_kubeconfig(k8s_cluster, token, workdir / "router.kubeconfig"))
    finally:
        if not operator.alive():  # it must run to release its finalizer
            operator.start()
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_each_pool_discovers_exactly_its_ready_pods(pools: Pools) -> None:
    pools.set_replicas(prefill=2, decode=2)
    found = {role: pools.wait_until_discovered(role, 2) for role in ROLES}
    for role, urls in found.items():
        for url in urls:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            assert ipaddress.ip_address(host) in KWOK_POD_NET, f"{role}: {url} is not a kwok pod IP"
            assert int(port) == WORKER_PORT
    assert not set(found["prefill"]) & set(found["decode"]), found
    # What the router is given in its pod: both Services in one discovery source.
    assert pools.discover(*ROLES) == sorted(found["prefill"] + found["decode"])


def test_scaling_the_model_adds_and_removes_endpoints(pools: Pools) -> None:
    pools.set_replicas(decode=2)
    before = pools.wait_until_discovered("decode", 2)
    prefill = pools.wait_until_discovered("prefill", 2)

    pools.set_replicas(decode=4)
    grown = pools.wait_until_discovered("decode", 4)
    assert set(before) < set(grown), f"scale-up replaced existing endpoints: {before} -> {grown}"

    pools.set_replicas(decode=1)
    shrunk = pools.wait_until_discovered("decode", 1)
    assert set(shrunk) < set(grown), f"scale-down left an unknown endpoint: {grown} -> {shrunk}"
    assert pools.discover("prefill") == prefill, "scaling decode changed what the prefill pool discovers"


def test_a_pod_that_is_not_ready_is_not_discovered(pools: Pools) -> None:
    pools.set_replicas(prefill=2)
    urls = pools.wait_until_discovered("prefill", 2)
    victim = pools.pods("prefill")[0]
    ip, name = victim["status"]["podIP"], victim["metadata"]["name"]
    victim_url = f"http://{ip}:{WORKER_PORT}"
    assert victim_url in urls

    pools.set_pod_ready(name, False)
    try:
        # The endpoint stays in the slice, marked not ready: discovery itself must leave it out.
        wait_for(f"the EndpointSlice to mark {ip} not ready", lambda: pools.endpoint_ready("prefill", ip) is False,
                 timeout=30)
        assert pools.discover("prefill") == [u for u in urls if u != victim_url]
        assert victim_url not in pools.discover(*ROLES)
    finally:
        pools.set_pod_ready(name, True)
    back = pools.wait_until_discovered("prefill", 2)
    assert back == urls


def test_discovered_pods_carry_the_spec_fingerprint_and_no_hash_to_check(pools: Pools) -> None:
    """The label tells which spec a pod runs; the layout fence is the workers' own hash, via /info."""
    pools.wait_until_discovered("decode", len(pools.pods("decode")))
    expected = wait_for("the DisaggregatedModel's status.specFingerprint",
                        lambda: (pools.get("dm", DM).get("status") or {}).get("specFingerprint"), timeout=30)
    discovered = set(pools.discover(*ROLES))
    pods = [p for role in ROLES for p in pools.pods(role)
            if f"http://{p['status'].get('podIP')}:{WORKER_PORT}" in discovered]
    assert len(pods) == len(discovered)
    for pod in pods:
        name = pod["metadata"]["name"]
        assert pod["metadata"]["labels"].get("tandem.dev/spec-fingerprint") == expected, name
        worker = pod["spec"]["containers"][0]
        assert "--layout-hash" not in (worker.get("args") or []), name
        assert "TANDEM_LAYOUT_HASH" not in {e["name"] for e in worker.get("env") or []}, name


def test_the_routers_service_account_sees_only_its_namespace(pools: Pools) -> None:
    """A denied list raises (so the router keeps its last worker list) instead of returning no workers."""
    from kubernetes.client.exceptions import ApiException

    other = KubernetesDiscovery("default", [f"{DM}-prefill"], kubeconfig=pools.router_kubeconfig)
    with pytest.raises(ApiException) as denied:
        asyncio.run(other.urls())
    assert denied.value.status == 403
    assert pools.discover("no-such-service") == []


def test_unknown_discovery_method_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown discovery method 'consul'"):
        KubernetesDiscovery("default", ["svc"], method="consul")
