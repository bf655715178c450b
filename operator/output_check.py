"""Pure: the routers' output canary as read from Prometheus -> the OutputVerified condition.

Every router probes its decode workers with one greedy request, prefilled locally and disaggregated,
and counts the result in tandem_router_canary_probes_total{result} (worker/router/canary.py). The
operator sums those counters over the resource's routers (selected like the autoscaler's signals:
`namespace` and the target label `tandem_dev_model`, the DisaggregatedModel's name) over the window
and with the threshold of the alert TandemOutputMismatch (tandem.worker.metrics
CANARY_MISMATCH_WINDOW / CANARY_MISMATCH_THRESHOLD, shared with hack/monitoring_config.py):

  - True, CanaryMatched: probes matched and none mismatched in the window;
  - False, CanaryMismatch: at least the threshold of mismatches (the alert fires too);
  - Unknown, CanaryMismatchUnconfirmed: mismatches, but fewer than the threshold (one can be a
    near-tie flipped by a batch shape on a GPU);
  - Unknown, NoCanaryProbes: no probe compared anything in the window (canary off, no prefill and
    decode worker of one layout, only skipped or failed probes, no router scraped yet);
  - Unknown, MetricsUnavailable: no Prometheus configured, or the query failed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.operator.conditions import ConditionValue
from tandem.operator.signals import SignalsError, resource_matchers
from tandem.worker import metrics as m

OUTPUT_VERIFIED = "OutputVerified"
MATCH, MISMATCH, SKIPPED, ERROR = "match", "mismatch", "skipped", "error"
RESULTS = (MATCH, MISMATCH, SKIPPED, ERROR)
WINDOW = m.CANARY_MISMATCH_WINDOW
THRESHOLD = m.CANARY_MISMATCH_THRESHOLD
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d)$")
_MAX_MESSAGE_CHARS = 1000


def canary_query(namespace: str, resource: str, window: str = WINDOW) -> str:
    """The canary's results of one DisaggregatedModel's routers over `window`, one series per result."""
    if not _DURATION.match(window):
        raise SignalsError(f"canary window must look like 30m or 1h (got {window!r})")
    selector = "{" + ",".join(resource_matchers(namespace, resource)) + "}"
    return (f"sum by (result) (increase({m.exposed_name(m.ROUTER_CANARY_PROBES)}{selector}[{window}]))")


@dataclass(frozen=True)
class CanaryCounts:
    """Probes per result in the window (increase() extrapolates, so not always whole numbers)."""

    match: float = 0.0
    mismatch: float = 0.0
    skipped: float = 0.0
    error: float = 0.0


def counts_from_result(result: Sequence[Mapping[str, Any]]) -> tuple[CanaryCounts | None, str | None]:
    """CanaryCounts from the query's result, or (None, why) when there is nothing to trust."""
    if not result:
        return None, "no canary series for this resource (no router scraped yet)"
    counts: dict[str, float] = {}
    for sample in result:
        label = (sample.get("metric") or {}).get("result")
        if label not in RESULTS:
            continue
        try:
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            return None, f"malformed sample {sample!r}"
        if not math.isfinite(value):
            return None, f"{label} count is {value}"
        counts[label] = value
    if not counts:
        return None, "no series with a known result label"
    return CanaryCounts(**counts), None


def _n(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


def output_condition(counts: CanaryCounts | None, why: str | None = None, *, metrics_failed: bool = False,
                     window: str = WINDOW, threshold: float = THRESHOLD) -> ConditionValue:
    """The OutputVerified condition from the window's counts (None: no data, `why` says why).

    `metrics_failed`: the counts are missing because Prometheus could not be asked (MetricsUnavailable),
    not because the routers reported no probes (NoCanaryProbes).
    """
    if counts is None:
        reason = "MetricsUnavailable" if metrics_failed else "NoCanaryProbes"
        return ConditionValue(OUTPUT_VERIFIED, "Unknown", reason,
                              f"no canary result to judge: {why or 'no data'}"[:_MAX_MESSAGE_CHARS])
    others = f"skipped {_n(counts.skipped)}, error {_n(counts.error)}"
    if counts.mismatch >= threshold:
        return ConditionValue(
            OUTPUT_VERIFIED, "False", "CanaryMismatch",
            f"{_n(counts.mismatch)} canary probes in the last {window} got different greedy tokens disaggregated "
            f"than with a local prefill on the same decode worker (matched {_n(counts.match)}, {others}): the "
            "disaggregated path serves wrong output; the routers' logs name the worker pairs")
    if counts.mismatch > 0:
        return ConditionValue(
            OUTPUT_VERIFIED, "Unknown", "CanaryMismatchUnconfirmed",
            f"{_n(counts.mismatch)} canary mismatch in the last {window}, fewer than {threshold:g} (matched "
            f"{_n(counts.match)}, {others}): one can be a near-tie flipped by a batch shape; more mean wrong output")
    if counts.match > 0:
        return ConditionValue(OUTPUT_VERIFIED, "True", "CanaryMatched",
                              f"{_n(counts.match)} canary probes in the last {window} matched, none mismatched "
                              f"({others})")
    return ConditionValue(
        OUTPUT_VERIFIED, "Unknown", "NoCanaryProbes",
        f"no canary probe compared outputs in the last {window} ({others}): the routers' canary is off "
        "(--canary-interval 0), or there is no ready prefill and decode worker of one layout")


class PromQuery(Protocol):
    """signals.PrometheusSignals, or signals.NoSignals (whose query raises, saying why)."""

    def query(self, promql: str) -> list[dict[str, Any]]: ...


def read_output_condition(source: PromQuery, namespace: str, resource: str) -> ConditionValue:
    """Ask Prometheus and judge; never raises (a failure is an Unknown condition saying why)."""
    try:
        result = source.query(canary_query(namespace, resource))
    except Exception as exc:  # no Prometheus, connection, timeout, HTTP status, bad JSON
        url = getattr(source, "url", None)
        where = f"Prometheus at {url} failed: {type(exc).__name__}: " if url else ""
        return output_condition(None, f"{where}{exc}"[:300], metrics_failed=True)
    counts, why = counts_from_result(result)
    # Series that cannot be read are a metrics problem; no series at all means no router reported yet.
    return output_condition(counts, why, metrics_failed=bool(result))
