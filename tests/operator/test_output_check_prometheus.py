"""OutputVerified through a real Prometheus: the canary query selects one resource's routers by namespace and
tandem_dev_model (as the scrape sets them), and increase() over the window gives the condition.

Two routers' /metrics pages (plain HTTP servers whose canary counters the test moves) are scraped every
second with the labels the Kubernetes scrape adds: the resource `tiny` and a neighbour `tiny-b` that serves
the same model name in the same namespace. The neighbour's mismatches must not touch tiny's condition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tandem.operator import output_check
from tandem.operator import signals as sig
from tandem.worker import metrics as m

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE, MODEL = "team-a", "tiny-llama"


class RouterPage:
    """A router's canary counters, as prometheus_client renders them (every result initialised at 0)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(output_check.RESULTS, 0)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                name = m.exposed_name(m.ROUTER_CANARY_PROBES)
                page = "".join(f'{name}{{model="{MODEL}",role="router",pool="router",result="{r}"}} {v}\n'
                               for r, v in outer.counts.items()).encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.target = f"127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def routers() -> Iterator[tuple[RouterPage, RouterPage]]:
    pages = (RouterPage(), RouterPage())
    yield pages
    for page in pages:
        page.server.shutdown()
        page.server.server_close()


def wait_for(source: sig.PrometheusSignals, resource: str, want: Callable[[Any], bool],
              timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    cond = None
    while time.monotonic() < deadline:
        cond = output_check.read_output_condition(source, NAMESPACE, resource)
        if want(cond):
            return cond
        time.sleep(0.5)
    raise AssertionError(f"{resource}: condition never as wanted; last {cond}")


def test_output_verified_from_a_real_prometheus(prometheus: Any, routers: tuple[RouterPage, RouterPage]) -> None:
    tiny, neighbour = routers
    prom = prometheus([tiny.target], extra_labels={"namespace": NAMESPACE, m.LABEL_RESOURCE: "tiny"},
                      more_targets=[([neighbour.target], {"namespace": NAMESPACE, m.LABEL_RESOURCE: "tiny-b"})])
    prom.wait_for_targets_up()
    source = sig.PrometheusSignals(prom.url)

    # Scraped, all zero: no probe compared anything yet.
    cond = wait_for(source, "tiny", lambda c: c.reason == "NoCanaryProbes" and "skipped 0" in c.message)
    assert cond.status == "Unknown"
    # A resource nobody scrapes has no series at all.
    assert output_check.read_output_condition(source, NAMESPACE, "other").reason == "NoCanaryProbes"

    time.sleep(4)  # samples at 0, so increase() sees the counters rise (and extrapolates little)
    tiny.counts["match"] = 3
    neighbour.counts["match"], neighbour.counts["mismatch"] = 1, 4
    cond = wait_for(source, "tiny", lambda c: c.status == "True")
    assert cond.reason == "CanaryMatched" and "none mismatched" in cond.message, cond
    bad = wait_for(source, "tiny-b", lambda c: c.status == "False")
    assert bad.reason == "CanaryMismatch", bad
    # The neighbour's mismatches (same served model, same namespace) never reach tiny.
    assert output_check.read_output_condition(source, NAMESPACE, "tiny").status == "True"

    tiny.counts["mismatch"] = 2
    cond = wait_for(source, "tiny", lambda c: c.status == "False")
    assert cond.reason == "CanaryMismatch" and "matched 3" in cond.message, cond


def test_prometheus_down_is_metrics_unavailable() -> None:
    source = sig.PrometheusSignals("http://127.0.0.1:9", timeout_s=1)
    cond = output_check.read_output_condition(source, NAMESPACE, "tiny")
    assert (cond.status, cond.reason) == ("Unknown", "MetricsUnavailable"), cond
    assert "Prometheus at http://127.0.0.1:9 failed" in cond.message
