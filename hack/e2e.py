"""Tandem end to end on the test bed's real node: `hack/e2e.sh --model DIR [--keep]`.

1. The test bed with its real node (`hack/cluster.sh up --real-node`), or the one already running.
2. The images built locally and loaded into the node (hack/images.py).
3. charts/tandem installed with those images: the operator runs as a pod with the chart's RBAC.
4. DIR served to the workers through a hostPath PersistentVolume and its claim.
5. Prometheus on the node IP, scraping every pod the operator makes (hack/e2e_metrics.py), and
   the chart's operator pointed at it.
6. A DisaggregatedModel for it (both pools on the real node, `device: cpu`, transport auto), with
   the node's RDMA resource withdrawn first: auto must then schedule and serve over tcp. Prefill
   is autoscaled by Tandem on its queue (one sequence at a time, so a burst queues); decode is
   scaled externally (`kubectl scale disaggregatedpool <name>-decode`).
7. Its Ready condition awaited, every condition change on the way recorded; the router reached on
   127.0.0.1 through `kubectl port-forward`; one line printed: `router: http://127.0.0.1:PORT/v1`.
Then, without --keep, the checks (tests/e2e/test_real_node.py, which reads STATE/e2e.json) and
the teardown. With --keep everything stays up until `hack/cluster.sh down`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import cluster  # noqa: E402
import e2e_metrics  # noqa: E402
import k8s_build  # noqa: E402
import real_node  # noqa: E402

OPERATOR_NAMESPACE = "tandem-system"
RELEASE = "tandem"
MODEL_CLAIM = "model"
ROUTER_PORT = 8000  # the router Service's default port
AUTOSCALE_INTERVAL_S = 3


def log(msg: str, t0: float = time.monotonic()) -> None:
    print(f"[e2e {time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)


class Kube:
    """kubectl and helm of the test bed's own build, on its kubeconfig."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.bins = k8s_build.bin_dir()
        self.env = dict(os.environ, KUBECONFIG=str(state / "kubeconfig"))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        proc = subprocess.run([str(self.bins / "kubectl"), *args], input=input, capture_output=True,
                              text=True, env=self.env)
        if check and proc.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args)} failed:\n{proc.stderr.strip()}")
        return proc.stdout

    def json(self, *args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.kubectl(*args, "-o", "json"))  # type: ignore[no-any-return]

    def apply(self, *objects: dict) -> None:  # type: ignore[type-arg]
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def helm(self, *args: str) -> str:
        proc = subprocess.run([str(self.bins / "helm"), *args], capture_output=True, text=True, env=self.env)
        if proc.returncode != 0:
            raise SystemExit(f"helm {' '.join(args)} failed:\n{proc.stderr.strip()}")
        return proc.stdout


# --- 1, 2: test bed and images -------------------------------------------------------------

def ensure_cluster(state: Path) -> bool:
    """Reuse a running test bed with a real node, else start one; True if started here."""
    if (state / "pids.json").exists():
        if not (state / "node").exists():
            raise SystemExit(f"the test bed in {state} has no real node; run `hack/cluster.sh down "
                             f"--state {state}` and try again")
        log(f"reusing the test bed in {state}")
        return False
    log("starting the test bed with its real node (hack/cluster.sh up --real-node)")
    proc = subprocess.run([str(HERE / "cluster.sh"), "up", "--real-node", "--state", str(state)],
                          stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit("hack/cluster.sh up --real-node failed (its messages are above)")
    return True


def build_and_load_images(state: Path) -> None:
    proc = subprocess.run([sys.executable, str(HERE / "images.py"), "all", "--state", str(state)])
    if proc.returncode != 0:
        raise SystemExit("hack/images.py failed (its messages are above)")


# --- 3: the chart --------------------------------------------------------------------------

def start_prometheus(state: Path) -> str:
    """Prometheus on the node IP (the operator pod reaches the host there) and its target writer,
    both in the test bed's pids so that `hack/cluster.sh down` stops them; reused when running."""
    sup = cluster.Supervisor(state)
    saved = state / "prometheus.json"
    if saved.exists() and all(pid_alive(sup.pids.get(n)) for n in ("prometheus", "pod-targets")):
        return str(json.loads(saved.read_text())["url"])
    work = state / "prometheus"
    work.mkdir(exist_ok=True)
    targets = work / "targets.json"
    targets.write_text("[]")
    (work / "prometheus.yml").write_text(json.dumps(e2e_metrics.prometheus_config(targets)))
    port = cluster.free_port()
    url = f"http://{real_node.NODE_IP}:{port}"
    sup.start("pod-targets", [sys.executable, str(HERE / "e2e_metrics.py"), "targets",
                              "--kubeconfig", str(state / "kubeconfig"), "--out", str(targets)])
    sup.start("prometheus", ["prometheus", f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address={real_node.NODE_IP}:{port}"])
    cluster.wait_for("prometheus", lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=3).status == 200,
                     sup, timeout=60)
    saved.write_text(json.dumps({"url": url}))
    log(f"prometheus at {url}, scraping the operator's pods")
    return url


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def install_chart(kube: Kube, prometheus_url: str) -> None:
    # helm installs the chart's CRDs only on first install; the current ones are applied each time.
    for crd in sorted((REPO / "charts" / "tandem" / "crds").glob("*.yaml")):
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    node_label = "tandem.dev/real-node".replace(".", "\\.")  # helm --set splits keys at dots
    kube.helm("upgrade", "--install", RELEASE, str(REPO / "charts" / "tandem"),
              "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
              "--set", "image.repository=tandem/operator", "--set", "image.tag=dev",
              "--set", "image.pullPolicy=Never",
              # The kwok nodes would "run" the operator without running it.
              "--set-string", f"nodeSelector.{node_label}=true",
              "--set", f"operator.prometheusUrl={prometheus_url}",
              "--set", f"operator.autoscaleInterval={AUTOSCALE_INTERVAL_S}",
              "--wait", "--timeout", "5m")
    log(f"chart installed: the operator runs in {OPERATOR_NAMESPACE}")


# --- 4, 5: model volume and the resource ---------------------------------------------------

def check_model_dir(model: Path) -> None:
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} holds no config.json: not a model folder")
    # The worker runs as uid 65532: the folder itself and its files must be readable by others
    # (a hostPath volume mounts the folder itself, so the folders above it do not matter).
    unreadable = [p for p in [model, *model.rglob("*")]
                  if not (p.stat().st_mode & 0o004) or (p.is_dir() and not p.stat().st_mode & 0o001)]
    if unreadable:
        raise SystemExit(f"the workers (uid 65532) cannot read {unreadable[0]}: chmod -R a+rX {model}")


def model_volume(namespace: str, model: Path) -> list[dict]:  # type: ignore[type-arg]
    pv_name = f"{namespace}-model"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                   "hostPath": {"path": str(model), "type": "Directory"},
                   "claimRef": {"namespace": namespace, "name": MODEL_CLAIM}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": MODEL_CLAIM, "namespace": namespace},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                    "resources": {"requests": {"storage": "1Gi"}}}}
    return [pv, pvc]


def resource(name: str, namespace: str, model_name: str) -> dict:  # type: ignore[type-arg]
    on_node = {k: v for k, v in real_node.NODE_LABELS.items() if k == "tandem.dev/real-node"}
    pool = {"replicas": 1, "device": "cpu", "nodeSelector": on_node, "shmSize": "256Mi",
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}}}
    # Prefill takes one sequence at a time, so that a burst of requests queues where Prometheus
    # sees it. The queue is a gauge sampled every 2 s, and on 2 shared cores the burst shows in
    # about 1 sample in 8 (measured): a target of 0.5 queued per replica scales up on any queued
    # request the autoscaler sees; no scale-down for 90 s after a change (a new pod starts in 30-60 s here)
    # and a 60 s window bring the pool back after the burst.
    prefill = {**pool, "args": ["--max-num-seqs", "1"],
               "autoscaling": {"enabled": True, "mode": "tandem", "minReplicas": 1, "maxReplicas": 2,
                               "targetQueueDepth": 0.5, "scaleDownStabilizationSeconds": 60,
                               "cooldownSeconds": 90}}
    decode = {**pool, "autoscaling": {"enabled": True, "mode": "external", "minReplicas": 1, "maxReplicas": 3}}
    return {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": model_name, "source": {"pvc": {"claimName": MODEL_CLAIM}},
                      # Long enough for a stream that outlives a killed pod (the tiny models' 2048).
                      "dtype": "float32", "maxModelLen": 2048},
            "image": "tandem/worker:dev", "imagePullPolicy": "Never",
            "prefill": prefill, "decode": decode,
            # The output canary every 5 s (default 60), so that its condition is there to check within seconds.
            "router": {"replicas": 1, "nodeSelector": on_node, "args": ["--canary-interval", "5"]},
        },
    }


def withdraw_rdma(kube: Kube) -> None:
    """A cluster without the RDMA device plugin: transport auto must still schedule (over tcp)."""
    alloc = kube.json("get", "node", real_node.NODE_NAME)["status"]["capacity"]
    if real_node.RDMA_RESOURCE in alloc:
        path = "/status/capacity/" + real_node.RDMA_RESOURCE.replace("/", "~1")
        kube.kubectl("patch", "node", real_node.NODE_NAME, "--subresource=status", "--type=json",
                     "-p", json.dumps([{"op": "remove", "path": path}]))


def wait_ready(kube: Kube, name: str, namespace: str, timeout: float) -> list[dict]:  # type: ignore[type-arg]
    """Poll the resource until Ready=True; returns each distinct set of conditions seen, in order."""
    history: list[dict] = []  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = kube.json("get", "disaggregatedmodel", name, "-n", namespace)
        conditions = {c["type"]: {"status": c["status"], "reason": c.get("reason", "")}
                      for c in obj.get("status", {}).get("conditions", [])}
        pods = kube.json("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
        ready_pods = sum(all(cs.get("ready") for cs in p["status"].get("containerStatuses", [])) and
                         bool(p["status"].get("containerStatuses")) for p in pods)
        seen = {"conditions": conditions, "pods": len(pods), "readyPods": ready_pods}
        if not history or {k: v for k, v in history[-1].items() if k != "t"} != seen:
            history.append({"t": round(time.monotonic() - (deadline - timeout), 1), **seen})
            summary = ", ".join(f"{k}={v['status']}({v['reason']})" for k, v in sorted(conditions.items()))
            log(f"{name}: {summary or 'no conditions yet'}; pods ready {ready_pods}/{len(pods)}")
        if conditions.get("Ready", {}).get("status") == "True":
            return history
        time.sleep(1)
    events = kube.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)
    raise SystemExit(f"{name} not Ready after {timeout:.0f}s; events:\n{events[-4000:]}")


# --- 6: the router on 127.0.0.1 ------------------------------------------------------------

def port_forward(kube: Kube, state: Path, name: str, namespace: str) -> str:
    """`kubectl port-forward` to the router Service, recorded in the test bed's pids so that
    `hack/cluster.sh down` stops it with everything else."""
    port = cluster.free_port()
    sup = cluster.Supervisor(state)
    sup.start(f"port-forward-{namespace}-{name}", [
        str(kube.bins / "kubectl"), f"--kubeconfig={state / 'kubeconfig'}", "port-forward", "-n", namespace,
        f"service/{name}", f"{port}:{ROUTER_PORT}", "--address", "127.0.0.1"])
    url = f"http://127.0.0.1:{port}/v1"
    cluster.wait_for("the router through port-forward",
                     lambda: urllib.request.urlopen(f"{url}/models", timeout=3).status == 200, sup, timeout=60)
    return url


# --- teardown ------------------------------------------------------------------------------

def teardown(kube: Kube, state: Path, info: dict, started_cluster: bool) -> int:  # type: ignore[type-arg]
    if started_cluster:
        return subprocess.run([str(HERE / "cluster.sh"), "down", "--state", str(state)]).returncode
    # A test bed we found running stays up: remove only what this run added to it.
    kube.kubectl("delete", "namespace", info["namespace"], "--ignore-not-found", "--wait=true", check=False)
    kube.kubectl("delete", "pv", f"{info['namespace']}-model", "--ignore-not-found", check=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/e2e.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model folder (tandem make-tiny-model DIR)")
    parser.add_argument("--keep", action="store_true", help="leave everything up (until hack/cluster.sh down)")
    parser.add_argument("--state", type=Path, default=None, help="test bed state folder (default: hack/cluster.sh's)")
    parser.add_argument("--namespace", default="tandem-e2e")
    parser.add_argument("--name", default="e2e", help="the DisaggregatedModel's name")
    parser.add_argument("--model-name", default="tiny", help="the served model name")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for Ready")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    model = args.model.resolve()
    check_model_dir(model)
    state = (args.state or cluster.default_state_dir()).resolve()
    started = ensure_cluster(state)
    kube = Kube(state)
    timings = {"cluster": round(time.monotonic() - t0, 1)}
    build_and_load_images(state)
    timings["images"] = round(time.monotonic() - t0 - timings["cluster"], 1)
    prometheus_url = start_prometheus(state)
    install_chart(kube, prometheus_url)
    # PodSecurity `restricted` enforced by the real apiserver: every pod the operator makes here
    # (tcp workers, router) must pass it or it is refused at admission.
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": args.namespace, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    kube.apply(*model_volume(args.namespace, model))
    withdraw_rdma(kube)
    t_apply = time.monotonic()
    kube.apply(resource(args.name, args.namespace, args.model_name))
    history = wait_ready(kube, args.name, args.namespace, args.timeout)
    timings["ready_after_apply"] = round(time.monotonic() - t_apply, 1)
    url = port_forward(kube, state, args.name, args.namespace)
    timings["total_setup"] = round(time.monotonic() - t0, 1)
    info = {"state": str(state), "kubeconfig": str(state / "kubeconfig"), "namespace": args.namespace,
            "name": args.name, "model_name": args.model_name, "model_dir": str(model), "router": url,
            "operator_namespace": OPERATOR_NAMESPACE, "node": real_node.NODE_NAME, "prometheus": prometheus_url,
            "pvc": MODEL_CLAIM,
            "condition_history": history, "timings": timings, "started_cluster": started}
    (state / "e2e.json").write_text(json.dumps(info, indent=1))
    log(f"ready: setup took {timings}")
    print(f"router: {url}", flush=True)
    if args.keep:
        return 0
    checks = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v",
                             str(REPO / "tests" / "e2e")],
                            env=dict(os.environ, TANDEM_E2E_STATE=str(state)), cwd=REPO)
    torn = teardown(kube, state, info, started)
    log(f"checks exit {checks.returncode}, teardown exit {torn}; {time.monotonic() - t0:.0f}s in all")
    return checks.returncode or torn


if __name__ == "__main__":
    sys.exit(main())
