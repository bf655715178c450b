"""Tandem on real pods: the operator's workers and router on the test bed's real node.

The setup is `hack/e2e.sh --model DIR --keep` (test bed with its real node, local images, the
chart, a hostPath model volume, a DisaggregatedModel with transport auto on a node without the
RDMA resource); these tests are its checks. Run by hand they start it all themselves and tear it
down at the end; `hack/e2e.sh` without --keep runs them against its own setup (TANDEM_E2E_STATE).
The last test deletes the resource, so they run in file order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import k8s_build  # noqa: E402
import real_node  # noqa: E402

# The first run builds the images (torch: gigabytes) and the kubelet: give the setup time.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

MAX_TOKENS = 12
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values."]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello to Zürich."}]


@dataclass
class Setup:
    info: dict[str, Any]
    env: dict[str, str]

    @property
    def namespace(self) -> str:
        return str(self.info["namespace"])

    @property
    def name(self) -> str:
        return str(self.info["name"])

    def kubectl(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run([str(k8s_build.bin_dir() / "kubectl"), *args], capture_output=True, text=True,
                              env=self.env, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def resource(self) -> Any:
        return self.json("get", "disaggregatedmodel", self.name, "-n", self.namespace)

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.info["router"], api_key="unused", max_retries=0, timeout=120)


def why_no_real_node() -> str | None:
    """Only what truly cannot be had here skips; a missing package is a failure (with its fix)."""
    if sys.platform != "linux":
        return "the real node needs Linux"
    if os.geteuid() != 0:
        return "the real node needs root (network devices, mounts, cgroups)"
    return None


def make_model(folder: Path) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    model = write_tiny_model(folder / "tiny-e2e")
    for path in [folder, model, *model.rglob("*")]:  # the workers run as uid 65532
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    given = os.environ.get("TANDEM_E2E_STATE")
    if given:  # hack/e2e.sh runs these checks against what it set up, and tears it down itself
        info = json.loads((Path(given) / "e2e.json").read_text())
        yield Setup(info, dict(os.environ, KUBECONFIG=info["kubeconfig"]))
        return
    if reason := why_no_real_node():
        pytest.skip(reason)
    # One real node per machine: reuse one that runs (its owner keeps it), else start our own.
    owner = real_node.owner_of_running_node()
    state = Path(owner) if owner else tmp_path_factory.mktemp("e2e-state")
    model = make_model(tmp_path_factory.mktemp("e2e-model"))
    proc = subprocess.run([str(REPO / "hack" / "e2e.sh"), "--model", str(model), "--keep", "--state", str(state)],
                          capture_output=True, text=True)
    router_line = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not router_line.startswith("router: http://127.0.0.1:"):
        if not owner:  # leave nothing running behind a failed setup
            subprocess.run([str(REPO / "hack" / "cluster.sh"), "down", "--state", str(state)], capture_output=True)
        pytest.fail(f"hack/e2e.sh failed ({proc.returncode}); its last output line {router_line!r}:\n"
                    f"{proc.stderr[-8000:]}", pytrace=False)
    info = json.loads((state / "e2e.json").read_text())
    yield Setup(info, dict(os.environ, KUBECONFIG=info["kubeconfig"]))
    if owner:
        setup_ns = info["namespace"]
        subprocess.run([str(k8s_build.bin_dir() / "kubectl"), f"--kubeconfig={info['kubeconfig']}", "delete",
                        "namespace", setup_ns, "--ignore-not-found"], capture_output=True)
        return
    down = subprocess.run([str(REPO / "hack" / "cluster.sh"), "down", "--state", str(state)],
                          capture_output=True, text=True)
    # `down` fails when it leaves anything behind (processes, mounts, links, chains, cgroups, sysctls).
    assert down.returncode == 0, f"hack/cluster.sh down:\n{down.stderr[-4000:]}"


@pytest.fixture(scope="module")
def hf_greedy(setup: Setup) -> Any:
    """transformers' greedy continuation: the reference the pods must match token for token."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(setup.info["model_dir"], dtype=torch.float32)
    model.eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            # The mask explicitly: inferred from pad_token_id it would hide the chat template's
            # <|begin_of_text|>, which is token 0 in the tiny models.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return list(out[0, len(prompt):].tolist())

    return greedy


@pytest.fixture(scope="module")
def tokenizer(setup: Setup) -> Any:
    from tandem.worker.model.tokenizer import Tokenizer

    return Tokenizer(Path(setup.info["model_dir"]))


# --- serving -------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence"])
def test_completion_equals_transformers(setup: Setup, tokenizer: Any, hf_greedy: Any, prompt: str) -> None:
    resp = setup.client().completions.create(model=setup.info["model_name"], prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == hf_greedy(tokenizer.encode(prompt), MAX_TOKENS)
    assert choice.finish_reason == "length"
    # The text of those tokens, less a trailing incomplete UTF-8 sequence the router holds back.
    assert tokenizer.decode(choice.model_extra["token_ids"]).startswith(choice.text) and choice.text


def test_streamed_chat_equals_transformers(setup: Setup, tokenizer: Any, hf_greedy: Any) -> None:
    text, ids = "", []
    for chunk in setup.client().chat.completions.create(
            model=setup.info["model_name"], messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += choice.model_extra.get("token_ids") or []
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert ids == hf_greedy(prompt, MAX_TOKENS)
    whole = setup.client().chat.completions.create(model=setup.info["model_name"], messages=CHAT,
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


def test_transport_auto_serves_over_tcp_without_the_rdma_plugin(setup: Setup) -> None:
    node = setup.json("get", "node", setup.info["node"])
    assert real_node.RDMA_RESOURCE not in node["status"]["allocatable"], "the setup withdraws the RDMA resource"
    pods = setup.json("get", "pods", "-n", setup.namespace, "-l", f"app.kubernetes.io/instance={setup.name}")["items"]
    workers = [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") in ("prefill", "decode")]
    assert len(workers) == 2
    for pod in workers:
        assert pod["spec"]["nodeName"] == setup.info["node"]
        limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
        assert real_node.RDMA_RESOURCE not in limits, f"{pod['metadata']['name']} asks for RDMA under auto"
    for pod in workers:
        logs = setup.kubectl("logs", "-n", setup.namespace, pod["metadata"]["name"])
        assert "KV transport: tcp" in logs, f"{pod['metadata']['name']} does not say it uses tcp:\n{logs[-2000:]}"


# --- what the resource says ----------------------------------------------------------------

def test_conditions_told_the_truth_on_the_way(setup: Setup) -> None:
    history = setup.info["condition_history"]
    first_ready = next(i for i, h in enumerate(history) if h["conditions"].get("Ready", {}).get("status") == "True")
    # Ready only once every pod (2 workers and the router) was ready, never before.
    for step in history[:first_ready]:
        assert step["conditions"].get("Ready", {}).get("status") != "True"
    assert history[first_ready]["readyPods"] == 3, history[first_ready]
    # While pods were starting, the resource said so.
    starting = [h for h in history[:first_ready] if h["readyPods"] < 3 and h["pods"]]
    assert starting, "the setup never saw the pods starting (too coarse a poll?)"
    assert any(h["conditions"].get("Progressing", {}).get("status") == "True" for h in starting), history


def test_status_printer_columns_and_events_now(setup: Setup) -> None:
    obj = setup.resource()
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions.get("Degraded", {}).get("status", "False") == "False"
    assert obj["status"]["prefill"]["summary"] == "1/1" and obj["status"]["decode"]["summary"] == "1/1"
    row = setup.kubectl("get", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--no-headers").split()
    assert row[:5] == [setup.name, setup.info["model_name"], "1/1", "1/1", "True"], row
    events = setup.json("get", "events", "-n", setup.namespace,
                        "--field-selector", f"involvedObject.name={setup.name}")["items"]
    assert events, "the operator recorded no event on the resource"
    # Warnings on the way are fine when they were true (a pod restarting); the last word is Ready.
    last = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    assert (last["type"], last["reason"]) == ("Normal", "Ready"), last["message"]


def test_operator_runs_as_a_pod_with_the_charts_rbac(setup: Setup) -> None:
    pods = setup.json("get", "pods", "-n", setup.info["operator_namespace"])["items"]
    running = [p for p in pods if p["status"]["phase"] == "Running" and p["spec"]["nodeName"] == setup.info["node"]]
    assert running, "no operator pod runs on the real node"
    sa = running[0]["spec"]["serviceAccountName"]
    bindings = setup.json("get", "clusterrolebindings")["items"]
    assert any(s.get("name") == sa for b in bindings for s in b.get("subjects") or []), sa


# --- deletion (last: it removes what the tests above use) ----------------------------------

def test_delete_removes_everything_it_created(setup: Setup) -> None:
    selector = f"app.kubernetes.io/instance={setup.name}"
    setup.kubectl("delete", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--timeout=120s")
    kinds = "pods,services,deployments,poddisruptionbudgets,serviceaccounts,roles,rolebindings,secrets,endpointslices"
    deadline = time.monotonic() + 120
    left: list[str] = []
    while time.monotonic() < deadline:
        left = setup.kubectl("get", kinds, "-n", setup.namespace, "-l", selector, "-o", "name").split()
        if not left:
            break
        time.sleep(1)
    assert not left, f"still there {120}s after the delete: {left}"
    # Our claim stays bound to our volume (the operator never created or touched it).
    pvc = setup.json("get", "pvc", "model", "-n", setup.namespace)
    assert pvc["status"]["phase"] == "Bound"


def test_cli_tools_present() -> None:
    """The binaries the real node needs are where the setup looks for them (a cheap guard that
    also runs where the rest skipped)."""
    if why_no_real_node():
        pytest.skip(why_no_real_node() or "")
    missing = [t for t in ("containerd", "runc", "ctr", "buildah", "mmdebstrap", "iptables", "conntrack")
               if shutil.which(t) is None]
    assert not missing, f"missing {missing}: {real_node.APT_HINT} buildah mmdebstrap"
