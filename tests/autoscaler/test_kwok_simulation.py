"""The simulation through the real operator: kwok GPU pools, the load model, Prometheus, `tandem operator`.

Real parts: the local control plane (kube-apiserver, scheduler, controller-manager; kwok nodes
with 8 GPUs, 96 (prefill) or 64 (decode) CPUs each, 4 prefill and 8 decode nodes, hack/cluster-nodes.json), the operator as a
subprocess (`tandem operator --prometheus-url ... --autoscale-interval 2`), Debian's Prometheus,
and hack/load_model.py serving the worker metrics for as many replicas as the pools' Deployments
have ready, so the loop closes through Prometheus and the control plane. Each worker pod asks
for most of a node's CPUs (one GPU each: tensor parallelism is not built): the prefill nodes hold 4 pods and the scheduler leaves a fifth
Pending/Unschedulable. Nothing in this test writes a replica count; the operator does.

Time is compressed 10x against the modeled system (docs/autoscaling.md): each replica is 10x
faster (prefill 80,000 prompt tokens/s instead of 8,000; ITL 1.5 ms + 0.04 ms per running request
instead of 15 + 0.4), the step's arrivals come 10x faster, the SLOs are a tenth (TTFT 300 ms, ITL
5 ms), and so are the autoscaler's interval (2 s for 20 s), down window (16 s for 160 s) and
cooldown (4 s for 40 s), set in the DisaggregatedModel and on the operator's command line. The
policy's built-in delays (unschedulable back-off 300 s, SLO hold-off 60 s, start-up grace 120 s)
are not in the spec and stay in real seconds: inside this test they only mean "for the rest of it".
Decode has 40,000 KV tokens per replica and a KV target of 0.5, so the step fills it and decode
scales on KV pressure.

The two load shapes:
- a 5x step: 2 req/s (simulated) of 2,000/200-token requests for 80 s, 10 req/s for 240 s, 2 req/s
  after; in real time 20 req/s for 8 s, 100 req/s for 24 s, 20 req/s for 28 s;
- the Mooncake FAST'25 conversation trace: its first 10 minutes with arrivals 20x faster
  (30 real seconds) and prompt and output lengths scaled to a quarter (`--time-scale 20
  --length-scale 0.25 --limit 30`): about 66 req/s of ~3,300-token prompts, some 2.5 prefill
  replicas' worth on average, with the trace's own minute-to-minute swings.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.metrics import LABEL_RESOURCE
from tandem.worker.server.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_harness import OperatorProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOAD_MODEL = REPO / "hack" / "load_model.py"
MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")
POOLS = ("prefill", "decode")
MODEL, NAME = "sim-model", "sim"

K = 10.0  # the modeled system runs this many times slower than the test
INTERVAL, DOWN_WINDOW, COOLDOWN, MAX = 2, 16, 4, 6  # real seconds; replicas
RATIO = (0.25, 4.0)
CAPACITY = {"prefill": 4, "decode": 8}  # one pod per node: each asks for most of its CPUs (POD_CPUS)
POD_CPUS = {"prefill": "90", "decode": "60"}  # of 96 and 64
# The load model's KV usage tops out near 0.8 when decode is saturated (it frees and refills KV in
# whole requests between samples), so the target sits below that.
TARGET_KV = 0.5
SCRAPE_S = 0.5
STEP_BEFORE, STEP_DURING, STEP_AFTER = 8.0, 24.0, 28.0  # real seconds
REPLAY_S = 30.0
LOAD_CAPACITY = ["--prefill-tps", str(8000 * K), "--itl-base", str(0.015 / K), "--itl-per-seq",
                 str(0.0004 / K), "--kv-tokens", "40000"]


def resource() -> dict[str, Any]:
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": MAX,
            "scaleDownStabilizationSeconds": DOWN_WINDOW, "cooldownSeconds": COOLDOWN}
    return {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "metadata": {"name": NAME},
        "spec": {
            "model": {"name": MODEL, "source": {"path": "/models/sim"}},
            # maxScaleUpPods 8: one decision may ask for more than maxReplicas and than the nodes hold.
            "prefill": {"replicas": 1, "resources": {"requests": {"cpu": POD_CPUS["prefill"]}},
                        "autoscaling": {**auto, "targetQueueDepth": 2, "maxScaleUpPods": 8}},
            "decode": {"replicas": 1, "resources": {"requests": {"cpu": POD_CPUS["decode"]}},
                       "autoscaling": {**auto, "targetKVUtilization": TARGET_KV}},
            "slo": {"ttftMs": int(3000 / K), "itlMs": int(50 / K)},
            "ratio": {"minPrefillPerDecode": RATIO[0], "maxPrefillPerDecode": RATIO[1]},
        },
    }


# --------------------------------------------------------------------------- observing the cluster

@dataclass
class Sample:
    """What a user could read at one moment: status, Deployments, pods, conditions."""

    t: float  # wall clock, time.time()
    desired: dict[str, int]  # status.<pool>.desiredReplicas
    deployment: dict[str, int]  # the Deployments' spec.replicas
    ready: dict[str, int]  # the Deployments' status.readyReplicas
    running: dict[str, int]  # pods Running
    unschedulable: dict[str, int]  # pods Pending/Unschedulable
    active: str  # ScalingActive reason
    limited: tuple[str, str]  # ScalingLimited (status, reason)
    recommendations: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    signal: dict[str, float | None] = field(default_factory=dict)  # status.<pool>.signal
    reason: dict[str, str] = field(default_factory=dict)  # status.<pool>.scaleReason

    def row(self, t0: float) -> str:
        return (f"{self.t - t0:6.1f}s status {self.desired} deploy {self.deployment} ready {self.ready} "
                f"running {self.running} unsched {self.unschedulable} signal {self.signal} {self.active} "
                f"limited={self.limited}")


@dataclass(frozen=True)
class Scale:
    t: float
    pool: str
    reason: str  # ScaledUp | ScaledDown | ScaledBackUnschedulable
    before: int
    after: int
    message: str


class Cluster:
    """Reads through the Kubernetes Python client (fast enough to sample a few times per interval)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.custom, self.apps, self.core = client.CustomObjectsApi(api), client.AppsV1Api(api), client.CoreV1Api(api)
        self.namespace = namespace

    @staticmethod
    def _raw(call: Any, *args: Any, **kwargs: Any) -> Any:
        return json.loads(call(*args, _preload_content=False, **kwargs).data)

    def dm(self) -> dict[str, Any]:
        return self._raw(self.custom.get_namespaced_custom_object,  # type: ignore[no-any-return]
                         "tandem.dev", "v1alpha1", self.namespace, "disaggregatedmodels", NAME)

    def sample(self) -> Sample:
        dm = self.dm()
        status = dm.get("status") or {}
        deps = {d["metadata"]["name"]: d for d in
                self._raw(self.apps.list_namespaced_deployment, self.namespace)["items"]}
        pods = self._raw(self.core.list_namespaced_pod, self.namespace)["items"]
        conds = {c["type"]: c for c in status.get("conditions") or []}
        out = Sample(time.time(), {}, {}, {}, {}, {}, conds.get("ScalingActive", {}).get("reason", ""),
                     (conds.get("ScalingLimited", {}).get("status", ""), conds.get("ScalingLimited", {}).get("reason", "")))
        for pool in POOLS:
            dep = deps.get(f"{NAME}-{pool}") or {}
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == pool
                    and not p["metadata"].get("deletionTimestamp")]
            pool_status = status.get(pool) or {}
            out.desired[pool] = int(pool_status.get("desiredReplicas", 0))
            out.deployment[pool] = int((dep.get("spec") or {}).get("replicas", 0))
            out.ready[pool] = int((dep.get("status") or {}).get("readyReplicas", 0))
            out.running[pool] = sum(1 for p in mine if p["status"].get("phase") == "Running")
            out.unschedulable[pool] = sum(1 for p in mine if any(
                c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in p["status"].get("conditions") or []))
            recs = (pool_status.get("autoscalerState") or {}).get("recommendations") or []
            out.recommendations[pool] = [(float(t), int(r)) for t, r in recs]
            out.signal[pool] = pool_status.get("signal")
            out.reason[pool] = str(pool_status.get("scaleReason", ""))
        return out

    def scales(self) -> list[Scale]:
        """The operator's scaling Events, with their microsecond eventTime."""
        found = []
        for e in self._raw(self.core.list_namespaced_event, self.namespace)["items"]:
            match = re.match(r"^(prefill|decode) (\d+) -> (\d+):", e.get("message") or "")
            if e["involvedObject"].get("name") != NAME or not match or not e.get("eventTime"):
                continue
            at = datetime.fromisoformat(e["eventTime"].replace("Z", "+00:00")).timestamp()
            found.append(Scale(at, match[1], e["reason"], int(match[2]), int(match[3]), e["message"]))
        return sorted(found, key=lambda s: s.t)


@dataclass
class Bed:
    cluster: Any
    namespace: str
    operator: OperatorProcess
    port: int
    view: Cluster


@pytest.fixture
def bed(k8s_cluster: Any, prometheus: Any, tmp_path: Path) -> Iterator[Bed]:
    """A namespace, Prometheus scraping the load model's port, the operator, and a 1/1 DisaggregatedModel."""
    namespace = k8s_cluster.new_namespace("sim")
    k8s_cluster.install_crds()
    # Prometheus first, on the port the load model will take: its scrape targets apply every 5 s,
    # and the load trace's clock must not run while nobody scrapes. It adds the namespace label
    # as the Kubernetes scrape does.
    port = free_port()
    prom = prometheus([f"127.0.0.1:{port}"], extra_labels={"namespace": namespace, LABEL_RESOURCE: NAME},
                      scrape_interval=f"{SCRAPE_S * 1000:.0f}ms")
    env = dict(k8s_cluster.env, TANDEM_AUTOSCALER_RATE_WINDOW="5s")  # the latency quantiles' window, compressed
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, tmp_path / "operator.log", env,
                               extra_args=("--prometheus-url", prom.url, "--autoscale-interval", str(INTERVAL)))
    operator.start()
    try:
        view = Cluster(k8s_cluster.kubeconfig, namespace)
        k8s_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(resource()))
        wait_for("both pools 1/1 and Prometheus scraping", lambda: (
            all(((view.dm().get("status") or {}).get(p) or {}).get("summary") == "1/1" for p in POOLS)
            and bool(prom.query("up"))) or None, timeout=60, on_timeout=operator.log_tail)
        yield Bed(k8s_cluster, namespace, operator, port, view)
    finally:
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# --------------------------------------------------------------------------- running a scenario

@dataclass
class Run:
    t0: float  # wall clock when the load model's trace clock started
    samples: list[Sample]
    scales: list[Scale]
    log: str

    def recommendations(self) -> dict[float, dict[str, int]]:
        """Every autoscaler tick that had a signal, with each pool's raw recommendation (the policy
        memory the operator keeps in status.<pool>.autoscalerState)."""
        out: dict[float, dict[str, int]] = {}
        for sample in self.samples:
            for pool, recs in sample.recommendations.items():
                for t, rec in recs:
                    out.setdefault(t, {})[pool] = rec
        return dict(sorted(out.items()))

    def ticks(self) -> list[float]:
        return list(self.recommendations())

    def tick_period(self) -> float:
        gaps = [b - a for a, b in itertools.pairwise(self.ticks()) if b - a > 0.5]
        return statistics.median(gaps) if gaps else float(INTERVAL)

    def scale_lines(self) -> str:
        return "\n".join(f"{s.t - self.t0:6.1f}s {s.reason} {s.pool} {s.before} -> {s.after}" for s in self.scales)

    def trace(self) -> str:
        ticks = "\n".join(f"{t - self.t0:6.1f}s {recs}" for t, recs in self.recommendations().items())
        rows = "\n".join(s.row(self.t0) for s in self.samples[::2])
        return (f"--- scaling events ---\n{self.scale_lines()}\n--- ticks: raw recommendations ---\n{ticks}\n"
                f"--- samples ---\n{rows}\n--- operator log ---\n{self.log}")


def run_load(bed: Bed, load_args: list[str], duration: float, settle_timeout: float) -> Run:
    """Start the load model, sample the cluster for `duration` s, then until both pools are back at 1."""
    errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed below; a pipe could fill and block it)
    proc = subprocess.Popen(
        [sys.executable, str(LOAD_MODEL), "serve", *load_args, *LOAD_CAPACITY, "--model", MODEL,
         "--port", str(bed.port), "--tick", "0.1", "--kubeconfig", str(bed.cluster.kubeconfig),
         "--deployment", f"prefill={bed.namespace}/{NAME}-prefill",
         "--deployment", f"decode={bed.namespace}/{NAME}-decode"],
        stdout=subprocess.PIPE, stderr=errors, text=True)

    def exited() -> str:
        errors.seek(0)
        return f"load model exited ({proc.poll()}): {errors.read()[-3000:]}"

    samples: list[Sample] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline(), exited()
        t0 = time.time()  # its trace clock started just before it printed
        settled_since: float | None = None
        while True:
            assert proc.poll() is None, exited()
            sample = bed.view.sample()
            samples.append(sample)
            at_one = all(sample.desired[p] == sample.deployment[p] == sample.ready[p] == 1 for p in POOLS)
            if sample.t - t0 >= duration and at_one:
                settled_since = settled_since or sample.t
                if sample.t - settled_since >= INTERVAL:  # stays there for a tick
                    break
            else:
                settled_since = None
            if sample.t - t0 > duration + settle_timeout:
                break  # the assertions say what was wrong
            time.sleep(0.25)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        errors.close()
    return Run(t0, samples, bed.view.scales(), bed.operator.log_tail(3000))


def summary(run: Run, title: str) -> str:
    final = run.samples[-1]
    ups = [s for s in run.scales if s.reason == "ScaledUp"]
    peak = {p: max(s.desired[p] for s in run.samples) for p in POOLS}
    return (f"{title}: autoscaler tick every {run.tick_period():.2f}s (interval {INTERVAL}s), "
            f"{len(run.scales)} scaling events, {len(ups)} up; peak status desired {peak}; "
            f"final {final.desired} after {final.t - run.t0:.0f}s\n{run.scale_lines()}")


# --------------------------------------------------------------------------- what must hold

def assert_invariants(run: Run) -> str:
    """Metrics flowed; status and Deployments stayed within max and the ratio band and agreed within a tick; no pool
    ran beyond its nodes; pods that could not be placed were given back; every scale-down came a full window after
    the pool's last scale-up on its own signal; at the end both pools are back at 1, in status and on the Deployments."""
    trace = run.trace()
    valid = [i for i, s in enumerate(run.samples) if s.active == "ValidMetrics"]
    assert valid, f"the autoscaler never had metrics: {trace}"
    assert all(s.active == "ValidMetrics" for s in run.samples[valid[0]:]), f"metrics dropped out: {trace}"
    lo, hi = RATIO
    for s in run.samples:
        for pool in POOLS:
            assert 1 <= s.desired[pool] <= MAX and s.deployment[pool] <= MAX, f"outside [1, {MAX}] at {s.row(run.t0)}\n{trace}"
            assert s.running[pool] <= CAPACITY[pool], f"more {pool} pods than its nodes hold: {trace}"
        # Both counts come from one status patch; the reconcile applies them to the two Deployments.
        assert lo * s.desired["decode"] <= s.desired["prefill"] <= hi * s.desired["decode"], \
            f"status outside the P:D band {RATIO} at {s.row(run.t0)}\n{trace}"
        if s.deployment == s.desired:
            assert lo * s.deployment["decode"] <= s.deployment["prefill"] <= hi * s.deployment["decode"], trace
    # The reconcile applies each decision to the Deployment at once (well within a tick), and a
    # Deployment asks for more pods than the nodes hold only until the next tick or the one after.
    lag, limit = run.tick_period() + 1.0, 2 * run.tick_period() + 1.0
    apart_since: dict[str, float | None] = {p: None for p in POOLS}
    over_since: dict[str, float | None] = {p: None for p in POOLS}
    for s in run.samples:
        for pool in POOLS:
            if s.deployment[pool] != s.desired[pool]:
                since = apart_since[pool] = apart_since[pool] or s.t
                assert s.t - since <= lag, f"{pool} Deployment lagged status for over {lag:.1f}s: {trace}"
            else:
                apart_since[pool] = None
            if s.deployment[pool] > CAPACITY[pool]:
                since = over_since[pool] = over_since[pool] or s.t
                assert s.t - since <= limit, f"{pool} kept unplaceable pods for over {limit:.1f}s: {trace}"
            else:
                over_since[pool] = None
    final = run.samples[-1]
    assert not any(final.unschedulable.values()), f"pods left Unschedulable: {trace}"
    for pool in POOLS:
        # Moves on the pool's own signal; the P:D band may raise or lower a pool regardless of its window.
        ups = [s.t for s in run.scales if s.pool == pool and s.reason == "ScaledUp"
               and f"{pool} raised to" not in s.message]
        for down in (s.t for s in run.scales if s.pool == pool and s.reason == "ScaledDown"
                     and f"{pool} lowered to" not in s.message):
            before = [u for u in ups if u < down]
            if before:
                assert down - before[-1] >= DOWN_WINDOW - 1.0, \
                    f"{pool} scaled down {down - before[-1]:.1f}s after scaling up (window {DOWN_WINDOW}s): {trace}"
    # Back at the minimum, in status and on the Deployments, after the load is gone and a window passed.
    assert all(final.desired[p] == final.deployment[p] == final.ready[p] == 1 for p in POOLS), \
        f"the pools did not scale back down to 1: {trace}"
    assert final.limited[0] == "False", f"still ScalingLimited at the end: {trace}"
    return trace


def nth_tick_after(run: Run, at: float, n: int) -> float:
    later = [t for t in run.ticks() if t > at]
    assert len(later) >= n, f"fewer than {n} ticks after {at - run.t0:.1f}s: {run.trace()}"
    return later[n - 1]


# --------------------------------------------------------------------------- the scenarios

def test_five_x_step_through_the_operator(bed: Bed) -> None:
    shape = f"2,5,{STEP_BEFORE * K:g},{STEP_DURING * K:g},{STEP_AFTER * K:g}"
    run = run_load(bed, ["--trace", "step", "--step-shape", shape, "--time-scale", str(K)],
                   STEP_BEFORE + STEP_DURING + STEP_AFTER, settle_timeout=40)
    print(f"\n5x step, time compressed {K:g}x (step shape {shape} simulated s, --time-scale {K:g}, "
          f"replicas {K:g}x faster)\n" + summary(run, "step"))
    trace = assert_invariants(run)
    step = run.t0 + STEP_BEFORE

    # Both pools scale up within two autoscaler ticks of the step (counted from when Prometheus could see it).
    for pool in POOLS:
        ups = [s for s in run.scales if s.pool == pool and s.reason == "ScaledUp" and s.t > step]
        assert ups, f"{pool} never scaled up after the step: {trace}"
        deadline = nth_tick_after(run, step + SCRAPE_S, 2) + 1.0  # +1 s: the tick's own queries and writes
        assert ups[0].t <= deadline, (f"{pool} scaled up {ups[0].t - step:.1f}s after the step, later than two "
                                      f"ticks ({deadline - step:.1f}s): {trace}")
        print(f"{pool}: first scale-up {ups[0].before} -> {ups[0].after} {ups[0].t - step:.1f}s after the step")
    # The Deployments and status agreed at a scaled-up count during the step.
    assert any(s.deployment[p] == s.desired[p] > 1 for s in run.samples for p in POOLS), trace

    # Prefill asked for more pods than its 4 nodes hold: Unschedulable -> ScalingLimited -> given back.
    assert any(s.unschedulable["prefill"] for s in run.samples), f"the step never reached the prefill capacity: {trace}"
    assert any(s.limited == ("True", "Unschedulable") for s in run.samples), trace
    backs = [s for s in run.scales if s.pool == "prefill" and s.reason == "ScaledBackUnschedulable"]
    assert backs and backs[0].after == CAPACITY["prefill"], trace
    assert all(s.desired["prefill"] <= CAPACITY["prefill"] for s in run.samples if s.t > backs[0].t + 1.0), trace

    # Back down once the step is over and the window has passed, not before.
    end = step + STEP_DURING
    last_down = max(s.t for s in run.scales if s.pool == "prefill" and s.reason == "ScaledDown")
    assert last_down >= end, f"prefill was not scaled down after the step ended: {trace}"
    print(f"prefill back at 1 {last_down - end:.1f}s after the step ended (window {DOWN_WINDOW}s)")


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the shared Mooncake trace is absent ({MOONCAKE})")
def test_mooncake_replay_through_the_operator(bed: Bed) -> None:
    run = run_load(bed, ["--trace", "mooncake", "--time-scale", "20", "--length-scale", "0.25",
                         "--limit", str(REPLAY_S)], REPLAY_S, settle_timeout=45)
    print(f"\nMooncake replay: first {REPLAY_S * 20 / 60:g} min of the trace, arrivals 20x faster "
          f"({REPLAY_S:g}s), lengths x0.25, replicas {K:g}x faster\n" + summary(run, "mooncake"))
    trace = assert_invariants(run)
    during = [s for s in run.scales if s.t < run.t0 + REPLAY_S]
    for pool in POOLS:
        assert any(s.pool == pool and s.reason == "ScaledUp" for s in during), \
            f"the replay never needed more {pool}: {trace}"
    assert any(s.deployment["prefill"] == s.desired["prefill"] > 1 for s in run.samples), trace
