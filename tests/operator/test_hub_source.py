"""spec.model.source.huggingFace -> worker pods: an init container downloads into the shared cache, a claim (one
download per claim) or a node folder (one per node; the others wait on its lock, tests/hub/test_hub_download.py),
the worker reads the snapshot the init container linked, from the cache mounted read-only, and never sees the
token."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator import builders
from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.fingerprint import spec_fingerprint

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")


def pod_of(source: dict[str, Any], pool: str = "prefill", **changes: Any) -> dict[str, Any]:
    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "llama", "source": source}, **changes})
    built = builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, spec_fingerprint(spec))
    (deployment,) = [c for c in built if c["kind"] == "Deployment" and c["metadata"]["name"] == f"tiny-{pool}"]
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


HF = {"repo": "meta-llama/Llama-3.1-8B-Instruct", "cache": {"claimName": "hub-cache"}}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_hugging_face_source_downloads_in_an_init_container_into_the_cache_claim(pool: str) -> None:
    source = {"huggingFace": {**HF, "revision": "v1.0", "tokenSecretRef": {"name": "hf-token"}}}
    pod = pod_of(source, pool, image="registry.example/tandem:3",
                 **{pool: {"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]}})
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}} in pod["volumes"]
    (init,) = pod["initContainers"]
    assert init["name"] == "fetch-model" and init["image"] == "registry.example/tandem:3"
    assert init["args"] == ["fetch-model", "--model", "meta-llama/Llama-3.1-8B-Instruct@v1.0", "--link", "/tmp/model"]
    assert init["env"] == [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_CACHE", "value": "/models"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
        {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},  # the pool's env: proxies, HF_ENDPOINT
    ]
    # Read-write for the download; /tmp is the pod's own emptyDir, where the link to the snapshot goes.
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert init["securityContext"] == builders.RESTRICTED_CONTEXT
    worker = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in worker["volumeMounts"]
    args = worker["args"]
    assert args[args.index("--model") + 1] == "/tmp/model"
    assert args[args.index("--model-name") + 1] == "llama"
    assert not any(e["name"].startswith("HF_") for e in worker["env"])  # the token stays in the init container
    # The claim's root is made writable by the images' uid once (not re-chowned at every pod start).
    assert pod["securityContext"] == {"fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_host_path_cache_is_a_node_folder_with_no_fs_group(pool: str) -> None:
    """cache.hostPath: the node's folder is the Hub cache (one download per node: the init container's lock in it
    serialises that node's pods), read-write for the init container and read-only for the worker. No fsGroup: the
    kubelet never applies it to a hostPath (the folder is made writable for uid/gid 65532 when the node is
    prepared), and it would only change the ownership of the pod's other volumes."""
    source = {"huggingFace": {**HF, "cache": {"hostPath": "/var/cache/tandem/hub"}, "tokenSecretRef": {"name": "t"}}}
    pod = pod_of(source, pool)
    (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert model == {"name": "model", "hostPath": {"path": "/var/cache/tandem/hub", "type": "DirectoryOrCreate"}}
    assert "securityContext" not in pod
    (init,) = pod["initContainers"]
    assert init["args"] == ["fetch-model", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--link", "/tmp/model"]
    assert init["env"][:3] == [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_CACHE", "value": "/models"},
                               {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert init["securityContext"] == builders.RESTRICTED_CONTEXT  # uid 65532, no capabilities: never root
    worker = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert worker["args"][worker["args"].index("--model") + 1] == "/tmp/model"
    assert not any(e["name"].startswith("HF_") for e in worker["env"])


def test_the_cache_kind_is_part_of_the_spec_fingerprint() -> None:
    """Moving the cache from a claim to a node folder rolls the pools (their pods mount another volume)."""
    def fingerprint(cache: dict[str, Any]) -> str:
        return spec_fingerprint(DisaggregatedModelSpec.model_validate(
            {"model": {"name": "llama", "source": {"huggingFace": {**HF, "cache": cache}}}}))

    assert fingerprint({"claimName": "hub-cache"}) != fingerprint({"hostPath": "/var/cache/tandem/hub"})


def test_hugging_face_source_without_token_or_revision() -> None:
    (init,) = pod_of({"huggingFace": HF})["initContainers"]
    assert init["args"] == ["fetch-model", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--link", "/tmp/model"]
    assert [e["name"] for e in init["env"]] == ["HOME", "HF_HUB_CACHE", "HF_HUB_DISABLE_TELEMETRY"]


def test_token_secret_key_can_be_named() -> None:
    source = {"huggingFace": {**HF, "tokenSecretRef": {"name": "hf", "key": "HF_TOKEN"}}}
    (init,) = pod_of(source)["initContainers"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} in init["env"]


@pytest.mark.parametrize("source", [{"path": "/models/tiny"}, {"pvc": {"claimName": "weights"}},
                                    {"uri": "https://models.example/tiny.tgz"}])
def test_other_sources_set_no_fs_group(source: dict[str, Any]) -> None:
    """fsGroup would chown a model pvc; only the Hub cache claim, which the pods write, gets it."""
    assert "securityContext" not in pod_of(source)


def test_the_source_is_part_of_the_spec_fingerprint() -> None:
    """A new repo or revision rolls the pools (each new pod resolves and, where needed, downloads it)."""
    def fingerprint(hf: dict[str, Any]) -> str:
        return spec_fingerprint(DisaggregatedModelSpec.model_validate(
            {"model": {"name": "llama", "source": {"huggingFace": hf}}}))

    assert fingerprint(HF) != fingerprint({**HF, "revision": "v2"})
