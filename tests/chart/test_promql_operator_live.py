"""Every dashboard and rule expression that reads the operator's metrics returns data from a real
Prometheus scraping the real operator.

Real parts: the local control plane (fixture k8s_cluster), `tandem operator` as a subprocess with
its autoscaler on (--prometheus-url, --autoscale-interval), Debian's Prometheus, and
hack/load_model.py serving worker metrics for as many replicas as the pools' Deployments have
ready. The load is too much for one replica of each pool, so the autoscaler scales both pools up
and the scale-event, signal, target and replica series all exist.

Prometheus scrapes the two the way the chart does:
- the operator as the chart's ServiceMonitor would: with honor_labels, and with the target label
  `namespace` set to the operator's own namespace, which the series' own `namespace` label (the
  DisaggregatedModel's) must win over;
- the load model as the chart's PodMonitor would: target labels `namespace` and
  `tandem_dev_model` (the pods' tandem.dev/model label, the DisaggregatedModel's name).
tests/chart/test_promql_live.py covers the expressions that read only worker series.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_inventory as inventory
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_harness import OperatorProcess, autoscaled_resource, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOAD_MODEL = REPO / "hack" / "load_model.py"
NAME = "obs"  # the DisaggregatedModel
MODEL = "tiny-llama"  # the served model name
OPERATOR_NAMESPACE = "tandem-system"  # where the chart installs the operator: its scrape target's namespace
AUTOSCALE_INTERVAL = 2
# Alerts that must be quiet once the pools have settled: they fire here only on a label mismatch.
QUIET_WHEN_HEALTHY = ("TandemWorkersDown",)



def scrape_config(workers: str, operator: str, namespace: str) -> dict[str, Any]:
    """Two jobs labelled as the chart's PodMonitor (workers) and ServiceMonitor (operator) label them."""
    return {
        "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
        "scrape_configs": [
            {"job_name": "tandem-workers", "static_configs": [
                {"targets": [workers], "labels": {"namespace": namespace, "tandem_dev_model": NAME}}]},
            {"job_name": "tandem-operator", "honor_labels": True, "static_configs": [
                {"targets": [operator], "labels": {"namespace": OPERATOR_NAMESPACE}}]},
        ],
    }


def reconfigure(prom: Any, config: dict[str, Any]) -> None:
    """Replace the fixture's one-job config and reload (it runs with --web.enable-lifecycle)."""
    (prom.workdir / "prometheus.yml").write_text(json.dumps(config))
    request = urllib.request.Request(f"{prom.url}/-/reload", method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200, f"Prometheus refused the new config: {resp.status}"


@dataclass
class Bed:
    cluster: Any
    namespace: str
    operator: OperatorProcess
    prom: Any
    load_port: int
    load_log: Path

    def dm(self) -> dict[str, Any]:
        return self.cluster.kubectl_json("get", "dm", NAME, "-n", self.namespace)  # type: ignore[no-any-return]

    def diagnostics(self) -> str:
        return (f"--- status ---\n{json.dumps(self.dm().get('status'), indent=1)[-2000:]}\n"
                f"--- operator log ---\n{self.operator.log_tail(2000)}\n"
                f"--- load model log ---\n{self.load_log.read_text(errors='replace')[-1000:]}")


@pytest.fixture
def bed(k8s_cluster: Any, prometheus: Any, tmp_path: Path) -> Iterator[Bed]:
    namespace = k8s_cluster.new_namespace("pq")
    k8s_cluster.install_crds()
    load_port = free_port()
    # The operator needs Prometheus's URL to start and Prometheus the operator's metrics port:
    # start Prometheus, then the operator, then give Prometheus both jobs.
    prom = prometheus([f"127.0.0.1:{load_port}"], scrape_interval="500ms")
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, tmp_path / "operator.log", k8s_cluster.env,
                               extra_args=("--prometheus-url", prom.url,
                                           "--autoscale-interval", str(AUTOSCALE_INTERVAL)))
    operator.start()
    try:
        reconfigure(prom, scrape_config(f"127.0.0.1:{load_port}", f"127.0.0.1:{operator.metrics_port}", namespace))
        yield Bed(k8s_cluster, namespace, operator, prom, load_port, tmp_path / "load_model.log")
    finally:
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def load(bed: Bed) -> Iterator[None]:
    """4 req/s of 2,000/200-token requests: more than one prefill and one decode replica can take."""
    with bed.load_log.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(LOAD_MODEL), "serve", "--trace", "step", "--step-shape", "4,1,0,600,0",
             "--prefill-tps", "4000", "--kv-tokens", "20000", "--model", MODEL, "--port", str(bed.load_port),
             "--tick", "0.2", "--kubeconfig", str(bed.cluster.kubeconfig),
             "--deployment", f"prefill={bed.namespace}/{NAME}-prefill",
             "--deployment", f"decode={bed.namespace}/{NAME}-decode"],
            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline(), \
            f"load model exited: {bed.load_log.read_text()}"
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def operator_queries() -> list[inventory.PromQL]:
    queries = inventory.all_queries()
    records = inventory.record_needs(queries)
    return [q for q in queries if "operator" in q.needs(records)]


def test_every_operator_expression_returns_data(bed: Bed, load: None) -> None:
    bed.cluster.kubectl("apply", "-n", bed.namespace, "-f", "-",
                        input=json.dumps(autoscaled_resource(NAME, MODEL, max_replicas=3)))
    # Both pools scale up under the load: scale events, signals and targets exist for both.
    wait_for("the operator to scale both pools up", lambda: all(
        (bed.dm().get("status", {}).get(pool) or {}).get("desiredReplicas", 1) > 1 for pool in ("prefill", "decode"))
        or None, timeout=60, on_timeout=bed.diagnostics)
    bed.prom.wait_for_targets_up()
    for pool in ("prefill", "decode"):
        # Selected by resource name only, so that a namespace mismatch shows up in the expressions below.
        wait_for(f"Prometheus to scrape a {pool} scale-up", lambda pool=pool: bed.prom.query(
            f'tandem_autoscaler_scale_events_total{{name="{NAME}", pool="{pool}", direction="up"}}')
            or None, timeout=20, on_timeout=bed.diagnostics)
    time.sleep(1.5)  # a few more scrapes, so rate() and increase() have two samples of every series

    queries = operator_queries()
    assert len(queries) >= 15, f"expected the operator dashboard and rules, found {len(queries)} expressions"
    variables = {"namespace": bed.namespace, "model": MODEL, "resource": NAME}
    empty = []
    for q in queries:  # every one can return data here: no allow-list
        for selector in inventory.selectors(q.expr):
            if not bed.prom.query(inventory.render(selector, variables)):
                empty.append(f"{q.source}: selector {selector}")
        if q.kind == "alert":
            bed.prom.query(inventory.render(q.expr, variables))  # must run; fires only when something is wrong
        elif not bed.prom.query(inventory.render(q.expr, variables, rate_interval="5m")):
            empty.append(f"{q.source}: {q.expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)

    # Joins across the two jobs: with matching labels these alerts go quiet once every pod is ready;
    # a label mismatch between worker and operator series makes them fire for ever.
    quiet = [q for q in queries if q.kind == "alert" and q.source.rsplit(" ", 1)[1] in QUIET_WHEN_HEALTHY]
    assert len(quiet) == len(QUIET_WHEN_HEALTHY), f"alerts {QUIET_WHEN_HEALTHY} not all in the rules"
    for q in quiet:
        expr = inventory.render(q.expr, variables)
        wait_for(f"{q.source} to be quiet with every pod ready", lambda expr=expr: not bed.prom.query(expr) or None,
                 timeout=30, on_timeout=lambda expr=expr: f"it returns {bed.prom.query(expr)}\n{bed.diagnostics()}")
