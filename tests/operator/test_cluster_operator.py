"""The operator against the real control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok GPU nodes), running as `tandem operator` in a subprocess and driven with kubectl."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    OperatorProcess,
    condition,
    environ_without_kubeconfig,
    rbac_only_kubeconfig,
    wait_for,
)

from tandem.worker.kv.keys import KVKeys

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed


def resource(sample: Callable[[str], dict[str, Any]], name: str, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name
    for key, value in spec.items():
        body["spec"][key] = value
    return body


def wait_ready(testbed: Bed, name: str, timeout: float = 60.0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        dm = testbed.get("dm", name)
        if dm is None or condition(dm, "Ready").get("status") != "True":
            return None
        if dm["status"].get("observedGeneration") != dm["metadata"]["generation"]:
            return None
        return dm

    return testbed.wait_for(f"dm/{name} to be Ready at its current generation", ready, timeout)  # type: ignore[no-any-return]


def children(testbed: Bed, name: str, kind: str) -> list[dict[str, Any]]:
    return testbed.list(kind, f"app.kubernetes.io/instance={name}")  # type: ignore[no-any-return]


def test_minimal_sample_becomes_ready_with_its_children(testbed: Bed,
                                                        sample: Callable[[str], dict[str, Any]]) -> None:
    testbed.kubectl("apply", "-n", testbed.namespace, "-f", "crds/samples/minimal.yaml")
    dm = wait_ready(testbed, "tiny")
    ns = testbed.namespace

    assert dm["metadata"]["finalizers"] == ["tandem.dev/finalizer"]
    kopf_keys = [k for k in dm["metadata"].get("annotations", {}) if "kopf" in k or k.endswith("last-handled-configuration")]
    assert kopf_keys and all(k.startswith("tandem.dev/") for k in kopf_keys), kopf_keys

    status = dm["status"]
    for pool in ("prefill", "decode", "router"):
        assert (status[pool]["readyReplicas"], status[pool]["desiredReplicas"], status[pool]["summary"]) == (1, 1, "1/1")
    assert status["endpoint"] == f"http://tiny.{ns}.svc:8000/v1"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False"}

    assert sorted(d["metadata"]["name"] for d in children(testbed, "tiny", "deployments")) == [
        "tiny-decode", "tiny-prefill", "tiny-router"]
    services = {s["metadata"]["name"]: s["spec"] for s in children(testbed, "tiny", "services")}
    assert set(services) == {"tiny", "tiny-prefill", "tiny-decode"}
    assert services["tiny-prefill"]["clusterIP"] == "None" and services["tiny-decode"]["clusterIP"] == "None"
    assert sorted(p["metadata"]["name"] for p in children(testbed, "tiny", "pdb")) == ["tiny-decode", "tiny-prefill", "tiny-router"]

    prefill = testbed.get("deployment", "tiny-prefill")
    container = prefill["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["worker", "--role", "prefill"]
    # transport auto (the sample's default) asks for no RDMA device: it schedules without the device plugin.
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # no RDMA: no privilege
    managed = json.loads(testbed.kubectl("get", "deployment", "tiny-prefill", "-n", ns, "-o", "json",
                                         "--show-managed-fields").stdout)["metadata"]["managedFields"]
    assert [m["manager"] for m in managed if m["operation"] == "Apply"] == ["tandem-operator"]

    nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in
             json.loads(testbed.kubectl("get", "nodes", "-o", "json").stdout)["items"]}
    for pool in ("prefill", "decode"):
        pods = testbed.list("pods", f"app.kubernetes.io/instance=tiny,app.kubernetes.io/component={pool}")
        assert len(pods) == 1
        pod = pods[0]
        assert nodes[pod["spec"]["nodeName"]].get("tandem.dev/pool") == pool, pod["spec"]["nodeName"]
        assert pod["metadata"]["labels"]["tandem.dev/spec-fingerprint"] == status["specFingerprint"]
        assert pod["metadata"]["labels"]["tandem.dev/role"] == pool

    table = testbed.kubectl("get", "dm", "tiny", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "READY", "ENDPOINT", "AGE"]
    assert table[1].split()[:6] == ["tiny", "tiny-llama", "1/1", "1/1", "True", f"http://tiny.{ns}.svc:8000/v1"]

    events = testbed.kubectl("get", "events", "-n", ns, "--field-selector",
                             "involvedObject.kind=DisaggregatedModel,involvedObject.name=tiny", "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Created", "Ready"} <= reasons, reasons


def test_spec_change_updates_children_and_observed_generation(testbed: Bed, cleanup: list[str],
                                                              sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("roll")
    testbed.apply(resource(sample, "roll"))
    before = wait_ready(testbed, "roll")
    testbed.kubectl("patch", "dm", "roll", "-n", testbed.namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"decode": {"replicas": 2}, "image": "registry.example/tandem:2"}}))

    def rolled() -> bool:
        decode = testbed.get("deployment", "roll-decode")
        prefill = testbed.get("deployment", "roll-prefill")
        return (decode["spec"]["replicas"] == 2
                and decode["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/tandem:2"
                and prefill["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/tandem:2")

    testbed.wait_for("the Deployments to take the new replicas and image", rolled)
    after = testbed.wait_for("decode 2/2 at generation 2", lambda: (
        dm if (dm := wait_ready(testbed, "roll"))["status"]["decode"]["summary"] == "2/2" else None))
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert after["status"]["observedGeneration"] == after["metadata"]["generation"]
    assert all(c["observedGeneration"] == after["metadata"]["generation"] for c in after["status"]["conditions"])
    testbed.wait_for("every prefill pod to run the new image", lambda: all(
        p["spec"]["containers"][0]["image"] == "registry.example/tandem:2" and not p["metadata"].get("deletionTimestamp")
        for p in testbed.list("pods", "app.kubernetes.io/instance=roll,app.kubernetes.io/component=prefill")) or None)


def test_hand_edits_to_children_are_reverted(testbed: Bed, cleanup: list[str],
                                             sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("edits")
    testbed.apply(resource(sample, "edits"))
    wait_ready(testbed, "edits")

    testbed.kubectl("scale", "deployment", "edits-decode", "-n", testbed.namespace, "--replicas=4")
    testbed.wait_for("edits-decode to be scaled back to 1", lambda: (
        testbed.get("deployment", "edits-decode")["spec"]["replicas"] == 1) or None, timeout=30)

    old_uid = testbed.get("deployment", "edits-prefill")["metadata"]["uid"]
    testbed.kubectl("delete", "deployment", "edits-prefill", "-n", testbed.namespace, "--wait=false")
    testbed.wait_for("edits-prefill to be recreated", lambda: (
        (d := testbed.get("deployment", "edits-prefill")) is not None and d["metadata"]["uid"] != old_uid) or None,
        timeout=30)
    wait_ready(testbed, "edits")


# One GPU per pod (tensor parallelism is not built), so CPUs make the pods too big: the prefill nodes have 96.
@pytest.mark.parametrize(("name", "prefill", "why"), [
    ("too-big", {"resources": {"requests": {"cpu": "200"}}}, "more CPUs per pod than any node has"),
    ("too-many", {"resources": {"requests": {"cpu": "90"}}, "replicas": 5}, "more pods than the 4 prefill nodes hold"),
])
def test_asking_for_more_than_the_pool_has_is_degraded(testbed: Bed, cleanup: list[str],
                                                       sample: Callable[[str], dict[str, Any]],
                                                       name: str, prefill: dict[str, Any], why: str) -> None:
    cleanup.append(name)
    testbed.apply(resource(sample, name, prefill=prefill))
    dm = testbed.wait_for(f"dm/{name} ({why}) to be Degraded", lambda: (
        d if condition(d := testbed.get("dm", name), "Degraded").get("status") == "True" else None))
    degraded = condition(dm, "Degraded")
    assert degraded["reason"] == "Unschedulable"
    assert degraded["message"].startswith("prefill pool:"), degraded["message"]
    assert "Insufficient cpu" in degraded["message"], degraded["message"]
    assert condition(dm, "Ready")["status"] == "False"
    # The operator keeps serving: no crash, no restart, still healthy.
    time.sleep(1)
    assert testbed.operator.alive() and testbed.operator.healthz()[0] == 200


def test_uri_source_is_fetched_by_an_init_container(testbed: Bed, cleanup: list[str],
                                                    sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("fetched")
    uri, sha256 = "https://models.example/tiny-llama.tar.gz", "0123456789abcdef" * 4
    source = {"uri": uri, "sha256": sha256, "sizeLimit": "40Gi"}
    testbed.apply(resource(sample, "fetched", model={"name": "tiny-llama", "source": source}))
    wait_ready(testbed, "fetched")
    for pool in ("prefill", "decode"):
        pod = testbed.get("deployment", f"fetched-{pool}")["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["name"] == "fetch-model" and init["command"] == ["tandem"]
        assert init["args"] == ["fetch-model", "--uri", uri, "--dest", "/models/model", "--sha256", sha256,
                                "--max-bytes", str(40 << 30)]
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
        assert {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}} in pod["volumes"]
        worker = pod["containers"][0]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
        assert worker["args"][worker["args"].index("--model") + 1] == "/models/model"


def test_deleting_the_resource_removes_its_children(testbed: Bed, sample: Callable[[str], dict[str, Any]]) -> None:
    testbed.apply(resource(sample, "gone"))
    wait_ready(testbed, "gone")
    testbed.kubectl("delete", "dm", "gone", "-n", testbed.namespace, "--timeout=30s")
    for kind in ("deployments", "services", "pdb", "serviceaccounts", "roles", "rolebindings"):
        testbed.wait_for(f"{kind} of dm/gone to be garbage-collected",
                         lambda kind=kind: not children(testbed, "gone", kind) or None, timeout=45)


def test_invalid_resource_is_refused_by_the_api_server(testbed: Bed, invalid_case: dict[str, Any],
                                                       make_invalid: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    proc = testbed.kubectl("create", "--dry-run=server", "-n", testbed.namespace, "-f", "-",
                           input=json.dumps(make_invalid(invalid_case)), check=False)
    assert proc.returncode != 0, f"{invalid_case['id']} was accepted: {proc.stdout}"
    assert invalid_case["field"] in proc.stderr, proc.stderr
    assert invalid_case.get("message", "") in proc.stderr, proc.stderr


ACCEPTED_EDGES = {
    "prefill": {"shmSize": "0.5Gi", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "1"}],
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "tier": ""}},
    "decode": {"shmSize": 1073741824, "nodeSelector": {"kubernetes.io/hostname": "node-1"},
               "autoscaling": {"enabled": True, "policy": "predictive"}},  # with the profile below
    "router": {"env": [{"name": "A", "value": "1"}], "nodeSelector": {"a.b-c.example/x_y.z": "v"}},
    "capacityProfile": {"prefillTokensPerSecond": 8000, "kvTokens": 160000, "itlBaseSeconds": 0.015,
                        "itlPerRequestSeconds": 0, "startupSeconds": 0},
}


def test_valid_neighbours_of_the_refused_values_are_accepted(testbed: Bed,
                                                             sample: Callable[[str], dict[str, Any]]) -> None:
    """The env, nodeSelector, shmSize and predictive-profile rules refuse only what they should (checked by pydantic too)."""
    from tandem.operator.reconcile import parse_spec

    body = resource(sample, "edges", **{k: {**sample("minimal")["spec"].get(k, {}), **v} for k, v in ACCEPTED_EDGES.items()})
    assert parse_spec(body)[1] is None
    proc = testbed.kubectl("create", "--dry-run=server", "-n", testbed.namespace, "-f", "-",
                           input=json.dumps(body), check=False)
    assert proc.returncode == 0, proc.stderr


def test_operator_health_metrics_and_namespace_scope(testbed: Bed,
                                                     sample: Callable[[str], dict[str, Any]]) -> None:
    status, _ = testbed.operator.healthz()
    assert status == 200
    metrics = testbed.operator.metrics()
    assert f'tandem_operator_reconciles_total{{name="tiny",namespace="{testbed.namespace}"}}' in metrics

    other = f"{testbed.namespace}-unwatched"
    testbed.kubectl("create", "namespace", other)
    try:
        testbed.kubectl("apply", "-n", other, "-f", "-", input=json.dumps(resource(sample, "elsewhere")))
        time.sleep(3)
        dm = json.loads(testbed.kubectl("get", "dm", "elsewhere", "-n", other, "-o", "json").stdout)
        assert "status" not in dm and not dm["metadata"].get("finalizers"), "an unwatched namespace was reconciled"
        assert not json.loads(testbed.kubectl("get", "deployments", "-n", other, "-o", "json").stdout)["items"]
    finally:
        testbed.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_restart_in_the_middle_of_a_reconcile_converges_without_duplicates(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("restart")
    testbed.operator.stop()
    testbed.apply(resource(sample, "restart", decode={"replicas": 2}))
    testbed.operator.start()
    # Kill it as soon as the first child shows up: the rest of that reconcile never happens.
    testbed.wait_for("the first child of dm/restart", lambda: children(testbed, "restart", "deployments")
                     or children(testbed, "restart", "services") or children(testbed, "restart", "serviceaccounts"),
                     timeout=30)
    testbed.operator.kill()
    testbed.operator.start()
    dm = wait_ready(testbed, "restart")
    assert dm["status"]["decode"]["summary"] == "2/2"
    assert sorted(d["metadata"]["name"] for d in children(testbed, "restart", "deployments")) == [
        "restart-decode", "restart-prefill", "restart-router"]
    assert len(children(testbed, "restart", "services")) == 3
    assert len(children(testbed, "restart", "pdb")) == 3
    for deployment in ("restart-prefill", "restart-decode", "restart-router"):
        replicasets = testbed.list("replicasets", f"app.kubernetes.io/instance=restart,"
                                                  f"app.kubernetes.io/component={deployment.split('-')[1]}")
        assert len(replicasets) == 1, f"{deployment} has {len(replicasets)} ReplicaSets"
    pods = [p for p in testbed.list("pods", "app.kubernetes.io/instance=restart")
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 4  # 1 prefill + 2 decode + 1 router


def test_operator_works_with_only_the_documented_rbac(testbed: Bed, sample: Callable[[str], dict[str, Any]],
                                                      tmp_path: Path) -> None:
    """Run a second operator as a ServiceAccount bound to tandem.operator.rbac's ClusterRole and nothing else."""
    ns = f"{testbed.namespace}-rbac"
    role = f"tandem-operator-{ns}"
    testbed.kubectl("create", "namespace", ns)
    operator = None
    try:
        rbac_only_kubeconfig(testbed, ns, tmp_path / "kubeconfig")
        operator = OperatorProcess(tmp_path / "kubeconfig", ns, tmp_path / "operator.log", testbed.cluster.env)
        operator.start()

        # Secure, so the secrets rule (get, create) is exercised too.
        testbed.kubectl("apply", "-n", ns, "-f", "-",
                        input=json.dumps(resource(sample, "scoped", kvTransfer={"secure": True})))

        def ready() -> dict[str, Any] | None:
            dm = json.loads(testbed.kubectl("get", "dm", "scoped", "-n", ns, "-o", "json").stdout)
            return dm if condition(dm, "Ready").get("status") == "True" else None

        wait_for("dm/scoped to be Ready under the restricted operator", ready, timeout=60,
                 on_timeout=operator.log_tail)
        events = json.loads(testbed.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
        assert any(e["involvedObject"]["name"] == "scoped" and e["reason"] == "Ready" for e in events)
        assert any(e["involvedObject"]["name"] == "scoped" and e["reason"] == "KVKeysCreated" for e in events)
        testbed.kubectl("get", "secret", "scoped-kv-keys", "-n", ns)
        testbed.kubectl("delete", "dm", "scoped", "-n", ns, "--timeout=30s")  # the operator releases its finalizer
        log = operator.log_tail(200_000)
        # A refused call shows as "Forbidden"/"forbidden" or an HTTP 403 status; timestamps such as
        # 11:02:31,403 must not count.
        refused = re.findall(r"forbidden|\(403\)|\b403 forbidden|status[=: ]+403\b", log, re.IGNORECASE)
        assert not refused, log[-3000:]
    finally:
        if operator is not None:
            operator.stop()
        testbed.kubectl("delete", "clusterrolebinding", role, "--wait=false", check=False)
        testbed.kubectl("delete", "clusterrole", role, "--wait=false", check=False)
        testbed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.parametrize("env_kubeconfig", [None, "bogus"], ids=["KUBECONFIG-unset", "KUBECONFIG-elsewhere"])
def test_kubeconfig_flag_alone_is_enough(testbed: Bed, sample: Callable[[str], dict[str, Any]], tmp_path: Path,
                                         env_kubeconfig: str | None) -> None:
    """--kubeconfig is what both kopf's watches and the operator's own calls use, whatever $KUBECONFIG says
    (the kubernetes library reads $KUBECONFIG once, at import, and kopf's default login reads only that)."""
    ns = f"{testbed.namespace}-kc{'b' if env_kubeconfig else 'u'}"
    testbed.kubectl("create", "namespace", ns)
    env = environ_without_kubeconfig()
    env["PATH"] = testbed.cluster.env["PATH"]
    env["HOME"] = str(tmp_path)  # no ~/.kube/config to fall back on
    if env_kubeconfig:
        env["KUBECONFIG"] = str(tmp_path / "no-such-kubeconfig")
    operator = OperatorProcess(testbed.cluster.kubeconfig, ns, tmp_path / "operator.log", env)
    try:
        operator.start()
        testbed.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(resource(sample, "flagged")))

        def ready() -> dict[str, Any] | None:
            dm = json.loads(testbed.kubectl("get", "dm", "flagged", "-n", ns, "-o", "json").stdout)
            return dm if condition(dm, "Ready").get("status") == "True" else None

        wait_for("dm/flagged to be Ready under an operator given only --kubeconfig", ready, timeout=60,
                 on_timeout=operator.log_tail)
        testbed.kubectl("delete", "dm", "flagged", "-n", ns, "--timeout=30s")  # kopf's watch releases the finalizer
        assert "LoginError" not in operator.log_tail(200_000)
    finally:
        operator.stop()
        testbed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_autoscaled_pool_follows_status_desired_replicas(testbed: Bed, cleanup: list[str],
                                                        sample: Callable[[str], dict[str, Any]]) -> None:
    """The autoscaler's write path: status.<pool>.desiredReplicas, clamped to the pool's bounds."""
    cleanup.append("scaled")
    testbed.apply(resource(sample, "scaled", decode={
        "replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}))
    wait_ready(testbed, "scaled")

    def set_desired(n: int) -> None:
        testbed.kubectl("patch", "dm", "scaled", "-n", testbed.namespace, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"decode": {"desiredReplicas": n}}}))

    def decode_replicas() -> int:
        return int(testbed.get("deployment", "scaled-decode")["spec"]["replicas"])

    set_desired(3)
    testbed.wait_for("scaled-decode to follow desiredReplicas=3", lambda: decode_replicas() == 3 or None, timeout=30)
    dm = testbed.wait_for("decode 3/3", lambda: d if (d := testbed.get("dm", "scaled"))["status"]["decode"].get(
        "summary") == "3/3" else None, timeout=30)
    assert dm["status"]["decode"]["desiredReplicas"] == 3  # the operator left the autoscaler's value alone

    set_desired(9)  # above maxReplicas
    testbed.wait_for("scaled-decode to be clamped to maxReplicas=4", lambda: decode_replicas() == 4 or None, timeout=30)


def keys_of(secret: dict[str, Any], folder: Path) -> KVKeys:
    """The Secret's pair as a worker loads it from the mounted folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in secret["data"].items():
        (folder / key).write_bytes(base64.b64decode(value))
    return KVKeys.load(folder)


def fingerprints(testbed: Bed, name: str) -> dict[str, str | None]:
    return {pool: testbed.get("deployment", f"{name}-{pool}")["spec"]["template"]["metadata"]["annotations"].get(
        "tandem.dev/kv-keys-fingerprint") for pool in ("prefill", "decode")}


def test_secure_transfer_keeps_its_keys_in_a_secret_until_it_is_deleted(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]], tmp_path: Path) -> None:
    cleanup.append("secure")
    testbed.apply(resource(sample, "secure", kvTransfer={"secure": True}))
    wait_ready(testbed, "secure")

    secret = testbed.get("secret", "secure-kv-keys")
    assert secret is not None and secret["type"] == "Opaque"
    assert [(r["kind"], r["name"]) for r in secret["metadata"]["ownerReferences"]] == [("DisaggregatedModel", "secure")]
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "secure"
    keys = keys_of(secret, tmp_path / "first")
    fingerprint = hashlib.sha256(keys.public).hexdigest()[:12]
    assert fingerprints(testbed, "secure") == {"prefill": fingerprint, "decode": fingerprint}
    for pool in ("prefill", "decode"):
        pod = testbed.get("deployment", f"secure-{pool}")["spec"]["template"]["spec"]
        assert {"name": "kv-keys", "secret": {
            "secretName": "secure-kv-keys", "defaultMode": 0o444,
            "items": [{"key": "public", "path": "public"}, {"key": "secret", "path": "secret"}]}} in pod["volumes"]
        worker = pod["containers"][0]
        assert {"name": "kv-keys", "mountPath": "/etc/tandem/kv-keys", "readOnly": True} in worker["volumeMounts"]
        assert worker["args"][worker["args"].index("--kv-keys") + 1] == "/etc/tandem/kv-keys"
        pods = testbed.list("pods", f"app.kubernetes.io/instance=secure,app.kubernetes.io/component={pool}")
        assert pods and all(p["metadata"]["annotations"]["tandem.dev/kv-keys-fingerprint"] == fingerprint
                            for p in pods)
    router = testbed.get("deployment", "secure-router")["spec"]["template"]["spec"]
    assert "--kv-keys" not in router["containers"][0]["args"]

    # A spec change (and the resyncs around it) leave the Secret as it is: no new keys per reconcile.
    testbed.kubectl("patch", "dm", "secure", "-n", testbed.namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"image": "registry.example/tandem:2"}}))
    testbed.wait_for("the new image on both pools", lambda: all(
        testbed.get("deployment", f"secure-{pool}")["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example/tandem:2" for pool in ("prefill", "decode")) or None)
    wait_ready(testbed, "secure")
    time.sleep(6)  # at least one resync (TANDEM_OPERATOR_RESYNC_SECONDS=5)
    after = testbed.get("secret", "secure-kv-keys")
    assert after["data"] == secret["data"]
    assert after["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    assert fingerprints(testbed, "secure") == {"prefill": fingerprint, "decode": fingerprint}

    # Deleting the Secret rotates the keys: a new pair, and the pools roll onto it.
    testbed.kubectl("delete", "secret", "secure-kv-keys", "-n", testbed.namespace)
    renewed = testbed.wait_for("a new secure-kv-keys", lambda: (
        s if (s := testbed.get("secret", "secure-kv-keys")) and s["metadata"]["uid"] != secret["metadata"]["uid"]
        else None), timeout=30)
    new_keys = keys_of(renewed, tmp_path / "second")
    assert new_keys != keys
    new_fingerprint = hashlib.sha256(new_keys.public).hexdigest()[:12]
    testbed.wait_for("both pools' templates to carry the new fingerprint", lambda: fingerprints(
        testbed, "secure") == {"prefill": new_fingerprint, "decode": new_fingerprint} or None, timeout=30)
    testbed.wait_for("every worker pod to carry the new fingerprint", lambda: all(
        p["metadata"]["annotations"]["tandem.dev/kv-keys-fingerprint"] == new_fingerprint
        for p in testbed.list("pods", "app.kubernetes.io/instance=secure,app.kubernetes.io/component in "
                                      "(prefill,decode)") if not p["metadata"].get("deletionTimestamp")) or None)
    wait_ready(testbed, "secure")


def test_a_keys_secret_without_a_usable_pair_is_degraded_naming_it(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("badkeys")
    testbed.kubectl("create", "secret", "generic", "badkeys-kv-keys", "-n", testbed.namespace,
                    "--from-literal=public=not-a-key", "--from-literal=secret=not-a-key-either")
    try:
        testbed.apply(resource(sample, "badkeys", kvTransfer={"secure": True}))
        dm = testbed.wait_for("dm/badkeys to be Degraded", lambda: (
            d if condition(d := testbed.get("dm", "badkeys"), "Degraded").get("status") == "True" else None))
        degraded = condition(dm, "Degraded")
        assert degraded["reason"] == "KVKeysInvalid", degraded
        assert "Secret badkeys-kv-keys" in degraded["message"], degraded["message"]
        assert condition(dm, "Ready")["status"] == "False"
        # Nothing is applied, so nothing is rolling out either.
        progressing = condition(dm, "Progressing")
        assert (progressing["status"], progressing["reason"]) == ("False", "KVKeysInvalid"), progressing
        assert not children(testbed, "badkeys", "deployments")  # nothing applied with keys it cannot use
        secret = testbed.get("secret", "badkeys-kv-keys")
        assert base64.b64decode(secret["data"]["public"]) == b"not-a-key"  # reported, never replaced
        time.sleep(1)
        assert testbed.operator.alive() and testbed.operator.healthz()[0] == 200
    finally:
        testbed.kubectl("delete", "secret", "badkeys-kv-keys", "-n", testbed.namespace, check=False)
    # Deleting it lets the operator make a pair of its own.
    wait_ready(testbed, "badkeys")
    assert condition(testbed.get("dm", "badkeys"), "Degraded")["status"] == "False"
    assert testbed.get("secret", "badkeys-kv-keys")["metadata"]["ownerReferences"][0]["name"] == "badkeys"
