"""Tandem on real pods, as set up: serving through the router, what the resource says, the operator.

The setup (tests/e2e/conftest.py) is `hack/e2e.sh --model DIR --keep`; test_real_node_lifecycle.py
then scales, kills, rolls and deletes it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import real_node  # noqa: E402

from tandem.worker import metrics as m  # noqa: E402

# The first run builds the images (torch: gigabytes) and the kubelet: give the setup time.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

MAX_TOKENS = 12
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values."]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello to Zürich."}]


# --- serving -------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence"])
def test_completion_equals_transformers(setup: Any, tokenizer: Any, hf_greedy: Any, prompt: str) -> None:
    resp = setup.client().completions.create(model=setup.info["model_name"], prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == hf_greedy(tokenizer.encode(prompt), MAX_TOKENS)
    assert choice.finish_reason == "length"
    # The text of those tokens, less a trailing incomplete UTF-8 sequence the router holds back.
    assert tokenizer.decode(choice.model_extra["token_ids"]).startswith(choice.text) and choice.text


def test_streamed_chat_equals_transformers(setup: Any, tokenizer: Any, hf_greedy: Any) -> None:
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


def test_transport_auto_serves_over_tcp_without_the_rdma_plugin(setup: Any) -> None:
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

def test_conditions_told_the_truth_on_the_way(setup: Any) -> None:
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


def test_status_printer_columns_and_events_now(setup: Any) -> None:
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


def test_the_output_canary_matches_and_the_resource_says_so(setup: Any) -> None:
    """The router's canary (every 5 s here) compares a local and a disaggregated greedy probe on real pods;
    the operator reads its counts from Prometheus into the OutputVerified condition."""
    probes = m.exposed_name(m.ROUTER_CANARY_PROBES)
    setup.wait("the router's canary compared a probe",
               lambda: setup.router_sample(probes, result="match") >= 1, timeout=120)
    assert setup.router_sample(probes, result="mismatch") == 0

    def verified() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in setup.resource()["status"]["conditions"]}
        found = conditions.get("OutputVerified")
        return found if found and found["status"] == "True" else None
    condition = setup.wait("OutputVerified is True", verified, timeout=180)
    assert condition["reason"] == "CanaryMatched", condition


def test_pods_pass_podsecurity_restricted_with_a_read_only_root(setup: Any) -> None:
    """The namespace enforces PodSecurity `restricted` (the apiserver refuses any pod that breaks it),
    so these pods running is the check; on top, what restricted does not ask: a read-only root that
    holds (a write outside /tmp fails in the pod) and no API token in the workers."""
    ns = setup.json("get", "namespace", setup.namespace)
    assert ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted"
    pods = setup.json("get", "pods", "-n", setup.namespace, "-l", f"app.kubernetes.io/instance={setup.name}")["items"]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} == {"prefill", "decode", "router"}
    for pod in pods:
        name, component = pod["metadata"]["name"], pod["metadata"]["labels"]["app.kubernetes.io/component"]
        probe = ("import pathlib\nfor d in ('/home/tandem', '/opt/venv', '/tmp'):\n"
                 "    try:\n        pathlib.Path(d, 'probe').write_text('x'); print(d, 'writable')\n"
                 "    except OSError as e:\n        print(d, 'refused', e.errno)\n"
                 "print('token', pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/token').exists())")
        out = setup.kubectl("exec", "-n", setup.namespace, name, "--", "python3", "-c", probe)
        assert "/home/tandem refused 30" in out and "/opt/venv refused 30" in out, (name, out)  # EROFS
        assert "/tmp writable" in out, (name, out)
        assert f"token {component == 'router'}" in out, (name, out)


# In an RDMA worker's context: the capabilities it holds, whether it can pin memory past its memlock
# limit (what ibv_reg_mr does when it registers the KV cache; mlock stands in, there is no NIC here),
# and the read-only root.
RDMA_CONTEXT_PROBE = """
import ctypes, mmap, pathlib, resource
caps = int(next(l for l in open('/proc/self/status') if l.startswith('CapEff:')).split()[1], 16)
soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
size = 64 << 20
buf = mmap.mmap(-1, size)
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.mlock(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(buf))), ctypes.c_size_t(size))
print('uid', __import__('os').getuid(), 'caps', hex(caps), 'memlock', soft, 'mlock', rc, ctypes.get_errno())
for d in ('/opt/venv', '/tmp'):
    try:
        pathlib.Path(d, 'probe').write_text('x'); print(d, 'writable')
    except OSError as e:
        print(d, 'refused', e.errno)
"""
CAP_IPC_LOCK = 14


def test_an_rdma_workers_context_holds_only_ipc_lock_and_pins_memory(setup: Any) -> None:
    """The security context the operator gives RDMA workers, on a real pod (the worker image, no NIC):
    root holding IPC_LOCK and no other capability, able to pin 64 MiB past the memlock limit, with a
    read-only root; and a namespace enforcing PodSecurity baseline refuses it (IPC_LOCK is not in
    baseline's list), as docs/security.md says."""
    from tandem.operator import builders
    from tandem.operator.api import DisaggregatedModelSpec

    spec = setup.resource()["spec"]
    rdma_spec = DisaggregatedModelSpec.model_validate({**spec, "kvTransfer": {**spec.get("kvTransfer", {}),
                                                                               "transport": "rdma"}})
    context = builders.worker_security_context(rdma_spec, rdma_spec.decode.resources)
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, context
    worker = next(p for p in setup.json("get", "pods", "-n", setup.namespace, "-l",
                                        f"app.kubernetes.io/instance={setup.name}")["items"]
                  if p["metadata"]["labels"]["app.kubernetes.io/component"] == "decode")
    image = worker["spec"]["containers"][0]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rdma-context"},
           "spec": {"restartPolicy": "Never", "nodeName": setup.info["node"], "automountServiceAccountToken": False,
                    "containers": [{"name": "probe", "image": image["image"],
                                    "imagePullPolicy": image.get("imagePullPolicy", "IfNotPresent"),
                                    "command": ["python3", "-c", RDMA_CONTEXT_PROBE], "securityContext": context,
                                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]}}
    baseline, free = f"{setup.namespace}-baseline", f"{setup.namespace}-rdma"
    try:
        for ns, level in ((baseline, "baseline"), (free, "privileged")):
            setup.kubectl("create", "namespace", ns)
            setup.kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}")
        with pytest.raises(AssertionError, match=r"violates PodSecurity .baseline.*IPC_LOCK"):
            setup.kubectl("apply", "-n", baseline, "-f", "-", input=json.dumps(pod))
        setup.kubectl("apply", "-n", free, "-f", "-", input=json.dumps(pod))
        setup.wait("the probe pod finished", lambda: setup.json("get", "pod", "rdma-context", "-n", free)
                   ["status"]["phase"] in ("Succeeded", "Failed"), timeout=180)
        out = setup.kubectl("logs", "-n", free, "rdma-context")
        assert f"uid 0 caps {hex(1 << CAP_IPC_LOCK)} " in out, out  # IPC_LOCK, effective, and nothing else
        assert " mlock 0 " in out, out  # pinned past the memlock limit printed beside it
        assert "/opt/venv refused 30" in out and "/tmp writable" in out, out  # EROFS
    finally:
        for ns in (baseline, free):
            setup.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)


def test_operator_runs_as_a_pod_with_the_charts_rbac(setup: Any) -> None:
    pods = setup.json("get", "pods", "-n", setup.info["operator_namespace"])["items"]
    running = [p for p in pods if p["status"]["phase"] == "Running" and p["spec"]["nodeName"] == setup.info["node"]]
    assert running, "no operator pod runs on the real node"
    sa = running[0]["spec"]["serviceAccountName"]
    bindings = setup.json("get", "clusterrolebindings")["items"]
    assert any(s.get("name") == sa for b in bindings for s in b.get("subjects") or []), sa


def test_cli_tools_present() -> None:
    """The binaries the real node needs are where the setup looks for them (a cheap guard that
    also runs where the rest skipped)."""
    if sys.platform != "linux":
        pytest.skip("the real node needs Linux")
    missing = [t for t in ("containerd", "runc", "ctr", "buildah", "mmdebstrap", "iptables", "conntrack")
               if shutil.which(t) is None]
    assert not missing, f"missing {missing}: {real_node.APT_HINT} buildah mmdebstrap"
