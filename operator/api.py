"""The DisaggregatedModel resource (tandem.dev/v1alpha1): the single source of its schema.

The CRD in crds/ and the reference in docs/crd.md are generated from these models by
hack/gen_crd.py; a unit test fails when the committed files are stale. Field names are
snake_case here and camelCase on the wire.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field

from tandem.operator.rules import ApiModel, CrossFieldRule
from tandem.worker import faults

GROUP = "tandem.dev"
VERSION = "v1alpha1"
KIND = "DisaggregatedModel"
PLURAL = "disaggregatedmodels"
SINGULAR = "disaggregatedmodel"
SHORT_NAMES = ("dm",)
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_IMAGE = "ghcr.io/tandem-serving/tandem:0.1.0"
DEFAULT_RDMA_RESOURCE = "rdma/rdma_shared_device_a"
POWERS_OF_TWO = tuple(2**i for i in range(11))  # 1 .. 1024 tokens per KV block
# Children are named <name>-prefill etc. and Services must be DNS-1035 labels (<= 63 chars).
MAX_NAME_LENGTH = 55
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# The API server's own pattern for resource.Quantity (as controller-gen emits it).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


_QUANTITY_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def quantity_bytes(value: int | str) -> int:
    """A quantity (as QUANTITY_PATTERN allows) as a whole number, rounded up: "100Gi" -> 107374182400."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+(?:\.[0-9]*)?|[KMGTPE]i|[numkMGTPE]?)",
                         value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = Decimal(match.group(1)), match.group(2)
    exponent = len(suffix) > 1 and suffix[0] in "eE"  # 1e3; a lone E is exa
    scale = Decimal(10) ** Decimal(suffix[1:]) if exponent else _QUANTITY_SUFFIXES[suffix]
    return math.ceil(number * scale)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (such as 2, 500m or 16Gi)")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    Field(description="A Kubernetes quantity such as 2, 500m or 16Gi.", json_schema_extra={"pattern": QUANTITY_PATTERN}),
]
# /dev/shm: a quantity above zero (a 0 sizeLimit gives the workers no shared memory at all). The mantissa,
# after an optional +, holds a non-zero digit: 8Gi, 0.5Gi, 10 pass; 0, 0Gi, 0e3, -1Gi do not.
POSITIVE_QUANTITY_PATTERN = r"^\+?0*\.?0*[1-9]"


def _check_positive_quantity(value: int | str) -> int | str:
    positive = value > 0 if isinstance(value, int) else bool(re.match(POSITIVE_QUANTITY_PATTERN, value))
    if not positive:
        raise ValueError(f"{value!r} must be a quantity above zero, such as 8Gi")
    return value


PositiveQuantity = Annotated[
    Quantity,
    AfterValidator(_check_positive_quantity),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"type(self) == int ? self > 0 : self.matches(r'{POSITIVE_QUANTITY_PATTERN}')",
        "message": "must be a quantity above zero, such as 8Gi"}]}),
]

# A label key as the API server checks it: an optional DNS-subdomain prefix (<= 253 characters) and /,
# then a name of at most 63 characters that starts and ends alphanumeric.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LABEL_KEYS_MESSAGE = "every key must be a valid label key ([prefix/]name, name at most 63 characters)"


def _check_label_keys(value: dict[str, str] | None) -> dict[str, str] | None:
    for key in value or {}:
        if not re.match(LABEL_KEY_PATTERN, key) or ("/" in key and key.index("/") > 253):
            raise ValueError(f"{key!r} is not a valid label key: {_LABEL_KEYS_MESSAGE}")
    return value


NodeSelector = Annotated[
    Annotated[dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]], Field(max_length=64)] | None,
    AfterValidator(_check_label_keys),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"self.all(k, k.matches(r'{LABEL_KEY_PATTERN}') && (!k.contains('/') || k.indexOf('/') <= 253))",
        "message": _LABEL_KEYS_MESSAGE}]}),
]

PoolName = Literal["prefill", "decode"]
POOLS: tuple[PoolName, ...] = ("prefill", "decode")


# ---------------------------------------------------------------- model


class PvcSource(ApiModel):
    """A PersistentVolumeClaim holding the model folder; mounted read-only at /models."""

    claim_name: str = Field(min_length=1, max_length=253, description="Name of the claim, in the resource's namespace.")
    sub_path: str = Field(default="", max_length=1024, description="Folder inside the volume that holds config.json.")


DEFAULT_MODEL_SIZE_LIMIT = "100Gi"  # spec.model.source.sizeLimit when unset: about a 50 GB model with its archive
URI_PATTERN = r"^https?://[^\s/?#]+[^\s]*$"  # a scheme, a host, then anything but whitespace
SHA256_PATTERN = r"^[0-9a-f]{64}$"


# Absolute, no empty, "." or ".." segment, no trailing slash: one spelling per folder, so the reserved paths
# cannot be reached by another (/tmp/, //tmp, /etc/x/../tandem). The Hub cache's node folder (cache.hostPath)
# takes the same form, which also refuses / itself.
MOUNT_PATH_PATTERN = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"


# A Hub repository id as huggingface_hub checks it: [org/]name of letters, digits, - _ . (no -- or .. anywhere).
HF_REPO_PATTERN = r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,95}/)?[A-Za-z0-9][-A-Za-z0-9_.]{0,95}$"
HF_REVISION_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_./]*$"  # a branch, tag or commit hash
HF_TOKEN_KEY = "token"  # the default key of spec.model.source.huggingFace.tokenSecretRef
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # a Secret's or a claim's name


class HubTokenRef(ApiModel):
    """The Secret key holding a Hugging Face access token (for gated or private repositories)."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN, description="The Secret's name.")
    key: str = Field(default=HF_TOKEN_KEY, min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret whose value is the token.")


class HubCache(ApiModel):
    """Where the Hub cache lives: exactly one of claimName (one download per claim, shared by every worker pod of
    the model) or hostPath (a folder on each node: one download per node)."""

    cross_field_rules = (
        CrossFieldRule(
            cel="[has(self.claimName), has(self.hostPath)].filter(x, x).size() == 1",
            message="cache needs exactly one of claimName or hostPath",
            check=lambda c: (c.claim_name is not None) + (c.host_path is not None) == 1,
        ),
        CrossFieldRule(
            cel=f"!has(self.hostPath) || self.hostPath.matches(r'{MOUNT_PATH_PATTERN}')",
            message="hostPath must be an absolute folder on the node, without . or .. segments or a trailing / "
            "(such as /var/cache/tandem/hub)",
            check=lambda c: c.host_path is None or re.fullmatch(MOUNT_PATH_PATTERN, c.host_path) is not None,
            field_path=".hostPath",
        ),
    )

    claim_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN,
        description="A PersistentVolumeClaim in the resource's namespace; the Hugging Face cache is its root. "
        "ReadWriteMany when the pools' pods run on several nodes (ReadWriteOnce ties them all to one node). "
        "Several models may share one claim. The pods get fsGroup 65532, so the kubelet makes the claim's root "
        "writable by the images' user.",
    )
    host_path: str | None = Field(
        default=None, max_length=1024,
        description="A folder on each node (hostPath, type DirectoryOrCreate) that is the Hugging Face cache: the "
        "first pod on a node downloads, the node's other pods wait for it, and a node that already holds the "
        "model downloads nothing. The folder must be writable by uid or gid 65532 (the images' user; fsGroup does "
        "not apply to hostPath and a folder the kubelet creates is root's): create it when preparing the node, "
        "e.g. install -d -o 65532 -g 65532 -m 0775 /var/cache/tandem/hub. PodSecurity baseline and restricted "
        "refuse hostPath volumes: such a namespace needs privileged.",
    )


class HuggingFaceSource(ApiModel):
    """A model from the Hugging Face Hub, downloaded once into a cache volume the worker pods share."""

    cross_field_rules = (
        CrossFieldRule(
            cel="!self.repo.contains('--') && !self.repo.contains('..')",
            message="repo must not contain -- or .. (the Hub refuses such ids)",
            check=lambda s: "--" not in s.repo and ".." not in s.repo,
            field_path=".repo",
        ),
    )

    repo: str = Field(max_length=193, pattern=HF_REPO_PATTERN,
                      description="The repository id, such as meta-llama/Llama-3.1-8B-Instruct.")
    revision: str | None = Field(
        default=None, max_length=255, pattern=HF_REVISION_PATTERN,
        description="A branch, tag or commit hash (default: main). Each worker pod resolves a branch when it "
        "starts, so pods started after the branch moved serve the new commit: pin a commit hash or a tag.",
    )
    token_secret_ref: HubTokenRef | None = Field(
        default=None,
        description="A Secret key holding an access token, for gated or private repositories. Only the download's "
        "init container gets it (as HF_TOKEN), never the worker that serves requests.",
    )
    cache: HubCache = Field(description="Where the Hub cache lives: one download per claim (claimName) or per node "
                            "(hostPath), not one per pod.")


class ModelSource(ApiModel):
    """Where the model folder (config.json, *.safetensors, tokenizer.json) comes from: exactly one of path, pvc,
    uri or huggingFace."""

    cross_field_rules = (
        CrossFieldRule(
            cel="[has(self.path), has(self.pvc), has(self.uri), has(self.huggingFace)].filter(x, x).size() == 1",
            message="model.source needs exactly one of path, pvc, uri or huggingFace",
            check=lambda s: (s.path is not None) + (s.pvc is not None) + (s.uri is not None)
            + (s.hugging_face is not None) == 1,
        ),
        CrossFieldRule(
            cel="!has(self.sha256) || has(self.uri)",
            message="sha256 is the checksum of a uri's archive: it needs uri",
            check=lambda s: s.sha256 is None or s.uri is not None,
            field_path=".sha256",
        ),
        CrossFieldRule(
            cel="!has(self.sizeLimit) || has(self.uri)",
            message="sizeLimit bounds the volume a uri's archive is fetched into: it needs uri",
            check=lambda s: s.size_limit is None or s.uri is not None,
            field_path=".sizeLimit",
        ),
        # Over plain http anyone on the path can swap the archive; the weights and tokenizer run in every worker.
        CrossFieldRule(
            cel="!has(self.uri) || self.uri.startsWith('https://') || has(self.sha256)",
            message="a plain http:// uri needs sha256 (the archive's checksum), or anyone on the network path can "
            "replace the model: use https://, or give sha256",
            check=lambda s: s.uri is None or s.uri.startswith("https://") or s.sha256 is not None,
            field_path=".uri",
        ),
    )

    path: str | None = Field(
        default=None, min_length=2, max_length=1024, pattern=r"^/",
        description="Absolute path of the model folder inside the worker container (baked into the image or mounted by you).",
    )
    pvc: PvcSource | None = Field(default=None, description="Mount the model folder from a PersistentVolumeClaim.")
    uri: str | None = Field(
        default=None, max_length=4096, pattern=URI_PATTERN,
        description="https:// URL (or http:// with sha256) of a tar archive (.tar, .tar.gz or .tgz; the compression "
        "is read from the content) of the model folder, at the top of the archive or in its one top-level folder. "
        "An init container of each worker pod downloads and unpacks it into an emptyDir at /models/model.",
    )
    hugging_face: HuggingFaceSource | None = Field(
        default=None,
        description="A Hugging Face Hub repository. An init container of each worker pod downloads what the engine "
        "reads into the shared cache, a claim or a node folder (one pod downloads, the others wait for it and find "
        "the files there), and the worker reads the snapshot it resolved from the cache, mounted read-only at "
        "/models.",
    )
    sha256: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="SHA-256 of the archive at uri (64 lowercase hex digits); the download is refused when it differs. "
        "Required for an http:// uri.",
    )
    size_limit: PositiveQuantity | None = Field(
        default=None,
        description="uri only: the most disk the fetched model may take in each worker pod, the sizeLimit of the "
        f"emptyDir the init container fills (default {DEFAULT_MODEL_SIZE_LIMIT}). While unpacking, the archive and "
        "the unpacked folder share it, so allow the archive's size plus the model's (about twice the model for "
        "safetensors, which barely compress); the init container refuses a larger archive, or one that unpacks to "
        "more, before the kubelet would evict the pod for it.",
    )


class ModelSpec(ApiModel):
    """The model to serve."""

    name: str = Field(
        min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_./:]*$",
        description="Name clients pass as `model` in OpenAI requests; also part of the spec fingerprint.",
    )
    source: ModelSource = Field(description="Where the weights come from.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weight and KV-cache dtype (passed to every worker as --dtype); part of the "
        "spec fingerprint."
    )
    max_model_len: int = Field(default=4096, ge=16, le=1_048_576, description="Longest prompt plus output, in tokens.")


# ---------------------------------------------------------------- KV transfer


class KVTransferSpec(ApiModel):
    """How prefill workers ship KV blocks to decode workers."""

    cross_field_rules = (
        CrossFieldRule(
            cel=f"self.blockSize in {list(POWERS_OF_TWO)}",
            message="blockSize must be a power of two (1, 2, 4, ... 1024)",
            check=lambda s: s.block_size in POWERS_OF_TWO,
            field_path=".blockSize",
        ),
    )

    transport: Literal["auto", "rdma", "tcp"] = Field(
        default="auto",
        description="rdma requests the rdmaResource for every worker pod and uses RDMA (pods stay Pending where no "
        "node has the resource). auto requests nothing, so its pods schedule on any cluster: each worker uses RDMA "
        "where its pod has an RDMA device anyway (e.g. rdmaResource listed in the pool's resources) and TCP "
        "otherwise. tcp always uses TCP.",
    )
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV-cache block; part of the spec fingerprint.")
    rdma_resource: str = Field(
        default=DEFAULT_RDMA_RESOURCE, min_length=3, max_length=253, pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9_.-]+$",
        description="Extended resource that an RDMA device plugin advertises (one is requested per worker pod with "
        "transport rdma).",
    )
    secure: bool = Field(
        default=False,
        description="Authenticate and encrypt KV transfer with a CURVE keypair shared by the model's workers: only "
        "workers holding the keys can exchange KV. Cost: tcp KV transfer moves about 2.5-3x fewer bytes per "
        "second (every frame is CURVE-encrypted). With rdma the payload is not encrypted; only the control channel is (and peers are "
        "authenticated before they get the memory keys). The operator keeps the keypair in the Secret "
        "<name>-kv-keys (keys public and secret): created when missing, never overwritten; delete it to rotate "
        "the keys, and the pools roll onto the new ones.",
    )


# ---------------------------------------------------------------- pods


class Toleration(ApiModel):
    """A pod toleration (the core/v1 Toleration fields)."""

    cross_field_rules = (
        CrossFieldRule(
            cel="self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="a toleration with operator Exists must not set value",
            check=lambda t: t.operator != "Exists" or not t.value,
            field_path=".value",
        ),
        CrossFieldRule(
            cel="self.operator == 'Exists' || (has(self.key) && self.key != '')",
            message="a toleration with operator Equal needs a key",
            check=lambda t: t.operator == "Exists" or bool(t.key),
            field_path=".key",
        ),
    )

    key: str | None = Field(default=None, max_length=316, description="Taint key; empty with operator Exists matches every taint.")
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="How key and value are matched.")
    value: str | None = Field(default=None, max_length=63, description="Taint value (operator Equal only).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="How long a NoExecute taint is tolerated.")


class EnvVar(ApiModel):
    """An environment variable for the container."""

    cross_field_rules = (
        CrossFieldRule(
            cel="!(has(self.value) && has(self.valueFrom))",
            message="an env var sets value or valueFrom, not both",
            check=lambda e: e.value is None or e.value_from is None,
        ),
    )

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...), passed through."
    )


def _check_unique_env_names(value: list[EnvVar]) -> list[EnvVar]:
    names = [env.name for env in value]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"env var names must be unique (repeated: {', '.join(duplicates)})")
    return value


EnvList = Annotated[
    list[EnvVar],
    AfterValidator(_check_unique_env_names),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.all(e, self.exists_one(f, f.name == e.name))", "message": "env var names must be unique"}]}),
]


class ResourceRequirements(ApiModel):
    """Extra container resources. The operator adds nvidia.com/gpu (and, for transport rdma, the RDMA resource)
    itself."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources, e.g. cpu, memory.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources.")


# ---------------------------------------------------------------- pod template passthrough

# What the operator itself puts on every pod (builders.py; a unit test keeps the two in step). A `pod` block may
# add beside them, never take them over: a clash would either be refused by the API server when the operator
# applies the Deployment, or silently replace what the workers need (their control token, the model, /dev/shm).
OPERATOR_VOLUMES = ("shm", "tmp", "model", "kv-keys", "control-token")
OPERATOR_MOUNT_PATHS = ("/dev/shm", "/tmp")  # exactly these
OPERATOR_MOUNT_ROOT = "/etc/tandem"  # the Secrets (control token, KV keys): this folder and everything below
MODEL_MOUNT_ROOT = "/models"  # the model volume of a pvc, uri or huggingFace source (a path source leaves it to you)
# Selector labels (app.kubernetes.io/name, instance, component) would move pods in or out of a Deployment,
# Service or NetworkPolicy; managed-by and anything under tandem.dev/ are the operator's bookkeeping.
RESERVED_LABEL_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                       "app.kubernetes.io/managed-by")
RESERVED_ANNOTATION_KEYS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
TANDEM_KEY_PATTERN = r"^([^/]*\.)?tandem\.dev/"  # tandem.dev/... and <sub>.tandem.dev/...
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _meta_keys_message(reserved: tuple[str, ...], what: str) -> str:
    return (f"every key must be a valid {what} key ([prefix/]name), and not the operator's own "
            f"(tandem.dev/..., {', '.join(reserved)})")


def _check_meta_keys(reserved: tuple[str, ...], what: str) -> Any:
    def check(value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(LABEL_KEY_PATTERN, key) or ("/" in key and key.index("/") > 253) \
                    or key in reserved or re.match(TANDEM_KEY_PATTERN, key):
                raise ValueError(f"{_meta_keys_message(reserved, what)}: not {key!r}")
        return value
    return check


def _meta_keys_rule(reserved: tuple[str, ...], what: str) -> dict[str, str]:
    return {
        "rule": f"self.all(k, k.matches(r'{LABEL_KEY_PATTERN}') && (!k.contains('/') || k.indexOf('/') <= 253) "
                f"&& !k.matches(r'{TANDEM_KEY_PATTERN}') && !(k in {list(reserved)}))",
        "message": _meta_keys_message(reserved, what),
    }


PodLabels = Annotated[
    Annotated[dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]], Field(max_length=64)],
    AfterValidator(_check_meta_keys(RESERVED_LABEL_KEYS, "label")),
    Field(json_schema_extra={"x-kubernetes-validations": [_meta_keys_rule(RESERVED_LABEL_KEYS, "label")]}),
]
PodAnnotations = Annotated[
    Annotated[dict[str, Annotated[str, Field(max_length=65536)]], Field(max_length=64)],
    AfterValidator(_check_meta_keys(RESERVED_ANNOTATION_KEYS, "annotation")),
    Field(json_schema_extra={"x-kubernetes-validations": [_meta_keys_rule(RESERVED_ANNOTATION_KEYS, "annotation")]}),
]


class LocalObjectReference(ApiModel):
    """A Secret in the resource's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="The Secret's name.")


class Volume(ApiModel):
    """A core/v1 Volume: a name and one volume source (configMap, secret, persistentVolumeClaim, hostPath, csi,
    ephemeral, ...), passed through; the API server checks the source when the operator applies the Deployment."""

    model_config = ConfigDict(**{**ApiModel.model_config, "extra": "allow"})
    cross_field_rules = (
        CrossFieldRule(
            cel=f"!(self.name in {list(OPERATOR_VOLUMES)})",
            message=f"volume names {', '.join(OPERATOR_VOLUMES)} are the operator's own",
            check=lambda v: v.name not in OPERATOR_VOLUMES,
            field_path=".name",
        ),
    )

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description="Volume name (a DNS label).")


def _mount_path_allowed(path: str) -> bool:
    return path not in OPERATOR_MOUNT_PATHS and path != OPERATOR_MOUNT_ROOT \
        and not path.startswith(OPERATOR_MOUNT_ROOT + "/")


class VolumeMount(ApiModel):
    """Where a volume of `volumes` appears in the container (the core/v1 VolumeMount fields)."""

    cross_field_rules = (
        CrossFieldRule(
            cel=f"!(self.mountPath in {list(OPERATOR_MOUNT_PATHS)}) && self.mountPath != '{OPERATOR_MOUNT_ROOT}' "
                f"&& !self.mountPath.startsWith('{OPERATOR_MOUNT_ROOT}/')",
            message=f"mountPath must not be {', '.join(OPERATOR_MOUNT_PATHS)} or under {OPERATOR_MOUNT_ROOT} "
                    "(the operator's own mounts)",
            check=lambda m: _mount_path_allowed(m.mount_path),
            field_path=".mountPath",
        ),
        CrossFieldRule(
            cel="!(has(self.subPath) && has(self.subPathExpr))",
            message="a volumeMount sets subPath or subPathExpr, not both",
            check=lambda m: m.sub_path is None or m.sub_path_expr is None,
            field_path=".subPath",
        ),
    )

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description="Name of a volume in `volumes`.")
    mount_path: str = Field(max_length=512, pattern=MOUNT_PATH_PATTERN,
                            description="Absolute path in the container (no `.`/`..` segments, no trailing /).")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    sub_path: str | None = Field(default=None, max_length=1024, description="Folder inside the volume to mount.")
    sub_path_expr: str | None = Field(default=None, max_length=1024,
                                      description="Like subPath, with $(VAR) expanded from the container's env.")
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = Field(
        default=None, description="Mount propagation (Bidirectional needs a privileged container).")


class TopologySpreadConstraint(ApiModel):
    """A core/v1 TopologySpreadConstraint. Without labelSelector it spreads the pool's own pods (the router's,
    for the router), which is what an unset selector would otherwise not do: it would match no pod at all."""

    max_skew: int = Field(ge=1, le=1000, description="Most pods one domain may have above the least loaded.")
    topology_key: str = Field(min_length=1, max_length=316, description="Node label that names the domains, e.g. "
                              "topology.kubernetes.io/zone or kubernetes.io/hostname.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(description="Hard or soft.")
    label_selector: dict[str, Any] | None = Field(
        default=None, description="A metav1.LabelSelector of the pods to count. Unset: the pool's own pods.")
    match_label_keys: list[Annotated[str, Field(max_length=316)]] | None = Field(
        default=None, max_length=16, description="Pod label keys whose values narrow the pods counted "
        "(e.g. pod-template-hash: spread each rollout's pods).")
    min_domains: int | None = Field(default=None, ge=1, le=1000, description="Fewest eligible domains (DoNotSchedule only).")
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Count only nodes the pod's "
                                                                     "nodeSelector/affinity allow (Honor).")
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Count only nodes whose "
                                                                   "taints the pod tolerates (Honor).")


def _check_unique(what: str, key: Any) -> Any:
    def check(value: list[Any]) -> list[Any]:
        seen = [key(item) for item in value]
        repeated = sorted({k for k in seen if seen.count(k) > 1})
        if repeated:
            raise ValueError(f"{what} must be unique (repeated: {', '.join(repeated)})")
        return value
    return check


VolumeList = Annotated[
    list[Volume],
    AfterValidator(_check_unique("volume names", lambda v: v.name)),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.all(v, self.exists_one(w, w.name == v.name))", "message": "volume names must be unique"}]}),
]
VolumeMountList = Annotated[
    list[VolumeMount],
    AfterValidator(_check_unique("volumeMount paths", lambda m: m.mount_path)),
    Field(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.all(m, self.exists_one(n, n.mountPath == m.mountPath))",
        "message": "volumeMount paths must be unique"}]}),
]


class PodTemplateSpec(ApiModel):
    """Passed through onto every pod (and, for volumeMounts, the main container and the fetch-model init
    container) beside what the operator sets itself; the operator's own labels, annotations, volumes and mount
    paths cannot be taken over."""

    cross_field_rules = (
        CrossFieldRule(
            cel="!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                "self.volumes.exists(v, v.name == m.name))",
            message="every volumeMount must name a volume listed in volumes",
            check=lambda p: {m.name for m in p.volume_mounts} <= {v.name for v in p.volumes},
            field_path=".volumeMounts",
        ),
    )

    annotations: PodAnnotations = Field(
        default_factory=dict,
        description="Pod annotations, e.g. k8s.v1.cni.cncf.io/networks (Multus: attach the RDMA/SR-IOV network). "
        "Not the operator's own: tandem.dev/..., prometheus.io/scrape, port and path.",
    )
    labels: PodLabels = Field(
        default_factory=dict,
        description="Pod labels. Not the selector labels app.kubernetes.io/name, instance and component, nor "
        "app.kubernetes.io/managed-by or tandem.dev/...",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets (kubernetes.io/dockerconfigjson) to pull the image with.")
    volumes: VolumeList = Field(
        default_factory=list, max_length=32,
        description="Extra volumes, beside the operator's (shm, tmp, model, kv-keys, control-token: names refused).",
    )
    volume_mounts: VolumeMountList = Field(
        default_factory=list, max_length=32,
        description="Mounts of `volumes` into the container. Not at /dev/shm, /tmp or under /etc/tandem; for the "
        "pools, not under /models either when model.source is pvc, uri or huggingFace (the model is mounted there).",
    )
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
        description="ServiceAccount the pods run as. Workers never mount its token (they never call the Kubernetes "
        "API). For the router, the operator binds its Role <name>-router (endpoint discovery) to this account too; "
        "unset, the router runs as <name>-router.",
    )
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                                            description="PriorityClass of the pods.")
    runtime_class_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
        description="RuntimeClass, e.g. nvidia where the NVIDIA container runtime is not the node's default.",
    )
    scheduler_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                                       description="Scheduler that places the pods (default-scheduler when unset).")
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=8, description="How the pods spread over zones or nodes.")
    host_network: bool = Field(
        default=False,
        description="Run in the node's network namespace: some RDMA setups (RoCE without Multus or SR-IOV) need it "
        "for the pod to see the NIC's netdevice and GIDs. The ports then are the node's: the HTTP port 8000 and the "
        "KV port 5555 become host ports, so at most one such pod (of any pool or model) runs per node; the pod's IP "
        "is the node's; the operator's NetworkPolicies do not apply to it, and pods it calls see the node's address "
        "(run the operator with --no-network-policy where a router or prefill pool uses it); DNS stays the "
        "cluster's (dnsPolicy ClusterFirstWithHostNet). PodSecurity baseline and restricted refuse it.",
    )
    host_ipc: bool = Field(
        default=False, alias="hostIPC",
        description="Share the node's IPC namespace (System V / POSIX shared memory with processes outside the pod, "
        "as some RDMA and CUDA IPC setups ask). PodSecurity baseline and restricted refuse it.",
    )


AutoscalingMode = Literal["tandem", "external"]
AutoscalingPolicy = Literal["reactive", "predictive"]


class AutoscalingSpec(ApiModel):
    """Autoscaling of one pool. When enabled, something other than spec replicas owns the replica count:
    Tandem's autoscaler (mode tandem) or whatever scales the pool's DisaggregatedPool (mode external)."""

    cross_field_rules = (
        CrossFieldRule(
            cel="self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            field_path=".minReplicas",
        ),
        CrossFieldRule(
            cel="self.maxScaleUpPods > 0 || self.maxScaleUpPercent > 0",
            message="maxScaleUpPods and maxScaleUpPercent cannot both be 0 (the pool could never grow)",
            check=lambda a: a.max_scale_up_pods > 0 or a.max_scale_up_percent > 0,
            field_path=".maxScaleUpPods",
        ),
    )

    enabled: bool = Field(
        default=False,
        description="Let an autoscaler set replicas (spec replicas is then only the starting size). "
        "false: spec replicas is the size.",
    )
    mode: AutoscalingMode = Field(
        default="tandem",
        description="Who scales the pool while enabled: tandem (Tandem's autoscaler, on the pool's signal) or "
        "external (spec.replicas of the pool's DisaggregatedPool <name>-<pool>, which kubectl scale, an HPA "
        "or a KEDA ScaledObject drive through its scale subresource). One owner at a time.",
    )
    policy: AutoscalingPolicy = Field(
        default="reactive",
        description="How mode tandem sizes the pool: reactive (from its own queue or KV signal, against the "
        "target) or predictive (from the arrival rates the router measures, spec.capacityProfile and spec.slo, "
        "ahead of a rising trend; falls back to reactive, saying so in scaleReason, while an arrival signal is "
        "missing). predictive needs spec.capacityProfile.",
    )
    min_replicas: int = Field(
        default=1, ge=0, le=1000,
        description="Fewest replicas. Mode tandem reads 0 as 1 (its signals come from the pool's own workers); "
        "mode external allows 0 (scale to zero).",
    )
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Most replicas, in either mode.")
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600,
        description="Scale up only to the lowest recommendation of this window (as HPA): a short spike does not "
        "add replicas. Mode tandem.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600,
        description="Scale down only to the highest recommendation of this window (as HPA). Mode tandem.",
    )
    tolerance: float = Field(
        default=0.1, ge=0, lt=1,
        description="No change while signal/target is within 1 +- tolerance. Mode tandem.",
    )
    max_scale_up_pods: int = Field(
        default=4, ge=0, le=1000,
        description="Most pods added per decision (the larger of this and maxScaleUpPercent applies). Mode tandem.",
    )
    max_scale_up_percent: int = Field(
        default=100, ge=0, le=10_000,
        description="Most growth per decision, in percent of the current replicas. Mode tandem.",
    )
    cooldown_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="No scale-down for this long after any change (scale-ups are not delayed). Mode tandem.",
    )


class PrefillAutoscalingSpec(AutoscalingSpec):
    """Prefill scales on its queue: requests waiting for or in prefill, per replica."""

    target_queue_depth: float = Field(default=4.0, gt=0, le=10_000, description="Queued requests per prefill replica to aim for.")
    target_queue_tokens: int | None = Field(
        default=None, ge=1, le=100_000_000,
        description="Queued prompt tokens per prefill replica to aim for; when set, the larger of the two ratios "
        "decides (long prompts weigh more than short ones).",
    )


class DecodeAutoscalingSpec(AutoscalingSpec):
    """Decode scales on KV-cache memory pressure."""

    target_kv_utilization: float = Field(
        default=0.75, alias="targetKVUtilization", gt=0, le=1, description="Fraction of KV-cache blocks in use (0 < x <= 1) to aim for."
    )


def _is_fault_flag(arg: str) -> bool:
    return arg == faults.FLAG or arg.startswith(faults.FLAG + "=")


class PoolSpec(ApiModel):
    """One worker pool (a Deployment of identical workers)."""

    cross_field_rules = (
        CrossFieldRule(
            cel="self.gpusPerReplica == 1",
            message="gpusPerReplica must be 1: tensor-parallel workers have no KV transfer between them yet",
            check=lambda p: p.gpus_per_replica == 1,
            field_path=".gpusPerReplica",
        ),
        # Fault injection (tandem.worker.faults) is for tests: a resource can neither pass the hook nor switch it on.
        CrossFieldRule(
            cel=f"!has(self.args) || !self.args.exists(a, a == '{faults.FLAG}' || a.startsWith('{faults.FLAG}='))",
            message=f"args must not pass {faults.FLAG}: it is a test hook that makes workers misbehave on purpose",
            check=lambda p: not any(_is_fault_flag(a) for a in p.args),
            field_path=".args",
        ),
        CrossFieldRule(
            cel=f"!has(self.env) || !self.env.exists(e, e.name == '{faults.ENV}')",
            message=f"env must not set {faults.ENV}: it enables test hooks that make workers misbehave on purpose",
            check=lambda p: all(e.name != faults.ENV for e in p.env),
            field_path=".env",
        ),
    )

    replicas: int = Field(default=1, ge=0, le=1000, description="Workers in the pool (while autoscaling is disabled).")
    gpus_per_replica: int = Field(
        default=1, ge=1, le=64,
        description="GPUs per worker pod: the tensor-parallel size; part of the spec fingerprint. Only 1 is accepted "
        "until the KV transfer between tensor-parallel workers lands (`tandem serve --mode monolithic` runs them).",
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda",
        description="Where the worker runs the model (its --device): cuda, on the pod's GPUs, or cpu, for test "
        "clusters whose GPUs are not real (the pod still requests gpusPerReplica GPUs, so it schedules the same).",
    )
    gpu_type: str | None = Field(
        default=None, max_length=63, description="Value of the nvidia.com/gpu.product node label to require, e.g. NVIDIA-H100-80GB-HBM3."
    )
    node_selector: NodeSelector = Field(
        default=None, description="Node labels to require. Unset: tandem.dev/pool=<pool> (and a toleration for that taint)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Added to the toleration for the tandem.dev/pool taint."
    )
    affinity: dict[str, Any] | None = Field(default=None, description="A core/v1 Affinity, passed through to the pods.")
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(), description="Extra container resources (cpu, memory, ...)."
    )
    env: EnvList = Field(default_factory=list, max_length=64, description="Extra environment variables.")
    args: list[str] = Field(
        default_factory=list, max_length=64,
        description="Extra arguments appended to `tandem worker` (not the test hook --fault).",
    )
    shm_size: PositiveQuantity = Field(default="8Gi", description="Size of the shared-memory (/dev/shm) volume.")
    pod: PodTemplateSpec = Field(
        default_factory=lambda: PodTemplateSpec(),
        description="What else goes onto the pool's pods: annotations, labels, imagePullSecrets, volumes, "
        "serviceAccountName, priority, runtime and scheduler, spread constraints, host network and IPC.",
    )


class PrefillPoolSpec(PoolSpec):
    """The prefill pool: ingests prompts and ships their KV cache."""

    autoscaling: PrefillAutoscalingSpec = Field(
        default_factory=lambda: PrefillAutoscalingSpec(), description="Queue-depth autoscaling."
    )


class DecodePoolSpec(PoolSpec):
    """The decode pool: receives KV caches and generates tokens."""

    autoscaling: DecodeAutoscalingSpec = Field(
        default_factory=lambda: DecodeAutoscalingSpec(), description="KV-utilization autoscaling."
    )


class RouterServiceSpec(ApiModel):
    """The Service in front of the router (the OpenAI endpoint)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP", description="Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="Service port; the API is at http://<name>.<namespace>.svc:<port>/v1.")


class SecretKeyRef(ApiModel):
    """One key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="The Secret's name.")
    key: str = Field(default="api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret whose value is used.")


API_KEY_ENV = "TANDEM_API_KEY"  # where `tandem router` reads its API keys (spec.router.apiKeySecret)


class RouterSpec(ApiModel):
    """The OpenAI-compatible router."""

    cross_field_rules = (
        CrossFieldRule(
            cel=f"!has(self.apiKeySecret) || !has(self.env) || !self.env.exists(e, e.name == '{API_KEY_ENV}')",
            message=f"apiKeySecret sets {API_KEY_ENV}: env must not set it too",
            check=lambda r: r.api_key_secret is None or all(e.name != API_KEY_ENV for e in r.env),
            field_path=".env",
        ),
    )

    replicas: int = Field(default=1, ge=0, le=100, description="Router pods.")
    node_selector: NodeSelector = Field(default=None, description="Node labels to require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    resources: ResourceRequirements = Field(default_factory=lambda: ResourceRequirements(), description="Container resources.")
    env: EnvList = Field(default_factory=list, max_length=64, description="Extra environment variables.")
    args: list[str] = Field(default_factory=list, max_length=64, description="Extra arguments appended to `tandem router`.")
    service: RouterServiceSpec = Field(default_factory=lambda: RouterServiceSpec(), description="The router's Service.")
    pod: PodTemplateSpec = Field(
        default_factory=lambda: PodTemplateSpec(),
        description="What else goes onto the router's pods: annotations, labels, imagePullSecrets, volumes, "
        "serviceAccountName, priority, runtime and scheduler, spread constraints, host network and IPC.",
    )
    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description="A Secret key holding the API keys clients must send as `Authorization: Bearer <key>` on every "
        "route but /health, /ready and /metrics: one key, or several separated by whitespace, all valid at once. "
        f"The router reads it from the environment variable {API_KEY_ENV} at start; the operator reads the Secret "
        "at every reconcile and rolls the routers when its value changes (annotation tandem.dev/api-key-fingerprint "
        "on their pods). To rotate: put the new key beside the old one, move clients once the routers have rolled, "
        "then drop the old key. Unset: the router asks no key (anyone who reaches its Service may use it).",
    )


# ---------------------------------------------------------------- objectives


class SloSpec(ApiModel):
    """Latency objectives; the autoscaler and the dashboards measure against them."""

    ttft_ms: int = Field(default=2000, ge=1, le=600_000, description="Time-to-first-token objective, milliseconds.")
    itl_ms: int = Field(default=100, ge=1, le=60_000, description="Inter-token latency objective, milliseconds.")


class RatioSpec(ApiModel):
    """Bounds on prefill replicas per decode replica, kept by the autoscaler."""

    cross_field_rules = (
        CrossFieldRule(
            cel="self.minPrefillPerDecode <= self.maxPrefillPerDecode",
            message="minPrefillPerDecode must not exceed maxPrefillPerDecode",
            check=lambda r: r.min_prefill_per_decode <= r.max_prefill_per_decode,
            field_path=".minPrefillPerDecode",
        ),
    )

    min_prefill_per_decode: float = Field(default=0.0, ge=0, le=100, description="Fewest prefill replicas per decode replica.")
    max_prefill_per_decode: float = Field(default=8.0, gt=0, le=100, description="Most prefill replicas per decode replica.")


class CapacityProfileSpec(ApiModel):
    """What one replica does (tandem.operator.capacity_model.Profile, as `tandem profile` writes it, in
    camelCase): the predictive autoscaling policy sizes the pools from it."""

    prefill_tokens_per_second: float = Field(
        gt=0, le=1e9, allow_inf_nan=False, description="Prompt tokens/s one prefill replica ingests (prefill_tps).")
    kv_tokens: float = Field(gt=0, le=1e12, allow_inf_nan=False,
                             description="KV-cache tokens one decode replica holds (kv_tokens).")
    itl_base_seconds: float = Field(gt=0, le=60, allow_inf_nan=False,
                                    description="Decode step time at batch 1, seconds (itl_base_s).")
    itl_per_request_seconds: float = Field(
        ge=0, le=60, allow_inf_nan=False,
        description="Step time added per running request on a decode replica, seconds (itl_per_seq_s).")
    startup_seconds: float = Field(
        default=30.0, ge=0, le=3600, allow_inf_nan=False,
        description="Pod placement to ready, seconds (startup_s): how far ahead a rising trend is followed "
        "(plus one autoscaler interval).")


def _uses_predictive(spec: DisaggregatedModelSpec) -> bool:
    return any(spec.pool(p).autoscaling.policy == "predictive" for p in ("prefill", "decode"))


PREDICTIVE_NEEDS_PROFILE = CrossFieldRule(
    cel="has(self.capacityProfile) || ((!has(self.prefill) || !has(self.prefill.autoscaling) || "
        "!has(self.prefill.autoscaling.policy) || self.prefill.autoscaling.policy != 'predictive') && "
        "(!has(self.decode) || !has(self.decode.autoscaling) || !has(self.decode.autoscaling.policy) || "
        "self.decode.autoscaling.policy != 'predictive'))",
    message="autoscaling policy predictive needs spec.capacityProfile (what one replica does: `tandem profile`)",
    check=lambda s: s.capacity_profile is not None or not _uses_predictive(s),
    field_path=".capacityProfile",
)


# The model sources the operator mounts at MODEL_MOUNT_ROOT (CEL over the spec, and the same in Python).
MODEL_VOLUME_CEL = "has(self.model.source.pvc) || has(self.model.source.uri) || has(self.model.source.huggingFace)"


def _model_volume_mounted(spec: DisaggregatedModelSpec) -> bool:
    source = spec.model.source
    return source.pvc is not None or source.uri is not None or source.hugging_face is not None


def _mounts_over_model(pool: PoolSpec) -> bool:
    return any(m.mount_path == MODEL_MOUNT_ROOT or m.mount_path.startswith(MODEL_MOUNT_ROOT + "/")
               for m in pool.pod.volume_mounts)


def _model_mount_rule(pool: PoolName) -> CrossFieldRule:
    return CrossFieldRule(
        cel=f"!({MODEL_VOLUME_CEL}) || !has(self.{pool}.pod) || !has(self.{pool}.pod.volumeMounts) || "
            f"!self.{pool}.pod.volumeMounts.exists(m, m.mountPath == '{MODEL_MOUNT_ROOT}' || "
            f"m.mountPath.startsWith('{MODEL_MOUNT_ROOT}/'))",
        message=f"{pool}.pod.volumeMounts must not be at or under {MODEL_MOUNT_ROOT}: the operator mounts the model "
        "there for a pvc, uri or huggingFace source",
        check=lambda s: not (_model_volume_mounted(s) and _mounts_over_model(s.pool(pool))),
        field_path=f".{pool}.pod.volumeMounts",
    )


class DisaggregatedModelSpec(ApiModel):
    """One model served by a prefill pool, a decode pool and a router."""

    cross_field_rules = (_model_mount_rule("prefill"), _model_mount_rule("decode"), PREDICTIVE_NEEDS_PROFILE)

    model: ModelSpec = Field(description="The model to serve.")
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512, description="Container image with the `tandem` command.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent", description="Image pull policy.")
    kv_transfer: KVTransferSpec = Field(default_factory=lambda: KVTransferSpec(), description="KV-cache transfer between pools.")
    prefill: PrefillPoolSpec = Field(default_factory=lambda: PrefillPoolSpec(), description="The prefill pool.")
    decode: DecodePoolSpec = Field(default_factory=lambda: DecodePoolSpec(), description="The decode pool.")
    router: RouterSpec = Field(default_factory=lambda: RouterSpec(), description="The router.")
    slo: SloSpec = Field(default_factory=lambda: SloSpec(), description="Latency objectives.")
    ratio: RatioSpec = Field(default_factory=lambda: RatioSpec(), description="Prefill/decode ratio bounds.")
    capacity_profile: CapacityProfileSpec | None = Field(
        default=None, description="What one replica does, for autoscaling policy predictive. Unset: no pool may "
        "use policy predictive.")

    def pool(self, name: PoolName) -> PrefillPoolSpec | DecodePoolSpec:
        return self.prefill if name == "prefill" else self.decode


# ---------------------------------------------------------------- status


class Condition(ApiModel):
    """A condition as in the Kubernetes API conventions."""

    type: str = Field(
        description="Ready, Progressing or Degraded (the operator); ScalingActive and ScalingLimited (the autoscaler)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation the condition was computed for.")


class PoolStatus(ApiModel):
    """Observed state of one pool."""

    replicas: int | None = Field(default=None, description="Pods of the pool's Deployment.")
    ready_replicas: int | None = Field(default=None, description="Pods passing their readiness probe.")
    updated_replicas: int | None = Field(default=None, description="Pods running the current template.")
    desired_replicas: int | None = Field(
        default=None,
        description="Replicas the operator applies: spec replicas, the autoscaler's choice (mode tandem), or the "
        "DisaggregatedPool's spec.replicas (mode external), clamped to min/max while autoscaling is enabled.",
    )
    scaled_by: Literal["spec", "autoscaler", "external"] | None = Field(
        default=None, description="Who owns the replica count now: spec, Tandem's autoscaler, or an external scaler.",
    )
    summary: str | None = Field(default=None, description="readyReplicas/desiredReplicas, shown by kubectl get.")
    last_scale_time: str | None = Field(default=None, description="When the autoscaler last changed desiredReplicas (RFC 3339).")
    signal: float | None = Field(default=None, description="Last value of the pool's autoscaling signal.")
    scale_reason: str | None = Field(default=None, description="Why the autoscaler chose desiredReplicas.")
    autoscaler_state: dict[str, Any] | None = Field(
        default=None, description="The autoscaler's memory between decisions (free-form; kept across operator restarts)."
    )


class DisaggregatedModelStatus(ApiModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(default=None, description="metadata.generation this status describes.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing and Degraded; with autoscaling, ScalingActive (whether the autoscaler can "
        "decide: metrics present and valid) and ScalingLimited (whether a bound, the ratio band or pool capacity "
        "keeps a pool from where its load wants it).",
    )
    prefill: PoolStatus | None = Field(default=None, description="The prefill pool.")
    decode: PoolStatus | None = Field(default=None, description="The decode pool.")
    router: PoolStatus | None = Field(default=None, description="The router.")
    endpoint: str | None = Field(default=None, description="OpenAI API base URL inside the cluster.")
    spec_fingerprint: str | None = Field(
        default=None, description="Hash of the spec fields that decide which KV a worker produces (label "
        "tandem.dev/spec-fingerprint on every worker pod).",
    )


def name_problem(name: str) -> str | None:
    """Why a resource name cannot be used (the CRD's root rule, in Python), or None."""
    if len(name) > MAX_NAME_LENGTH:
        return f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children are named <name>-prefill)"
    if not re.match(NAME_PATTERN, name):
        return "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter"
    return None


ROOT_RULES = (
    {
        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children are named <name>-prefill)",
    },
    {
        "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
        "message": "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter",
    },
)


# ---------------------------------------------------------------- per-pool scale (for kubectl scale, HPA, KEDA)

POOL_KIND = "DisaggregatedPool"
POOL_PLURAL = "disaggregatedpools"
POOL_SINGULAR = "disaggregatedpool"
POOL_SHORT_NAMES = ("dmpool",)


class DisaggregatedPoolSpec(ApiModel):
    """One pool's scale, created by the operator as a child of its DisaggregatedModel (named <model>-<pool>).

    spec.replicas is read only while the pool's autoscaling is enabled with mode external; the scale
    subresource (kubectl scale, HPA, KEDA) writes it.
    """

    replicas: int = Field(
        ge=0, le=1000,
        description="Replicas an external scaler wants (used in autoscaling mode external, clamped to min/max).",
    )
    model: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="The DisaggregatedModel this pool belongs to.")
    pool: PoolName = Field(description="Which of its pools.")


class DisaggregatedPoolStatus(ApiModel):
    """The pool as observed, written by the operator."""

    replicas: int | None = Field(default=None, description="Pods of the pool's Deployment (the scale subresource's status).")
    ready_replicas: int | None = Field(default=None, description="Pods passing their readiness probe.")
    desired_replicas: int | None = Field(default=None, description="Replicas the operator applies to the Deployment.")
    selector: str | None = Field(default=None, description="Label selector of the pool's pods (for HPA per-pod metrics).")
    scaled_by: Literal["spec", "autoscaler", "external"] | None = Field(
        default=None, description="Who owns the replica count; spec.replicas here counts only when this is external.",
    )
    message: str | None = Field(default=None, description="What spec.replicas does now, in words.")
    observed_generation: int | None = Field(default=None, description="metadata.generation this status describes.")
