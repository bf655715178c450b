"""vLLM's metric names, mirrored from Tandem's own series so that tools built for vLLM work unchanged.

The Gateway API Inference Extension's endpoint picker scrapes each pod for `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` in older releases);
KEDA examples scale on the same gauges; the published vLLM Grafana dashboards chart the latency histograms
and token/request counters, all selected by the `model_name` label. A mirror is not a second set of books:
at every scrape it reads the samples of the Tandem collector it mirrors and renames them, so both names
always carry the same value.

Which process exports which: the scheduler and KV-cache series come from the workers (each pod's own
queue, as the endpoint picker wants it); the per-request series (latencies, tokens, finished requests)
only from the router, the one process that sees every request whole. Under disaggregation a prefill and
a decode worker each see half of a request, and a dashboard summing `vllm:generation_tokens_total` over
all pods would otherwise count tokens twice.

Imports only prometheus_client (and the names in tandem.worker.metrics), like metrics.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tandem.worker import metrics as m

LABEL_MODEL_NAME = "model_name"  # vLLM's label for the served model name (Tandem's `model`)
LABEL_FINISHED_REASON = "finished_reason"  # vLLM's label on vllm:request_success_total (Tandem's `reason`)


@dataclass(frozen=True)
class VllmMetric:
    name: str  # as vLLM exposes it, without _total / _bucket
    source: m.MetricDef  # the Tandem series it mirrors (same kind)
    help: str
    # Tandem `reason` values that count as a vLLM finished (successful) request; None: no reason label.
    finished_reasons: tuple[str, ...] | None = None


NUM_REQUESTS_RUNNING = VllmMetric("vllm:num_requests_running", m.RUNNING_REQUESTS,
                                  "Requests in the running batch (tandem_running_requests).")
NUM_REQUESTS_WAITING = VllmMetric("vllm:num_requests_waiting", m.WAITING_REQUESTS,
                                  "Requests waiting to be scheduled (tandem_waiting_requests).")
KV_CACHE_USAGE = VllmMetric("vllm:kv_cache_usage_perc", m.KV_USAGE_RATIO,
                            "KV-cache usage, 1 is 100 percent (tandem_kv_cache_usage_ratio).")
GPU_CACHE_USAGE = VllmMetric("vllm:gpu_cache_usage_perc", m.KV_USAGE_RATIO,
                             "KV-cache usage, 1 is 100 percent; the older vLLM name (tandem_kv_cache_usage_ratio).")
NUM_PREEMPTIONS = VllmMetric("vllm:num_preemptions", m.PREEMPTIONS,
                             "Requests preempted for lack of KV blocks (tandem_preemptions_total).")
PREFIX_CACHE_QUERIES = VllmMetric("vllm:prefix_cache_queries", m.PREFIX_CACHE_QUERIES,
                                  "Prompt tokens looked up in the prefix cache (tandem_prefix_cache_queries_total).")
PREFIX_CACHE_HITS = VllmMetric("vllm:prefix_cache_hits", m.PREFIX_CACHE_HITS,
                               "Prompt tokens found in the prefix cache (tandem_prefix_cache_hits_total).")

TIME_TO_FIRST_TOKEN = VllmMetric("vllm:time_to_first_token_seconds", m.TTFT,
                                 "Time to first token, seconds (tandem_time_to_first_token_seconds).")
INTER_TOKEN_LATENCY = VllmMetric("vllm:inter_token_latency_seconds", m.ITL,
                                 "Time between output tokens, seconds (tandem_inter_token_latency_seconds).")
TIME_PER_OUTPUT_TOKEN = VllmMetric("vllm:time_per_output_token_seconds", m.ITL,
                                   "Time between output tokens, seconds; the older vLLM name "
                                   "(tandem_inter_token_latency_seconds).")
E2E_REQUEST_LATENCY = VllmMetric("vllm:e2e_request_latency_seconds", m.E2E,
                                 "Request arrival to last token, seconds (tandem_e2e_request_latency_seconds).")
PROMPT_TOKENS = VllmMetric("vllm:prompt_tokens", m.PROMPT_TOKENS, "Prompt tokens (tandem_prompt_tokens_total).")
GENERATION_TOKENS = VllmMetric("vllm:generation_tokens", m.GENERATION_TOKENS,
                               "Generated tokens (tandem_generation_tokens_total).")
# vLLM counts a request finished by stop or length (or abort) as a success; the router's `error` (refused,
# failed, cut off by a deadline) is not one.
REQUEST_SUCCESS = VllmMetric("vllm:request_success", m.REQUESTS,
                             "Requests that finished, by finished_reason (tandem_requests_total but reason error).",
                             finished_reasons=("stop", "length", "abort"))

WORKER_MIRRORS = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE, GPU_CACHE_USAGE, NUM_PREEMPTIONS,
                  PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)
ROUTER_MIRRORS = (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY,
                  PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS)
ALL_MIRRORS = (*WORKER_MIRRORS, *ROUTER_MIRRORS)


def mirrors_for(role: str) -> tuple[VllmMetric, ...]:
    """What a process of this role exports under vLLM's names (see the module's docstring)."""
    return ROUTER_MIRRORS if role == "router" else WORKER_MIRRORS


def exposed_name(metric: VllmMetric) -> str:
    """As PromQL sees it: counters get _total."""
    return f"{metric.name}_total" if metric.source.kind == "counter" else metric.name


class WithVllmNames:
    """What a scrape renders: every family of `registry`, collected once, and `mirrors` derived from that same
    collection. One snapshot, not a second collector reading live values: a request finishing between the two
    reads would otherwise leave a scrape whose vLLM and Tandem values differ."""

    def __init__(self, registry: Collector, mirrors: Iterable[VllmMetric]) -> None:
        self._registry = registry
        self._mirrors = tuple(mirrors)

    def collect(self) -> list[Metric]:
        families = list(self._registry.collect())
        by_name = {family.name: family for family in families}
        out = list(families)
        for v in self._mirrors:
            source = by_name.get(v.source.name)
            if source is not None:
                out.append(mirror_family(source, v))
        return out


def mirror_family(source: Metric, v: VllmMetric) -> Metric:
    """`source`'s samples under vLLM's name and labels: one series per Tandem series."""
    labels = [LABEL_MODEL_NAME] + ([LABEL_FINISHED_REASON] if v.finished_reasons is not None else [])
    base, kind = v.source.name, v.source.kind
    scalars: list[tuple[list[str], float]] = []
    histograms: dict[tuple[str, ...], tuple[list[tuple[str, float]], list[float]]] = {}
    for sample in source.samples:
        key = [sample.labels[m.LABEL_MODEL]]
        if v.finished_reasons is not None:
            reason = sample.labels.get(m.LABEL_REASON, "")
            if reason not in v.finished_reasons:
                continue
            key.append(reason)
        if sample.name in (base, f"{base}_total"):  # a gauge's or counter's value (not a counter's _created)
            scalars.append((key, sample.value))
        elif sample.name == f"{base}_bucket":
            histograms.setdefault(tuple(key), ([], [0.0]))[0].append((sample.labels["le"], sample.value))
        elif sample.name == f"{base}_sum":
            histograms.setdefault(tuple(key), ([], [0.0]))[1][0] = sample.value
    if kind == "histogram":
        histogram = HistogramMetricFamily(v.name, v.help, labels=labels)
        for hkey, (buckets, total) in histograms.items():
            histogram.add_metric(list(hkey), buckets, total[0])
        return histogram
    if kind not in ("gauge", "counter"):
        raise ValueError(f"{v.name}: cannot mirror a {kind}")
    family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(v.name, v.help, labels=labels)
    for key, value in scalars:
        family.add_metric(key, value)
    return family
