"""Spec -> manifests: what every child looks like, table-driven where the spec varies."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

import pytest

from tandem.operator import builders, kv_keys
from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.fingerprint import spec_fingerprint
from tandem.worker.kv.keys import KVKeys

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")


def spec_of(**changes: Any) -> DisaggregatedModelSpec:
    base: dict[str, Any] = {"model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}}}
    base.update(changes)
    return DisaggregatedModelSpec.model_validate(base)


def children(spec: DisaggregatedModelSpec, prefill: int = 1, decode: int = 1) -> dict[tuple[str, str], dict[str, Any]]:
    built = builders.build_children(OWNER, spec, {"prefill": prefill, "decode": decode}, spec_fingerprint(spec))
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


def worker(spec: DisaggregatedModelSpec, pool: str) -> dict[str, Any]:
    return children(spec)[("Deployment", f"tiny-{pool}")]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def flags(args: list[str]) -> dict[str, str]:
    """--name value pairs of a command line (the worker/router CLI contract)."""
    return {args[i][2:]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}


def test_one_resource_makes_every_child_once() -> None:
    names = sorted(f"{kind}/{name}" for kind, name in children(spec_of()))
    assert names == sorted([
        "Deployment/tiny-prefill", "Deployment/tiny-decode", "Deployment/tiny-router",
        "Service/tiny-prefill", "Service/tiny-decode", "Service/tiny",
        "PodDisruptionBudget/tiny-prefill", "PodDisruptionBudget/tiny-decode", "PodDisruptionBudget/tiny-router",
        "ServiceAccount/tiny-router", "Role/tiny-router", "RoleBinding/tiny-router",
    ])


def test_every_child_is_owned_labelled_and_namespaced() -> None:
    for child in children(spec_of()).values():
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{
            "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "name": "tiny", "uid": "uid-1",
            "controller": True}]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "tandem"
        assert labels["app.kubernetes.io/instance"] == "tiny"
        assert labels["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert labels["tandem.dev/model"] == "tiny"
        assert labels["tandem.dev/role"] == labels["app.kubernetes.io/component"]


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_worker_command_follows_the_cli_contract(pool: str) -> None:
    spec = spec_of(model={"name": "tiny-llama", "source": {"path": "/models/tiny"}, "dtype": "float16",
                          "maxModelLen": 2048},
                   kvTransfer={"transport": "tcp", "blockSize": 32}, **{pool: {"args": ["--x", "1"]}})
    c = container(worker(spec, pool))
    assert c["command"] == ["tandem"]
    assert c["args"][0] == "worker"
    assert c["args"][-2:] == ["--x", "1"]
    assert flags(c["args"]) == {
        "role": pool, "pool": pool, "model": "/models/tiny", "model-name": "tiny-llama", "device": "cuda",
        "dtype": "float16", "block-size": "32", "transport": "tcp", "host": "0.0.0.0", "port": "8000",
        "kv-port": "5555", "tensor-parallel": "1", "max-model-len": "2048", "drain-timeout": "60", "x": "1",
        "control-token-file": "/etc/tandem/control/token",
    }


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_the_operator_never_passes_a_layout_hash_for_the_worker_to_check(pool: str) -> None:
    """The worker's own KV layout hash (from the model it loaded) is the fence; a spec hash is not comparable."""
    c = container(worker(spec_of(), pool))
    assert "--layout-hash" not in c["args"]
    assert "TANDEM_LAYOUT_HASH" not in {e["name"] for e in c["env"]}


@pytest.mark.parametrize(("pool_spec", "device"), [({}, "cuda"), ({"device": "cpu"}, "cpu")])
def test_workers_run_on_the_gpus_unless_the_pool_says_cpu(pool_spec: dict[str, Any], device: str) -> None:
    spec = spec_of(decode=pool_spec, model={"name": "m", "source": {"path": "/m"}, "dtype": "bfloat16"})
    args = flags(container(worker(spec, "decode"))["args"])
    assert (args["device"], args["dtype"]) == (device, "bfloat16")
    assert flags(container(worker(spec, "prefill"))["args"])["device"] == "cuda"
    # The pod requests its GPU either way, so a cpu pool schedules where a cuda one would.
    assert container(worker(spec, "decode"))["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("field", ["prefill", "decode"])
def test_more_than_one_gpu_per_replica_is_refused_until_the_tensor_parallel_kv_transfer_lands(field: str) -> None:
    with pytest.raises(ValueError, match="tensor-parallel workers have no KV transfer between them yet"):
        spec_of(**{field: {"gpusPerReplica": 2}})


@pytest.mark.parametrize(("transport", "expected"), [
    # auto requests no RDMA device: on a cluster without the device plugin its pods schedule and use tcp.
    ("auto", {"nvidia.com/gpu": "1"}),
    ("rdma", {"nvidia.com/gpu": "1", "rdma/rdma_shared_device_a": "1"}),
    ("tcp", {"nvidia.com/gpu": "1"}),
])
def test_worker_requests_gpus_and_rdma_device(transport: str, expected: dict[str, str]) -> None:
    spec = spec_of(kvTransfer={"transport": transport})
    c = container(worker(spec, "decode"))
    assert c["resources"] == {"requests": expected, "limits": expected}
    assert flags(c["args"])["transport"] == transport


def test_user_resources_are_kept_next_to_the_gpus() -> None:
    spec = spec_of(kvTransfer={"transport": "rdma", "rdmaResource": "rdma/hca"},
                   prefill={"resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "20Gi"}}})
    resources = container(worker(spec, "prefill"))["resources"]
    assert resources["requests"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1", "rdma/hca": "1"}
    assert resources["limits"] == {"memory": "20Gi", "nvidia.com/gpu": "1", "rdma/hca": "1"}


def test_only_rdma_workers_get_root_and_only_ipc_lock() -> None:
    """IPC_LOCK is effective only for root (the image runs as 65532): RDMA pods run as root with it and
    no other capability, under the same read-only, no-escalation, seccomp context; every other worker
    with no privilege."""
    unprivileged = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"}}
    rdma = {**unprivileged, "runAsNonRoot": False, "runAsUser": 0,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    for transport, expected in (("auto", unprivileged), ("tcp", unprivileged), ("rdma", rdma)):
        spec = spec_of(kvTransfer={"transport": transport})
        assert container(worker(spec, "decode"))["securityContext"] == expected, transport
    # transport auto with the device listed by the user: RDMA may be used, so it may pin memory.
    listed = spec_of(prefill={"resources": {"limits": {"rdma/rdma_shared_device_a": 1}}})
    assert container(worker(listed, "prefill"))["securityContext"] == rdma
    assert container(worker(listed, "decode"))["securityContext"] == unprivileged


def test_worker_pod_has_shared_memory_and_probes() -> None:
    spec = spec_of(prefill={"shmSize": "2Gi"})
    pod = worker(spec, "prefill")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "kv": 5555}


@pytest.mark.parametrize(("pool_spec", "selector", "extra_toleration"), [
    ({}, {"tandem.dev/pool": "decode"}, None),
    ({"gpuType": "NVIDIA-L40S"}, {"tandem.dev/pool": "decode", "nvidia.com/gpu.product": "NVIDIA-L40S"}, None),
    ({"nodeSelector": {"team": "a"}}, {"team": "a"}, None),
    ({"tolerations": [{"key": "spot", "operator": "Exists"}]}, {"tandem.dev/pool": "decode"},
     {"key": "spot", "operator": "Exists"}),
])
def test_worker_node_selection(pool_spec: dict[str, Any], selector: dict[str, str],
                               extra_toleration: dict[str, str] | None) -> None:
    pod = worker(spec_of(decode=pool_spec), "decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == selector
    assert {"key": "tandem.dev/pool", "operator": "Equal", "value": "decode", "effect": "NoSchedule"} in pod["tolerations"]
    if extra_toleration:
        assert extra_toleration in pod["tolerations"]


def test_affinity_is_passed_through() -> None:
    affinity = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}]}}
    pod = worker(spec_of(prefill={"affinity": affinity}), "prefill")["spec"]["template"]["spec"]
    assert pod["affinity"] == affinity


def test_worker_pods_carry_the_spec_fingerprint_scrape_annotations_and_env() -> None:
    spec = spec_of(decode={"env": [{"name": "A", "value": "1"},
                                   {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})
    template = worker(spec, "decode")["spec"]["template"]
    assert template["metadata"]["labels"]["tandem.dev/spec-fingerprint"] == spec_fingerprint(spec)
    assert template["metadata"]["labels"]["tandem.dev/role"] == "decode"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["A"] == {"name": "A", "value": "1"}
    assert env["TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "s", "key": "k"}}


def test_pvc_source_is_mounted_read_only() -> None:
    spec = spec_of(model={"name": "m", "source": {"pvc": {"claimName": "weights", "subPath": "llama"}}})
    pod = worker(spec, "prefill")["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert flags(pod["containers"][0]["args"])["model"] == "/models/llama"


SHA = "ab" * 32


@pytest.mark.parametrize("pool", ["prefill", "decode"])
@pytest.mark.parametrize(("sha256", "checksum_args"), [(None, []), (SHA, ["--sha256", SHA])])
def test_uri_source_is_fetched_into_an_empty_dir_by_an_init_container(pool: str, sha256: str | None,
                                                                       checksum_args: list[str]) -> None:
    source = {"uri": "https://models.example/tiny.tar.gz"} | ({"sha256": sha256} if sha256 else {})
    spec = spec_of(model={"name": "m", "source": source}, image="registry.example/tandem:3",
                   imagePullPolicy="Always", **{pool: {"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]}})
    pod = worker(spec, pool)["spec"]["template"]["spec"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "100Gi"}} in pod["volumes"]  # the default sizeLimit
    (init,) = pod["initContainers"]
    assert init == {
        "name": "fetch-model", "image": "registry.example/tandem:3", "imagePullPolicy": "Always",
        "command": ["tandem"],
        "args": ["fetch-model", "--uri", "https://models.example/tiny.tar.gz", "--dest", "/models/model",
                 *checksum_args, "--max-bytes", str(100 << 30)],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        "volumeMounts": [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": builders.RESTRICTED_CONTEXT,
    }
    worker_container = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker_container["volumeMounts"]
    assert flags(worker_container["args"])["model"] == "/models/model"


def test_init_container_env_is_only_home_when_the_pool_has_none() -> None:
    spec = spec_of(model={"name": "m", "source": {"uri": "https://10.0.0.5:8080/m.tar"}})
    (init,) = worker(spec, "decode")["spec"]["template"]["spec"]["initContainers"]
    assert init["env"] == [{"name": "HOME", "value": "/tmp"}]
    assert init["args"] == ["fetch-model", "--uri", "https://10.0.0.5:8080/m.tar", "--dest", "/models/model",
                            "--max-bytes", str(100 << 30)]


@pytest.mark.parametrize("source", [{"path": "/models/tiny"}, {"pvc": {"claimName": "weights"}}])
def test_path_and_pvc_sources_have_no_init_container(source: dict[str, Any]) -> None:
    pod = worker(spec_of(model={"name": "m", "source": source}), "prefill")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert not any("emptyDir" in v and v["name"] == "model" for v in pod["volumes"])


def test_replicas_come_from_the_caller_not_the_spec() -> None:
    built = children(spec_of(prefill={"replicas": 1}, decode={"replicas": 1}), prefill=3, decode=5)
    assert built[("Deployment", "tiny-prefill")]["spec"]["replicas"] == 3
    assert built[("Deployment", "tiny-decode")]["spec"]["replicas"] == 5


def test_worker_services_are_headless_and_router_service_is_the_endpoint() -> None:
    built = children(spec_of(router={"service": {"type": "LoadBalancer", "port": 9000}}))
    for pool in ("prefill", "decode"):
        svc = built[("Service", f"tiny-{pool}")]["spec"]
        assert svc["clusterIP"] == "None"
        assert {p["name"]: p["port"] for p in svc["ports"]} == {"http": 8000, "kv": 5555}
        assert svc["selector"]["app.kubernetes.io/component"] == pool
    router = built[("Service", "tiny")]["spec"]
    assert router["type"] == "LoadBalancer"
    assert router["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert builders.endpoint_url(OWNER, spec_of(router={"service": {"port": 9000}})) == "http://tiny.serving.svc:9000/v1"


def test_router_discovers_the_pools_through_their_services() -> None:
    built = children(spec_of(router={"replicas": 2}))
    deployment = built[("Deployment", "tiny-router")]
    assert deployment["spec"]["replicas"] == 2
    c = container(deployment)
    assert flags(c["args"]) == {
        "host": "0.0.0.0", "port": "8000", "model-name": "tiny-llama", "discovery": "k8s", "namespace": "serving",
        "prefill-service": "tiny-prefill", "decode-service": "tiny-decode", "drain-timeout": "30",
        "control-token-file": "/etc/tandem/control/token"}
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "tiny-router"
    binding = built[("RoleBinding", "tiny-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-router", "namespace": "serving"}]


def test_router_is_ready_only_with_usable_workers_and_drains_before_it_is_killed() -> None:
    pod = children(spec_of())[("Deployment", "tiny-router")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # a prefill and a decode worker
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # A slow start is not a dead router: liveness begins only after the startup probe has passed.
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health" and startup["periodSeconds"] * startup["failureThreshold"] >= 120
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > sleep + int(flags(c["args"])["drain-timeout"])


@pytest.mark.parametrize(("extra", "drain"), [([], 60), (["--drain-timeout", "300"], 300),
                                              (["--drain-timeout=12.5"], 13), (["--drain-timeout", "inf"], 60)])
def test_worker_grace_period_outlasts_its_drain_timeout(extra: list[str], drain: int) -> None:
    for pool in ("prefill", "decode"):
        deployment = worker(spec_of(**{pool: {"args": extra}}), pool)
        args = container(deployment)["args"]
        assert builders.flag_value(args, "--drain-timeout") == (extra[-1].split("=")[-1] if extra else "60")
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + 10, (grace, drain)  # SIGKILL never races the drain


def test_router_grace_period_follows_its_args() -> None:
    deployment = children(spec_of(router={"args": ["--drain-timeout", "120"]}))[("Deployment", "tiny-router")]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 5 + 120 + 10


def test_pdb_per_pool_and_router_selects_that_component() -> None:
    built = children(spec_of())
    for pool in ("prefill", "decode", "router"):
        pdb = built[("PodDisruptionBudget", f"tiny-{pool}")]["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == pool


def test_selectors_do_not_change_when_the_spec_does() -> None:
    """Deployment selectors are immutable: a spec change must never alter them."""
    one, two = worker(spec_of(), "decode"), worker(spec_of(kvTransfer={"blockSize": 64}, image="x:2"), "decode")
    assert one["spec"]["selector"] == two["spec"]["selector"]
    assert one["spec"]["template"] != two["spec"]["template"]


@pytest.mark.parametrize(("change", "same"), [
    (lambda s: s | {"image": "other:1"}, True),
    (lambda s: s | {"prefill": {"replicas": 7}}, True),
    (lambda s: s | {"slo": {"ttftMs": 5}}, True),
    (lambda s: s | {"model": {**s["model"], "dtype": "float32"}}, False),
    (lambda s: s | {"kvTransfer": {"blockSize": 32}}, False),
    (lambda s: s | {"model": {**s["model"], "name": "other"}}, False),
    (lambda s: s | {"model": {**s["model"], "source": {"path": "/models/other"}}}, False),
    (lambda s: s | {"model": {**s["model"], "source": {"uri": "https://models.example/tiny.tar"}}}, False),
])
def test_spec_fingerprint_follows_only_kv_relevant_settings(change: Callable[[dict[str, Any]], dict[str, Any]],
                                                       same: bool) -> None:
    base = {"model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}}}
    before = spec_fingerprint(DisaggregatedModelSpec.model_validate(base))
    after = spec_fingerprint(DisaggregatedModelSpec.model_validate(change(dict(base))))
    assert (before == after) == same


# ---------------------------------------------------------------- kvTransfer.secure

KEYS = KVKeys.generate()
FINGERPRINT = builders.kv_keys_fingerprint(KEYS)


def secure_children(**changes: Any) -> dict[tuple[str, str], dict[str, Any]]:
    spec = spec_of(kvTransfer={"secure": True}, **changes)
    built = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, spec_fingerprint(spec), FINGERPRINT)
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_secure_workers_mount_the_keys_secret_and_pass_kv_keys(pool: str) -> None:
    template = secure_children(**{pool: {"args": ["--x", "1"]}})[("Deployment", f"tiny-{pool}")]["spec"]["template"]
    pod = template["spec"]
    assert {"name": "kv-keys", "secret": {
        "secretName": "tiny-kv-keys",
        "items": [{"key": "public", "path": "public"}, {"key": "secret", "path": "secret"}],
        "defaultMode": 0o444,
    }} in pod["volumes"]
    c = pod["containers"][0]
    assert {"name": "kv-keys", "mountPath": "/etc/tandem/kv-keys", "readOnly": True} in c["volumeMounts"]
    assert flags(c["args"])["kv-keys"] == "/etc/tandem/kv-keys"
    assert c["args"][-2:] == ["--x", "1"]  # the pool's own args still come last
    assert template["metadata"]["annotations"]["tandem.dev/kv-keys-fingerprint"] == FINGERPRINT


def test_secure_transfer_leaves_the_router_alone() -> None:
    router = secure_children()[("Deployment", "tiny-router")]["spec"]["template"]
    assert router == children(spec_of())[("Deployment", "tiny-router")]["spec"]["template"]


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_without_secure_there_is_no_mount_flag_or_annotation(pool: str) -> None:
    template = worker(spec_of(), pool)["spec"]["template"]
    c = template["spec"]["containers"][0]
    assert "kv-keys" not in {v["name"] for v in template["spec"]["volumes"]}
    assert "kv-keys" not in {m["name"] for m in c["volumeMounts"]}
    assert "--kv-keys" not in c["args"]
    assert "tandem.dev/kv-keys-fingerprint" not in template["metadata"]["annotations"]
    # A fingerprint passed anyway (say, a stale one) changes nothing while secure is off.
    spec = spec_of()
    assert builders.worker_pod_template(OWNER, spec, pool, "h", FINGERPRINT) == \
        builders.worker_pod_template(OWNER, spec, pool, "h")


def test_secure_without_a_fingerprint_is_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        builders.worker_pod_template(OWNER, spec_of(kvTransfer={"secure": True}), "prefill", "h")


def test_new_keys_change_the_worker_templates_and_nothing_else() -> None:
    spec = spec_of(kvTransfer={"secure": True})
    other = builders.kv_keys_fingerprint(KVKeys.generate())
    assert other != FINGERPRINT and len(other) == 12 and int(other, 16) >= 0
    one = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, "h", FINGERPRINT)
    two = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, "h", other)
    changed = sorted(a["metadata"]["name"] for a, b in zip(one, two, strict=True) if a != b)
    assert changed == ["tiny-decode", "tiny-prefill"]
    for a, b in zip(one, two, strict=True):
        if a != b:
            a["spec"]["template"]["metadata"]["annotations"].pop("tandem.dev/kv-keys-fingerprint")
            b["spec"]["template"]["metadata"]["annotations"].pop("tandem.dev/kv-keys-fingerprint")
            assert a == b


def test_the_fingerprint_is_a_hash_of_the_public_key_only() -> None:
    assert hashlib.sha256(KEYS.public).hexdigest()[:12] == FINGERPRINT
    assert KEYS.secret.decode() not in FINGERPRINT and KEYS.public.decode() not in FINGERPRINT


def test_keys_secret_manifest() -> None:
    secret = builders.kv_keys_secret(OWNER, KEYS)
    assert (secret["apiVersion"], secret["kind"], secret["type"]) == ("v1", "Secret", "Opaque")
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("tiny-kv-keys", "serving")
    assert meta["ownerReferences"] == [{
        "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "name": "tiny", "uid": "uid-1",
        "controller": True}]
    assert meta["labels"] == {
        "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "tiny",
        "app.kubernetes.io/component": "kv-keys", "app.kubernetes.io/managed-by": "tandem-operator",
        "tandem.dev/model": "tiny", "tandem.dev/role": "kv-keys"}
    assert set(secret["data"]) == {"public", "secret"}
    assert base64.b64decode(secret["data"]["public"]) == KEYS.public
    assert base64.b64decode(secret["data"]["secret"]) == KEYS.secret
    assert kv_keys.from_secret(secret) == KEYS


def test_the_keys_secret_is_not_among_the_applied_children() -> None:
    """Applying it would write new keys at every reconcile: it is created once, by kv_keys.ensure."""
    assert not [name for kind, name in secure_children() if kind == "Secret"]


def test_workers_and_router_run_restricted_with_a_read_only_root_and_scratch_tmp() -> None:
    """PodSecurity `restricted` for tcp models (the e2e namespace enforces it on the real apiserver),
    a read-only root with an emptyDir /tmp and HOME there, and no API token on the workers."""
    spec = spec_of(kvTransfer={"transport": "tcp"})
    children = {(c["kind"], c["metadata"]["name"]): c for c in
                builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, spec_fingerprint(spec))}
    for name in ("tiny-prefill", "tiny-decode", "tiny-router"):
        pod = children[("Deployment", name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["securityContext"] == builders.RESTRICTED_CONTEXT, name
        assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"], name
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], name
        assert c["env"][0] == {"name": "HOME", "value": "/tmp"}, name
        # The router reads EndpointSlices with its token; workers have none.
        assert pod.get("automountServiceAccountToken", True) is (name == "tiny-router"), name


def test_fetch_model_init_container_is_restricted_too() -> None:
    spec = spec_of(model={"name": "tiny", "source": {"uri": "https://models.example/tiny.tar.gz"}})
    pod = worker(spec, "decode")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["securityContext"] == builders.RESTRICTED_CONTEXT
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]
