"""A huggingFace model with a node-local cache (spec.model.source.huggingFace.cache.hostPath) on the real node.

The Hub is the stand-in of tests/hub (hub_standin.py) serving the setup's tiny model, bound to the node IP: the
pods' only way out is the host, which holds that address (the operator pod reaches Prometheus there too), and the
pools' env gives the init containers HF_ENDPOINT. The namespace is not `restricted`: PodSecurity baseline and
restricted refuse hostPath volumes. Runs after test_real_node.py and before test_real_node_lifecycle.py (name
order), beside the setup's own model, and removes what it made.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(REPO / "tests" / "hub"))
import real_node  # noqa: E402
from hub_standin import HubStandIn, folder_repo  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

WORKER_UID = 65532  # operator/builders.py WORKER_UID: the images' user and group
NAME = "hub"
PROMPT = "The quick brown fox"


def _fetch_logs(setup: Any, ns: str, pod: str) -> str:
    """The fetch-model container's output, of the run now or (in back-off) the last one."""
    return "".join(setup.kubectl("logs", "-n", ns, pod, "-c", "fetch-model", *previous, check=False)
                   for previous in ((), ("--previous",)))


def test_host_path_cache_downloads_once_per_node(setup: Any, tmp_path: Path) -> None:
    """Both worker pods run on the one node: the kubelet creates the missing folder root-owned (DirectoryOrCreate),
    so the init container (uid 65532, no capabilities) says it cannot write it, as docs/operator.md says; once the
    folder is made writable for uid 65532 (what node preparation does), the pods start, the model is downloaded
    once for both, and the pools serve what the setup's model serves (the same weights)."""
    ns = f"{setup.namespace}-hub"
    cache = tmp_path / "hub-cache"  # absent: the kubelet creates it
    on_node = {"tandem.dev/real-node": real_node.NODE_LABELS["tandem.dev/real-node"]}
    with HubStandIn(host=real_node.NODE_IP) as hub:
        hub.repos["org/tiny"] = folder_repo(Path(setup.info["model_dir"]))
        pool = {"replicas": 1, "device": "cpu", "nodeSelector": on_node, "shmSize": "256Mi",
                "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
                "env": [{"name": "HF_ENDPOINT", "value": hub.url}]}
        body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel",
                "metadata": {"name": NAME, "namespace": ns},
                "spec": {"model": {"name": "tiny-hub", "dtype": "float32", "maxModelLen": 2048,
                                   "source": {"huggingFace": {"repo": "org/tiny", "cache": {"hostPath": str(cache)}}}},
                         "image": "tandem/worker:dev", "imagePullPolicy": "Never",
                         "prefill": pool, "decode": pool, "router": {"replicas": 1, "nodeSelector": on_node}}}
        setup.kubectl("create", "namespace", ns)
        try:
            setup.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=privileged")
            setup.kubectl("apply", "-f", "-", input=json.dumps(body))

            def refused() -> str | None:
                pods = setup.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
                for pod in pods:
                    if pod["spec"].get("initContainers"):
                        logs = _fetch_logs(setup, ns, pod["metadata"]["name"])
                        if "cannot write to the Hub cache /models (Permission denied)" in logs:
                            return logs
                return None

            setup.wait("a fetch-model container refused the root-owned folder", refused, timeout=300)
            made = cache.stat()
            assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (0, 0o755), made  # the kubelet's DirectoryOrCreate
            assert not hub.gets("model.safetensors")
            os.chown(cache, WORKER_UID, WORKER_UID)  # what preparing the node does
            cache.chmod(0o775)

            def ready() -> bool:
                dm = setup.json("get", "disaggregatedmodel", NAME, "-n", ns)
                return any(c["type"] == "Ready" and c["status"] == "True" for c in dm.get("status", {}).get("conditions", []))

            setup.wait(f"dm/{NAME} Ready with the node-local cache", ready, timeout=600)
            workers = [p for p in setup.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME}")["items"]
                       if p["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")]
            assert len(workers) == 2 and {p["spec"]["nodeName"] for p in workers} == {real_node.NODE_NAME}
            for pod in workers:
                (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
                assert volume["hostPath"] == {"path": str(cache), "type": "DirectoryOrCreate"}
            # One download for the node's two pods: the second found every file in the cache.
            for name in hub.repos["org/tiny"].files:
                assert len(hub.gets(name)) <= 1, (name, hub.gets(name))
            assert len(hub.gets("model.safetensors")) == 1
            assert (cache / "models--org--tiny" / "snapshots" / hub.repos["org/tiny"].sha / "config.json").is_file()

            (router,) = [p for p in setup.json("get", "pods", "-n", ns, "-l",
                                               f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=router")
                         ["items"] if not p["metadata"].get("deletionTimestamp")]

            def answer(client: Any, model: str) -> list[int]:
                resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
                return list(resp.choices[0].model_extra["token_ids"])

            ours = answer(setup.client(f"http://{router['status']['podIP']}:8000/v1"), "tiny-hub")
            assert ours == answer(setup.client(), setup.info["model_name"])
        finally:
            setup.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=180s", check=False)
