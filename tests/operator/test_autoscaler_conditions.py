"""The autoscaler's ScalingLimited condition when there is no load signal to compare with."""

from __future__ import annotations

from typing import Any

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec

T0 = 1_764_400_000.0
READY = {"prefill": t.PoolCounts(ready=1), "decode": t.PoolCounts(ready=1)}


class DecodeOnly:
    """Prefill's signal is missing, decode's is at its target."""

    def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
        if pool == "prefill":
            return sig.PoolSignals({}, {sig.QUEUE_REQUESTS: "no data for this pool yet"})
        return sig.PoolSignals({sig.KV_USAGE: 0.5}, {})


def spec() -> DisaggregatedModelSpec:
    auto: dict[str, Any] = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": "m", "source": {"path": "/m"}},
        "prefill": {"autoscaling": {**auto, "targetQueueDepth": 2}},
        "decode": {"autoscaling": {**auto, "targetKVUtilization": 0.5}},
    })


def conditions(source: sig.SignalSource) -> dict[str, t.ConditionValue]:
    result = t.autoscale_tick(spec=spec(), status=None, namespace="ns", name="tiny", counts=READY, signals=source,
                              clock=lambda: T0)
    return {c.type: c for c in result.conditions}


def test_without_prometheus_scaling_limited_says_there_is_no_signal() -> None:
    got = conditions(sig.NoSignals())
    assert (got["ScalingActive"].status, got["ScalingActive"].reason) == ("False", "MetricsUnavailable")
    limited = got["ScalingLimited"]
    assert (limited.status, limited.reason) == ("Unknown", "MetricsUnavailable"), limited
    assert "where its load wants it" not in limited.message
    assert "prefill: no load signal (no Prometheus URL configured" in limited.message, limited.message
    assert "decode: no load signal" in limited.message and "held at 1" in limited.message


def test_one_pool_without_a_signal_is_still_unknown_not_within_range() -> None:
    limited = conditions(DecodeOnly())["ScalingLimited"]
    assert (limited.status, limited.reason) == ("Unknown", "MetricsUnavailable"), limited
    assert limited.message.startswith("prefill: no load signal (no data for this pool yet)"), limited.message
    assert "decode" not in limited.message
