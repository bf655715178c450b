"""The one configuration shared by the dashboard and alert generators.

Like kubernetes-mixin, the SLOs, thresholds and label conventions live here once, and every
PromQL string is assembled from the metric definitions in `tandem.worker.metrics`: a metric or
label that does not exist there raises at generation time instead of drawing an empty panel.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.worker import metrics as m

# Labels Prometheus attaches to every scraped series (Prometheus Operator monitors or the
# plain `kubernetes_sd` example in docs/alerts.md). Operator metrics carry their own
# `namespace` label, which is why the chart scrapes the operator with honorLabels: true.
# The pod label tandem.dev/model (the DisaggregatedModel's name) becomes the target label
# tandem_dev_model: the chart's PodMonitor sets podTargetLabels, and the usual kubernetes_sd
# `labelmap: __meta_kubernetes_pod_label_(.+)` does the same. It is the only link between a
# worker's series (`model` is the *served* model name) and the operator's (`name`).
RESOURCE_TARGET_LABEL = m.LABEL_RESOURCE
TARGET_LABELS = ("namespace", "pod", "instance", "job", RESOURCE_TARGET_LABEL)
# Alerts and SLO recordings aggregate per served model in its namespace.
MODEL_GROUPING = ("namespace", m.LABEL_MODEL)
POOL_GROUPING = ("namespace", m.LABEL_NAME, m.LABEL_POOL)


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def render(self) -> str:
        if self.op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"unknown label matcher operator {self.op!r}")
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.label}{self.op}"{escaped}"'


def eq(label: str, value: str) -> Matcher:
    return Matcher(label, "=", value)


def regex(label: str, value: str) -> Matcher:
    return Matcher(label, "=~", value)


_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "info": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
}


def series(metric: m.MetricDef, suffix: str = "", matchers: Sequence[Matcher] = ()) -> str:
    """`name_suffix{matchers}`, checked against the metric's kind and labels."""
    if metric.kind == "counter" and suffix == "":
        suffix = "_total"
    if suffix not in _SUFFIXES[metric.kind]:
        raise ValueError(f"{metric.name} is a {metric.kind}; suffix {suffix!r} does not exist")
    allowed = set(metric.labels) | set(TARGET_LABELS) | ({"le"} if suffix == "_bucket" else set())
    for matcher in matchers:
        if matcher.label not in allowed:
            raise ValueError(f"{metric.name} has no label {matcher.label!r} (labels: {sorted(allowed)})")
    inner = ", ".join(matcher.render() for matcher in matchers)
    return f"{metric.name}{suffix}{{{inner}}}" if inner else f"{metric.name}{suffix}"


def by(labels: Sequence[str]) -> str:
    return f"by ({', '.join(labels)})"


def le_matcher(bound: float, metric: m.MetricDef) -> Matcher:
    """Select one histogram bucket whatever its float spelling.

    prometheus_client writes `le="2.0"`; Prometheus 3 normalises that to `le="2"` at ingestion.
    """
    if metric.buckets is None or bound not in metric.buckets:
        raise ValueError(f"{bound} is not a bucket boundary of {metric.name}: {metric.buckets}")
    spellings = {repr(float(bound)), f"{bound:g}"}
    return regex("le", "|".join(sorted(re.escape(s) for s in spellings)))


# --- SLOs: the fraction of events under a latency threshold, per model ---

@dataclass(frozen=True)
class LatencySLO:
    key: str  # short name used in record and alert names
    metric: m.MetricDef
    threshold_seconds: float  # must be a bucket boundary of the metric
    objective: float  # fraction of events that must be faster than the threshold
    tier: str  # the pool whose capacity fixes a burn: prefill for TTFT, decode for ITL
    role_regex: str  # which engine roles measure it

    @property
    def error_budget(self) -> float:
        return 1.0 - self.objective


TTFT_SLO = LatencySLO("ttft", m.TTFT, 2.0, 0.99, "prefill", "prefill|both")
ITL_SLO = LatencySLO("itl", m.ITL, 0.1, 0.99, "decode", "decode|both")
SLOS = (TTFT_SLO, ITL_SLO)


@dataclass(frozen=True)
class BurnWindow:
    """Multi-window, multi-burn-rate alerting (Google SRE workbook, chapter 5)."""
    long: str
    short: str
    factor: float  # how many times faster than sustainable the budget is spent
    severity: str
    for_: str


BURN_WINDOWS = (
    BurnWindow(long="1h", short="5m", factor=14.4, severity="critical", for_="2m"),
    BurnWindow(long="6h", short="30m", factor=6.0, severity="warning", for_="15m"),
)
SLO_RATE_WINDOWS = ("5m", "30m", "1h", "6h")


def slo_record_name(slo: LatencySLO, window: str) -> str:
    return f"tandem:{slo.key}_slo_errors:ratio_rate{window}"


def slo_error_ratio(slo: LatencySLO, window: str) -> str:
    """Fraction of events slower than the SLO threshold over `window`, per model."""
    role = regex(m.LABEL_ROLE, slo.role_regex)
    fast = series(slo.metric, "_bucket", [role, le_matcher(slo.threshold_seconds, slo.metric)])
    total = series(slo.metric, "_count", [role])
    group = by(MODEL_GROUPING)
    return f"1 - (sum {group} (rate({fast}[{window}])) / sum {group} (rate({total}[{window}])))"


# --- other alert thresholds ---
KV_TRANSFER_FAILURE_RATIO = 0.05  # failed / attempted, over 10m
KV_TRANSFER_WINDOW = "10m"
KV_TRANSFER_FOR = "10m"
SCALING_LIMITED_FOR = "15m"
WORKERS_DOWN_FOR = "10m"
RECONCILE_ERROR_RATIO = 0.1
RECONCILE_ERRORS_FOR = "15m"
# The router's output canary (worker/router/canary.py, one probe a minute by default): two mismatches in this
# window. One could be a near-tie flipped by a different batch shape on a GPU; a wrong KV path mismatches
# on every probe. Defined in tandem.worker.metrics: the operator's OutputVerified condition uses the same.
CANARY_WINDOW = m.CANARY_MISMATCH_WINDOW
CANARY_MISMATCHES = m.CANARY_MISMATCH_THRESHOLD
# Each alert links to its section in docs/alerts.md (a path in this repository).
RUNBOOK_BASE = "docs/alerts.md"

# The pools the operator manages, i.e. the ones with autoscaler series.
SCALED_POOLS = "prefill|decode"
