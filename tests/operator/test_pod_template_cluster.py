"""spec.<pool>.pod and spec.router.pod against the real control plane: the API server takes the resource (and
refuses its neighbours over the operator's own fields: invalid_resources.yaml), the operator's Deployments
with the passed-through fields pass the API server's own pod validation, admission resolves the classes and
accounts they name, and the pods (kwok) come up with them."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from operator_harness import condition
from pod_template_cases import RESERVED_NEIGHBOURS

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed
MULTUS = "k8s.v1.cni.cncf.io/networks"


def pod_block(suffix: str, account: str) -> dict[str, Any]:
    return {
        "annotations": {MULTUS: "rdma-net"},
        "labels": {"team": "inference"},
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True},
                         {"name": "scratch", "mountPath": "/scratch"}],
        "serviceAccountName": account,
        "priorityClassName": f"tandem-high-{suffix}",
        "runtimeClassName": f"nvidia-{suffix}",
        "schedulerName": "default-scheduler",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
    }


@pytest.fixture
def classes(testbed: Bed) -> Iterator[str]:
    """A PriorityClass and a RuntimeClass (cluster-wide, so named after the test namespace)."""
    suffix = testbed.namespace.rsplit("-", 1)[-1]
    testbed.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": f"tandem-high-{suffix}"},
         "value": 100000},
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": f"nvidia-{suffix}"},
         "handler": "nvidia"},
    ]}))
    for account in ("gpu-workers", "edge"):
        testbed.kubectl("create", "serviceaccount", account, "-n", testbed.namespace)
    yield suffix
    testbed.kubectl("delete", "priorityclass", f"tandem-high-{suffix}", "--wait=false", check=False)
    testbed.kubectl("delete", "runtimeclass", f"nvidia-{suffix}", "--wait=false", check=False)


def test_pod_blocks_reach_the_running_pods(testbed: Bed, cleanup: list[str], classes: str,
                                           sample: Callable[[str], dict[str, Any]]) -> None:
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name = "passthrough"
    body["spec"]["prefill"] = {"pod": pod_block(classes, "gpu-workers")}
    body["spec"]["decode"] = {"pod": {**pod_block(classes, "gpu-workers"), "hostNetwork": True, "hostIPC": True}}
    body["spec"]["router"] = {"pod": pod_block(classes, "edge")}
    cleanup.append(name)
    testbed.apply(body)

    def ready() -> dict[str, Any] | None:
        dm = testbed.get("dm", name)
        return dm if dm is not None and condition(dm, "Ready").get("status") == "True" else None

    testbed.wait_for(f"dm/{name} to be Ready", ready, timeout=90)
    for component in ("prefill", "decode", "router"):
        (pod,) = testbed.list("pods", f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["annotations"][MULTUS] == "rdma-net" and meta["labels"]["team"] == "inference"
        assert meta["labels"]["app.kubernetes.io/component"] == component  # still selected by its Deployment
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert {"ca", "scratch", "control-token", "tmp"} <= {v["name"] for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["/etc/ssl/corp"] == "ca" and mounts["/scratch"] == "scratch" and mounts["/tmp"] == "tmp"
        assert spec["serviceAccountName"] == ("edge" if component == "router" else "gpu-workers")
        # Admission resolved the classes: the priority's value is on the pod.
        assert (spec["priorityClassName"], spec["priority"]) == (f"tandem-high-{classes}", 100000)
        assert spec["runtimeClassName"] == f"nvidia-{classes}"
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec.get("hostNetwork", False) is (component == "decode")
        assert spec.get("hostIPC", False) is (component == "decode")
    decode = testbed.list("pods", f"app.kubernetes.io/instance={name},app.kubernetes.io/component=decode")[0]["spec"]
    assert decode["dnsPolicy"] == "ClusterFirstWithHostNet"
    # hostNetwork: the container ports became the node's ports (one such pod per node and port).
    assert {p["containerPort"]: p.get("hostPort") for p in decode["containers"][0]["ports"]} == {8000: 8000, 5555: 5555}
    # The router's own account may still watch its pools' endpoints (the operator's Role is bound to it).
    can = testbed.kubectl("auth", "can-i", "list", "endpointslices.discovery.k8s.io", "-n", testbed.namespace,
                          f"--as=system:serviceaccount:{testbed.namespace}:edge", check=False)
    assert can.stdout.strip() == "yes", can.stdout + can.stderr


@pytest.mark.parametrize("pod", list(RESERVED_NEIGHBOURS.values()), ids=list(RESERVED_NEIGHBOURS))
def test_neighbours_of_the_reserved_keys_and_paths_are_accepted(testbed: Bed, pod: dict[str, Any],
                                                               sample: Callable[[str], dict[str, Any]]) -> None:
    from tandem.operator.reconcile import parse_spec

    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = "neighbour"
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "weights"}}  # the operator mounts /models
    body["spec"]["prefill"] = {"pod": pod}
    assert parse_spec(body)[1] is None
    proc = testbed.kubectl("create", "--dry-run=server", "-n", testbed.namespace, "-f", "-",
                           input=json.dumps(body), check=False)
    assert proc.returncode == 0, proc.stderr
    # A path source mounts nothing at /models: a user mount there is the documented way to provide the folder.
    body["spec"]["model"]["source"] = {"path": "/models/tiny"}
    body["spec"]["prefill"] = {"pod": {"volumes": [{"name": "w", "emptyDir": {}}],
                                       "volumeMounts": [{"name": "w", "mountPath": "/models/tiny"}]}}
    proc = testbed.kubectl("create", "--dry-run=server", "-n", testbed.namespace, "-f", "-",
                           input=json.dumps(body), check=False)
    assert proc.returncode == 0, proc.stderr
