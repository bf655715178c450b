"""Signals and decisions from real worker processes under load from `tandem bench`.

`tandem serve --mode disaggregated` runs one prefill and one decode worker (tiny random model, a
1 MiB KV cache each, so a burst of requests fills it); Debian's Prometheus scrapes both workers'
/metrics and adds `namespace` as the Kubernetes scrape would; `tandem bench` sends a burst. The
timer body, reading through PrometheusSignals, must see the prefill queue grow and the decode KV
cache fill, and scale both pools up; once the burst is served the signals fall back.

`tandem serve` labels every worker pool="local" (roles prefill and decode), where a Kubernetes
pool label is prefill or decode: `LocalStackSignals` maps one onto the other by narrowing on the
role, which is all that differs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec
from tandem.worker import metrics as m
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.server.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE, MODEL, RESOURCE = "team-a", "tiny", "tiny-dm"


class LocalStackSignals:
    """PrometheusSignals for a `tandem serve` stack: pool "local", narrowed by role."""

    def __init__(self, inner: sig.PrometheusSignals) -> None:
        self.inner = inner

    def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
        return self.inner.fetch(pool, sig.Selector(sel.namespace, sel.resource, "local", role=pool))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tandem.worker.model.tiny import write_tiny_model

    work = tmp_path_factory.mktemp("autoscale-stack")
    model = write_tiny_model(work / "tiny")
    state_file, port = work / "state.json", free_port()
    log = (work / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(model), "--model-name", MODEL,
         "--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--port", str(port),
         "--kv-cache-bytes", str(1 << 20), "--log-dir", str(work / "logs"), "--state-file", str(state_file)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not state_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tandem serve did not come up:\n{(work / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield json.loads(state_file.read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def spec() -> DisaggregatedModelSpec:
    auto = {"enabled": True, "maxReplicas": 8}
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": MODEL, "source": {"path": "/models/tiny"}},
        "prefill": {"replicas": 1, "autoscaling": {**auto, "targetQueueDepth": 2}},
        "decode": {"replicas": 1, "autoscaling": {**auto, "targetKVUtilization": 0.5}},
        "ratio": {"minPrefillPerDecode": 0, "maxPrefillPerDecode": 8},
    })


def test_decisions_follow_the_prefill_queue_and_the_decode_kv_cache(stack: dict[str, Any], prometheus: Any,
                                                                   tmp_path: Path) -> None:
    workers = [p for p in stack["processes"] if p["role"] in ("prefill", "decode")]
    assert {p["role"] for p in workers} == {"prefill", "decode"}, stack
    prom = prometheus([p["url"].removeprefix("http://") for p in workers],
                      extra_labels={"namespace": NAMESPACE, m.LABEL_RESOURCE: RESOURCE}, scrape_interval="500ms")
    source = LocalStackSignals(sig.PrometheusSignals(prom.url, timeout_s=3,
                                                     settings=sig.QuerySettings(rate_window="10s")))
    prefill_sel = sig.Selector(NAMESPACE, RESOURCE, "prefill")
    deadline = time.monotonic() + 30
    decode_sel = sig.Selector(NAMESPACE, RESOURCE, "decode")
    # Both workers' series must be in Prometheus (they are scraped independently).
    while (source.fetch("prefill", prefill_sel).get(sig.QUEUE_REQUESTS) is None
           or source.fetch("decode", decode_sel).get(sig.KV_USAGE) is None):
        assert time.monotonic() < deadline, "the workers' series never reached Prometheus"
        time.sleep(0.5)
    idle = source.fetch("decode", decode_sel)
    assert idle.get(sig.KV_USAGE) is not None and idle.values[sig.KV_USAGE] < 0.5

    # The router sends work to decode alone until it sees a usable prefill worker; this test is
    # about the prefill queue, so make sure the burst goes through prefill.
    deadline = time.monotonic() + 30
    control = ControlTokens.from_file(stack["control_token_file"]).headers  # /workers wants the stack's token
    while not {"prefill", "decode"} <= {w["role"] for w in httpx.get(f"{stack['url']}/workers", headers=control,
                                                                      timeout=5).json() if w["usable"]}:
        assert time.monotonic() < deadline, "the router never saw a usable prefill and decode worker"
        time.sleep(0.2)
    bench = subprocess.Popen(
        [sys.executable, "-m", "tandem.worker.cli", "bench", "--url", stack["url"], "--model", MODEL,
         "-n", "48", "--rate", "0", "--prompt-tokens", "256", "--output-tokens", "32",
         "--max-duration", "90", "--json", str(tmp_path / "bench.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counts = {"prefill": t.PoolCounts(1), "decode": t.PoolCounts(1)}
    peak: dict[str, float] = {"queue": 0.0, "kv": 0.0}
    scaled: dict[str, int] = {"prefill": 1, "decode": 1}
    reasons: dict[str, str] = {}
    try:
        while bench.poll() is None:
            result = t.autoscale_tick(spec=spec(), status=None, namespace=NAMESPACE, name=RESOURCE, counts=counts,
                                      signals=source, clock=time.time)
            for pool, dec in result.decisions.items():
                if dec.desired > scaled[pool]:
                    scaled[pool], reasons[pool] = dec.desired, "; ".join(dec.reasons)
            peak["queue"] = max(peak["queue"], result.decisions["prefill"].signal or 0.0)
            peak["kv"] = max(peak["kv"], result.decisions["decode"].signal or 0.0)
            time.sleep(0.3)
    finally:
        if bench.poll() is None:
            bench.kill()
        out = bench.communicate()[0]
    assert bench.returncode == 0, out[-2000:]
    assert peak["queue"] > 2, f"the prefill queue never grew past its target: {peak}"
    assert peak["kv"] > 0.5, f"the decode KV cache never filled past its target: {peak}"
    assert scaled["prefill"] > 1 and "vs target 2" in reasons["prefill"], reasons
    assert scaled["decode"] > 1 and "vs target 0.5" in reasons["decode"], reasons

    # The burst is served: the queue empties and the KV cache is freed.
    deadline = time.monotonic() + 30
    while True:
        after = {p: source.fetch(p, sig.Selector(NAMESPACE, RESOURCE, p)) for p in ("prefill", "decode")}
        queue, kv = after["prefill"].get(sig.QUEUE_REQUESTS), after["decode"].get(sig.KV_USAGE)
        if queue == 0 and kv is not None and kv < 0.5:
            break
        assert time.monotonic() < deadline, f"signals did not fall back after the burst: {after}"
        time.sleep(0.5)


def predictive_spec() -> DisaggregatedModelSpec:
    """Both pools on the predictive policy, sized with the tiny model's shipped CPU profile."""
    profile = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "tiny-cpu.json").read_text())
    auto = {"enabled": True, "maxReplicas": 8, "policy": "predictive"}
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": MODEL, "source": {"path": "/models/tiny"}},
        "prefill": {"replicas": 1, "autoscaling": auto}, "decode": {"replicas": 1, "autoscaling": auto},
        "capacityProfile": {"prefillTokensPerSecond": profile["prefill_tps"], "kvTokens": profile["kv_tokens"],
                            "itlBaseSeconds": profile["itl_base_s"], "itlPerRequestSeconds": profile["itl_per_seq_s"],
                            "startupSeconds": profile["startup_s"]},
    })


def test_the_predictive_policy_reads_real_arrivals(stack: dict[str, Any], prometheus: Any, tmp_path: Path) -> None:
    """The arrival queries (signals.arrival_queries) against a real Prometheus scraping the real router and
    workers, with the pool labels a Kubernetes scrape gives (here set per target: `tandem serve` labels every
    worker pool="local"). While `tandem bench` runs, the timer sizes both pools predictively, not on the
    reactive fallback, and the lengths it infers are the bench's."""
    procs = {p["role"]: p["url"].removeprefix("http://") for p in stack["processes"]}
    labels = {"namespace": NAMESPACE, m.LABEL_RESOURCE: RESOURCE}
    prom = prometheus([procs["router"]], extra_labels=labels, scrape_interval="500ms",
                      more_targets=[([procs["prefill"]], {**labels, m.LABEL_POOL: "prefill"}),
                                    ([procs["decode"]], {**labels, m.LABEL_POOL: "decode"})])
    source = sig.PrometheusSignals(prom.url, timeout_s=3, settings=sig.QuerySettings(
        rate_window="10s", trend_window="20s", trend_step="1s"))
    bench = subprocess.Popen(
        [sys.executable, "-m", "tandem.worker.cli", "bench", "--url", stack["url"], "--model", MODEL,
         "-n", "60", "--rate", "4", "--prompt-tokens", "256", "--output-tokens", "32",
         "--max-duration", "90", "--json", str(tmp_path / "bench.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counts = {"prefill": t.PoolCounts(1), "decode": t.PoolCounts(1)}
    sized: list[str] = []
    arrivals: list[sig.PoolSignals] = []
    try:
        while bench.poll() is None:
            result = t.autoscale_tick(spec=predictive_spec(), status=None, namespace=NAMESPACE, name=RESOURCE,
                                      counts=counts, signals=source, clock=time.time)
            reason = "; ".join(result.decisions["prefill"].reasons)
            if reason.startswith("predictive: arriving"):
                sized.append(reason)
                arrivals.append(source.fetch_arrivals(NAMESPACE, RESOURCE))
            time.sleep(0.5)
    finally:
        if bench.poll() is None:
            bench.kill()
        out = bench.communicate()[0]
    assert bench.returncode == 0, out[-2000:]
    assert sized, f"the timer never sized predictively; last reason: {reason}"
    done = [a.values for a in arrivals if a.values.get(sig.ARRIVAL_REQUEST_RATE, 0) > 0
            and a.values.get(sig.ARRIVAL_FINISHED_RATE, 0) > 0]
    assert done, arrivals[-3:]
    last = done[-1]
    mean_prompt = last[sig.ARRIVAL_PROMPT_TPS] / last[sig.ARRIVAL_REQUEST_RATE]
    mean_output = last[sig.ARRIVAL_OUTPUT_TPS] / last[sig.ARRIVAL_FINISHED_RATE]
    assert 128 < mean_prompt < 512, f"mean prompt {mean_prompt:.0f} tokens from Prometheus, the bench sends ~256"
    assert 16 < mean_output < 64, f"mean output {mean_output:.0f} tokens from Prometheus, the bench asks for 32"
    assert sig.ARRIVAL_BACKLOG_TOKENS in last, "the prefill pool's backlog was not read"
