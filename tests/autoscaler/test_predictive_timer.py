"""The timer body with autoscaling.policy predictive: arrival signals + spec.capacityProfile -> sizes, clamped
like a reactive decision, with the reactive decision as the fallback when an arrival value is missing."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec

PROFILE = {"prefillTokensPerSecond": 8000, "kvTokens": 160000, "itlBaseSeconds": 0.015,
           "itlPerRequestSeconds": 0.0004, "startupSeconds": 30}
# Reactive signals exactly at target: a reactive decision would hold every pool.
STEADY = {"prefill": {sig.QUEUE_REQUESTS: 4.0, sig.QUEUE_TOKENS: 4000.0}, "decode": {sig.KV_USAGE: 0.5}}
T0 = 1_764_400_000.0


def make_spec(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, replicas: int = 1,
              **extra: Any) -> DisaggregatedModelSpec:
    def pool(target: dict[str, Any], over: dict[str, Any] | None) -> dict[str, Any]:
        return {"replicas": replicas, "autoscaling": {"enabled": True, "policy": "predictive", "maxReplicas": 16,
                                                      "scaleDownStabilizationSeconds": 120, **target, **(over or {})}}
    body: dict[str, Any] = {
        "model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}},
        "prefill": pool({"targetQueueDepth": 4}, prefill),
        "decode": pool({"targetKVUtilization": 0.5}, decode),
        "slo": {"ttftMs": 2000, "itlMs": 100},
        "capacityProfile": PROFILE,
        **extra,
    }
    return DisaggregatedModelSpec.model_validate(body)


def arrivals(prompt_tps: float, trend: float = 0.0, mean_prompt: float = 1000.0, mean_output: float = 200.0,
             backlog: float = 0.0, **more: float) -> dict[str, float]:
    rps = prompt_tps / mean_prompt
    return {sig.ARRIVAL_PROMPT_TPS: prompt_tps, sig.ARRIVAL_PROMPT_TREND: trend, sig.ARRIVAL_REQUEST_RATE: rps,
            sig.ARRIVAL_OUTPUT_TPS: rps * mean_output, sig.ARRIVAL_FINISHED_RATE: rps,
            sig.ARRIVAL_BACKLOG_TOKENS: backlog, sig.ARRIVAL_DECODE_WAITING: 0.0, **more}


class Source:
    """Pool signals and arrival values as set; `arrival_problems` makes values missing."""

    def __init__(self, values: dict[str, float], pools: dict[str, dict[str, float]] = STEADY,
                 arrival_problems: dict[str, str] | None = None) -> None:
        self.values, self.pools, self.arrival_problems = values, pools, arrival_problems or {}
        self.asked: list[tuple[str, str]] = []

    def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
        return sig.PoolSignals(dict(self.pools.get(pool, {})), {})

    def fetch_arrivals(self, namespace: str, resource: str) -> sig.PoolSignals:
        self.asked.append((namespace, resource))
        values = {k: v for k, v in self.values.items() if k not in self.arrival_problems}
        return sig.PoolSignals(values, dict(self.arrival_problems))


def counts(prefill: int, decode: int) -> dict[str, t.PoolCounts]:
    return {"prefill": t.PoolCounts(ready=prefill), "decode": t.PoolCounts(ready=decode)}


def tick(spec: DisaggregatedModelSpec, source: Any, status: dict[str, Any] | None = None,
         state: dict[str, Any] | None = None, now: float = T0, ready: tuple[int, int] = (1, 1)) -> t.TickResult:
    return t.autoscale_tick(spec=spec, status=status, namespace="team-a", name="tiny", counts=counts(*ready),
                            signals=source, clock=lambda: now, state=state)


def test_a_rising_trend_scales_prefill_up_ahead_of_the_load() -> None:
    spec = make_spec()
    # 4000 tok/s fits one replica at 80% of 8000; +100 tok/s per s is 8500 in 45 s (30 s start + 15 s).
    flat = tick(spec, Source(arrivals(4000)))
    assert flat.desired == {"prefill": 1, "decode": 1}
    source = Source(arrivals(4000, trend=100))
    rising = tick(spec, source)
    assert source.asked == [("team-a", "tiny")]
    assert rising.desired["prefill"] == 2
    reason = rising.status["prefill"]["scaleReason"]
    assert reason.startswith("predictive: arriving 4000 prompt tok/s (trend +100/s, 8500 in 45s)")
    assert "-> 2 prefill" in reason
    assert any(e.reason == "ScaledUp" and e.message.startswith("prefill 1 -> 2: predictive") for e in rising.events)
    active = next(c for c in rising.conditions if c.type == t.SCALING_ACTIVE)
    assert (active.status, active.reason) == ("True", "ValidMetrics") and "predictive: prefill, decode" in active.message
    # The reactive memory is kept beside the predictive one (a later fallback starts from it).
    assert rising.state["prefill"]["predictive"]["history"][-1][1:] == [2, 1]
    assert "recommendations" in rising.state["prefill"]


def test_missing_arrivals_fall_back_to_the_reactive_decision_and_say_so_once() -> None:
    spec = make_spec(replicas=2)
    high_queue = {"prefill": {sig.QUEUE_REQUESTS: 12.0, sig.QUEUE_TOKENS: 4000.0}, "decode": {sig.KV_USAGE: 0.5}}
    source = Source(arrivals(4000), pools=high_queue,
                    arrival_problems={sig.ARRIVAL_PROMPT_TPS: "no series for sum(rate(...))"})
    first = tick(spec, source, ready=(2, 2))
    assert first.desired["prefill"] == 6  # reactive: 2 ready x 12/4
    reason = first.status["prefill"]["scaleReason"]
    assert reason.startswith("predictive: prompt_tps no series for sum(rate(...)); reactive fallback; signal 12")
    active = next(c for c in first.conditions if c.type == t.SCALING_ACTIVE)
    assert (active.status, active.reason) == ("True", t.REACTIVE_FALLBACK)
    assert [e.reason for e in first.events].count("PredictiveFallback") == 1
    status = {"conditions": [{"type": c.type, "status": c.status, "reason": c.reason} for c in first.conditions]}
    again = tick(spec, source, status=status, state=first.state, now=T0 + 15, ready=(2, 2))
    assert "PredictiveFallback" not in [e.reason for e in again.events]


def test_a_source_without_arrival_queries_and_an_unmeetable_profile_fall_back() -> None:
    class PoolsOnly:
        def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
            return sig.PoolSignals(dict(STEADY[pool]), {})

    result = tick(make_spec(), PoolsOnly())
    assert "no arrival queries; reactive fallback" in result.status["decode"]["scaleReason"]
    # One decode step at batch 1 (15 ms) is above the ITL SLO: no size meets it.
    slow = make_spec(slo={"ttftMs": 2000, "itlMs": 10})
    result = tick(slow, Source(arrivals(4000)))
    assert "capacity profile cannot be sized" in result.status["decode"]["scaleReason"]
    assert result.desired == {"prefill": 1, "decode": 1}


def test_nothing_arriving_is_a_size_of_min_not_a_missing_signal() -> None:
    result = tick(make_spec(), Source(arrivals(0.0, mean_prompt=1.0)))
    assert result.desired == {"prefill": 1, "decode": 1}
    assert result.status["prefill"]["scaleReason"].startswith("predictive: arriving 0 prompt tok/s")
    assert next(c for c in result.conditions if c.type == t.SCALING_ACTIVE).reason == "ValidMetrics"


@pytest.mark.parametrize(("values", "why"), [
    ({sig.ARRIVAL_FINISHED_RATE: 0.0}, "none finished in the window"),
    ({sig.ARRIVAL_REQUEST_RATE: 0.0}, "no request reached its first token"),
    ({sig.ARRIVAL_BACKLOG_TOKENS: -1.0}, "invalid arrival values"),
])
def test_arrival_values_that_cannot_give_lengths_are_missing_not_zero(values: dict[str, float], why: str) -> None:
    load, reason, _ = t.arrival_load(sig.PoolSignals({**arrivals(4000), **values}, {}))
    assert load is None and why in reason


def test_arrival_load_derives_lengths_and_waiting_kv() -> None:
    load, reason, notes = t.arrival_load(sig.PoolSignals(
        {**arrivals(4000, mean_prompt=500, mean_output=100, backlog=3000), sig.ARRIVAL_DECODE_WAITING: 2.0,
         sig.ARRIVAL_PREFILL_BUSY_TPS: 7000.0}, {}))
    assert load is not None and reason == "" and notes == []
    assert (load.request_rate, load.mean_prompt, load.mean_output) == (8.0, 500.0, 100.0)
    assert (load.backlog_tokens, load.kv_waiting_tokens, load.prefill_busy_tps) == (3000.0, 1200.0, 7000.0)
    values = arrivals(4000)
    del values[sig.ARRIVAL_DECODE_WAITING]
    load, _, notes = t.arrival_load(sig.PoolSignals(values, {}))
    assert load is not None and load.kv_waiting_tokens == 0 and notes == ["decode waiting requests unknown (not counted)"]


def test_predictive_sizes_are_clamped_to_max_replicas_and_the_ratio_band() -> None:
    spec = make_spec(prefill={"maxReplicas": 6}, ratio={"minPrefillPerDecode": 0, "maxPrefillPerDecode": 2})
    # 64000 tok/s wants 10 prefill replicas at 80%; short outputs want one decode replica.
    result = tick(spec, Source(arrivals(64000, mean_prompt=4000, mean_output=10)))
    assert result.decisions["prefill"].recommendation == 10
    assert result.desired["prefill"] == 6
    assert "capped at maxReplicas 6 (load wants 10)" in result.status["prefill"]["scaleReason"]
    assert result.desired["decode"] == 3  # the band [-, 2] raises decode for 6 prefill
    assert "P:D ratio band [-, 2]: decode raised to 3 for 6 prefill" in result.status["decode"]["scaleReason"]
    limited = next(c for c in result.conditions if c.type == t.SCALING_LIMITED)
    assert (limited.status, limited.reason) == ("True", "TooManyReplicas")


def test_predictive_respects_the_capacity_cap_after_unschedulable_pods() -> None:
    spec = make_spec(replicas=4)
    source = Source(arrivals(64000, mean_prompt=4000, mean_output=10))
    status = {"prefill": {"desiredReplicas": 4}, "decode": {"desiredReplicas": 4}}
    stuck = t.autoscale_tick(spec=spec, status=status, namespace="team-a", name="tiny",
                             counts={"prefill": t.PoolCounts(ready=2, unschedulable=2), "decode": t.PoolCounts(4)},
                             signals=source, clock=lambda: T0)
    assert stuck.desired["prefill"] == 2
    assert "the capacity rule decides" in stuck.status["prefill"]["scaleReason"]
    later = t.autoscale_tick(spec=spec, status={"prefill": {"desiredReplicas": 2}, "decode": {"desiredReplicas": 4}},
                             namespace="team-a", name="tiny", counts=counts(2, 4), signals=source,
                             clock=lambda: T0 + 15, state=stuck.state)
    assert later.desired["prefill"] == 2 and "Unschedulable" in later.decisions["prefill"].limits


def test_scale_down_waits_for_the_down_window_then_steps() -> None:
    spec = make_spec()
    state: dict[str, Any] | None = None
    status: dict[str, Any] = {"prefill": {"desiredReplicas": 1}, "decode": {"desiredReplicas": 1}}
    sizes, reasons = [], []
    for k in range(20):
        now = T0 + 15 * k
        load = arrivals(48000) if k < 2 else arrivals(4000)  # 8 prefill replicas' worth, then 1
        result = tick(spec, Source(load), status=status, state=state, now=now)
        state = result.state
        status = {p: {"desiredReplicas": n} for p, n in result.desired.items()}
        sizes.append(result.desired["prefill"])
        reasons.append(result.status["prefill"]["scaleReason"])
    assert sizes[:2] == [8, 8]
    # The last high need (t=15) leaves the 120 s window at t=135: held until then, then -2 per step.
    assert sizes[2:9] == [8] * 7
    assert sizes[9:13] == [6, 4, 2, 1]
    assert "prefill: down to 6, the highest need of the last 120s (at most -2 per step)" in reasons[9]
    assert all("decode: down" not in r for r in reasons)  # only this pool's notes


def test_a_reactive_pool_beside_a_predictive_one_is_unchanged() -> None:
    spec = make_spec(decode={"policy": "reactive"})
    result = tick(spec, Source(arrivals(4000, trend=100)))
    assert result.desired["prefill"] == 2
    assert not result.status["decode"]["scaleReason"].startswith("predictive")
    assert "predictive" not in result.state["decode"]


def test_policy_predictive_without_a_profile_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs spec\.capacityProfile"):
        DisaggregatedModelSpec.model_validate({"model": {"name": "m", "source": {"path": "/m"}},
                                               "decode": {"autoscaling": {"policy": "predictive"}}})
    spec = make_spec()
    assert t.capacity_profile(spec) is not None
    assert t.capacity_profile(spec).prefill_tps == 8000  # type: ignore[union-attr]
