"""docs/deploy-gpu.md's steps that need running containers, on the real node's pods.

tests/operator/test_deploy_gpu_doc.py runs the page's manifests and kubectl commands against kwok nodes and
skips what kwok cannot do: `kubectl exec ... tandem doctor` (section 8) and `kubectl run ... tandem bench`
(section 8). Here they run, taken from the page with that test's own parsers (so a changed command on the page
is the command run here), against the shared setup (tests/e2e/conftest.py): the chart installed with helm
(hack/e2e.py's `helm upgrade --install`, the page's section 6 with the local images), a model Ready on the
real node, transport auto over tcp (no RDMA resource, no GPU). What the bed lacks is stood in for, each in
`on_real_node`: the page's namespace `llm` and model `llama3-8b` are the setup's; the image is the locally
loaded one (`--image-pull-policy=Never`, no registry); the bed has no cluster DNS and does not route a pod
to a pod through a ClusterIP, so the bench's `<svc>.<ns>.svc:<port>` is the Service's ready endpoint for that
port (`service_endpoint`, what kube-proxy would translate it to); the bench pod is pinned to the
real node (the bed's kwok nodes would "run" it without running it) in a namespace of its own, PodSecurity
`privileged` like the page's `llm` (the setup's namespace enforces `restricted`, which a bare `kubectl run`
pod fails); and the bench is bounded (few, short requests, for a tiny model on 2 CPU cores).

Then the pod-template passthrough the page's model uses (`spec.<pool>.pod.annotations`: the Multus network),
plus labels, is applied to the setup's pools and checked on the running pods, with what the setup's resource
itself sets (nodeSelector, resources, shmSize, args). This rolls both pools once and leaves the passthrough in
place (an annotation naming a network no CNI attaches here is inert); it runs last in this file, and
test_real_node_lifecycle.py rolls the pools again anyway.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import k8s_build  # noqa: E402
import real_node  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

# The kwok test's parsers of the page (a distinct module name: pytest imports that file as test_deploy_gpu_doc).
_spec = importlib.util.spec_from_file_location("deploy_gpu_doc_parsers",
                                               REPO / "tests" / "operator" / "test_deploy_gpu_doc.py")
assert _spec is not None and _spec.loader is not None
doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc)

DOC_NAMESPACE, DOC_MODEL = "llm", "llama3-8b"
# The bench bounded for a tiny model on 2 CPU cores: the page's flags, these values.
BENCH_BOUNDS = {"-n": "4", "--rate": "2", "--prompt-tokens": "32", "--output-tokens": "8", "--slo-ttft": "30",
                "--slo-itl": "5"}
PASSTHROUGH_LABELS = {"example.com/team": "llm-serving"}


def doc_command(verb: str) -> list[str]:
    """The page's one `kubectl <verb>` command."""
    (argv,) = [argv for argv in doc.kubectl_commands() if argv[1] == verb]
    return argv


def on_real_node(argv: list[str], setup: Any) -> list[str]:
    """The page's command with the setup's namespace and model in place of `llm` and `llama3-8b`."""
    out = []
    for arg in argv:
        arg = setup.namespace if arg == DOC_NAMESPACE else arg
        out.append(re.sub(rf"^(deploy/){DOC_MODEL}-", rf"\g<1>{setup.name}-", arg))
    return out


def doc_sh_lines(program: str) -> list[list[str]]:
    """Every `<program> ...` command line of the page's ```sh blocks, continuation lines joined."""
    return [shlex.split(line, comments=True) for info, body in doc.blocks() if info == "sh"
            for line in body.replace("\\\n", " ").splitlines() if line.startswith(f"{program} ")]


def test_the_pages_helm_install_renders_the_operator_the_setup_runs(setup: Any) -> None:
    """Section 6's `helm install` (not run by the kwok test, which runs only kubectl): rendered as written
    (`helm template`, with the page's $REGISTRY; installing it would start a second operator beside the
    setup's), it makes the operator Deployment in tandem-system with the page's image; the setup installed
    the same chart and release name (hack/e2e.py, with local images), and that release's operator runs."""
    (registry,) = [line.split("=", 1)[1] for info, body in doc.blocks() if info == "sh"
                   for line in body.splitlines() if line.startswith("REGISTRY=")]
    installs = [argv for argv in doc_sh_lines("helm") if argv[1] == "install" and argv[3] == "charts/tandem"]
    (argv,) = installs
    args = [a.replace("$REGISTRY", registry) for a in argv[1:]]
    args[0] = "template"
    args[2] = str(REPO / "charts" / "tandem")
    proc = subprocess.run([str(k8s_build.bin_dir() / "helm"), *args], capture_output=True, text=True,
                          env=setup.env, timeout=120)
    assert proc.returncode == 0, f"`{shlex.join(argv)}` from docs/deploy-gpu.md does not render:\n{proc.stderr}"
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    assert deployment["metadata"].get("namespace") == argv[argv.index("-n") + 1] == setup.info["operator_namespace"]
    images = [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]
    assert f"{registry}/tandem-operator:0.1.0" in images, images
    releases = json.loads(subprocess.run([str(k8s_build.bin_dir() / "helm"), "list", "-n",
                                          setup.info["operator_namespace"], "-o", "json"], capture_output=True,
                                         text=True, env=setup.env, timeout=60, check=True).stdout)
    assert any(r["name"] == argv[2] and r["status"] == "deployed" for r in releases), releases


def test_tandem_doctor_in_a_decode_worker(setup: Any) -> None:
    """Section 8's `kubectl exec ... -- tandem doctor`, as written: it names both transports, says tcp works
    (with its loopback bandwidth), rdma not available with a reason, auto picks tcp, and no GPU with a reason."""
    argv = doc_command("exec")
    assert argv[argv.index("--") + 1:] == ["tandem", "doctor"], argv
    args = on_real_node(argv, setup)
    assert f"deploy/{setup.name}-decode" in args, f"the page's exec no longer targets the decode Deployment: {argv}"
    out = setup.kubectl(*args[1:])
    assert "KV transports" in out, out
    assert re.search(r"^  tcp   works\. Loopback: [\d.]+ GB/s", out, re.M), out
    rdma = re.search(r"^  rdma  not available: (.+)$", out, re.M)
    assert rdma and rdma.group(1).strip(), out  # no RDMA device on the bed, and the reason is given
    assert "  auto  picks tcp on this machine" in out, out
    gpu = re.search(r"^  none: (.+)$", out, re.M)
    assert gpu and "no CUDA device" in gpu.group(1), out


def bench_command(argv: list[str], setup: Any, namespace: str, url: str) -> list[str]:
    """The page's `kubectl run ... tandem bench` with the bed's stand-ins (module docstring)."""
    worker = setup.pods("decode")[0]["spec"]["containers"][0]
    args = on_real_node(argv, setup)
    split = args.index("--")
    kubectl, bench = args[:split], args[split:]
    kubectl[kubectl.index("-n") + 1] = namespace
    image = next(i for i, a in enumerate(kubectl) if a.startswith("--image="))
    kubectl[image] = f"--image={worker['image']}"
    kubectl += [f"--image-pull-policy={worker.get('imagePullPolicy', 'IfNotPresent')}",
                "--overrides=" + json.dumps({"spec": {"nodeSelector": {
                    "tandem.dev/real-node": real_node.NODE_LABELS["tandem.dev/real-node"]}}}),
                "--pod-running-timeout=90s"]
    bench[bench.index("--url") + 1] = url
    for flag, value in BENCH_BOUNDS.items():
        assert flag in bench, f"the page's bench no longer passes {flag}: {shlex.join(argv)}"
        bench[bench.index(flag) + 1] = value
    return kubectl + bench


def service_endpoint(setup: Any, service_port: dict[str, Any]) -> str:
    """Where kube-proxy sends the router Service's port: a ready endpoint of its EndpointSlice, ip:port. The bed
    has no cluster DNS, and a pod cannot reach a pod through a ClusterIP there (the host does not forward between
    the pods' bridge and itself, by design: hack/real_node.py), so the bench gets the address the ClusterIP would
    be translated to."""
    slices = setup.json("get", "endpointslices", "-n", setup.namespace, "-l",
                        f"kubernetes.io/service-name={setup.name}")["items"]
    for s in slices:
        ports = [p["port"] for p in s.get("ports") or [] if p.get("name", "") == service_port.get("name", "")]
        for endpoint in s.get("endpoints") or []:
            if ports and endpoint.get("conditions", {}).get("ready"):
                return f"{endpoint['addresses'][0]}:{ports[0]}"
    raise AssertionError(f"the router Service {setup.name} has no ready endpoint: {slices}")


def test_tandem_bench_through_the_routers_service(setup: Any) -> None:
    """Section 8's `kubectl run ... -- tandem bench --url http://<model>.<ns>.svc:8000 ...` from a pod: the
    URL names the router's Service and port; the bench completes every request, none failed."""
    argv = doc_command("run")
    assert argv[argv.index("--") + 1:argv.index("--") + 3] == ["tandem", "bench"], argv
    page_url = argv[argv.index("--url") + 1]
    match = re.fullmatch(rf"http://{DOC_MODEL}\.{DOC_NAMESPACE}\.svc:(\d+)", page_url)
    assert match, f"the page's bench --url is not the router Service's: {page_url}"
    service = setup.json("get", "service", setup.name, "-n", setup.namespace)
    port = int(match.group(1))
    assert port in [p["port"] for p in service["spec"]["ports"]], service["spec"]["ports"]
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    url = f"http://{service_endpoint(setup, service_port)}"
    ns = f"{setup.namespace}-bench"
    setup.kubectl("create", "namespace", ns)
    try:
        setup.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=privileged")
        args = bench_command(argv, setup, ns, url)
        proc = subprocess.run([str(k8s_build.bin_dir() / "kubectl"), *args[1:]], capture_output=True, text=True,
                              env=setup.env, timeout=240)
        assert proc.returncode == 0, (f"`{shlex.join(argv)}` from docs/deploy-gpu.md failed ({proc.returncode}), "
                                      f"as run here: {shlex.join(args)}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
        out = " ".join(proc.stdout.split())  # rich wraps at 80 columns without a terminal
        n = BENCH_BOUNDS["-n"]
        assert re.search(rf"requests: {n} completed, 0 failed", out), out
        assert f"benchmarking {setup.info['model_name']} at {url}" in out, out
        assert "TTFT" in out and "goodput:" in out, out
    finally:
        setup.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)


def test_pod_template_passthrough_reaches_the_running_pods(setup: Any) -> None:
    """The page's pools' `pod` (the Multus annotation) plus labels, applied to the setup's pools: once rolled,
    every running worker pod carries them, and what the setup's resource sets besides (nodeSelector, CPU and
    memory requests, shmSize, args), and the model is Ready and serves."""
    page = yaml.safe_load(doc.manifests()["llama3-8b.yaml"])["spec"]
    spec = setup.resource()["spec"]
    wanted: dict[str, dict[str, Any]] = {}
    for pool in ("prefill", "decode"):
        pod = page[pool]["pod"]
        assert pod.get("annotations"), f"the page's {pool} pool sets no pod annotations any more: {pod}"
        wanted[pool] = {**pod, "labels": {**pod.get("labels", {}), **PASSTHROUGH_LABELS}}
    setup.kubectl("patch", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--type=merge", "-p",
                  json.dumps({"spec": {pool: {"pod": wanted[pool]} for pool in wanted}}))

    def rolled() -> bool:
        for pool, pod in wanted.items():
            pods = setup.pods(pool)
            if not pods or not all(doc_annotations_on(p, pod) and p["metadata"]["labels"].items()
                                   >= pod["labels"].items() and _ready(p) for p in pods):
                return False
        return setup.ready_condition() == "True"

    setup.wait("both pools rolled to pods with the page's pod template", rolled, timeout=420, period=3)
    for pool, pod in wanted.items():
        pool_spec = spec[pool]
        for p in setup.pods(pool, ready_only=True):
            name = p["metadata"]["name"]
            assert p["status"]["phase"] == "Running", (name, p["status"]["phase"])
            for key, value in pod["annotations"].items():
                assert p["metadata"]["annotations"].get(key) == value, (name, key, p["metadata"]["annotations"])
            for key, value in pod["labels"].items():
                assert p["metadata"]["labels"].get(key) == value, (name, key, p["metadata"]["labels"])
            assert p["spec"]["nodeName"] == setup.info["node"], name
            assert p["spec"]["nodeSelector"].items() >= pool_spec["nodeSelector"].items(), (name, p["spec"])
            (worker,) = p["spec"]["containers"]
            requests = worker["resources"]["requests"]
            for resource, quantity in pool_spec["resources"]["requests"].items():
                assert requests.get(resource) == quantity, (name, resource, requests)
            shm = next(v for v in p["spec"]["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": pool_spec["shmSize"]}, (name, shm)
            command = [*worker.get("command", []), *worker.get("args", [])]
            joined = " ".join(command)
            assert " ".join(pool_spec.get("args", [])) in joined, (name, command)
    resp = setup.client().completions.create(model=setup.info["model_name"], prompt="Hello", max_tokens=4,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length", resp


def doc_annotations_on(pod: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("annotations", {}).items() >= wanted["annotations"].items())


def _ready(pod: dict[str, Any]) -> bool:
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)
