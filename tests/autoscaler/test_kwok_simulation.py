"""The simulation on the local control plane: kwok GPU pools, the load model, Prometheus, the timer.

Real kube-apiserver, scheduler and controller-manager; kwok nodes with 8 GPUs each (4 prefill
nodes, 8 decode nodes, hack/cluster-nodes.json). Each worker pod asks for 8 GPUs, so the
prefill pool holds at most 4 pods and the scheduler leaves the fifth Pending/Unschedulable.
hack/load_model.py reads the Deployments' readyReplicas and serves the worker metrics; Debian's
Prometheus scrapes it; every autoscaler interval this test runs the timer body and writes the
result to the Deployments' scale, standing in for the operator's reconcile (which applies
status.<pool>.desiredReplicas the same way).

Time is compressed 10x: the load model replays the step trace 10x faster with 10x the
per-replica throughput, and the autoscaler's clock runs 10x faster, so every window, cooldown
and back-off of the policy shrinks with it (15 s interval -> 1.5 s, 120 s down window -> 12 s).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOAD_MODEL = Path(__file__).resolve().parents[2] / "hack" / "load_model.py"
NS, MODEL = "autoscale-sim", "sim-model"
K = 10.0  # simulated seconds per real second
INTERVAL, DOWN_WINDOW, MAX = 15.0, 120, 12
STEP_AT, STEP_FOR, AFTER = 45.0, 120.0, 240.0  # simulated seconds
CAPACITY = {"prefill": 4, "decode": 8}  # nodes x 8 GPUs / 8 GPUs per pod


def deployment(pool: str) -> dict[str, Any]:
    name = f"sim-{pool}"
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"tandem.dev/pool": pool},
                    "tolerations": [{"key": "tandem.dev/pool", "operator": "Equal", "value": pool,
                                     "effect": "NoSchedule"}],
                    "containers": [{"name": "worker", "image": "tandem/worker:sim",
                                    "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
                },
            },
        },
    }


def spec() -> DisaggregatedModelSpec:
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": MAX, "scaleDownStabilizationSeconds": DOWN_WINDOW}
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": MODEL, "source": {"path": "/models/sim"}},
        "prefill": {"replicas": 1, "autoscaling": {**auto, "targetQueueDepth": 2}},
        "decode": {"replicas": 1, "autoscaling": {**auto, "targetKVUtilization": 0.75}},
        "slo": {"ttftMs": 3000, "itlMs": 50},
        "ratio": {"minPrefillPerDecode": 0.25, "maxPrefillPerDecode": 4},
    })


class Pools:
    """The two Deployments and their pods, through the Kubernetes Python client (fast enough for 1.5 s ticks)."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.apps, self.core, self.api = client.AppsV1Api(api), client.CoreV1Api(api), api

    def observe(self) -> tuple[dict[str, t.PoolCounts], dict[str, int], dict[str, int]]:
        counts, running, replicas = {}, {}, {}
        for pool in ("prefill", "decode"):
            dep = self.apps.read_namespaced_deployment(f"sim-{pool}", NS)
            pods = [self.api.sanitize_for_serialization(p) for p in
                    self.core.list_namespaced_pod(NS, label_selector=f"app=sim-{pool}").items]
            counts[pool] = t.PoolCounts(ready=int((dep.status and dep.status.ready_replicas) or 0),
                                        unschedulable=t.count_unschedulable(pods))
            running[pool] = sum(1 for p in pods if p["status"].get("phase") == "Running")
            replicas[pool] = int((dep.spec and dep.spec.replicas) or 0)
        return counts, running, replicas

    def scale(self, pool: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(f"sim-{pool}", NS, {"spec": {"replicas": replicas}})


def run_closed_loop(k8s_cluster: Any, prometheus: Any, load_args: list[str], duration: float) -> list[dict[str, Any]]:
    """Deployments + load model + Prometheus + a timer tick every INTERVAL simulated seconds."""
    k8s_cluster.kubectl("create", "namespace", NS)
    proc = None
    timeline: list[dict[str, Any]] = []
    try:
        for pool in ("prefill", "decode"):
            k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(deployment(pool)))
        pools = Pools(k8s_cluster.kubeconfig)
        deadline = time.monotonic() + 60
        while pools.observe()[0] != {p: t.PoolCounts(1) for p in ("prefill", "decode")}:
            assert time.monotonic() < deadline, "the starting pods never became ready"
            time.sleep(0.5)

        # Prometheus first, on the port the load model will take: its scrape manager applies new
        # targets only every 5 s, and the trace clock must not run while nobody scrapes.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        prom = prometheus([f"127.0.0.1:{port}"], extra_labels={"namespace": NS}, scrape_interval="500ms")
        deadline = time.monotonic() + 30
        while not prom.query("up"):
            assert time.monotonic() < deadline, "Prometheus never started scraping"
            time.sleep(0.2)
        proc = subprocess.Popen(
            [sys.executable, str(LOAD_MODEL), "serve", *load_args, "--port", str(port),
             "--prefill-tps", str(8000 * K), "--itl-base", str(0.015 / K), "--itl-per-seq", str(0.0004 / K),
             "--model", MODEL, "--tick", "0.1", "--kubeconfig", str(k8s_cluster.kubeconfig),
             "--deployment", f"prefill={NS}/sim-prefill", "--deployment", f"decode={NS}/sim-decode"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"load model exited: {proc.stderr.read() if proc.stderr else ''}"
        t0 = time.monotonic()  # the load model's trace clock started just before it printed

        def now() -> float:
            return (time.monotonic() - t0) * K

        source = sig.PrometheusSignals(prom.url, timeout_s=2, settings=sig.QuerySettings(rate_window="5s"))
        status: dict[str, Any] = {p: {"desiredReplicas": 1} for p in ("prefill", "decode")}
        state: dict[str, Any] | None = None
        next_tick = 0.0
        while now() < duration:
            if now() < next_tick:
                time.sleep(0.05)
                continue
            next_tick += INTERVAL
            counts, running, replicas = pools.observe()
            result = t.autoscale_tick(spec=spec(), status=status, namespace=NS, counts=counts,
                                      signals=source, clock=now, state=state)
            state = result.state
            for pool, n in result.desired.items():
                if n != replicas[pool]:
                    pools.scale(pool, n)
                status[pool] = {"desiredReplicas": n}
            timeline.append({"t": round(now(), 1), "desired": dict(result.desired), "running": running,
                             "unschedulable": {p: c.unschedulable for p, c in counts.items()},
                             "events": [(e.reason, e.message.split(":")[0]) for e in result.events],
                             "active": result.conditions[0].reason,
                             "why": result.conditions[0].message[:160]})
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        k8s_cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=60s", check=False)
    return timeline


def assert_invariants(timeline: list[dict[str, Any]]) -> str:
    """Metrics flowed, desired stayed within max and the ratio band, no pool ran beyond its nodes."""
    trace = "\n".join(json.dumps(p) for p in timeline)
    assert all(p["active"] == "ValidMetrics" for p in timeline if p["t"] >= 10), trace
    for p in timeline:
        d = p["desired"]
        assert max(d.values()) <= MAX, trace
        assert 0.25 * d["decode"] <= d["prefill"] <= 4 * d["decode"], trace
        assert all(p["running"][pool] <= CAPACITY[pool] for pool in CAPACITY), trace
    # Whenever more prefill pods were wanted than the nodes hold, they were given back next tick.
    for i, p in enumerate(timeline[:-1]):
        if p["desired"]["prefill"] > CAPACITY["prefill"]:
            assert ("ScaledBackUnschedulable", "prefill") in [tuple(e) for e in timeline[i + 1]["events"]] \
                or timeline[i + 1]["desired"]["prefill"] <= CAPACITY["prefill"], trace
    return trace


def moves(timeline: list[dict[str, Any]], pool: str, reason: str) -> list[float]:
    return [p["t"] for p in timeline if any(r == reason and what.startswith(pool) for r, what in p["events"])]


def test_five_x_step_on_kwok_gpu_pools(k8s_cluster: Any, prometheus: Any) -> None:
    timeline = run_closed_loop(
        k8s_cluster, prometheus,
        ["--trace", "step", "--step-shape", f"2,5,{STEP_AT},{STEP_FOR},{AFTER}", "--time-scale", str(K)],
        STEP_AT + STEP_FOR + AFTER)
    trace = assert_invariants(timeline)
    ups, downs = moves(timeline, "prefill", "ScaledUp"), moves(timeline, "prefill", "ScaledDown")
    assert ups and ups[0] <= STEP_AT + 2 * INTERVAL + 1, f"no scale-up within two intervals: {trace}"
    assert downs, f"prefill never scaled down after the step: {trace}"
    assert downs[0] - max(u for u in ups if u < downs[0]) >= DOWN_WINDOW - INTERVAL, trace
    assert timeline[-1]["desired"]["prefill"] == 1, trace


@pytest.mark.skipif(not Path("/work/shared/traces/mooncake_conversation.jsonl").exists(),
                    reason="the shared Mooncake trace is absent")
def test_mooncake_replay_on_kwok_gpu_pools(k8s_cluster: Any, prometheus: Any) -> None:
    # The first 10 minutes of the Mooncake conversation trace, 4x faster and with prompts and
    # outputs scaled to a quarter (as in docs/autoscaling.md), then the 10x of this test: 15 s.
    timeline = run_closed_loop(
        k8s_cluster, prometheus,
        ["--trace", "mooncake", "--time-scale", str(4 * K), "--length-scale", "0.25", "--limit", "15"],
        150.0)
    trace = assert_invariants(timeline)
    assert moves(timeline, "prefill", "ScaledUp"), f"the replay never needed more prefill: {trace}"
