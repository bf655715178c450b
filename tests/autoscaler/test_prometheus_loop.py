"""The autoscaler's signals through a real Prometheus scraping a real load-model process.

hack/load_model.py serve plays the workers (it exposes the worker metrics for as many replicas as
the replicas file says are ready); Debian's prometheus scrapes it every second and adds the
`namespace` label as the Kubernetes scrape does; the timer body reads it with PrometheusSignals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec
from tandem.worker import metrics as m

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOAD_MODEL = Path(__file__).resolve().parents[2] / "hack" / "load_model.py"
NAMESPACE, MODEL = "team-a", "tiny-llama"


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def load_model_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"prefill": 2, "decode": 2}))
    # 2 req/s of 2000-token prompts against 2 replicas at 1000 tokens/s: the queue grows ~1/s.
    proc = subprocess.Popen(
        [sys.executable, str(LOAD_MODEL), "serve", "--trace", "step", "--prefill-tps", "1000",
         "--model", MODEL, "--replicas-file", str(replicas), "--port", "0", "--tick", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"load model exited: {proc.stderr.read() if proc.stderr else ''}")
        yield proc, int(json.loads(line)["port"]), replicas
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def spec() -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": MODEL, "source": {"path": "/models/tiny"}},
        "prefill": {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6, "targetQueueDepth": 1}},
        "decode": {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6}},
    })


def test_signals_decisions_and_a_prometheus_outage(prometheus: Any, load_model_server: Any) -> None:
    proc, port, replicas = load_model_server
    prom = prometheus([f"127.0.0.1:{port}"], extra_labels={"namespace": NAMESPACE})
    source = sig.PrometheusSignals(prom.url, timeout_s=3)
    prefill_sel = sig.Selector(NAMESPACE, MODEL, "prefill")

    got = wait_for("prefill queue and TTFT in Prometheus", lambda: (
        s if {sig.QUEUE_REQUESTS, sig.LATENCY_P} <= set((s := source.fetch("prefill", prefill_sel)).values)
        and s.values[sig.QUEUE_REQUESTS] > 0 else None))
    assert 0 < got.values[sig.QUEUE_TOKENS] / got.values[sig.QUEUE_REQUESTS] <= 2000
    assert got.values[sig.LATENCY_P] > 0
    series = prom.query(f'{m.PREFILL_QUEUE_REQUESTS.name}{{namespace="{NAMESPACE}"}}')
    assert len(series) == 2, "one series per ready prefill replica"
    assert {s["metric"][m.LABEL_POOL] for s in series} == {"prefill"}
    decode = source.fetch("decode", sig.Selector(NAMESPACE, MODEL, "decode"))
    assert 0 <= decode.values[sig.KV_USAGE] <= 1
    other = source.fetch("prefill", sig.Selector("another-namespace", MODEL, "prefill"))
    assert other.get(sig.QUEUE_REQUESTS) is None, "the namespace filter holds"

    # A tick on the growing queue scales prefill up; the load model sees the new pods as ready.
    counts = {"prefill": t.PoolCounts(2), "decode": t.PoolCounts(2)}
    result = t.autoscale_tick(spec=spec(), status=None, namespace=NAMESPACE, counts=counts,
                              signals=source, clock=time.time)
    assert result.desired["prefill"] > 2, result.decisions["prefill"].reasons
    assert result.conditions[0].reason == "ValidMetrics"
    replicas.write_text(json.dumps({"prefill": result.desired["prefill"], "decode": result.desired["decode"]}))
    ready_query = f'sum({m.WORKER_READY.name}{{namespace="{NAMESPACE}",pool="prefill"}})'
    wait_for("the new ready count in Prometheus",
             lambda: [r for r in prom.query(ready_query) if float(r["value"][1]) == result.desired["prefill"]])

    # The workers vanish (their scrape fails): the signal goes missing, the pool is held.
    proc.terminate()
    proc.wait(timeout=10)
    wait_for("the series to go stale", lambda: source.fetch("prefill", prefill_sel).get(sig.QUEUE_REQUESTS) is None)
    status = {"prefill": {"desiredReplicas": result.desired["prefill"]},
              "decode": {"desiredReplicas": result.desired["decode"]}}
    held = t.autoscale_tick(spec=spec(), status=status, namespace=NAMESPACE, counts=counts,
                            signals=source, clock=time.time, state=result.state)
    assert held.desired == result.desired, "missing data never shrinks a pool"
    assert (held.conditions[0].status, held.conditions[0].reason) == ("False", "MetricsUnavailable")
