"""Scale for others: each pool's DisaggregatedPool and its scale subresource, against the real control plane.

`kubectl scale dmpool/<dm>-<pool>` is what an HPA or a KEDA ScaledObject does through the same
/scale subresource, so driving it with kubectl exercises the path they use. The operator is the
real `tandem operator` subprocess (tests/operator/conftest.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed


def make(sample: Callable[[str], dict[str, Any]], name: str, **pools: Any) -> dict[str, Any]:
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name
    body["spec"].update(pools)
    return body


def replicas(testbed: Bed, deployment: str) -> int | None:
    dep = testbed.get("deployment", deployment)
    return None if dep is None else int(dep["spec"]["replicas"])


def scale(testbed: Bed, pool: str, n: int) -> None:
    testbed.kubectl("scale", f"dmpool/{pool}", f"--replicas={n}", "-n", testbed.namespace)


def test_kubectl_scale_drives_an_externally_scaled_pool(testbed: Bed, cleanup: list[str],
                                                      sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("ext")
    testbed.apply(make(sample, "ext", decode={
        "replicas": 1, "autoscaling": {"enabled": True, "mode": "external", "minReplicas": 1, "maxReplicas": 4}}))
    pool = testbed.wait_for("dmpool/ext-decode handed to the external scaler", lambda: p if (
        p := testbed.get("dmpool", "ext-decode")) and (p.get("status") or {}).get("scaledBy") == "external" else None)
    owners = pool["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("DisaggregatedModel", "ext")]
    assert pool["spec"] == {"replicas": 1, "model": "ext", "pool": "decode"}
    assert pool["status"]["selector"] == ("app.kubernetes.io/component=decode,app.kubernetes.io/instance=ext,"
                                          "app.kubernetes.io/name=tandem")

    # What kubectl scale, an HPA and KEDA all do: write /scale.
    scale(testbed, "ext-decode", 3)
    testbed.wait_for("ext-decode Deployment at 3", lambda: replicas(testbed, "ext-decode") == 3 or None, timeout=30)
    dm = testbed.wait_for("dm status decode 3/3", lambda: d if (d := testbed.get("dm", "ext"))["status"]["decode"].get(
        "summary") == "3/3" else None, timeout=45)
    assert dm["status"]["decode"]["desiredReplicas"] == 3 and dm["status"]["decode"]["scaledBy"] == "external"
    # The scale subresource reports what runs, with the pool's selector (what an HPA reads).
    got = testbed.wait_for("the /scale status to show 3 replicas", lambda: s if (s := json.loads(testbed.kubectl(
        "get", "--raw", f"/apis/tandem.dev/v1alpha1/namespaces/{testbed.namespace}/disaggregatedpools/ext-decode/scale"
    ).stdout))["status"].get("replicas") == 3 else None, timeout=30)
    assert got["spec"]["replicas"] == 3
    assert got["status"]["selector"] == pool["status"]["selector"]

    # Beyond maxReplicas: the pool stops at 4 and the DisaggregatedPool says why.
    scale(testbed, "ext-decode", 9)
    testbed.wait_for("ext-decode clamped to maxReplicas 4", lambda: replicas(testbed, "ext-decode") == 4 or None,
                     timeout=30)
    message = testbed.wait_for("the clamp explained", lambda: m if "outside [1, 4]" in (
        m := (testbed.get("dmpool", "ext-decode").get("status") or {}).get("message", "")) else None, timeout=30)
    assert "4 applied" in message

    # A hand edit of the Deployment is still reverted: the DisaggregatedPool is the one input.
    testbed.kubectl("scale", "deployment/ext-decode", "--replicas=1", "-n", testbed.namespace)
    testbed.wait_for("ext-decode restored to 4", lambda: replicas(testbed, "ext-decode") == 4 or None, timeout=30)


def test_scale_is_ignored_unless_the_pool_is_external_and_handover_keeps_the_size(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("own")
    testbed.apply(make(sample, "own", prefill={"replicas": 1}))
    testbed.wait_for("dmpool/own-prefill", lambda: p if (p := testbed.get("dmpool", "own-prefill")) and (
        p.get("status") or {}).get("scaledBy") == "spec" else None)

    # The pool's size comes from spec: a scale on its DisaggregatedPool changes nothing and says so.
    scale(testbed, "own-prefill", 3)
    status = testbed.wait_for("the ignored scale explained", lambda: s if "ignored" in (
        s := testbed.get("dmpool", "own-prefill").get("status") or {}).get("message", "") else None, timeout=30)
    assert status["desiredReplicas"] == 1 and "mode: external" in status["message"]
    assert status["message"].startswith(
        "spec.replicas is ignored: the DisaggregatedModel's spec.prefill.replicas sets the size, because "
        "autoscaling is disabled on the prefill pool."), status["message"]
    assert replicas(testbed, "own-prefill") == 1

    # Spec grows the pool to 2; then the pool is handed over to an external scaler: it starts at 2
    # (what runs), not at the stale 3 written to the DisaggregatedPool before.
    testbed.kubectl("patch", "dm", "own", "-n", testbed.namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"prefill": {"replicas": 2}}}))
    testbed.wait_for("own-prefill at 2", lambda: replicas(testbed, "own-prefill") == 2 or None, timeout=30)
    testbed.kubectl("patch", "dm", "own", "-n", testbed.namespace, "--type=merge", "-p", json.dumps(
        {"spec": {"prefill": {"autoscaling": {"enabled": True, "mode": "external", "maxReplicas": 4}}}}))
    pool = testbed.wait_for("own-prefill handed over", lambda: p if (
        p := testbed.get("dmpool", "own-prefill")).get("status", {}).get("scaledBy") == "external" else None)
    assert pool["spec"]["replicas"] == 2
    assert replicas(testbed, "own-prefill") == 2
    scale(testbed, "own-prefill", 1)
    testbed.wait_for("own-prefill scaled down to 1", lambda: replicas(testbed, "own-prefill") == 1 or None,
                     timeout=30)


def test_a_deleted_pool_resource_is_recreated(testbed: Bed, cleanup: list[str],
                                              sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("gone")
    testbed.apply(make(sample, "gone"))
    first = testbed.wait_for("dmpool/gone-decode", lambda: testbed.get("dmpool", "gone-decode"))
    testbed.kubectl("delete", "dmpool", "gone-decode", "-n", testbed.namespace)
    again = testbed.wait_for("dmpool/gone-decode recreated", lambda: p if (
        p := testbed.get("dmpool", "gone-decode")) and p["metadata"]["uid"] != first["metadata"]["uid"] else None,
        timeout=30)
    assert again["spec"]["replicas"] == replicas(testbed, "gone-decode")
