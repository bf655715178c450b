"""The local control plane behaves like a GPU cluster: real scheduler decisions on kwok nodes."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.utils import parse_quantity

pytestmark = pytest.mark.integration

RDMA = "rdma/rdma_shared_device_a"


def gpu_deployment(name: str, replicas: int) -> str:
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"tandem.dev/pool": "decode"},
                    "tolerations": [{"key": "tandem.dev/pool", "operator": "Equal", "value": "decode",
                                     "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "worker", "image": "tandem/worker:test",
                        "resources": {"limits": {"nvidia.com/gpu": "1", RDMA: "1"}},
                    }],
                },
            },
        },
    })


def wait_until(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def test_nodes_show_gpu_pools(k8s_cluster) -> None:  # type: ignore[no-untyped-def]
    out = k8s_cluster.kubectl("get", "nodes", "-L", "tandem.dev/pool").stdout
    assert "prefill-0" in out and "decode-7" in out, out
    nodes = [n for n in k8s_cluster.kubectl_json("get", "nodes")["items"]
             if n["metadata"]["labels"]["tandem.dev/pool"] in ("prefill", "decode")]
    system = [n for n in k8s_cluster.kubectl_json("get", "nodes", "-l", "tandem.dev/pool=system")["items"]]
    # The untainted, GPU-less system pool is where routers and the operator run.
    assert len(system) == 2
    assert not [t for n in system for t in n["spec"].get("taints", []) if t["key"] == "tandem.dev/pool"]
    assert all("nvidia.com/gpu" not in n["status"]["allocatable"] for n in system)
    pools = {}
    for node in nodes:
        pool = node["metadata"]["labels"]["tandem.dev/pool"]
        pools[pool] = pools.get(pool, 0) + 1
        assert parse_quantity(node["status"]["allocatable"]["nvidia.com/gpu"]) == 8
        assert parse_quantity(node["status"]["allocatable"][RDMA]) == 1000
        assert node["spec"]["taints"][0]["key"] == "tandem.dev/pool"
    assert pools == {"prefill": 4, "decode": 8}
    gpu_types = {n["metadata"]["labels"]["tandem.dev/pool"]: n["metadata"]["labels"]["nvidia.com/gpu.product"]
                 for n in nodes}
    assert gpu_types["prefill"] != gpu_types["decode"]


def test_gpu_pods_land_on_decode_pool_and_become_ready(k8s_cluster) -> None:  # type: ignore[no-untyped-def]
    k8s_cluster.kubectl("apply", "-f", "-", input=gpu_deployment("smoke-decode", 3))
    try:
        wait_until(lambda: k8s_cluster.kubectl_json("get", "deployment", "smoke-decode")
                   .get("status", {}).get("readyReplicas") == 3, 60, "3 ready replicas")
        pods = k8s_cluster.kubectl_json("get", "pods", "-l", "app=smoke-decode")["items"]
        assert len(pods) == 3
        for pod in pods:
            assert pod["spec"]["nodeName"].startswith("decode-"), pod["spec"].get("nodeName")
            assert pod["status"]["phase"] == "Running"
    finally:
        k8s_cluster.kubectl("delete", "deployment", "smoke-decode", "--wait=false", check=False)


def test_pods_beyond_gpu_capacity_stay_pending_unschedulable(k8s_cluster) -> None:  # type: ignore[no-untyped-def]
    # 8 decode nodes x 8 GPUs = 64 GPUs; ask for 70 one-GPU pods.
    k8s_cluster.kubectl("apply", "-f", "-", input=gpu_deployment("smoke-overflow", 70))
    try:
        def pending_unschedulable():  # type: ignore[no-untyped-def]
            pods = k8s_cluster.kubectl_json("get", "pods", "-l", "app=smoke-overflow")["items"]
            stuck = [p for p in pods if p["status"].get("phase") == "Pending" and any(
                c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                and "nvidia.com/gpu" in c.get("message", "")
                for c in p["status"].get("conditions", []))]
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            return (len(running), len(stuck)) if len(running) == 64 and len(stuck) == 6 else None

        running, stuck = wait_until(pending_unschedulable, 120, "64 running and 6 unschedulable pods")
        assert (running, stuck) == (64, 6)
    finally:
        k8s_cluster.kubectl("delete", "deployment", "smoke-overflow", "--wait=false", check=False)
