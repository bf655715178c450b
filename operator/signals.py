"""The autoscaler's signals: PromQL built from tandem.worker.metrics, fetched with prometheus-api-client.

Query building is pure (tested on its strings); `PrometheusSignals.fetch` turns every failure
(connection refused, timeout, HTTP error, empty result, NaN from 0/0) into a *missing* value,
never into zero, so the policy holds the pool instead of shrinking it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tandem.worker import metrics as m

PREFILL = "prefill"
DECODE = "decode"

# The names of the values one fetch returns.
QUEUE_REQUESTS = "queue_requests"  # prefill: queued requests per ready replica
QUEUE_TOKENS = "queue_tokens"  # prefill: queued prompt tokens per ready replica
KV_USAGE = "kv_usage"  # decode: KV-cache usage ratio per ready replica
LATENCY_P = "latency_quantile"  # prefill: TTFT, decode: ITL, in seconds

# The names of the values one arrival fetch returns (the predictive policy's Load; one per resource).
ARRIVAL_PROMPT_TPS = "prompt_tps"  # prompt tokens/s arriving at the routers
ARRIVAL_PROMPT_TREND = "prompt_tps_trend"  # deriv() of that rate, (tokens/s)/s
ARRIVAL_REQUEST_RATE = "request_rate"  # requests/s reaching their first token at the routers
ARRIVAL_OUTPUT_TPS = "output_tps"  # tokens/s the routers stream out
ARRIVAL_FINISHED_RATE = "finished_rate"  # requests/s finishing at the routers (not reason error)
ARRIVAL_BACKLOG_TOKENS = "backlog_tokens"  # prompt tokens queued for prefill, whole prefill pool
ARRIVAL_DECODE_WAITING = "decode_waiting"  # requests admitted on decode, waiting for KV or a slot (optional)
ARRIVAL_PREFILL_BUSY_TPS = "prefill_busy_tps"  # prompt tokens/s per ready prefill replica, only while busy (optional)
# Optional: missing leaves the predictive policy's term out (with a note); the others are needed.
ARRIVAL_OPTIONAL = frozenset({ARRIVAL_DECODE_WAITING, ARRIVAL_PREFILL_BUSY_TPS})
ROUTER_POOL = "router"  # the routers' pool label (worker/router/telemetry.py)

_DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")


class SignalsError(ValueError):
    """A selector or query setting that would build a wrong query."""


@dataclass(frozen=True)
class Selector:
    """Which series belong to one pool of one resource.

    Keyed on the resource, not on the served model name (two DisaggregatedModels may serve the
    same name in one namespace): the scrape adds `namespace` and `tandem_dev_model` (the pod label
    tandem.dev/model, the resource's name); the workers carry `role` and `pool` (their --pool).
    The latency histograms are matched on namespace, resource and the engine roles that measure
    them (TTFT: prefill|both, ITL: decode|both, as the SLO alerts do), not on pool: a decode
    worker's fallback prefill must not count as prefill TTFT.
    """

    namespace: str
    resource: str  # the DisaggregatedModel's name
    pool: str
    # Also match the engine role: needed where one pool label holds both roles (`tandem serve`
    # labels every worker pool="local"); in Kubernetes role and pool coincide.
    role: str | None = None

    def __post_init__(self) -> None:
        for name in ("namespace", "resource", "pool"):
            if not getattr(self, name):
                raise SignalsError(f"selector {name} is empty: the query would match every {name}")
        if self.role is not None and not self.role:
            raise SignalsError("selector role is empty: leave it out to match every role")

    def matchers(self, *, with_pool: bool = True, role_regex: str | None = None) -> str:
        parts = resource_matchers(self.namespace, self.resource)
        if with_pool:
            parts.append(f'{m.LABEL_POOL}="{_escape(self.pool)}"')
            if self.role is not None:
                parts.append(f'{m.LABEL_ROLE}="{_escape(self.role)}"')
        if role_regex is not None:
            parts.append(f'{m.LABEL_ROLE}=~"{_escape(role_regex)}"')
        return "{" + ",".join(parts) + "}"


def resource_matchers(namespace: str, resource: str) -> list[str]:
    """The label matchers of one DisaggregatedModel's series: its namespace and the target label tandem_dev_model."""
    for what, value in (("namespace", namespace), ("resource", resource)):
        if not value:
            raise SignalsError(f"selector {what} is empty: the query would match every {what}")
    return [f'{m.LABEL_NAMESPACE}="{_escape(namespace)}"', f'{m.LABEL_RESOURCE}="{_escape(resource)}"']


def _escape(value: str) -> str:
    """A PromQL double-quoted string: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class QuerySettings:
    quantile: float = 0.9
    rate_window: str = "1m"  # at least 4 scrape intervals
    trend_window: str = "2m"  # deriv() of the arrival rate over this subquery range
    trend_step: str = "15s"  # the subquery's resolution (about one scrape interval)

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise SignalsError(f"quantile must be in (0, 1) (got {self.quantile})")
        for what, value in (("rate", self.rate_window), ("trend", self.trend_window),
                            ("trend step", self.trend_step)):
            if not _DURATION.match(value):
                raise SignalsError(f"{what} window must look like 30s, 1m or 2h (got {value!r})")


def per_ready_replica(metric: m.MetricDef, sel: Selector) -> str:
    """Sum of a gauge over the pool divided by its ready workers (0 ready gives NaN/Inf: missing)."""
    if metric.kind != "gauge":
        raise SignalsError(f"{metric.name} is a {metric.kind}, not a gauge")
    ready = m.exposed_name(m.WORKER_READY)
    return f"sum({m.exposed_name(metric)}{sel.matchers()}) / sum({ready}{sel.matchers()})"


# Which engine roles measure each latency (the same split as the SLO alerts).
TTFT_ROLES = "prefill|both"
ITL_ROLES = "decode|both"


def latency_quantile(metric: m.MetricDef, sel: Selector, settings: QuerySettings, role_regex: str) -> str:
    """histogram_quantile over the rate of the histogram's buckets, summed by `le`."""
    if metric.kind != "histogram":
        raise SignalsError(f"{metric.name} is a {metric.kind}, not a histogram")
    buckets = f"{metric.name}_bucket{sel.matchers(with_pool=False, role_regex=role_regex)}"
    return (f"histogram_quantile({settings.quantile:g}, "
            f"sum by (le) (rate({buckets}[{settings.rate_window}])))")


def pool_queries(pool: str, sel: Selector, settings: QuerySettings = QuerySettings()) -> dict[str, str]:
    """Every query one pool's decision needs, by value name."""
    if pool == PREFILL:
        return {
            QUEUE_REQUESTS: per_ready_replica(m.PREFILL_QUEUE_REQUESTS, sel),
            QUEUE_TOKENS: per_ready_replica(m.PREFILL_QUEUE_TOKENS, sel),
            LATENCY_P: latency_quantile(m.TTFT, sel, settings, TTFT_ROLES),
        }
    if pool == DECODE:
        return {
            KV_USAGE: per_ready_replica(m.KV_USAGE_RATIO, sel),
            LATENCY_P: latency_quantile(m.ITL, sel, settings, ITL_ROLES),
        }
    raise SignalsError(f"unknown pool {pool!r}: expected {PREFILL!r} or {DECODE!r}")


def summed_rate(metric: m.MetricDef, sel: Selector, settings: QuerySettings, *, suffix: str = "_total",
                extra: str = "") -> str:
    """sum(rate(counter[window])) over the selector's series (`extra`: more matchers, e.g. reason!="error")."""
    if metric.kind not in ("counter", "histogram"):
        raise SignalsError(f"{metric.name} is a {metric.kind}, not a counter or histogram")
    matchers = sel.matchers()
    if extra:
        matchers = matchers[:-1] + "," + extra + "}"
    return f"sum(rate({metric.name}{suffix}{matchers}[{settings.rate_window}]))"


def arrival_queries(namespace: str, resource: str, settings: QuerySettings = QuerySettings()) -> dict[str, str]:
    """Every query the predictive policy needs for one DisaggregatedModel, by value name.

    Arrivals are what the routers (pool="router") count: prompt tokens when a request starts
    (tandem_prompt_tokens_total), requests when their first token comes (the TTFT histogram's
    count, so within the TTFT of arrival), streamed tokens and finished requests for the mean
    output length. The backlog is the prefill pool's queued prompt tokens; the busy throughput is
    the prefill workers' prompt tokens per ready replica, only when every replica's queue stayed
    non-empty through the window (otherwise the series is absent: missing, not zero).
    """
    router = Selector(namespace, resource, ROUTER_POOL)
    prefill = Selector(namespace, resource, PREFILL)
    decode = Selector(namespace, resource, DECODE)
    prompt = summed_rate(m.PROMPT_TOKENS, router, settings)
    ready = f"sum({m.exposed_name(m.WORKER_READY)}{prefill.matchers()})"
    busy = (f"min_over_time(min({m.exposed_name(m.PREFILL_QUEUE_REQUESTS)}{prefill.matchers()})"
            f"[{settings.rate_window}:{settings.trend_step}]) > 0")
    return {
        ARRIVAL_PROMPT_TPS: prompt,
        ARRIVAL_PROMPT_TREND: f"deriv(({prompt})[{settings.trend_window}:{settings.trend_step}])",
        ARRIVAL_REQUEST_RATE: summed_rate(m.TTFT, router, settings, suffix="_count"),
        ARRIVAL_OUTPUT_TPS: summed_rate(m.GENERATION_TOKENS, router, settings),
        ARRIVAL_FINISHED_RATE: summed_rate(m.REQUESTS, router, settings, extra=f'{m.LABEL_REASON}!="error"'),
        ARRIVAL_BACKLOG_TOKENS: f"sum({m.exposed_name(m.PREFILL_QUEUE_TOKENS)}{prefill.matchers()})",
        ARRIVAL_DECODE_WAITING: f"sum({m.exposed_name(m.WAITING_REQUESTS)}{decode.matchers()})",
        ARRIVAL_PREFILL_BUSY_TPS: f"({summed_rate(m.PROMPT_TOKENS, prefill, settings)} / {ready}) and on() ({busy})",
    }


def scalar_from_result(result: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
    """One number from an instant-vector result, or (None, why) when there is none to trust."""
    if not result:
        return None, "no series"
    if len(result) > 1:
        return None, f"{len(result)} series where one was expected"
    try:
        value = float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None, f"malformed sample {result[0]!r}"
    if not math.isfinite(value):
        return None, f"value is {value} (no ready replicas or no samples)"
    return value, None


@dataclass(frozen=True)
class PoolSignals:
    """Values for one pool; a name absent from `values` is missing, with the why in `problems`."""

    values: dict[str, float] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        return self.values.get(name)

    def describe_problems(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in sorted(self.problems.items()))


class SignalSource(Protocol):
    def fetch(self, pool: str, sel: Selector) -> PoolSignals: ...


@runtime_checkable
class ArrivalSource(Protocol):
    """A source of the predictive policy's arrival values (PrometheusSignals has both methods)."""

    def fetch_arrivals(self, namespace: str, resource: str) -> PoolSignals: ...


class _QueryClient(Protocol):
    def custom_query(self, query: str, params: dict[str, Any] | None = None,
                     timeout: int | None = None) -> list[dict[str, Any]]: ...


class PrometheusSignals:
    """SignalSource backed by a Prometheus server (URL from the operator settings)."""

    def __init__(self, url: str, *, timeout_s: int = 5, settings: QuerySettings = QuerySettings(),
                 client: _QueryClient | None = None) -> None:
        if client is None:
            from prometheus_api_client import PrometheusConnect
            from urllib3.util.retry import Retry

            # No retries with backoff: a tick that finds Prometheus down should report it at
            # once and try again next interval, not stall the operator for seconds.
            client = PrometheusConnect(url=url, retry=Retry(total=0), timeout=timeout_s)
        self._client = client
        self._settings = settings
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        """One instant query, raising on any failure: for the checks that are not autoscaler signals (the
        output canary, tandem.operator.output_check)."""
        return self._client.custom_query(promql)

    def fetch(self, pool: str, sel: Selector) -> PoolSignals:
        return self._fetch_all(pool_queries(pool, sel, self._settings), frozenset({LATENCY_P}))

    def fetch_arrivals(self, namespace: str, resource: str) -> PoolSignals:
        """The predictive policy's values for one resource (arrival_queries), missing on any failure."""
        return self._fetch_all(arrival_queries(namespace, resource, self._settings), ARRIVAL_OPTIONAL)

    def _fetch_all(self, queries: Mapping[str, str], optional: frozenset[str]) -> PoolSignals:
        values: dict[str, float] = {}
        problems: dict[str, str] = {}
        for name, query in queries.items():
            try:
                result = self._client.custom_query(query)
            except Exception as exc:  # connection, timeout, HTTP status, bad JSON: all "missing"
                problems[name] = f"Prometheus at {self.url} failed: {type(exc).__name__}: {exc}"[:300]
                if name not in optional:
                    # Prometheus is down or refusing: the other queries would fail the same way.
                    for other in queries:
                        if other not in values and other not in problems:
                            problems[other] = "skipped after an earlier query failed"
                    break
                continue
            value, why = scalar_from_result(result)
            if value is None:
                problems[name] = f"{why} for {query}"
            else:
                values[name] = value
        return PoolSignals(values, problems)


class NoSignals:
    """SignalSource for an operator started without a Prometheus URL: everything missing, saying why.

    The autoscaler then holds every pool and reports MetricsUnavailable instead of guessing.
    """

    def __init__(self, why: str = "no Prometheus URL configured (tandem operator --prometheus-url)") -> None:
        self.why = why

    def fetch(self, pool: str, sel: Selector) -> PoolSignals:
        return PoolSignals({}, {name: self.why for name in pool_queries(pool, sel)})

    def fetch_arrivals(self, namespace: str, resource: str) -> PoolSignals:
        return PoolSignals({}, {name: self.why for name in arrival_queries(namespace, resource)})

    def query(self, promql: str) -> list[dict[str, Any]]:
        raise SignalsUnavailable(self.why)


class SignalsUnavailable(RuntimeError):
    """There is no Prometheus to ask (NoSignals.query)."""
