"""The pod fields the kwok tests can only see in the spec, on running pods (issue 21): hostNetwork, hostIPC,
a RuntimeClass and imagePullSecrets on a pool, and the router's own `pod` passthrough.

A model of its own in a namespace of its own (PodSecurity `privileged`: baseline and restricted refuse
hostNetwork), beside the setup's (tests/e2e/conftest.py), removed at the end. Its weights come the way
test_real_node_hub.py's do: the stand-in Hub (tests/hub/hub_standin.py, standing in for huggingface.co) on the
node IP, into a node-local cache prepared writable for the workers' uid.
- The decode pool runs with hostNetwork: its pod's IP is the node's, it listens on the node's ports 8000 and
  5555 (so prefill stays on the pod network: one node, and two hostNetwork pools would claim the same ports),
  and the prefill pool ships KV to it there.
- The prefill pool runs with hostIPC: its IPC namespace is the node's.
- The decode pool and the router name a RuntimeClass (handler `runc`, the bed's containerd runtime) and an
  image pull secret (unused by the kubelet: the images are loaded and imagePullPolicy is Never, which is
  what checks that a named secret does not get in the way).
- The router carries annotations, labels and a PriorityClass from `spec.router.pod`.
Its name sorts it before test_real_node_lifecycle.py, whose last test takes the real node down.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.worker.server.control_token import HEADER

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(REPO / "tests" / "hub"))
import real_node  # noqa: E402
from hub_standin import HubStandIn, folder_repo  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

WORKER_UID = 65532  # operator/builders.py WORKER_UID
NAME = "podfields"
RUNTIME_CLASS = "tandem-e2e-runc"
PRIORITY_CLASS = "tandem-e2e-router"
PRIORITY = 100_000
PULL_SECRET = "tandem-e2e-regcred"
ROUTER_POD = {"annotations": {"example.com/owner": "llm-platform"}, "labels": {"example.com/tier": "edge"},
              "runtimeClassName": RUNTIME_CLASS, "priorityClassName": PRIORITY_CLASS,
              "imagePullSecrets": [{"name": PULL_SECRET}]}
PREFILL_POD = {"hostIPC": True}
DECODE_POD = {"hostNetwork": True, "runtimeClassName": RUNTIME_CLASS, "imagePullSecrets": [{"name": PULL_SECRET}]}


def cluster_objects() -> list[dict[str, Any]]:
    """The cluster-scoped objects the pods name: the RuntimeClass and the PriorityClass."""
    return [{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS},
             "handler": "runc"},
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PRIORITY_CLASS},
             "value": PRIORITY, "description": "tests/e2e/test_real_node_fields.py"}]


def pull_secret(ns: str) -> dict[str, Any]:
    auth = base64.b64encode(b"robot:not-a-real-password").decode()
    config = {"auths": {"registry.example.com": {"auth": auth}}}
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
            "metadata": {"name": PULL_SECRET, "namespace": ns},
            "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()}}


def test_host_network_runtime_class_pull_secrets_and_the_router_pod_on_running_pods(setup: Any, tmp_path: Path) -> None:
    ns = f"{setup.namespace}-podfields"
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    os.chown(cache, WORKER_UID, WORKER_UID)  # node preparation (test_real_node_hub.py tests the refusal without it)
    on_node = {"tandem.dev/real-node": real_node.NODE_LABELS["tandem.dev/real-node"]}
    with HubStandIn(host=real_node.NODE_IP) as hub:
        hub.repos["org/tiny"] = folder_repo(Path(setup.info["model_dir"]))
        pool = {"replicas": 1, "device": "cpu", "nodeSelector": on_node, "shmSize": "256Mi",
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
                "env": [{"name": "HF_ENDPOINT", "value": hub.url}]}
        body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel",
                "metadata": {"name": NAME, "namespace": ns},
                "spec": {"model": {"name": "tiny-podfields", "dtype": "float32", "maxModelLen": 2048,
                                   "source": {"huggingFace": {"repo": "org/tiny", "cache": {"hostPath": str(cache)}}}},
                         "image": "tandem/worker:dev", "imagePullPolicy": "Never",
                         "prefill": {**pool, "pod": PREFILL_POD}, "decode": {**pool, "pod": DECODE_POD},
                         "router": {"replicas": 1, "nodeSelector": on_node, "pod": ROUTER_POD}}}
        setup.kubectl("create", "namespace", ns)
        try:
            setup.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=privileged")
            setup.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                "items": [*cluster_objects(), pull_secret(ns)]}))
            setup.kubectl("apply", "-f", "-", input=json.dumps(body))

            def ready() -> bool:
                dm = setup.json("get", "disaggregatedmodel", NAME, "-n", ns)
                return any(c["type"] == "Ready" and c["status"] == "True"
                           for c in dm.get("status", {}).get("conditions", []))

            setup.wait(f"dm/{NAME} Ready with a hostNetwork decode pool", ready, timeout=600)
            pods = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p
                    for p in setup.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
                    if not p["metadata"].get("deletionTimestamp")}
            assert set(pods) == {"prefill", "decode", "router"}, sorted(pods)
            decode, prefill, router = pods["decode"], pods["prefill"], pods["router"]

            # hostNetwork: the node's address and ports, the cluster's DNS.
            assert decode["spec"]["hostNetwork"] is True and decode["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
            assert decode["status"]["podIP"] == real_node.NODE_IP, decode["status"]
            assert prefill["status"]["podIP"] != real_node.NODE_IP and not prefill["spec"].get("hostNetwork")
            ports = {p["containerPort"]: p.get("hostPort") for p in decode["spec"]["containers"][0]["ports"]}
            assert ports == {8000: 8000, 5555: 5555}, ports  # what keeps a second such pod off the node
            info = httpx.get(f"http://{real_node.NODE_IP}:8000/health", timeout=5)
            assert info.status_code == 200, "the decode worker answers on the node's own port 8000"

            # hostIPC: the prefill worker's IPC namespace is the node's (this machine's), decode's its own.
            def ipc_namespace(pod: dict[str, Any]) -> str:
                return setup.kubectl("exec", "-n", ns, pod["metadata"]["name"], "-c", "worker", "--",
                                     "readlink", "/proc/1/ns/ipc").strip()

            assert prefill["spec"]["hostIPC"] is True
            assert ipc_namespace(prefill) == os.readlink("/proc/self/ns/ipc")
            assert ipc_namespace(decode) != os.readlink("/proc/self/ns/ipc")

            for pod in (decode, router):
                assert pod["spec"]["runtimeClassName"] == RUNTIME_CLASS, pod["spec"]
                assert pod["spec"]["imagePullSecrets"] == [{"name": PULL_SECRET}], pod["spec"]
            assert router["metadata"]["annotations"].items() >= ROUTER_POD["annotations"].items()
            assert router["metadata"]["labels"].items() >= ROUTER_POD["labels"].items()
            assert router["spec"]["priorityClassName"] == PRIORITY_CLASS and router["spec"]["priority"] == PRIORITY

            # Served disaggregated: prefill on the pod network ships KV to decode on the node's network. The
            # decode worker advertises its KV address from POD_IP (the node's IP here; its hostname, the node's,
            # resolves to 127.0.0.1 on this machine, which was the address it gave before).
            def decode_metric(name: str) -> float:
                text = httpx.get(f"http://{real_node.NODE_IP}:8000/metrics", timeout=5).text
                return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith(name + "{") and ('direction="recv"' in line or "bytes" not in name))

            token = base64.b64decode(setup.kubectl("get", "secret", "-n", ns, f"{NAME}-control-token", "-o",
                                                   "jsonpath={.data.token}")).decode().splitlines()[0]
            info = httpx.get(f"http://{real_node.NODE_IP}:8000/info", headers={HEADER: token}, timeout=5).json()
            assert info["kv_address"].startswith(f"tcp://{real_node.NODE_IP}:"), info["kv_address"]
            client = setup.client(f"http://{router['status']['podIP']}:8000/v1")
            theirs = setup.client().completions.create(
                model=setup.info["model_name"], prompt="The quick brown fox", max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].model_extra["token_ids"]

            def served_disaggregated() -> bool:  # the router may not have found the prefill pod yet
                before = decode_metric("tandem_kv_transfer_bytes_total")
                resp = client.completions.create(model="tiny-podfields", prompt="The quick brown fox", max_tokens=8,
                                                 temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
                assert list(resp.choices[0].model_extra["token_ids"]) == list(theirs), \
                    "the same weights must give the setup's model's tokens"
                return decode_metric("tandem_kv_transfer_bytes_total") > before

            try:
                setup.wait("a request's KV shipped to the hostNetwork decode worker", served_disaggregated,
                           timeout=60, period=2)
            except AssertionError as exc:
                fallbacks = decode_metric("tandem_fallback_prefills_total")
                failures = decode_metric("tandem_kv_transfer_failures_total")
                raise AssertionError(f"no KV reached the decode worker: {fallbacks} local prefills, {failures} "
                                     f"transfer failures; prefill log:\n"
                                     f"{setup.kubectl('logs', '-n', ns, prefill['metadata']['name'], check=False)[-3000:]}") from exc
        finally:
            setup.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=180s", check=False)
            for obj in cluster_objects():
                setup.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found",
                              check=False)
