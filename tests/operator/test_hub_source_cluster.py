"""spec.model.source.huggingFace against the real control plane: the API server takes the source (and refuses
its broken neighbours: invalid_resources.yaml), the operator's worker Deployments with the fetch-model init
container, the cache claim, the token's secretKeyRef and the pod's fsGroup pass the API server's own pod
validation, and the pods (kwok) are scheduled with the claim bound; a node-folder cache (hostPath) likewise."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from operator_harness import condition

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed



def wait_ready(testbed: Any, name: str) -> dict[str, Any]:
    """The resource, once Ready for its current generation."""
    def ready() -> dict[str, Any] | None:
        dm = testbed.get("dm", name)
        ok = dm is not None and condition(dm, "Ready").get("status") == "True"
        return dm if ok and dm["status"].get("observedGeneration") == dm["metadata"]["generation"] else None

    return testbed.wait_for(f"dm/{name} Ready", ready, timeout=90)

def test_hugging_face_source_reaches_the_pods(testbed: Bed, cleanup: list[str],
                                              sample: Callable[[str], dict[str, Any]]) -> None:
    ns = testbed.namespace
    testbed.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-hub-cache"},
         "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                  "hostPath": {"path": "/var/lib/hub-cache"},
                  "claimRef": {"namespace": ns, "name": "hub-cache"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "hub-cache", "namespace": ns},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{ns}-hub-cache",
                  "resources": {"requests": {"storage": "100Gi"}}}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": ns},
         "stringData": {"token": "hf_example"}},
    ]}))
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name = "hub"
    body["spec"]["model"]["source"] = {"huggingFace": {
        "repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f249a16976918f6564b8830bc894c89659",
        "tokenSecretRef": {"name": "hf-token"}, "cache": {"claimName": "hub-cache"}}}
    cleanup.append(name)
    testbed.apply(body)

    wait_ready(testbed, name)
    for pool in ("prefill", "decode"):
        pod = testbed.get("deployment", f"{name}-{pool}")["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["args"] == ["fetch-model", "--model",
                                "meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
                                "--link", "/tmp/model"]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init["env"]
        assert pod["securityContext"] == {"fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}} in pod["volumes"]
        pods = testbed.list("pod", f"app.kubernetes.io/instance={name},app.kubernetes.io/component={pool}")
        assert pods and all(p["spec"].get("nodeName") for p in pods), [p.get("status") for p in pods]
    assert testbed.get("pvc", "hub-cache")["status"]["phase"] == "Bound"


def test_host_path_cache_reaches_the_pods(testbed: Bed, cleanup: list[str],
                                          sample: Callable[[str], dict[str, Any]]) -> None:
    """cache.hostPath: the API server takes it, and the pods (kwok) carry the node folder as a DirectoryOrCreate
    hostPath with no fsGroup; the refusals of both or neither key, and of relative, `..`, / and trailing-/ paths,
    are in invalid_resources.yaml (test_cluster_operator.py runs them here too)."""
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name = "hub-node"
    body["spec"]["model"]["source"] = {"huggingFace": {
        "repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f249a16976918f6564b8830bc894c89659",
        "cache": {"hostPath": "/var/cache/tandem/hub"}}}
    cleanup.append(name)
    testbed.apply(body)

    wait_ready(testbed, name)
    for pool in ("prefill", "decode"):
        pods = testbed.list("pod", f"app.kubernetes.io/instance={name},app.kubernetes.io/component={pool}")
        assert pods and all(p["spec"].get("nodeName") for p in pods), [p.get("status") for p in pods]
        for pod in pods:
            spec = pod["spec"]
            assert {"name": "model", "hostPath": {"path": "/var/cache/tandem/hub", "type": "DirectoryOrCreate"}} \
                in spec["volumes"]
            assert not spec.get("securityContext", {}).get("fsGroup")
            (init,) = spec["initContainers"]
            assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
