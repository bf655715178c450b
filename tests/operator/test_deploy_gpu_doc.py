"""docs/deploy-gpu.md, run on the local control plane (real kube-apiserver, kwok nodes, the operator as a process).

Every ```yaml block of the page is applied and every `kubectl` command of its ```sh blocks that can run here is
run, in the page's order, from a folder holding the blocks as the files they name. What cannot exist here is
stood in for, each in one named place:

- `doc_nodes`: four kwok nodes named after the page's h100-01..04 (with this run's suffix) offering what the
  GPU Operator and the Network Operator would advertise (8 fake nvidia.com/gpu, rdma/rdma_shared_device_a, the
  GFD product label). The page's own `kubectl label` and `kubectl taint` commands then make them the pools.
- `confine_to_test_nodes`: the session's other kwok nodes match the page's selectors too, so the applied model
  also selects and tolerates a label and taint only this run's nodes carry (nothing else lands on them).
- `on_test_bed`: the namespace `llm` is the test's, node names get the suffix, the 30-minute wait becomes 180 s.
- `hub_cache_volume`: the cache claim's storage class `shared-rwx` has no provisioner here; a PV stands in.
- ```yaml cluster-only blocks (the NVIDIA operators' resources: no such CRDs here) and commands that need a
  running container or a registry are not run; SKIPPED_VERBS says why, and an unclassified command fails.
  Only `kubectl` lines are run here: the page's `helm install` (and `docker`) are not. On real pods,
  tests/e2e/test_real_node_deploy_doc.py runs the skipped `kubectl exec ... tandem doctor` and
  `kubectl run ... tandem bench`, renders the `helm install`, and checks the pod passthrough on running pods.

The drift check: the page's model, unchanged, passes the CRD's schema with strict field validation (a server-side
dry-run apply), and the same check refuses a copy with one misspelled field, so it can fail.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Bed = Any  # tests/operator/conftest.py: Testbed
DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy-gpu.md"
RUN = uuid.uuid4().hex[:6]
DOC_NODES = {"h100-01": "prefill", "h100-02": "prefill", "h100-03": "decode", "h100-04": "decode"}
ISOLATION_KEY = "test.tandem.dev/deploy-gpu-doc"
MULTUS = "k8s.v1.cni.cncf.io/networks"
# kubectl verbs the page uses that the test bed cannot carry out, and why; any other verb must run.
SKIPPED_VERBS = {
    "exec": "kwok runs no containers: nothing to exec into (run on real pods: "
            "tests/e2e/test_real_node_deploy_doc.py::test_tandem_doctor_in_a_decode_worker)",
    "run": "kwok runs no containers: the bench pod would never execute (run on real pods: "
           "tests/e2e/test_real_node_deploy_doc.py::test_tandem_bench_through_the_routers_service)",
}
RUN_VERBS = {"get", "describe", "apply", "label", "taint", "create", "wait"}


def node_name(doc_name: str) -> str:
    return f"{doc_name}-{RUN}"


def blocks() -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of the page."""
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", DOC.read_text(),
                                                                  re.S | re.M)]


def manifests() -> dict[str, str]:
    """The ```yaml blocks by the file name their first line gives (`# name.yaml`)."""
    files: dict[str, str] = {}
    for info, body in blocks():
        if info == "yaml":
            first = body.splitlines()[0]
            assert re.fullmatch(r"# [-\w.]+\.yaml", first), f"a yaml block must start with '# file.yaml': {first!r}"
            files[first[2:]] = body
        else:
            assert info in ("", "sh", "yaml cluster-only"), f"unknown block kind {info!r} in {DOC.name}"
    return files


def kubectl_commands() -> list[list[str]]:
    """Every `kubectl ...` command line of the ```sh blocks, continuation lines joined."""
    commands = []
    for info, body in blocks():
        if info != "sh":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.startswith("kubectl "):
                commands.append(shlex.split(line, comments=True))
    return commands


def on_test_bed(argv: list[str], namespace: str) -> list[str]:
    """The page's command with the test's namespace and nodes, and a wait this test bed needs only seconds for."""
    out = []
    for arg in argv:
        arg = {"llm": namespace, "--timeout=30m": "--timeout=180s"}.get(arg, arg)
        out.append(node_name(arg) if arg in DOC_NODES else arg)
    return out


def confine_to_test_nodes(model: dict[str, Any]) -> dict[str, Any]:
    model = copy.deepcopy(model)
    for pool in ("prefill", "decode"):
        spec = model["spec"][pool]
        spec["nodeSelector"] = {**spec["nodeSelector"], ISOLATION_KEY: RUN}
        spec["tolerations"] = [*spec["tolerations"], {"key": ISOLATION_KEY, "operator": "Equal", "value": RUN,
                                                      "effect": "NoSchedule"}]
    return model


@pytest.fixture
def doc_nodes(testbed: Bed) -> Iterator[None]:
    """The page's H100 nodes, as the GPU and Network Operators would leave them, before its label/taint commands."""
    capacity = {"cpu": "96", "memory": "1024Gi", "pods": "110", "nvidia.com/gpu": "8",
                "rdma/rdma_shared_device_a": "63"}
    nodes = [{"apiVersion": "v1", "kind": "Node",
              "metadata": {"name": node_name(doc), "labels": {
                  "type": "kwok", "kubernetes.io/hostname": node_name(doc), "kubernetes.io/os": "linux",
                  "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8", ISOLATION_KEY: RUN},
                  "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
              "spec": {"taints": [{"key": ISOLATION_KEY, "value": RUN, "effect": "NoSchedule"}]},
              "status": {"capacity": capacity, "allocatable": capacity}} for doc in DOC_NODES]
    testbed.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))

    def ready() -> bool:
        out = json.loads(testbed.kubectl("get", "nodes", "-l", f"{ISOLATION_KEY}={RUN}", "-o", "json").stdout)
        return len(out["items"]) == len(DOC_NODES) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
            for n in out["items"])

    testbed.wait_for("kwok to make the page's four H100 nodes Ready", ready, timeout=60)
    yield
    # Gone before the next test: the session's other tests count the cluster's nodes.
    testbed.kubectl("delete", "nodes", "-l", f"{ISOLATION_KEY}={RUN}", "--timeout=60s", check=False)


@pytest.fixture
def hub_cache_volume(testbed: Bed) -> Iterator[None]:
    """The claim's storage class has no provisioner here: a PV waiting for exactly the page's claim stands in."""
    claim = yaml.safe_load(manifests()["hub-cache.yaml"])
    name = f"{testbed.namespace}-hub-cache"
    testbed.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": claim["spec"]["resources"]["requests"], "accessModes": claim["spec"]["accessModes"],
                 "storageClassName": claim["spec"]["storageClassName"], "hostPath": {"path": "/var/lib/hub-cache"},
                 "claimRef": {"namespace": testbed.namespace, "name": claim["metadata"]["name"]}}}))
    yield
    testbed.kubectl("delete", "pv", name, "--wait=false", check=False)


def test_every_block_kind_and_command_is_classified() -> None:
    files = manifests()
    assert set(files) == {"hub-cache.yaml", "llama3-8b.yaml"}, sorted(files)
    verbs = {argv[1] for argv in kubectl_commands()}
    assert verbs <= RUN_VERBS | set(SKIPPED_VERBS), f"classify these kubectl verbs: {verbs - RUN_VERBS - set(SKIPPED_VERBS)}"
    assert {"apply", "get", "describe", "wait"} <= verbs


def test_the_model_manifest_passes_the_crd_schema(testbed: Bed) -> None:
    """The page's model as written: a strict server-side dry run accepts it; a misspelled field is refused."""
    model = yaml.safe_load(manifests()["llama3-8b.yaml"])

    def dry_run(body: dict[str, Any]) -> Any:
        return testbed.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                               "--field-manager=deploy-gpu-doc", "-n", testbed.namespace, "-f", "-",
                               input=json.dumps(body), check=False)

    proc = dry_run(model)
    assert proc.returncode == 0, f"docs/deploy-gpu.md's llama3-8b.yaml no longer matches the CRD:\n{proc.stderr}"
    misspelled = copy.deepcopy(model)
    misspelled["spec"]["decode"]["gpuTypes"] = misspelled["spec"]["decode"].pop("gpuType")
    proc = dry_run(misspelled)
    assert proc.returncode != 0 and "gpuTypes" in proc.stderr, (proc.returncode, proc.stderr)


def test_the_page_deploys_onto_the_gpu_nodes(testbed: Bed, doc_nodes: None, hub_cache_volume: None,
                                             cleanup: list[str], tmp_path: Path) -> None:
    ns = testbed.namespace
    files = manifests()
    (tmp_path / "hub-cache.yaml").write_text(files["hub-cache.yaml"])
    model = yaml.safe_load(files["llama3-8b.yaml"])
    (tmp_path / "llama3-8b.yaml").write_text(yaml.safe_dump(confine_to_test_nodes(model)))
    cleanup.append(model["metadata"]["name"])

    outputs: dict[str, str] = {}
    not_run = []
    for argv in kubectl_commands():
        verb = argv[1]
        if verb in SKIPPED_VERBS or argv[1:3] == ["create", "namespace"]:  # the testbed's namespace stands in
            not_run.append(argv)
            continue
        args = on_test_bed(argv, ns)[1:]
        if verb == "apply":
            args = [str(tmp_path / a) if a.endswith(".yaml") else a for a in args]
        proc = testbed.cluster.kubectl(*args, check=False, timeout=240)
        assert proc.returncode == 0, f"`{shlex.join(argv)}` from docs/deploy-gpu.md failed:\n{proc.stderr}"
        outputs[" ".join(argv)] = proc.stdout

    allocatable = json.loads(outputs["kubectl get node h100-01 -o jsonpath={.status.allocatable}"])
    assert allocatable["nvidia.com/gpu"] == "8" and "rdma/rdma_shared_device_a" in allocatable
    assert "llama3-8b" in outputs["kubectl get dm -n llm llama3-8b"]
    assert "Ready" in outputs["kubectl describe dm -n llm llama3-8b"]
    assert testbed.get("pvc", "hub-cache")["status"]["phase"] == "Bound"

    for pool, replicas in (("prefill", 2), ("decode", 2)):
        pods = testbed.list("pods", f"app.kubernetes.io/instance=llama3-8b,app.kubernetes.io/component={pool}")
        assert len(pods) == replicas, [p["metadata"]["name"] for p in pods]
        own_nodes = {node_name(doc) for doc, p in DOC_NODES.items() if p == pool}
        for pod in pods:
            spec = pod["spec"]
            assert spec.get("nodeName") in own_nodes, (pool, spec.get("nodeName"), own_nodes)
            assert pod["status"]["phase"] == "Running", pod["status"]
            assert pod["metadata"]["annotations"][MULTUS] == "rdma-net"
            assert spec["nodeSelector"]["tandem.dev/pool"] == pool
            assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
            assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in spec["tolerations"]
            (worker,) = spec["containers"]
            assert worker["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1",
                                                       "rdma/rdma_shared_device_a": "1"}
            assert worker["resources"]["limits"]["memory"] == "96Gi"
            assert worker["image"] == "registry.example.com/ml/tandem:0.1.0"
            (fetch,) = spec["initContainers"]
            assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} \
                in fetch["env"]
            assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}} in spec["volumes"]
    (router,) = testbed.list("pods", "app.kubernetes.io/instance=llama3-8b,app.kubernetes.io/component=router")
    assert router["spec"].get("nodeName") and not router["spec"]["nodeName"].startswith("h100-")
    check_targets_of_commands_not_run(testbed, not_run)


def check_targets_of_commands_not_run(testbed: Bed, commands: list[list[str]]) -> None:
    """What `kubectl exec` and the bench's --url name exists as the page says: the Deployment and its container,
    the router's Service and port (the commands themselves need running containers)."""
    for argv in commands:
        if argv[1] == "exec":
            kind, name = argv[argv.index("-n") + 2].split("/")
            assert kind == "deploy", argv
            deployment = testbed.get("deployment", name)
            assert deployment is not None, f"`{' '.join(argv)}` names no Deployment the operator made"
            containers = [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]]
            assert argv[argv.index("-c") + 1] in containers, (argv, containers)
        elif argv[1] == "run":
            url = argv[argv.index("--url") + 1]
            match = re.fullmatch(r"http://([-a-z0-9]+)\.llm\.svc:(\d+)", url)
            assert match, url
            service = testbed.get("service", match.group(1))
            assert service is not None, f"the bench's --url {url} names no Service"
            assert int(match.group(2)) in [p["port"] for p in service["spec"]["ports"]], service["spec"]["ports"]


def test_commands_left_to_a_gpu_cluster() -> None:
    """Says which of the page's commands no test here runs, and why (their targets are checked above)."""
    skipped = [f"`{' '.join(argv[:4])} ...`: {SKIPPED_VERBS[argv[1]]}" for argv in kubectl_commands()
               if argv[1] in SKIPPED_VERBS]
    assert skipped, "the page should show tandem doctor (kubectl exec) and tandem bench (kubectl run)"
    pytest.skip("not run on the local control plane: " + "; ".join(skipped))
