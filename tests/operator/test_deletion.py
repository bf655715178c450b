"""Deleting a DisaggregatedModel while one of its timers is mid-tick finishes promptly.

kopf keeps its finalizer on a resource until the resource's timers have stopped. A timer whose
(synchronous) handler is running when the deletion arrives cannot be interrupted: kopf waits for
it and re-checks every `settings.background.cancellation_polling` seconds, 60 by default. With
that default a deletion that landed mid-tick sat in Terminating for a minute (it looked like a
hang in about 1 of 8 test runs). The operator sets a short polling interval; this test makes
the race deterministic and checks that `kubectl delete` returns soon after the tick ends.

Real parts: the local control plane and the operator subprocess. The one stand-in is a slow
Prometheus: a local HTTP server that answers the Prometheus query API with an empty result,
holding the first query for a few seconds so the autoscaler tick is certainly in progress when
the test deletes the resource (a real Prometheus cannot be made slow on demand).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from operator_harness import OperatorProcess, wait_for

pytestmark = [pytest.mark.integration]

HOLD_S = 4.0
EMPTY = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()


class SlowPrometheus:
    """Answers /api/v1/query with an empty vector; while `armed`, holds one query for HOLD_S."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.holding = threading.Event()  # set while a query is being held
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if outer.armed.is_set():
                    outer.armed.clear()
                    outer.holding.set()
                    time.sleep(HOLD_S)
                    outer.holding.clear()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(EMPTY)))
                self.end_headers()
                self.wfile.write(EMPTY)

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def bed(k8s_cluster: Any, tmp_path: Path) -> Iterator[tuple[Any, str, OperatorProcess, SlowPrometheus]]:
    namespace = k8s_cluster.new_namespace("del")
    k8s_cluster.install_crds()
    prom = SlowPrometheus()
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, tmp_path / "operator.log", k8s_cluster.env,
                               extra_args=("--prometheus-url", prom.url, "--autoscale-interval", "1"))
    operator.start()
    try:
        yield k8s_cluster, namespace, operator, prom
    finally:
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        prom.close()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_delete_during_an_autoscaler_tick_finishes_promptly(bed: Any) -> None:
    cluster, namespace, operator, prom = bed
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 2}
    resource = {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "metadata": {"name": "gone"},
        "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}},
                 "prefill": {"autoscaling": auto}, "decode": {"autoscaling": auto}},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(resource))

    def finalized() -> bool:
        proc = cluster.kubectl("get", "dm", "gone", "-n", namespace, "-o", "json", check=False)
        return proc.returncode == 0 and bool(json.loads(proc.stdout)["metadata"].get("finalizers"))

    wait_for("the operator to take the resource (finalizer added)", finalized, timeout=60,
             on_timeout=operator.log_tail)
    prom.armed.set()
    wait_for("an autoscaler tick to be waiting on Prometheus", prom.holding.is_set, timeout=30, interval=0.05,
             on_timeout=operator.log_tail)

    started = time.monotonic()
    proc = cluster.kubectl("delete", "dm", "gone", "-n", namespace, "--timeout=40s", check=False, timeout=60)
    took = time.monotonic() - started
    print(f"kubectl delete returned {took:.1f} s after it was issued, during a {HOLD_S:.0f} s tick")
    assert proc.returncode == 0, (
        f"kubectl delete did not finish: {proc.stderr.strip()}\n--- operator log ---\n{operator.log_tail()}")
    # The tick ends at most HOLD_S after the delete; kopf's default would then wait up to 60 s more.
    assert took < HOLD_S + 15, f"deletion took {took:.1f} s after the tick ended\n{operator.log_tail()}"
    assert operator.alive(), operator.log_tail()
