"""Pure functions: a DisaggregatedModel spec -> the manifests of its children (plain dicts).

Nothing here talks to the cluster, so every rule about what a pod looks like is unit-tested
directly. reconcile.py applies the result with server-side apply.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.api import (
    API_KEY_ENV,
    API_VERSION,
    DEFAULT_MODEL_SIZE_LIMIT,
    KIND,
    POOL_KIND,
    DisaggregatedModelSpec,
    EnvVar,
    HubCache,
    PodTemplateSpec,
    PoolName,
    ResourceRequirements,
    RouterSpec,
    Toleration,
    TopologySpreadConstraint,
    quantity_bytes,
)
from tandem.worker.kv.keys import KVKeys
from tandem.worker.server import control_token

Manifest = dict[str, Any]

HTTP_PORT = 8000
KV_PORT = 5555
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POOL_LABEL = "tandem.dev/pool"  # on nodes (and as a taint key) in GPU node pools
# Which spec a worker pod was built from (fingerprint.spec_fingerprint); informational, never checked by
# the worker: the worker's own KV layout hash is what keeps incompatible workers apart.
SPEC_FINGERPRINT_LABEL = "tandem.dev/spec-fingerprint"
MODEL_MOUNT = "/models"
FETCHED_MODEL_DIR = f"{MODEL_MOUNT}/model"  # where the fetch-model init container unpacks a uri source
FETCH_CONTAINER = "fetch-model"
# A huggingFace source: the cache (a claim, or a node folder) is the Hub cache, mounted at MODEL_MOUNT (read-write
# in the init container, read-only in the worker); the init container links HUB_MODEL_LINK, in the pod's own /tmp
# emptyDir, to the snapshot it resolved, so the worker reads that commit even if another pod moves the cache's
# branch ref later.
HUB_MODEL_LINK = "/tmp/model"
WORKER_UID = 65532  # the images' user and group (docker/worker.Dockerfile): a claim cache's fsGroup
KV_KEYS_MOUNT = "/etc/tandem/kv-keys"  # the Secret's public and secret files: `tandem worker --kv-keys`
KV_KEYS_VOLUME = "kv-keys"
KV_KEYS_COMPONENT = "kv-keys"  # the Secret's component label (shared by both pools)
# On the worker pod template: a new keypair (the Secret deleted and recreated) rolls the pools.
KV_KEYS_FINGERPRINT_ANNOTATION = "tandem.dev/kv-keys-fingerprint"
# The Secret's keys, which become the files of the mounted folder (tandem.worker.transfer.security's
# PUBLIC_FILE and SECRET_FILE; a unit test keeps them equal).
KV_PUBLIC_KEY, KV_SECRET_KEY = "public", "secret"
# The worker control token (tandem.worker.server.control_token): the Secret `<dm>-control-token`, created once
# per model like the KV keys, mounted into every worker and router pod; `--control-token-file` points at it.
CONTROL_TOKEN_MOUNT = "/etc/tandem/control"
CONTROL_TOKEN_KEY = "token"  # the Secret's key, and the file's name in the mounted folder
CONTROL_TOKEN_FILE = f"{CONTROL_TOKEN_MOUNT}/{CONTROL_TOKEN_KEY}"
CONTROL_TOKEN_VOLUME = "control-token"
CONTROL_TOKEN_COMPONENT = "control-token"  # the Secret's component label
# On worker and router pod templates: a new token (the Secret deleted and recreated, or edited) rolls them all.
CONTROL_TOKEN_FINGERPRINT_ANNOTATION = "tandem.dev/control-token-fingerprint"
# On the router pod template: spec.router.apiKeySecret's value changed (router_api_key.py) rolls the routers.
API_KEY_FINGERPRINT_ANNOTATION = "tandem.dev/api-key-fingerprint"
MANAGER = "tandem-operator"
Component = str  # prefill | decode | router

# Shutdown. SIGKILL comes terminationGracePeriodSeconds after the pod starts terminating, so the grace
# period is derived from the drain timeout (the container's, or the one its extra args set) plus room.
WORKER_DRAIN_TIMEOUT_S = 60  # `tandem worker --drain-timeout`: in-flight requests finish, then it exits
ROUTER_DRAIN_TIMEOUT_S = 30  # `tandem router --drain-timeout`: open streams finish, then it exits
ROUTER_PRESTOP_SLEEP_S = 5  # the router keeps serving while its endpoint leaves the Service
SHUTDOWN_MARGIN_S = 15  # after the drain: engine and KV transport shutdown, process exit


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
    if source.hugging_face is not None:
        return HUB_MODEL_LINK
    assert source.path is not None  # the one-of rule guarantees it
    return source.path


def requests_rdma(spec: DisaggregatedModelSpec) -> bool:
    """Only transport rdma requests the RDMA device-plugin resource. auto never does, so its pods schedule on a
    cluster without the plugin; the worker then uses RDMA only where the pod has a device anyway (say, the
    resource listed in the pool's resources) and tcp otherwise."""
    return spec.kv_transfer.transport == "rdma"


def worker_args(owner: Owner, spec: DisaggregatedModelSpec, pool: PoolName) -> list[str]:
    pool_spec = spec.pool(pool)
    return [
        "worker", "--role", pool, "--pool", pool,
        "--model", worker_model_dir(spec), "--model-name", spec.model.name,
        "--device", pool_spec.device, "--dtype", spec.model.dtype,
        "--block-size", str(spec.kv_transfer.block_size),
        "--transport", spec.kv_transfer.transport,
        "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--kv-port", str(KV_PORT),
        "--tensor-parallel", str(pool_spec.gpus_per_replica),
        "--max-model-len", str(spec.model.max_model_len),
        "--drain-timeout", str(WORKER_DRAIN_TIMEOUT_S),
        "--control-token-file", CONTROL_TOKEN_FILE,
        *(["--kv-keys", KV_KEYS_MOUNT] if spec.kv_transfer.secure else []),
        *pool_spec.args,
    ]


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value given for `flag` (`--flag V` or `--flag=V`), as click reads it; None if absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def grace_period(args: list[str], drain_default: int, before_drain: int = 0) -> int:
    """terminationGracePeriodSeconds for a container with these args: its drain timeout plus room, so
    SIGKILL never cuts a drain short (an unreadable --drain-timeout fails the container anyway)."""
    try:
        drain = math.ceil(float(flag_value(args, "--drain-timeout") or drain_default))
    except (ValueError, OverflowError):  # not a number, or inf
        drain = drain_default
    return before_drain + max(drain, 0) + SHUTDOWN_MARGIN_S


def fetch_model_args(spec: DisaggregatedModelSpec) -> list[str]:
    """`tandem fetch-model` for a uri source: download, verify and unpack into the pod's emptyDir; for a
    huggingFace source: download into the shared cache (or wait for the pod that does) and link the snapshot."""
    source = spec.model.source
    hub = source.hugging_face
    if hub is not None:
        repo = hub.repo + (f"@{hub.revision}" if hub.revision else "")
        return ["fetch-model", "--model", repo, "--link", HUB_MODEL_LINK]
    assert source.uri is not None
    args = ["fetch-model", "--uri", source.uri, "--dest", FETCHED_MODEL_DIR]
    if source.sha256 is not None:
        args += ["--sha256", source.sha256]
    # The emptyDir's limit: refused by fetch-model with a clear message rather than evicted by the kubelet.
    return [*args, "--max-bytes", str(quantity_bytes(model_size_limit(spec)))]


def model_size_limit(spec: DisaggregatedModelSpec) -> str:
    """The sizeLimit of a uri source's emptyDir (spec.model.source.sizeLimit, or the default)."""
    return str(spec.model.source.size_limit or DEFAULT_MODEL_SIZE_LIMIT)


def fetch_model_container(spec: DisaggregatedModelSpec, pool: PoolName) -> Manifest:
    """The init container that fills the "model" emptyDir; it gets the pool's env (e.g. HTTPS_PROXY)."""
    container: Manifest = {
        "name": FETCH_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": fetch_model_args(spec),
        # The pool's own mounts too: a CA bundle or proxy settings the download may need.
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}, {"name": TMP_VOLUME, "mountPath": "/tmp"},
                         *user_volume_mounts(spec.pool(pool).pod)],
        "securityContext": dict(RESTRICTED_CONTEXT),
        "env": SCRATCH_ENV + _hub_env(spec) + [e.model_dump(by_alias=True, exclude_none=True)
                                               for e in spec.pool(pool).env],
    }
    return container


def hub_cache_volume(cache: HubCache) -> Manifest:
    """The "model" volume of a huggingFace source: the cache claim (one download per claim), or the node folder
    (one download per node: the init container's lock file in the cache then serialises the pods of one node).

    The node folder must already be writable by uid or gid WORKER_UID, made so when the node is prepared: the
    kubelet applies no fsGroup to a hostPath, creates a missing DirectoryOrCreate folder as root with mode 0755,
    and the init container runs as WORKER_UID without capabilities (docs/security.md: no step of the pod runs as
    root to prepare a volume), so nothing in the pod can chown it. DirectoryOrCreate rather than Directory: a node without the folder still
    starts the pod, and the init container then fails with one line in its log (cannot write to the Hub cache
    /models, Permission denied) instead of a pod stuck before its containers on a mount event."""
    if cache.host_path is not None:
        return {"name": "model", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "model", "persistentVolumeClaim": {"claimName": cache.claim_name}}


def _hub_env(spec: DisaggregatedModelSpec) -> list[Manifest]:
    """The init container's Hub settings for a huggingFace source: the cache on its volume, and the token."""
    hub = spec.model.source.hugging_face
    if hub is None:
        return []
    env: list[Manifest] = [{"name": "HF_HUB_CACHE", "value": MODEL_MOUNT},
                           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if hub.token_secret_ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hub.token_secret_ref.name, "key": hub.token_secret_ref.key}}})
    return env


# What PodSecurity `restricted` asks of a container, plus a read-only root: the image's files cannot be
# changed by the process that serves untrusted requests; /tmp is an emptyDir (TMP_VOLUME).
RESTRICTED_CONTEXT: Manifest = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"},
}
TMP_VOLUME = "tmp"
TMP_SIZE = "1Gi"  # scratch only (CUDA and Triton kernel caches under HOME=/tmp); the model is elsewhere


def worker_security_context(spec: DisaggregatedModelSpec, resources: ResourceRequirements) -> Manifest:
    """RDMA memory registration pins pages, which needs CAP_IPC_LOCK, and Kubernetes makes an added
    capability effective only for root (no ambient capabilities; the image runs as uid 65532): RDMA pods
    run as uid 0 holding IPC_LOCK and nothing else (no CHOWN, DAC_OVERRIDE, NET_RAW, ...), with the
    rest of the restricted context: a root without capabilities cannot write the read-only image,
    read another uid's private files or gain more. Every other worker gets no privilege at all."""
    rdma_listed = spec.kv_transfer.rdma_resource in {**resources.requests, **resources.limits}
    if requests_rdma(spec) or rdma_listed:  # transport auto uses RDMA where a pod lists the device
        return {**RESTRICTED_CONTEXT, "runAsNonRoot": False, "runAsUser": 0,
                "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    return dict(RESTRICTED_CONTEXT)


def _scratch(volumes: list[Manifest], mounts: list[Manifest]) -> None:
    """A writable /tmp under a read-only root filesystem."""
    volumes.append({"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE}})
    mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})


# HOME on the scratch volume: the image's home is on the read-only root (caches written under HOME).
SCRATCH_ENV: list[Manifest] = [{"name": "HOME", "value": "/tmp"}]


# ---------------------------------------------------------------- spec.<pool>.pod, spec.router.pod


def user_volume_mounts(pod: PodTemplateSpec) -> list[Manifest]:
    return [m.model_dump(by_alias=True, exclude_none=True) for m in pod.volume_mounts]


def _spread(constraint: TopologySpreadConstraint, own_pods: Mapping[str, str]) -> Manifest:
    """Without a labelSelector a constraint counts no pod at all; the pool's own pods are what one means."""
    out: Manifest = constraint.model_dump(by_alias=True, exclude_none=True)
    out.setdefault("labelSelector", {"matchLabels": dict(own_pods)})
    return out


def apply_pod_template(pod: PodTemplateSpec, template: Manifest, own_pods: Mapping[str, str]) -> None:
    """Add a `pod` block to a built pod template: the user's labels and annotations under the operator's (the CRD
    refuses the operator's keys, so nothing is overridden), the user's volumes after the operator's, and the
    pod-level fields. Each only when given: a spec without them builds the same template as before they existed,
    so an operator upgrade rolls no pod."""
    meta, pod_spec = template["metadata"], template["spec"]
    meta["labels"] = {**pod.labels, **meta["labels"]}
    meta["annotations"] = {**pod.annotations, **meta["annotations"]}
    if pod.volumes:
        pod_spec["volumes"] = [*pod_spec["volumes"], *(v.model_dump(by_alias=True, exclude_none=True) for v in pod.volumes)]
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in pod.image_pull_secrets]
    for key, value in (("serviceAccountName", pod.service_account_name), ("priorityClassName", pod.priority_class_name),
                       ("runtimeClassName", pod.runtime_class_name), ("schedulerName", pod.scheduler_name)):
        if value:
            pod_spec[key] = value
    if pod.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [_spread(c, own_pods) for c in pod.topology_spread_constraints]
    if pod.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # the node's network, the cluster's DNS
    if pod.host_ipc:
        pod_spec["hostIPC"] = True


def worker_pod_template(owner: Owner, spec: DisaggregatedModelSpec, pool: PoolName, spec_fingerprint: str,
                        kv_keys_fingerprint: str | None = None, control_token_fingerprint: str | None = None) -> Manifest:
    """`kv_keys_fingerprint` (of the Secret's keys) is required when kvTransfer.secure is on.
    `control_token_fingerprint` (of the control token Secret) goes on the template, so a new token rolls the pool."""
    pool_spec = spec.pool(pool)
    if spec.kv_transfer.secure and not kv_keys_fingerprint:
        raise ValueError("kvTransfer.secure: the worker pod template needs the KV keys' fingerprint")
    extended = {GPU_RESOURCE: pool_spec.gpus_per_replica}
    if requests_rdma(spec):
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
    _scratch(volumes, mounts)
    if spec.model.source.pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": spec.model.source.pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif spec.model.source.uri is not None:
        # Per pod: a restarted container finds the model already there; a new pod downloads it again.
        volumes.append({"name": "model", "emptyDir": {"sizeLimit": model_size_limit(spec)}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif spec.model.source.hugging_face is not None:
        volumes.append(hub_cache_volume(spec.model.source.hugging_face.cache))
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                   "prometheus.io/path": "/metrics"}
    if spec.kv_transfer.secure:
        volumes.append(kv_keys_volume(owner))
        mounts.append({"name": KV_KEYS_VOLUME, "mountPath": KV_KEYS_MOUNT, "readOnly": True})
        annotations[KV_KEYS_FINGERPRINT_ANNOTATION] = str(kv_keys_fingerprint)
    _mount_control_token(owner, volumes, mounts, annotations, control_token_fingerprint)
    args = worker_args(owner, spec, pool)
    container: Manifest = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": args,
        "env": SCRATCH_ENV + _env(pool_spec.env),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"}],
        "resources": _resources(pool_spec.resources, extended),
        "securityContext": worker_security_context(spec, pool_spec.resources),
        "volumeMounts": mounts + user_volume_mounts(pool_spec.pod),
        # Loading weights can take minutes: the startup probe holds off liveness until /health answers.
        "startupProbe": _probe("/health", 10, 180),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 3),
    }
    pod_spec: Manifest = {
        "containers": [container],
        # Workers never call the Kubernetes API: no token for a compromised worker to use.
        "automountServiceAccountToken": False,
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace_period(args, WORKER_DRAIN_TIMEOUT_S),
    }
    if spec.model.source.uri is not None or spec.model.source.hugging_face is not None:
        pod_spec["initContainers"] = [fetch_model_container(spec, pool)]
    if spec.model.source.hugging_face is not None and spec.model.source.hugging_face.cache.claim_name is not None:
        # The cache claim's root becomes group-writable by the pods' uid; OnRootMismatch: one chown, not one per
        # pod start over a cache of many GB. (A hostPath cache gets none: the kubelet never applies fsGroup to it.)
        pod_spec["securityContext"] = {"fsGroup": WORKER_UID, "fsGroupChangePolicy": "OnRootMismatch"}
    if pool_spec.affinity:
        pod_spec["affinity"] = pool_spec.affinity
    template = {
        "metadata": {
            "labels": {**labels(owner, pool), SPEC_FINGERPRINT_LABEL: spec_fingerprint},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }
    apply_pod_template(pool_spec.pod, template, selector_labels(owner, pool))
    return template


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
                      spec_fingerprint: str, kv_keys_fingerprint: str | None = None,
                      control_token_fingerprint: str | None = None) -> Manifest:
    template = worker_pod_template(owner, spec, pool, spec_fingerprint, kv_keys_fingerprint, control_token_fingerprint)
    return _deployment(owner, pool, replicas, template, {SPEC_FINGERPRINT_LABEL: spec_fingerprint})


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


def disruption_budget(owner: Owner, component: Component) -> Manifest:
    """At most one pod of a pool (or of the routers) evicted at a time by a node drain: with two or more
    replicas the rest keep serving; a single replica can still be moved (a budget of 0 would block drains)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, child_name(owner, component), component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, component)}},
    }


def router_args(owner: Owner, spec: DisaggregatedModelSpec) -> list[str]:
    return [
        "router", "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--model-name", spec.model.name,
        "--discovery", "k8s", "--namespace", owner.namespace,
        "--prefill-service", child_name(owner, "prefill"), "--decode-service", child_name(owner, "decode"),
        "--drain-timeout", str(ROUTER_DRAIN_TIMEOUT_S),
        "--control-token-file", CONTROL_TOKEN_FILE,
        *spec.router.args,
    ]


def router_deployment(owner: Owner, spec: DisaggregatedModelSpec, replicas: int,
                      control_token_fingerprint: str | None = None, api_key_fingerprint: str | None = None) -> Manifest:
    """`api_key_fingerprint` (router_api_key.py: of spec.router.apiKeySecret's value) goes on the template, so new
    keys roll the routers (they read $TANDEM_API_KEY at start)."""
    router = spec.router
    args = router_args(owner, spec)
    volumes: list[Manifest] = []
    mounts: list[Manifest] = []
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                   "prometheus.io/path": "/metrics"}
    _mount_control_token(owner, volumes, mounts, annotations, control_token_fingerprint)
    if api_key_fingerprint:
        annotations[API_KEY_FINGERPRINT_ANNOTATION] = api_key_fingerprint
    _scratch(volumes, mounts)
    container: Manifest = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tandem"],
        "args": args,
        "env": SCRATCH_ENV + _env(router.env) + router_api_key_env(router),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": _resources(router.resources, {}),
        "securityContext": dict(RESTRICTED_CONTEXT),
        "volumeMounts": mounts + user_volume_mounts(router.pod),
        # Imports and uvicorn start take tens of seconds on a busy node: liveness waits for the first answer
        # (without this the e2e router was restarted before it had started).
        "startupProbe": _probe("/health", 2, 90),
        "livenessProbe": _probe("/health", 10, 3),
        # Ready only with a usable prefill and a usable decode worker: until then the Service sends it nothing.
        "readinessProbe": _probe("/ready", 5, 3),
        # Endpoints are removed while the pod terminates; until that reaches every proxy, keep serving.
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SLEEP_S}}},
    }
    pod_spec: Manifest = {
        "serviceAccountName": child_name(owner, "router"),
        "containers": [container],
        "tolerations": _tolerations(router.tolerations),
        "volumes": volumes,
        # SIGTERM comes after the preStop sleep; then the router stops accepting and lets open streams finish.
        "terminationGracePeriodSeconds": grace_period(args, ROUTER_DRAIN_TIMEOUT_S, ROUTER_PRESTOP_SLEEP_S),
    }
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(router.node_selector)
    template = {
        "metadata": {
            "labels": labels(owner, "router"),
            "annotations": annotations,
        },
        "spec": pod_spec,
    }
    apply_pod_template(router.pod, template, selector_labels(owner, "router"))  # its serviceAccountName too
    return _deployment(owner, "router", replicas, template)


def router_api_key_env(router: RouterSpec) -> list[Manifest]:
    """spec.router.apiKeySecret: the router reads its API keys from the Secret through an env var (never its args,
    which `kubectl get pod -o yaml` and `ps` show)."""
    ref = router.api_key_secret
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


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


def router_access(owner: Owner, spec: DisaggregatedModelSpec | None = None) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding letting the router watch its pools' endpoints. The Role is bound to
    spec.router.pod.serviceAccountName too, where the router runs as an account of the user's."""
    name = child_name(owner, "router")
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]
    own_account = spec.router.pod.service_account_name if spec is not None else None
    if own_account and own_account != name:
        subjects.append({"kind": "ServiceAccount", "name": own_account, "namespace": owner.namespace})
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
        "subjects": subjects,
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, "router")}
    return [account, role, binding]


def build_children(owner: Owner, spec: DisaggregatedModelSpec, replicas: Mapping[PoolName, int],
                   spec_fingerprint: str, kv_keys_fingerprint: str | None = None,
                   control_token_fingerprint: str | None = None, api_key_fingerprint: str | None = None) -> list[Manifest]:
    """Every child of one resource, in apply order (RBAC before the pods that use it).

    Not the KV keys or control token Secrets: they are created once (kv_keys.ensure, control_secret.ensure),
    never applied."""
    children: list[Manifest] = [*router_access(owner, spec)]
    for pool in ("prefill", "decode"):
        children.append(worker_service(owner, pool))
        children.append(disruption_budget(owner, pool))
        children.append(worker_deployment(owner, spec, pool, replicas[pool], spec_fingerprint, kv_keys_fingerprint,
                                          control_token_fingerprint))
    children.append(router_service(owner, spec))
    children.append(disruption_budget(owner, "router"))
    children.append(router_deployment(owner, spec, spec.router.replicas, control_token_fingerprint, api_key_fingerprint))
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
    """The Secret as a volume: only its two keys. Mode 0444 for the reason control_token_volume gives: the
    kubelet writes the files as root, and 0400 left them unreadable to the worker's uid 65532."""
    return {"name": KV_KEYS_VOLUME, "secret": {
        "secretName": kv_keys_secret_name(owner),
        "items": [{"key": KV_PUBLIC_KEY, "path": KV_PUBLIC_KEY}, {"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}],
        "defaultMode": 0o444,
    }}


# ---------------------------------------------------------------- worker control token (every model)


def control_token_secret_name(owner: Owner) -> str:
    return child_name(owner, "control-token")


def control_token_secret(owner: Owner, token: str) -> Manifest:
    """The model's worker control token as a Secret (key `token`, the file `--control-token-file` reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, control_token_secret_name(owner), CONTROL_TOKEN_COMPONENT),
        "type": "Opaque",
        "data": {CONTROL_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def control_token_fingerprint(tokens: tuple[str, ...]) -> str:
    """Short and public: names the token on pod templates without revealing it (control_token.fingerprint)."""
    return control_token.fingerprint(tokens)


def control_token_volume(owner: Owner) -> Manifest:
    """The Secret as a volume: only its token. Mode 0444 because the containers run as a non-root uid (65532)
    and the kubelet writes Secret files as root without an fsGroup (which this pod does not set: it would
    also change the ownership of a model PVC); the pod's only process is tandem's, and the file stays
    out of reach of other pods and, on the node, of everyone but root."""
    return {"name": CONTROL_TOKEN_VOLUME, "secret": {
        "secretName": control_token_secret_name(owner),
        "items": [{"key": CONTROL_TOKEN_KEY, "path": CONTROL_TOKEN_KEY}],
        "defaultMode": 0o444,
    }}


def _mount_control_token(owner: Owner, volumes: list[Manifest], mounts: list[Manifest], annotations: dict[str, str],
                         fingerprint: str | None) -> None:
    volumes.append(control_token_volume(owner))
    mounts.append({"name": CONTROL_TOKEN_VOLUME, "mountPath": CONTROL_TOKEN_MOUNT, "readOnly": True})
    if fingerprint:
        annotations[CONTROL_TOKEN_FINGERPRINT_ANNOTATION] = fingerprint


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
