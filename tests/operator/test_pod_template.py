"""spec.<pool>.pod and spec.router.pod: what reaches the pods, and what stays the operator's."""

from __future__ import annotations

from typing import Any

import pytest
from pod_template_cases import RESERVED_NEIGHBOURS

from tandem.operator import api, builders
from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.fingerprint import spec_fingerprint

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")
MULTUS = "k8s.v1.cni.cncf.io/networks"

POD = {
    "annotations": {MULTUS: "rdma-net", "example.com/team": "inference"},
    "labels": {"team": "inference", "app.kubernetes.io/version": "1"},
    "imagePullSecrets": [{"name": "registry"}],
    "volumes": [{"name": "lora", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}},
                {"name": "ca", "configMap": {"name": "corp-ca"}}],
    "volumeMounts": [{"name": "lora", "mountPath": "/adapters", "readOnly": True},
                     {"name": "ca", "mountPath": "/etc/ssl/corp", "subPath": "certs"}],
    "serviceAccountName": "gpu-workers",
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
        {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": {"matchLabels": {"team": "inference"}}, "matchLabelKeys": ["pod-template-hash"]},
    ],
    "hostNetwork": True,
    "hostIPC": True,
}


def spec_of(source: dict[str, Any] | None = None, **changes: Any) -> DisaggregatedModelSpec:
    base: dict[str, Any] = {"model": {"name": "tiny-llama", "source": source or {"path": "/models/tiny"}}}
    base.update(changes)
    return DisaggregatedModelSpec.model_validate(base)


def built(spec: DisaggregatedModelSpec) -> dict[tuple[str, str], dict[str, Any]]:
    children = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, spec_fingerprint(spec),
                                       control_token_fingerprint="ct")
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def template(spec: DisaggregatedModelSpec, component: str) -> dict[str, Any]:
    return built(spec)[("Deployment", f"tiny-{component}")]["spec"]["template"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("component", ["prefill", "decode", "router"])
def test_an_empty_pod_block_builds_the_template_it_built_before(component: str) -> None:
    """No new key on a spec without a pod block: upgrading the operator rolls no pod."""
    tpl = template(spec_of(), component)
    assert not {"imagePullSecrets", "priorityClassName", "runtimeClassName", "schedulerName",
                "topologySpreadConstraints", "hostNetwork", "hostIPC", "dnsPolicy"} & set(tpl["spec"])
    assert [v["name"] for v in tpl["spec"]["volumes"]] == (
        ["control-token", "tmp"] if component == "router" else ["shm", "tmp", "control-token"])
    assert set(tpl["metadata"]["annotations"]) == {"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path",
                                                   "tandem.dev/control-token-fingerprint"}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_pools_pod_block_reaches_its_pods_beside_the_operators_fields(pool: str) -> None:
    spec = spec_of(**{pool: {"pod": POD}})
    tpl = template(spec, pool)
    meta, pod = tpl["metadata"], tpl["spec"]
    assert meta["annotations"][MULTUS] == "rdma-net" and meta["annotations"]["example.com/team"] == "inference"
    assert meta["annotations"]["prometheus.io/port"] == "8000"  # the operator's own stay
    assert meta["labels"]["team"] == "inference" and meta["labels"]["app.kubernetes.io/version"] == "1"
    assert {k: meta["labels"][k] for k in builders.selector_labels(OWNER, pool)} == builders.selector_labels(OWNER, pool)
    assert meta["labels"]["tandem.dev/spec-fingerprint"] == spec_fingerprint(spec)
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # The operator's volumes first, then the user's, exactly as given (their sources pass through).
    assert [v["name"] for v in pod["volumes"]] == ["shm", "tmp", "control-token", "lora", "ca"]
    assert pod["volumes"][-2:] == POD["volumes"]
    (worker,) = pod["containers"]
    assert worker["volumeMounts"][-2:] == POD["volumeMounts"]
    assert [m["mountPath"] for m in worker["volumeMounts"][:-2]] == ["/dev/shm", "/tmp", "/etc/tandem/control"]
    assert (pod["serviceAccountName"], pod["priorityClassName"], pod["runtimeClassName"], pod["schedulerName"]) == (
        "gpu-workers", "inference-high", "nvidia", "volcano")
    assert pod["automountServiceAccountToken"] is False  # a worker never calls the API, whatever its account
    assert (pod["hostNetwork"], pod["hostIPC"], pod["dnsPolicy"]) == (True, True, "ClusterFirstWithHostNet")
    zone, host = pod["topologySpreadConstraints"]
    # Without a labelSelector the constraint would count no pod; the pool's own pods are meant.
    assert zone == {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": builders.selector_labels(OWNER, pool)}}
    assert host == POD["topologySpreadConstraints"][1]


def test_a_pools_pod_block_stays_on_that_pool() -> None:
    spec = spec_of(decode={"pod": POD})
    assert template(spec, "prefill") == template(spec_of(), "prefill")
    assert template(spec, "router") == template(spec_of(), "router")


def test_the_fetch_model_init_container_gets_the_pools_mounts() -> None:
    """A uri download may need the pool's CA bundle or proxy settings, as it gets the pool's env."""
    spec = spec_of({"uri": "https://models.example/tiny.tgz"}, prefill={"pod": POD})
    (fetch,) = template(spec, "prefill")["spec"]["initContainers"]
    assert fetch["volumeMounts"] == [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"},
                                     *POD["volumeMounts"]]


def test_a_user_mount_under_models_is_fine_with_a_path_source() -> None:
    """source.path names a folder the user provides, possibly by mounting it: the operator mounts nothing there."""
    pod = {"volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "w"}}],
           "volumeMounts": [{"name": "weights", "mountPath": "/models/tiny"}]}
    tpl = template(spec_of(decode={"pod": pod}), "decode")
    assert tpl["spec"]["containers"][0]["volumeMounts"][-1] == {"name": "weights", "mountPath": "/models/tiny"}


def test_the_router_runs_as_the_users_account_and_keeps_endpoint_discovery() -> None:
    spec = spec_of(router={"pod": {**POD, "serviceAccountName": "edge"}})
    tpl = template(spec, "router")
    assert tpl["spec"]["serviceAccountName"] == "edge"
    assert tpl["metadata"]["annotations"][MULTUS] == "rdma-net"
    assert tpl["spec"]["containers"][0]["volumeMounts"][-2:] == POD["volumeMounts"]
    assert tpl["spec"]["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": builders.selector_labels(OWNER, "router")}
    binding = built(spec)[("RoleBinding", "tiny-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-router", "namespace": "serving"},
                                   {"kind": "ServiceAccount", "name": "edge", "namespace": "serving"}]
    assert built(spec_of())[("RoleBinding", "tiny-router")]["subjects"] == binding["subjects"][:1]
    assert template(spec_of(), "router")["spec"]["serviceAccountName"] == "tiny-router"


@pytest.mark.parametrize("source", [{"path": "/models/tiny"}, {"pvc": {"claimName": "w", "subPath": "tiny"}},
                                    {"uri": "https://models.example/tiny.tgz"}])
def test_the_reserved_names_in_the_crd_cover_everything_the_operator_mounts(source: dict[str, Any]) -> None:
    """api.py's reserved volume names and mount paths (the CEL rules) are what builders.py really uses."""
    spec = spec_of(source, kvTransfer={"secure": True})
    model_mounted = "path" not in source
    for component in ("prefill", "decode", "router"):
        children = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, "fp", kv_keys_fingerprint="kv")
        tpl = next(c for c in children if c["metadata"]["name"] == f"tiny-{component}" and c["kind"] == "Deployment")
        pod = tpl["spec"]["template"]["spec"]
        assert {v["name"] for v in pod["volumes"]} <= set(api.OPERATOR_VOLUMES)
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            for mount in container["volumeMounts"]:
                path = mount["mountPath"]
                reserved = not api._mount_path_allowed(path) or (
                    model_mounted and (path == api.MODEL_MOUNT_ROOT or path.startswith(api.MODEL_MOUNT_ROOT + "/")))
                assert reserved, f"{component} mounts {path}, which a pod block could also claim"
        for key in tpl["spec"]["template"]["metadata"]["labels"]:
            assert key in api.RESERVED_LABEL_KEYS or key.startswith("tandem.dev/"), key
        for key in tpl["spec"]["template"]["metadata"]["annotations"]:
            assert key in api.RESERVED_ANNOTATION_KEYS or key.startswith("tandem.dev/"), key


@pytest.mark.parametrize("pod", list(RESERVED_NEIGHBOURS.values()), ids=list(RESERVED_NEIGHBOURS))
def test_neighbours_of_the_reserved_keys_and_paths_are_accepted(pod: dict[str, Any]) -> None:
    spec = spec_of({"pvc": {"claimName": "w"}}, prefill={"pod": pod})
    assert spec.prefill.pod.model_dump(by_alias=True, exclude_defaults=True) == pod
