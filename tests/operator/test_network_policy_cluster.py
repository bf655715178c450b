"""The model's NetworkPolicies on the real control plane: created with the model as their controller owner
(gone with it), kept as built (a hand edit or deletion is repaired), updated when the operator's metrics
selectors change, and removed when the operator runs with `--no-network-policy`.

What this does NOT test: that any traffic is blocked or let through. The API server validates and stores
the policies; enforcing them is the network plugin's job, and there is none here that does: the kwok nodes
run no containers at all, and the test bed's real node (hack/real_node.py, used by the e2e) wires pods with
the CNI `bridge` plugin, which ignores NetworkPolicy. Which traffic the policies admit is checked against
Kubernetes' ingress rules in tests/operator/test_network_policy.py, on paper only.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import OperatorProcess, condition, rbac_only_kubeconfig, wait_for

from tandem.operator import builders, network_policy
from tandem.operator.network_policy import NetworkPolicySettings

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed
COMPONENTS = ("router", "prefill", "decode")
MONITORING = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}


def resource(sample: Callable[[str], dict[str, Any]], name: str) -> dict[str, Any]:
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name
    return body


def kubectl_json(testbed: Bed, *args: str) -> dict[str, Any]:
    return json.loads(testbed.kubectl(*args, "-o", "json").stdout)  # type: ignore[no-any-return]


def policies(testbed: Bed, ns: str, name: str) -> dict[str, dict[str, Any]]:
    items = kubectl_json(testbed, "get", "networkpolicies", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")
    return {p["metadata"]["name"]: p for p in items["items"]}


def wait_ready(testbed: Bed, ns: str, name: str, on_timeout: Callable[[], str], timeout: float = 60.0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        dm = kubectl_json(testbed, "get", "dm", name, "-n", ns)
        return dm if condition(dm, "Ready").get("status") == "True" and \
            dm["status"].get("observedGeneration") == dm["metadata"]["generation"] else None

    return wait_for(f"dm/{name} to be Ready", ready, timeout=timeout, on_timeout=on_timeout)


def expected_specs(ns: str, name: str, uid: str, settings: NetworkPolicySettings) -> dict[str, dict[str, Any]]:
    owner = builders.Owner(name=name, namespace=ns, uid=uid)
    return {p["metadata"]["name"]: p["spec"] for p in network_policy.network_policies(owner, settings)}


def test_every_model_gets_policies_it_owns_kept_as_built_and_gone_with_it(
        testbed: Bed, sample: Callable[[str], dict[str, Any]]) -> None:
    ns = testbed.namespace
    testbed.apply(resource(sample, "fenced"))
    dm = wait_ready(testbed, ns, "fenced", testbed.operator.log_tail)
    uid = dm["metadata"]["uid"]

    found = policies(testbed, ns, "fenced")
    assert sorted(found) == ["fenced-decode", "fenced-prefill", "fenced-router"]
    # As built (the API server accepted them, defaulting nothing away): the default scrapers, router from anywhere.
    assert {n: p["spec"] for n, p in found.items()} == expected_specs(ns, "fenced", uid, NetworkPolicySettings())
    for name, policy in found.items():
        assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in policy["metadata"]["ownerReferences"]] \
            == [("DisaggregatedModel", "fenced", uid, True)], name
        assert policy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"
    # Each selects exactly its component's pods, as they run (kwok runs no containers, but the pods exist).
    for component in COMPONENTS:
        selector = found[f"fenced-{component}"]["spec"]["podSelector"]["matchLabels"]
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = [p for p in testbed.list("pods", label_selector) if not p["metadata"].get("deletionTimestamp")]
        assert pods and all(p["metadata"]["labels"]["tandem.dev/role"] == component for p in pods), component
    events = kubectl_json(testbed, "get", "events", "-n", ns, "--field-selector",
                          "involvedObject.kind=DisaggregatedModel,involvedObject.name=fenced")["items"]
    assert not [e for e in events if e["reason"] == "NetworkPoliciesRemoved"]

    # A hand edit that opens a worker's port to everyone is reverted; a deleted policy comes back.
    testbed.kubectl("patch", "networkpolicy", "fenced-decode", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"ingress": [{}]}}))
    old_uid = found["fenced-prefill"]["metadata"]["uid"]
    testbed.kubectl("delete", "networkpolicy", "fenced-prefill", "-n", ns)
    want = expected_specs(ns, "fenced", uid, NetworkPolicySettings())
    testbed.wait_for("the edited policy reverted and the deleted one recreated", lambda: (
        (now := policies(testbed, ns, "fenced")).get("fenced-decode", {}).get("spec") == want["fenced-decode"]
        and now.get("fenced-prefill", {}).get("metadata", {}).get("uid") not in (None, old_uid)) or None, timeout=30)

    testbed.kubectl("delete", "dm", "fenced", "-n", ns, "--timeout=30s")
    testbed.wait_for("the policies of dm/fenced to be garbage-collected",
                     lambda: not policies(testbed, ns, "fenced") or None, timeout=45)


@pytest.fixture
def scoped(testbed: Bed, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A namespace and a kubeconfig for a ServiceAccount bound to tandem.operator.rbac's rules and nothing else."""
    ns = f"{testbed.namespace}-np"
    role = f"tandem-operator-{ns}"
    testbed.kubectl("create", "namespace", ns)
    try:
        rbac_only_kubeconfig(testbed, ns, tmp_path / "kubeconfig")
        yield ns, tmp_path / "kubeconfig"
    finally:
        testbed.cluster.delete_custom_resources(ns)
        testbed.kubectl("delete", "clusterrolebinding", role, "--wait=false", check=False)
        testbed.kubectl("delete", "clusterrole", role, "--wait=false", check=False)
        testbed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_switch_and_the_selectors_update_and_remove_the_policies(
        testbed: Bed, sample: Callable[[str], dict[str, Any]], scoped: tuple[str, Path], tmp_path: Path) -> None:
    """Three operator runs one after the other, as a chart upgrade would restart it, each under exactly the
    documented RBAC: defaults; then other metrics selectors (the same objects, updated); then
    --no-network-policy (removed, and they stay away); then on again (recreated)."""
    ns, kubeconfig = scoped
    log = tmp_path / "operator.log"
    current: list[OperatorProcess] = []

    def run(*args: str) -> OperatorProcess:
        for old in current:
            old.stop()
        current.clear()
        operator = OperatorProcess(kubeconfig, ns, log, testbed.cluster.env, extra_args=args)
        operator.start()
        current.append(operator)
        return operator

    def log_tail() -> str:
        return current[0].log_tail() if current else ""

    try:
        run()
        testbed.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(resource(sample, "switch")))
        uid = wait_ready(testbed, ns, "switch", log_tail)["metadata"]["uid"]
        first = policies(testbed, ns, "switch")
        assert {n: p["spec"] for n, p in first.items()} == expected_specs(ns, "switch", uid, NetworkPolicySettings())

        # Other scrapers: the monitoring namespace's pods, any of them.
        run("--network-policy-metrics-namespace-selector", json.dumps(MONITORING),
            "--network-policy-metrics-pod-selector", "null")
        narrowed = NetworkPolicySettings(metrics_namespace_selector=MONITORING, metrics_pod_selector=None)
        want = expected_specs(ns, "switch", uid, narrowed)
        def taken() -> dict[str, dict[str, Any]] | None:
            now = policies(testbed, ns, "switch")
            return now if {n: p["spec"] for n, p in now.items()} == want else None

        updated = wait_for("the policies to take the new metrics selectors", taken, timeout=30, on_timeout=log_tail)
        assert {n: p["metadata"]["uid"] for n, p in updated.items()} == \
            {n: p["metadata"]["uid"] for n, p in first.items()}  # updated in place, not recreated
        assert updated["switch-decode"]["spec"]["ingress"][0]["from"][1] == {"namespaceSelector": MONITORING}

        # Off: the operator deletes them, says so, and the model stays Ready.
        run("--no-network-policy")
        wait_for("the policies of dm/switch to be removed", lambda: not policies(testbed, ns, "switch") or None,
                 timeout=30, on_timeout=log_tail)
        wait_ready(testbed, ns, "switch", log_tail)
        events = kubectl_json(testbed, "get", "events", "-n", ns, "--field-selector",
                              "involvedObject.kind=DisaggregatedModel,involvedObject.name=switch")["items"]
        removed = [e for e in events if e["reason"] == "NetworkPoliciesRemoved"]
        assert len(removed) == 1 and "switch-router" in removed[0]["message"], [e["message"] for e in removed]
        time.sleep(6)  # a resync (TANDEM_OPERATOR_RESYNC_SECONDS=5): nothing comes back while it is off
        assert not policies(testbed, ns, "switch")

        # On again: made anew.
        run()
        wait_for("the policies of dm/switch to be created again", lambda: (
            {n: p["spec"] for n, p in policies(testbed, ns, "switch").items()}
            == expected_specs(ns, "switch", uid, NetworkPolicySettings())) or None, timeout=30, on_timeout=log_tail)
        testbed.kubectl("delete", "dm", "switch", "-n", ns, "--timeout=30s")  # the operator releases its finalizer

        text = log.read_text(errors="replace")
        assert "NetworkPolicies: off" in text and "NetworkPolicies: on" in text
        # A refused call shows as "Forbidden"/"forbidden" or an HTTP 403 status (not timestamps such as ,403).
        refused = re.findall(r"forbidden|\(403\)|\b403 forbidden|status[=: ]+403\b", text, re.IGNORECASE)
        assert not refused, text[-3000:]
    finally:
        for operator in current:
            if not operator.alive():
                operator.start()
        # The fixture deletes what is left while this operator still runs (kopf's finalizer), then it stops.
        testbed.cluster.delete_custom_resources(ns)
        for operator in current:
            operator.stop()
