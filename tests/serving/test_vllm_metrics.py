"""vLLM's metric names on a real disaggregated `tandem serve` stack under load, read the way the tools built
for vLLM read them, with the values of Tandem's own series.

- The Gateway API Inference Extension's endpoint picker scrapes each model-server pod's /metrics and takes
  the gauges vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc (older:
  vllm:gpu_cache_usage_perc) from the text: read here from each worker's page, beside Tandem's series on
  the same page.
- KEDA's Prometheus scaler and the published vLLM Grafana dashboards query Prometheus with `model_name`
  selectors: a real Prometheus scrapes the router and both workers, and their queries (queue sums, latency
  quantiles from the histograms, token rates, finished requests by finished_reason) must equal the same
  query over Tandem's names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker import metrics_vllm as v

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
REQUESTS = 24
CONCURRENCY = 8
# The endpoint picker's three gauges and what they mirror, as it parses a pod's page.
PICKER_GAUGES = {"vllm:num_requests_waiting": "tandem_waiting_requests",
                 "vllm:num_requests_running": "tandem_running_requests",
                 "vllm:kv_cache_usage_perc": "tandem_kv_cache_usage_ratio",
                 "vllm:gpu_cache_usage_perc": "tandem_kv_cache_usage_ratio"}


def load(stack: Stack) -> int:
    """REQUESTS streamed completions, CONCURRENCY at a time, long enough to keep the batch busy for seconds."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)

    def one(i: int) -> int:
        stream = client.completions.create(model=MODEL, prompt=f"request {i}: " + "the pods scale " * (4 + i % 5),
                                           max_tokens=160, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return sum(1 for n in pool.map(one, range(REQUESTS)) if n > 0)


def page(url: str) -> dict[str, Any]:
    """The families of one /metrics page, by name (prometheus_client's text parser, as a scraper parses it)."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text)}


def test_the_endpoint_pickers_gauges_are_on_every_worker_page(disagg: Stack) -> None:
    for proc in disagg.procs("prefill") + disagg.procs("decode"):
        families = page(proc["url"])
        for name, tandem in PICKER_GAUGES.items():
            family = families[name]
            assert family.type == "gauge", name
            (sample,) = family.samples
            assert sample.labels == {"model_name": MODEL}, sample
            (mirrored,) = families[tandem].samples
            assert sample.value == mirrored.value, (proc["role"], name)
        # Per-request series come from the router only (a worker sees half of a disaggregated request).
        assert not {v.exposed_name(x) for x in v.ROUTER_MIRRORS} & set(families)
    router = page(disagg.url)
    assert not set(PICKER_GAUGES) & set(router)
    assert router["vllm:request_success"].type == "counter"
    assert router["vllm:time_to_first_token_seconds"].type == "histogram"


def test_vllm_dashboards_and_keda_queries_match_tandems_under_load(disagg: Stack,
                                                                   prometheus: Callable[..., Any]) -> None:
    wait_until_disaggregated(disagg)
    workers = disagg.procs("prefill") + disagg.procs("decode")
    targets = [disagg.url.removeprefix("http://"), *(p["url"].removeprefix("http://") for p in workers)]
    prom = prometheus(targets)
    prom.wait_for_targets_up()
    finished = [metric_value(disagg.url, "vllm:request_success_total", model_name=MODEL),
                metric_value(disagg.url, "tandem_requests_total", model=MODEL, reason="stop")
                + metric_value(disagg.url, "tandem_requests_total", model=MODEL, reason="length")]

    assert load(disagg) == REQUESTS
    after = [metric_value(disagg.url, "vllm:request_success_total", model_name=MODEL),
             metric_value(disagg.url, "tandem_requests_total", model=MODEL, reason="stop")
             + metric_value(disagg.url, "tandem_requests_total", model=MODEL, reason="length")]
    assert [a - b for a, b in zip(after, finished, strict=True)] == [REQUESTS, REQUESTS]
    # Until Prometheus holds the final counts, and one more scrape so rate() ends on them.
    deadline = time.monotonic() + 30
    while not prom.query(f'sum(vllm:request_success_total{{model_name="{MODEL}"}}) >= {after[0]}'):
        assert time.monotonic() < deadline, "Prometheus never scraped the router's final counts"
        time.sleep(0.5)
    time.sleep(1.5)

    at = time.time()  # one evaluation time for every query: a window that moved would change a rate

    def scalar(expr: str) -> float:
        body = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr, "time": at}, timeout=5).json()
        assert body["status"] == "success", body
        result = body["data"]["result"]
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    sel, own = f'{{model_name="{MODEL}"}}', f'{{model="{MODEL}", pool="router"}}'
    workers_sel = f'{{model="{MODEL}", pool!="router"}}'
    pairs = [
        # vLLM Grafana dashboard: latency quantiles and means, token throughput, finished requests.
        (f"histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{sel}[5m])))",
         f"histogram_quantile(0.99, sum by(le) (rate(tandem_time_to_first_token_seconds_bucket{own}[5m])))"),
        (f"histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{sel}[5m])))",
         f"histogram_quantile(0.5, sum by(le) (rate(tandem_inter_token_latency_seconds_bucket{own}[5m])))"),
        (f"histogram_quantile(0.9, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{sel}[5m])))",
         f"histogram_quantile(0.9, sum by(le) (rate(tandem_inter_token_latency_seconds_bucket{own}[5m])))"),
        (f"sum(rate(vllm:e2e_request_latency_seconds_sum{sel}[5m])) / sum(rate(vllm:e2e_request_latency_seconds_count{sel}[5m]))",
         f"sum(rate(tandem_e2e_request_latency_seconds_sum{own}[5m])) / sum(rate(tandem_e2e_request_latency_seconds_count{own}[5m]))"),
        (f"sum(rate(vllm:prompt_tokens_total{sel}[5m]))", f"sum(rate(tandem_prompt_tokens_total{own}[5m]))"),
        (f"sum(rate(vllm:generation_tokens_total{sel}[5m]))", f"sum(rate(tandem_generation_tokens_total{own}[5m]))"),
        (f"sum(increase(vllm:request_success_total{sel}[5m]))",
         f'sum(increase(tandem_requests_total{{model="{MODEL}", pool="router", reason=~"stop|length"}}[5m]))'),
        # KEDA-style scaling queries and the dashboards' scheduler panels: sums and peaks over the workers.
        (f"sum(vllm:num_requests_waiting{sel})", f"sum(tandem_waiting_requests{workers_sel})"),
        (f"sum(vllm:num_requests_running{sel})", f"sum(tandem_running_requests{workers_sel})"),
        (f"max(max_over_time(vllm:num_requests_running{sel}[5m]))",
         f"max(max_over_time(tandem_running_requests{workers_sel}[5m]))"),
        (f"avg(max_over_time(vllm:kv_cache_usage_perc{sel}[5m]))",
         f"avg(max_over_time(tandem_kv_cache_usage_ratio{workers_sel}[5m]))"),
        (f"avg(max_over_time(vllm:gpu_cache_usage_perc{sel}[5m]))",
         f"avg(max_over_time(tandem_kv_cache_usage_ratio{workers_sel}[5m]))"),
    ]
    # The raw samples first: identical, scrape for scrape (so any query over them agrees).
    raw = [(f"vllm:prompt_tokens_total{sel}[5m]", f"tandem_prompt_tokens_total{own}[5m]"),
           (f'vllm:request_success_total{{model_name="{MODEL}", finished_reason="length"}}[5m]',
            f'tandem_requests_total{{model="{MODEL}", pool="router", reason="length"}}[5m]')]
    for vllm_range, tandem_range in raw:
        (mine,), (theirs,) = prom.query(vllm_range), prom.query(tandem_range)
        assert mine["values"] == theirs["values"], vllm_range
    for vllm_expr, tandem_expr in pairs:
        assert scalar(vllm_expr) == pytest.approx(scalar(tandem_expr), rel=1e-9, abs=1e-12), vllm_expr
    # The load was seen: a busy batch, KV in use, tokens counted once (the router's), requests by reason.
    assert scalar(f"max(max_over_time(vllm:num_requests_running{sel}[5m]))") >= 2
    assert scalar(f"max(max_over_time(vllm:kv_cache_usage_perc{sel}[5m]))") > 0
    # Prometheus scraped before the first request and after the last: the counter's range is the load, exactly.
    assert scalar(f"sum(max_over_time(vllm:request_success_total{sel}[5m]) "
                  f"- min_over_time(vllm:request_success_total{sel}[5m]))") == REQUESTS
    reasons = {r["metric"]["finished_reason"] for r in
               prom.query(f"sum by(finished_reason) (vllm:request_success_total{sel})")}
    assert reasons == {"stop", "length"}
    # Every series pairs one to one with its Tandem source, sample for sample, on every target.
    for gauge, tandem in PICKER_GAUGES.items():
        assert len(prom.query(f"{gauge}{sel}")) == len(workers)
        assert not prom.query(f"{gauge}{sel} != on(instance) {tandem}{{model=\"{MODEL}\"}}"), gauge
    assert not prom.query(f"vllm:time_to_first_token_seconds_bucket{sel} "
                          f"!= on(instance, le) tandem_time_to_first_token_seconds_bucket{own}")
    # Grafana's model picker: label_values(model_name).
    names = httpx.get(f"{prom.url}/api/v1/label/model_name/values", timeout=5).json()["data"]
    assert names == [MODEL]
