"""Pure functions: a DisaggregatedModel spec -> the manifests of its children (plain dicts).

Nothing here talks to the cluster, so every rule about what a pod looks like is unit-tested
directly. reconcile.py applies the result with server-side apply.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.api import (
    API_VERSION,
    KIND,
    POOL_KIND,
    DisaggregatedModelSpec,
    EnvVar,
    PoolName,
    ResourceRequirements,
    Toleration,
)
from tandem.worker.kv.keys import KVKeys

Manifest = dict[str, Any]

HTTP_PORT = 8000
KV_PORT = 5555
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POOL_LABEL = "tandem.dev/pool"  # on nodes (and as a taint key) in GPU node pools
LAYOUT_HASH_LABEL = "tandem.dev/layout-hash"
LAYOUT_HASH_ENV = "TANDEM_LAYOUT_HASH"
MODEL_MOUNT = "/models"
FETCHED_MODEL_DIR = f"{MODEL_MOUNT}/model"  # where the fetch-model init container unpacks a uri source
FETCH_CONTAINER = "fetch-model"
KV_KEYS_MOUNT = "/etc/tandem/kv-keys"  # the Secret's public and secret files: `tandem worker --kv-keys`
KV_KEYS_VOLUME = "kv-keys"
KV_KEYS_COMPONENT = "kv-keys"  # the Secret's component label (shared by both pools)
# On the worker pod template: a new keypair (the Secret deleted and recreated) rolls the pools.
KV_KEYS_FINGERPRINT_ANNOTATION = "tandem.dev/kv-keys-fingerprint"
# The Secret's keys, which become the files of the mounted folder (tandem.worker.transfer.security's
# PUBLIC_FILE and SECRET_FILE; a unit test keeps them equal).
KV_PUBLIC_KEY, KV_SECRET_KEY = "public", "secret"
MANAGER = "tandem-operator"
Component = str  # prefill | decode | router


@dataclass(frozen=True)
class Owner:
    """The DisaggregatedModel the children belong to."""

    name: str
    namespace: str
    uid: str


def child_name(owner: Owner, component: Component) -> str:
    return f"{owner.name}-{component}"


def instance_labels(owner: Owner) -> dict[str, str]:
    """Selects every child of one resource (pods included)."""
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": owner.name}


def selector_labels(owner: Owner, component: Component) -> dict[str, str]:
    """The immutable subset used in Deployment and Service selectors."""
    return {**instance_labels(owner), "app.kubernetes.io/component": component}


def labels(owner: Owner, component: Component) -> dict[str, str]:
    return {
        **selector_labels(owner, component),
        "app.kubernetes.io/managed-by": MANAGER,
        "tandem.dev/model": owner.name,
        "tandem.dev/role": component,
    }


def _metadata(owner: Owner, name: str, component: Component, extra_labels: Mapping[str, str] = {}) -> Manifest:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**labels(owner, component), **extra_labels},
        # No blockOwnerDeletion: where OwnerReferencesPermissionEnforcement is on, setting it needs
        # update on disaggregatedmodels/finalizers, and foreground deletion of a model is not worth that.
        "ownerReferences": [{
            "apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid, "controller": True,
        }],
    }


def endpoint_url(owner: Owner, spec: DisaggregatedModelSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.router.service.port}/v1"


# ---------------------------------------------------------------- pod pieces


def _tolerations(tolerations: list[Toleration]) -> list[Manifest]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def _env(extra: list[EnvVar]) -> list[Manifest]:
    downward = [
        {"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for var, path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"),
                          ("POD_IP", "status.podIP"))
    ]
    return downward + [e.model_dump(by_alias=True, exclude_none=True) for e in extra]


def _resources(user: ResourceRequirements, extended: Mapping[str, int]) -> Manifest:
    """User requests/limits plus extended resources (which Kubernetes wants equal in both)."""
    as_text = {name: str(amount) for name, amount in extended.items()}
    requests = {name: str(q) for name, q in user.requests.items()} | as_text
    limits = {name: str(q) for name, q in user.limits.items()} | as_text
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> Manifest:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 2}


def worker_model_dir(spec: DisaggregatedModelSpec) -> str:
    """The model folder as the worker container sees it."""
    source = spec.model.source
    if source.pvc is not None:
        return f"{MODEL_MOUNT}/{source.pvc.sub_path}".rstrip("/")
    if source.uri is not None:
        return FETCHED_MODEL_DIR
    assert source.path is not None  # the one-of rule guarantees it
    return source.path


def worker_args(owner: Owner, spec: DisaggregatedModelSpec, pool: PoolName, layout_hash: str) -> list[str]:
    pool_spec = spec.pool(pool)
    return [
        "worker", "--role", pool, "--pool", pool,
        "--model", worker_model_dir(spec), "--model-name", spec.model.name,
        "--dtype", spec.model.dtype, "--block-size", str(spec.kv_transfer.block_size),
        "--transport", spec.kv_transfer.transport,
        "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--kv-port", str(KV_PORT),
        "--tensor-parallel", str(pool_spec.gpus_per_replica),
        "--max-model-len", str(spec.model.max_model_len),
        "--layout-hash", layout_hash,
        *(["--kv-keys", KV_KEYS_MOUNT] if spec.kv_transfer.secure else []),
        *pool_spec.args,
    ]


def fetch_model_args(spec: DisaggregatedModelSpec) -> list[str]:
    """`tandem fetch-model` for a uri source: download, verify and unpack into the pod's emptyDir."""
    source = spec.model.source
    assert source.uri is not None
    args = ["fetch-model", "--uri", source.uri, "--dest", FETCHED_MODEL_DIR]
    if source.sha256 is not None:
        args += ["--sha256", source.sha256]
    return args


def fetch_model_container(spec: DisaggregatedModelSpec, pool: PoolName) -> Manifest:
    """The init container that fills the "model" emptyDir; it gets the pool's env (e.g. HTTPS_PROXY)."""
    container: Manifest = {
        "name": FETCH_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": fetch_model_args(spec),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
    }
    if spec.pool(pool).env:
        container["env"] = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.pool(pool).env]
    return container


def worker_pod_template(owner: Owner, spec: DisaggregatedModelSpec, pool: PoolName, layout_hash: str,
                        kv_keys_fingerprint: str | None = None) -> Manifest:
    """`kv_keys_fingerprint` (of the Secret's keys) is required when kvTransfer.secure is on."""
    pool_spec = spec.pool(pool)
    if spec.kv_transfer.secure and not kv_keys_fingerprint:
        raise ValueError("kvTransfer.secure: the worker pod template needs the KV keys' fingerprint")
    extended = {GPU_RESOURCE: pool_spec.gpus_per_replica}
    if spec.kv_transfer.transport in ("rdma", "auto"):
        extended[spec.kv_transfer.rdma_resource] = 1
    node_selector: dict[str, str] = dict(pool_spec.node_selector) if pool_spec.node_selector is not None else {POOL_LABEL: pool}
    if pool_spec.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = pool_spec.gpu_type
    tolerations = [
        {"key": POOL_LABEL, "operator": "Equal", "value": pool, "effect": "NoSchedule"},
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        *_tolerations(pool_spec.tolerations),
    ]
    volumes: list[Manifest] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(pool_spec.shm_size)}}]
    mounts: list[Manifest] = [{"name": "shm", "mountPath": "/dev/shm"}]
    if spec.model.source.pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": spec.model.source.pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif spec.model.source.uri is not None:
        # Per pod: a restarted container finds the model already there; a new pod downloads it again.
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                   "prometheus.io/path": "/metrics"}
    if spec.kv_transfer.secure:
        volumes.append(kv_keys_volume(owner))
        mounts.append({"name": KV_KEYS_VOLUME, "mountPath": KV_KEYS_MOUNT, "readOnly": True})
        annotations[KV_KEYS_FINGERPRINT_ANNOTATION] = str(kv_keys_fingerprint)
    container: Manifest = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": worker_args(owner, spec, pool, layout_hash),
        "env": [{"name": LAYOUT_HASH_ENV, "value": layout_hash}, *_env(pool_spec.env)],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"}],
        "resources": _resources(pool_spec.resources, extended),
        # RDMA memory registration pins pages, which needs IPC_LOCK.
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": mounts,
        # Loading weights can take minutes: the startup probe holds off liveness until /health answers.
        "startupProbe": _probe("/health", 10, 180),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 3),
    }
    pod_spec: Manifest = {
        "containers": [container],
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,  # lets a worker drain its running requests
    }
    if spec.model.source.uri is not None:
        pod_spec["initContainers"] = [fetch_model_container(spec, pool)]
    if pool_spec.affinity:
        pod_spec["affinity"] = pool_spec.affinity
    return {
        "metadata": {
            "labels": {**labels(owner, pool), LAYOUT_HASH_LABEL: layout_hash},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


# ---------------------------------------------------------------- children


def _deployment(owner: Owner, component: Component, replicas: int, template: Manifest,
                extra_labels: Mapping[str, str] = {}) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, child_name(owner, component), component, extra_labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner, component)},
            # Surge one pod at a time and never drop below the desired count.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 600,
            "template": template,
        },
    }


def worker_deployment(owner: Owner, spec: DisaggregatedModelSpec, pool: PoolName, replicas: int,
                      layout_hash: str, kv_keys_fingerprint: str | None = None) -> Manifest:
    template = worker_pod_template(owner, spec, pool, layout_hash, kv_keys_fingerprint)
    return _deployment(owner, pool, replicas, template, {LAYOUT_HASH_LABEL: layout_hash})


def worker_service(owner: Owner, pool: PoolName) -> Manifest:
    """Headless: the router discovers the individual worker pods through it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, child_name(owner, pool), pool),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(owner, pool),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                      {"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"}],
        },
    }


def pool_disruption_budget(owner: Owner, pool: PoolName) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, child_name(owner, pool), pool),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, pool)}},
    }


def router_args(owner: Owner, spec: DisaggregatedModelSpec) -> list[str]:
    return [
        "router", "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--model-name", spec.model.name,
        "--discovery", "k8s", "--namespace", owner.namespace,
        "--prefill-service", child_name(owner, "prefill"), "--decode-service", child_name(owner, "decode"),
        *spec.router.args,
    ]


def router_deployment(owner: Owner, spec: DisaggregatedModelSpec, replicas: int) -> Manifest:
    router = spec.router
    container: Manifest = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": router_args(owner, spec),
        "env": _env(router.env),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": _resources(router.resources, {}),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/health", 5, 3),
    }
    pod_spec: Manifest = {
        "serviceAccountName": child_name(owner, "router"),
        "containers": [container],
        "tolerations": _tolerations(router.tolerations),
    }
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(router.node_selector)
    template = {
        "metadata": {
            "labels": labels(owner, "router"),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                            "prometheus.io/path": "/metrics"},
        },
        "spec": pod_spec,
    }
    return _deployment(owner, "router", replicas, template)


def router_service(owner: Owner, spec: DisaggregatedModelSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name, "router"),
        "spec": {
            "type": spec.router.service.type,
            "selector": selector_labels(owner, "router"),
            "ports": [{"name": "http", "port": spec.router.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_access(owner: Owner) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding letting the router watch its pools' endpoints."""
    name = child_name(owner, "router")
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(owner, name, "router"),
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods", "endpoints"], "verbs": ["get", "list", "watch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(owner, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, "router")}
    return [account, role, binding]


def build_children(owner: Owner, spec: DisaggregatedModelSpec, replicas: Mapping[PoolName, int],
                   layout_hash: str, kv_keys_fingerprint: str | None = None) -> list[Manifest]:
    """Every child of one resource, in apply order (RBAC before the pods that use it).

    Not the KV keys Secret: it is created once (kv_keys.ensure), never applied."""
    children: list[Manifest] = [*router_access(owner)]
    for pool in ("prefill", "decode"):
        children.append(worker_service(owner, pool))
        children.append(pool_disruption_budget(owner, pool))
        children.append(worker_deployment(owner, spec, pool, replicas[pool], layout_hash, kv_keys_fingerprint))
    children.append(router_service(owner, spec))
    children.append(router_deployment(owner, spec, spec.router.replicas))
    return children


# ---------------------------------------------------------------- KV transfer keys (kvTransfer.secure)


def kv_keys_secret_name(owner: Owner) -> str:
    return child_name(owner, "kv-keys")


def kv_keys_fingerprint(keys: KVKeys) -> str:
    """Short and public (a hash of the public key): names a keypair on the pod template without revealing it."""
    return hashlib.sha256(keys.public).hexdigest()[:12]


def kv_keys_secret(owner: Owner, keys: KVKeys) -> Manifest:
    """The model's keypair as a Secret (keys `public` and `secret`, as the worker's --kv-keys folder wants them)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, kv_keys_secret_name(owner), KV_KEYS_COMPONENT),
        "type": "Opaque",
        "data": {KV_PUBLIC_KEY: base64.b64encode(keys.public).decode(),
                 KV_SECRET_KEY: base64.b64encode(keys.secret).decode()},
    }


def kv_keys_volume(owner: Owner) -> Manifest:
    """The Secret as a volume: only its two keys, readable by the worker's user alone."""
    return {"name": KV_KEYS_VOLUME, "secret": {
        "secretName": kv_keys_secret_name(owner),
        "items": [{"key": KV_PUBLIC_KEY, "path": KV_PUBLIC_KEY}, {"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}],
        "defaultMode": 0o400,
    }}


# ---------------------------------------------------------------- per-pool scale


def pool_selector(owner: Owner, pool: PoolName) -> str:
    """The pool's pods as a label selector string (the scale subresource's status.selector)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(owner, pool).items()))


def pool_resource(owner: Owner, pool: PoolName, replicas: int) -> Manifest:
    """The pool's DisaggregatedPool, as created once: after that, spec.replicas belongs to whoever scales it."""
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "metadata": _metadata(owner, child_name(owner, pool), pool),
        "spec": {"replicas": replicas, "model": owner.name, "pool": pool},
    }
