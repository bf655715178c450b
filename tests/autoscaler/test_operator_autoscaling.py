"""The autoscaler wired into the real operator: `tandem operator --prometheus-url ... --autoscale-interval 2`.

Real parts: the local control plane (kube-apiserver, scheduler, controller-manager, kwok GPU
nodes), the operator as a subprocess, Debian's Prometheus, and hack/load_model.py serving the
worker metrics for as many replicas as the pools' Deployments have ready (so the loop closes
through Prometheus and the control plane, as with real workers). The load is constant at 4
req/s of 2,000/200-token requests against 4,000 prompt tokens/s per prefill replica and 20,000
KV tokens per decode replica: one replica of each pool is too few, so the prefill queue grows
and the decode KV cache fills.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.metrics import LABEL_RESOURCE
from tandem.worker.server.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_harness import OperatorProcess, autoscaled_resource, condition, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOAD_MODEL = REPO / "hack" / "load_model.py"
INTERVAL = 2
MODEL = "tiny-llama"
NAME = "auto"



class Bed:
    def __init__(self, cluster: Any, namespace: str, operator: OperatorProcess, prometheus: Any, port: int) -> None:
        self.cluster, self.namespace, self.operator, self.prometheus, self.port = (
            cluster, namespace, operator, prometheus, port)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.kubectl("get", kind, name, "-n", self.namespace, "-o", "json").stdout)  # type: ignore[no-any-return]

    def dm(self) -> dict[str, Any]:
        return self.get("dm", NAME)

    def replicas(self, pool: str) -> int:
        return int(self.get("deployment", f"{NAME}-{pool}")["spec"]["replicas"])

    def wait(self, what: str, probe: Any, timeout: float = 45) -> Any:
        return wait_for(what, probe, timeout=timeout, on_timeout=lambda: (
            f"--- status ---\n{json.dumps(self.dm().get('status'), indent=1)[-3000:]}\n"
            f"--- operator log ---\n{self.operator.log_tail(3000)}"))


@pytest.fixture
def bed(k8s_cluster: Any, prometheus: Any, tmp_path: Path) -> Iterator[Bed]:
    namespace = k8s_cluster.new_namespace("as")
    k8s_cluster.install_crds()
    # Prometheus first, on the port the load model will take (its scrape targets apply every 5 s);
    # it adds the namespace label as the Kubernetes scrape does.
    port = free_port()
    prom = prometheus([f"127.0.0.1:{port}"], extra_labels={"namespace": namespace, LABEL_RESOURCE: NAME},
                      scrape_interval="500ms")
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, tmp_path / "operator.log", k8s_cluster.env,
                               extra_args=("--prometheus-url", prom.url, "--autoscale-interval", str(INTERVAL)))
    operator.start()
    try:
        yield Bed(k8s_cluster, namespace, operator, prom, port)
    finally:
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def start_load(bed: Bed) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start() -> None:
        proc = subprocess.Popen(
            [sys.executable, str(LOAD_MODEL), "serve", "--trace", "step", "--step-shape", "4,1,0,600,0",
             "--prefill-tps", "4000", "--kv-tokens", "20000", "--model", MODEL, "--port", str(bed.port),
             "--tick", "0.2", "--kubeconfig", str(bed.cluster.kubeconfig),
             "--deployment", f"prefill={bed.namespace}/{NAME}-prefill",
             "--deployment", f"decode={bed.namespace}/{NAME}-decode"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline(), \
            f"load model exited: {proc.stderr.read() if proc.stderr else ''}"

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def metric(text: str, name: str, namespace: str, pool: str) -> float | None:
    want = f'{name}{{name="{NAME}",namespace="{namespace}",pool="{pool}"}} '
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return None


def test_operator_scales_on_queue_and_kv_and_holds_without_metrics(bed: Bed, start_load: Any) -> None:
    bed.cluster.kubectl("apply", "-n", bed.namespace, "-f", "-",
                        input=json.dumps(autoscaled_resource(NAME, MODEL, max_replicas=4)))
    bed.wait("both pools 1/1", lambda: ((d := bed.dm()).get("status", {}).get("prefill", {}).get("summary") == "1/1"
             and d["status"].get("decode", {}).get("summary") == "1/1") or None)

    # No worker metrics yet (the scrape target is down): the pools are held and a condition says why.
    active = bed.wait("ScalingActive=False/MetricsUnavailable before any metrics",
                      lambda: c if (c := condition(bed.dm(), "ScalingActive")).get("reason") == "MetricsUnavailable"
                      else None)
    assert active["status"] == "False" and "holding prefill at 1" in active["message"]
    assert (bed.replicas("prefill"), bed.replicas("decode")) == (1, 1)

    # The load arrives: the prefill queue grows and the decode KV cache fills; both pools scale up.
    start_load()
    dm = bed.wait("prefill and decode scaled up by the operator",
                  lambda: d if (d := bed.dm())["status"]["prefill"].get("desiredReplicas", 1) > 1
                  and d["status"]["decode"].get("desiredReplicas", 1) > 1 else None, timeout=60)
    prefill, decode = dm["status"]["prefill"], dm["status"]["decode"]
    assert "signal" in prefill["scaleReason"] and "vs target 2" in prefill["scaleReason"], prefill
    assert "vs target 0.5" in decode["scaleReason"] and decode["signal"] > 0, decode
    assert prefill["lastScaleTime"] and decode["lastScaleTime"]
    assert prefill["autoscalerState"]["recommendations"], "the policy's memory is kept in status"
    assert condition(dm, "ScalingActive")["reason"] == "ValidMetrics"
    # The reconcile applied the decisions to the Deployments, and the pools are at most at max.
    bed.wait("the Deployments at the autoscaler's counts", lambda: all(
        bed.replicas(p) == bed.dm()["status"][p]["desiredReplicas"] for p in ("prefill", "decode")) or None)
    assert all(1 < bed.replicas(p) <= 4 for p in ("prefill", "decode"))

    events = json.loads(bed.cluster.kubectl("get", "events", "-n", bed.namespace, "-o", "json").stdout)["items"]
    scaled = [e["message"] for e in events if e["reason"] == "ScaledUp" and e["involvedObject"]["name"] == NAME]
    assert any(m.startswith("prefill 1 -> ") for m in scaled), scaled
    # Decode scaled on KV pressure: the Event carries the KV usage it saw, above the 0.5 target.
    kv_seen = [float(found.group(1)) for m in scaled if m.startswith("decode 1 -> ")
               and (found := re.search(r"signal ([0-9.]+) vs target 0\.5", m))]
    assert kv_seen and kv_seen[0] > 0.5, scaled

    text = bed.operator.metrics()
    ns = bed.namespace
    for pool in ("prefill", "decode"):
        assert metric(text, "tandem_autoscaler_max_replicas", ns, pool) == 4
        assert (metric(text, "tandem_autoscaler_desired_replicas", ns, pool) or 0) > 1
        assert metric(text, "tandem_autoscaler_current_replicas", ns, pool) is not None
    assert metric(text, "tandem_autoscaler_target", ns, "decode") == 0.5
    assert (metric(text, "tandem_autoscaler_signal", ns, "prefill") or 0) > 0
    assert f'tandem_operator_reconcile_errors_total{{name="{NAME}",namespace="{ns}"}} 0.0' in text

    # Prometheus goes away: hold where the pools are, say so, never fall to minReplicas.
    bed.prometheus.proc.terminate()
    bed.prometheus.proc.wait(timeout=10)
    active = bed.wait("ScalingActive=False/MetricsUnavailable after Prometheus stopped",
                      lambda: c if (c := condition(bed.dm(), "ScalingActive")).get("reason") == "MetricsUnavailable"
                      else None, timeout=30)
    assert "Prometheus" in active["message"], active
    held = {p: bed.dm()["status"][p]["desiredReplicas"] for p in ("prefill", "decode")}
    time.sleep(3 * INTERVAL)
    assert {p: bed.dm()["status"][p]["desiredReplicas"] for p in ("prefill", "decode")} == held
    assert {p: bed.replicas(p) for p in ("prefill", "decode")} == held
    assert held["prefill"] > 1 and held["decode"] > 1
