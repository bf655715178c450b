"""The autoscaler's signals through a real Prometheus scraping a real load-model process.

hack/load_model.py serve plays the workers (it exposes the worker metrics for as many replicas as
the replicas file says are ready); Debian's prometheus scrapes it every second and adds the
`namespace` and `tandem_dev_model` labels as the Kubernetes scrape does; the timer body reads it
with PrometheusSignals. A second resource serving the same model name in the same namespace (a
fixed page of worker metrics with a long queue) must not move the first one's signals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
RESOURCE, NEIGHBOUR = "tiny", "tiny-canary"  # two DisaggregatedModels serving MODEL in NAMESPACE


@pytest.fixture
def neighbour() -> Iterator[str]:
    """Another resource's prefill worker: same served model name, 500 queued requests, always ready."""
    page = "".join(f'{name}{{model="{MODEL}",role="prefill",pool="prefill"}} {value}\n' for name, value in (
        (m.exposed_name(m.PREFILL_QUEUE_REQUESTS), 500), (m.exposed_name(m.PREFILL_QUEUE_TOKENS), 10**6),
        (m.exposed_name(m.WORKER_READY), 1))).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


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


def test_signals_decisions_and_a_prometheus_outage(prometheus: Any, load_model_server: Any, neighbour: str) -> None:
    proc, port, replicas = load_model_server
    prom = prometheus([f"127.0.0.1:{port}"], extra_labels={"namespace": NAMESPACE, m.LABEL_RESOURCE: RESOURCE},
                      more_targets=[([neighbour], {"namespace": NAMESPACE, m.LABEL_RESOURCE: NEIGHBOUR})])
    source = sig.PrometheusSignals(prom.url, timeout_s=3)
    prefill_sel = sig.Selector(NAMESPACE, RESOURCE, "prefill")
    theirs = wait_for("the other resource's prefill queue in Prometheus", lambda: (
        s if (s := source.fetch("prefill", sig.Selector(NAMESPACE, NEIGHBOUR, "prefill"))).values else None))
    assert theirs.values[sig.QUEUE_REQUESTS] == 500, theirs

    got = wait_for("prefill queue and TTFT in Prometheus", lambda: (
        s if {sig.QUEUE_REQUESTS, sig.LATENCY_P} <= set((s := source.fetch("prefill", prefill_sel)).values)
        and s.values[sig.QUEUE_REQUESTS] > 0 else None))
    assert 0 < got.values[sig.QUEUE_TOKENS] / got.values[sig.QUEUE_REQUESTS] <= 2000
    assert got.values[sig.LATENCY_P] > 0
    series = prom.query(f'{m.PREFILL_QUEUE_REQUESTS.name}{{namespace="{NAMESPACE}",model="{MODEL}"}}')
    assert len(series) == 3, "one series per ready prefill replica of both resources"
    # Each resource reads only its own pods, although both serve MODEL in NAMESPACE.
    assert got.values[sig.QUEUE_REQUESTS] < 100, got.values
    assert {s["metric"][m.LABEL_POOL] for s in series} == {"prefill"}
    decode = source.fetch("decode", sig.Selector(NAMESPACE, RESOURCE, "decode"))
    assert 0 <= decode.values[sig.KV_USAGE] <= 1
    other = source.fetch("prefill", sig.Selector("another-namespace", RESOURCE, "prefill"))
    assert other.get(sig.QUEUE_REQUESTS) is None, "the namespace filter holds"

    # A tick on the growing queue scales prefill up; the load model sees the new pods as ready.
    counts = {"prefill": t.PoolCounts(2), "decode": t.PoolCounts(2)}
    result = t.autoscale_tick(spec=spec(), status=None, namespace=NAMESPACE, name=RESOURCE, counts=counts,
                              signals=source, clock=time.time)
    assert result.desired["prefill"] > 2, result.decisions["prefill"].reasons
    assert result.conditions[0].reason == "ValidMetrics"
    replicas.write_text(json.dumps({"prefill": result.desired["prefill"], "decode": result.desired["decode"]}))
    ready_query = f'sum({m.WORKER_READY.name}{{namespace="{NAMESPACE}",{m.LABEL_RESOURCE}="{RESOURCE}",pool="prefill"}})'
    wait_for("the new ready count in Prometheus",
             lambda: [r for r in prom.query(ready_query) if float(r["value"][1]) == result.desired["prefill"]])

    # The workers vanish (their scrape fails): the signal goes missing, the pool is held.
    proc.terminate()
    proc.wait(timeout=10)
    wait_for("the series to go stale", lambda: source.fetch("prefill", prefill_sel).get(sig.QUEUE_REQUESTS) is None)
    status = {"prefill": {"desiredReplicas": result.desired["prefill"]},
              "decode": {"desiredReplicas": result.desired["decode"]}}
    held = t.autoscale_tick(spec=spec(), status=status, namespace=NAMESPACE, name=RESOURCE, counts=counts,
                            signals=source, clock=time.time, state=result.state)
    assert held.desired == result.desired, "missing data never shrinks a pool"
    assert (held.conditions[0].status, held.conditions[0].reason) == ("False", "MetricsUnavailable")
