"""Table-driven tests for the pure autoscaling policy (tandem.operator.autoscaling)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from tandem.operator.autoscaling import (
    DECODE,
    PREFILL,
    PolicyError,
    PoolDecision,
    PoolObservation,
    PoolPolicy,
    PoolState,
    RatioBand,
    decide,
)

BASE = PoolPolicy(min_replicas=1, max_replicas=20, target=5.0, tolerance=0.1,
                  scale_up_stabilization_s=0, scale_down_stabilization_s=300, max_scale_up_pods=4,
                  max_scale_up_percent=100, cooldown_s=60, slo_latency_s=None)
# A state that has watched the pool long enough for every window, with no recent change.
SETTLED = PoolState(observed_since=-10_000.0)
NOW = 1000.0


def one(policy: PoolPolicy, obs: PoolObservation, state: PoolState = SETTLED, now: float = NOW,
        pool: str = PREFILL) -> PoolDecision:
    """One tick for one pool, the other pool fixed and no ratio band."""
    other = DECODE if pool == PREFILL else PREFILL
    return decide({pool: policy, other: None}, {pool: obs, other: PoolObservation(1, 1, signal=0.0)},
                  {pool: state}, None, now)[pool]


def obs(replicas: int, signal: float | None, ready: int | None = None, **kw: float | int | None) -> PoolObservation:
    return PoolObservation(replicas=replicas, ready=replicas if ready is None else ready, signal=signal, **kw)


@pytest.mark.parametrize(("case", "policy", "observation", "desired"), [
    ("double load doubles the pool", BASE, obs(2, 10.0), 4),
    ("half load halves it", BASE, obs(4, 2.5), 2),
    ("inside the tolerance band: hold (up)", BASE, obs(4, 5.4), 4),
    ("inside the tolerance band: hold (down)", BASE, obs(4, 4.6), 4),
    ("just outside the band scales", BASE, obs(2, 5.6), 3),
    ("ceil is exact on whole numbers (1.1 / 0.1 is 11.000000000000002)",
     replace(BASE, target=0.1, max_scale_up_pods=100), obs(1, 1.1), 11),
    ("zero load goes to min", BASE, obs(4, 0.0), 1),
    ("never below min", replace(BASE, min_replicas=3), obs(4, 0.0), 3),
    ("never above max", replace(BASE, max_replicas=6, max_scale_up_pods=100), obs(4, 50.0), 6),
    ("step: +4 pods when that beats +100%", BASE, obs(2, 50.0), 6),
    ("step: +100% when that beats +4 pods", BASE, obs(8, 50.0), 16),
    ("step: percent only", replace(BASE, max_scale_up_pods=0, max_scale_up_percent=50), obs(4, 50.0), 6),
    ("step: pods only", replace(BASE, max_scale_up_pods=1, max_scale_up_percent=0), obs(4, 50.0), 5),
    ("queued tokens win when they are the larger ratio",
     replace(BASE, target_tokens=1000.0), obs(2, 5.0, signal_tokens=3000.0), 6),
    ("queued tokens below target do not scale down a busy pool",
     replace(BASE, target_tokens=1000.0), obs(2, 10.0, signal_tokens=10.0), 4),
])
def test_hpa_formula_bounds_and_step(case: str, policy: PoolPolicy, observation: PoolObservation,
                                     desired: int) -> None:
    assert one(policy, observation).desired == desired, case


@pytest.mark.parametrize(("case", "observation", "desired", "reason_part"), [
    ("starting pods absorb the load: no second scale-up", obs(4, 7.5, ready=2), 4, "starting pods"),
    ("more load than the starting pods can absorb", obs(4, 15.0, ready=2), 6, "2 ready x 3"),
    ("load is measured on ready pods only", obs(6, 10.0, ready=3), 6, "starting pods"),
])
def test_credit_for_pods_not_ready(case: str, observation: PoolObservation, desired: int,
                                   reason_part: str) -> None:
    d = one(BASE, observation)
    assert d.desired == desired, case
    assert any(reason_part in r for r in d.reasons), d.reasons


@pytest.mark.parametrize(("case", "observation"), [
    ("signal missing", obs(5, None)),
    ("signal NaN (0/0 in PromQL)", obs(5, math.nan)),
    ("signal infinite", obs(5, math.inf)),
    ("signal negative", obs(5, -1.0)),
    ("no ready replicas", obs(5, 0.0, ready=0)),
])
def test_missing_metrics_hold_the_current_size(case: str, observation: PoolObservation) -> None:
    # History says the pool was idle for a long time: a naive policy would drop to min.
    idle = PoolState(recommendations=tuple((NOW - s, 1) for s in range(0, 600, 15)), observed_since=0.0)
    d = one(BASE, observation, idle)
    assert (d.desired, d.metrics_missing, d.recommendation) == (5, True, None), case
    assert any("holding 5" in r for r in d.reasons)
    assert d.state.recommendations == idle.recommendations, "a gap adds nothing to the history"


def test_missing_metrics_still_respect_a_lowered_max() -> None:
    d = one(replace(BASE, max_replicas=3), obs(5, None))
    assert (d.desired, d.metrics_missing, d.limits) == (3, True, ("MinMax",))


def test_scale_down_waits_for_the_window_then_follows_its_highest_recommendation() -> None:
    high_then_low = PoolState(recommendations=((NOW - 250, 8), (NOW - 100, 6), (NOW - 15, 3)),
                              observed_since=0.0)
    d = one(BASE, obs(8, 2.5, ready=8), high_then_low)  # raw recommendation 4
    assert d.recommendation == 4
    assert d.desired == 8, "the 8 from 250 s ago is still inside the 300 s window"
    later = one(BASE, obs(8, 2.5), high_then_low, now=NOW + 60)
    assert later.desired == 6, "the 8 aged out; 6 is now the highest in the window"
    much_later = one(BASE, obs(8, 2.5), high_then_low, now=NOW + 400)
    assert much_later.desired == 4


def test_scale_up_window_ignores_a_one_tick_spike() -> None:
    policy = replace(BASE, scale_up_stabilization_s=30)
    calm = PoolState(recommendations=((NOW - 15, 2),), observed_since=0.0)
    spike = one(policy, obs(2, 25.0), calm)
    assert spike.desired == 2 and any("scale-up window" in r for r in spike.reasons)
    sustained = one(policy, obs(2, 25.0), spike.state, now=NOW + 31)
    assert sustained.desired == 6  # 10 wanted, +4 step


def test_no_scale_down_before_a_full_window_after_a_restart() -> None:
    fresh = PoolState()
    d = one(BASE, obs(6, 0.5), fresh)
    assert d.desired == 6 and any("not yet filled" in r for r in d.reasons)
    assert d.state.observed_since == NOW
    assert one(BASE, obs(6, 0.5), fresh).state.recommendations == ((NOW, 1),)
    # A restart never blocks a scale-up.
    assert one(BASE, obs(2, 10.0), fresh).desired == 4


@pytest.mark.parametrize(("case", "since_change", "observation", "desired"), [
    ("scale-down blocked inside the cooldown", 30.0, obs(6, 0.5), 6),
    ("scale-down allowed after the cooldown", 61.0, obs(6, 0.5), 1),
    ("scale-up is never blocked by the cooldown", 5.0, obs(2, 10.0), 4),
])
def test_cooldown(case: str, since_change: float, observation: PoolObservation, desired: int) -> None:
    policy = replace(BASE, scale_down_stabilization_s=0)
    state = replace(SETTLED, last_scale_time=NOW - since_change)
    assert one(policy, observation, state).desired == desired, case


def test_a_change_stamps_last_scale_time_and_a_hold_keeps_it() -> None:
    changed = one(BASE, obs(2, 10.0), replace(SETTLED, last_scale_time=1.0))
    held = one(BASE, obs(2, 5.0), replace(SETTLED, last_scale_time=1.0))
    assert (changed.state.last_scale_time, held.state.last_scale_time) == (NOW, 1.0)


class TestUnschedulable:
    def test_scales_back_to_what_was_placed_and_reports_it(self) -> None:
        d = one(BASE, obs(10, 50.0, ready=6, unschedulable=4))
        assert d.desired == 6 and d.limits == ("Unschedulable",)
        assert "4 prefill pods could not be scheduled" in d.reasons[0]
        assert d.state.capacity_cap == 6

    def test_no_scale_up_while_capped_then_one_retry_after_the_backoff(self) -> None:
        first = one(BASE, obs(10, 50.0, ready=6, unschedulable=4))
        capped = one(BASE, obs(6, 50.0), first.state, now=NOW + 15)
        assert capped.desired == 6 and "Unschedulable" in capped.limits
        retry = one(BASE, obs(6, 50.0), first.state, now=NOW + BASE.unschedulable_backoff_s + 1)
        assert retry.desired == 12 and retry.state.capacity_cap is None  # +100% step

    def test_the_cap_never_forces_a_scale_down(self) -> None:
        first = one(BASE, obs(10, 50.0, ready=6, unschedulable=4))
        # Someone freed capacity and the operator already runs 8: the cap of 6 must not cut it.
        d = one(BASE, obs(8, 50.0), first.state, now=NOW + 15)
        assert d.desired == 8

    def test_never_below_min_even_when_nothing_was_placed(self) -> None:
        d = one(replace(BASE, min_replicas=2), obs(3, None, ready=0, unschedulable=3))
        assert d.desired == 2 and "minReplicas" in d.reasons[0]


class TestSloGuard:
    POLICY = replace(BASE, slo_latency_s=0.5)

    @pytest.mark.parametrize(("case", "observation", "state", "desired", "reason_part"), [
        ("latency breach scales up below the queue target",
         obs(4, 3.0, latency_p90_s=1.0), SETTLED, 8, "SLO guard -> 8"),
        ("latency above SLO but inside tolerance: no scale-down, no scale-up",
         obs(4, 3.0, latency_p90_s=0.52), SETTLED, 4, "no scale-down"),
        ("latency within SLO: the queue decides",
         obs(4, 3.0, latency_p90_s=0.3), SETTLED, 3, "signal 3 vs target 5"),
        ("no traffic (no latency): the queue decides",
         obs(4, 3.0, latency_p90_s=None), SETTLED, 3, "signal 3 vs target 5"),
        ("pool nearly idle: a high p90 is stale or service-bound, the queue decides",
         obs(4, 1.0, latency_p90_s=1.0), SETTLED, 1, "nothing waits"),
        ("starting pods get credit first",
         obs(6, 3.0, ready=4, latency_p90_s=1.0), SETTLED, 6, "starting pods get credit"),
        ("hold off right after a change (the quantile still shows old load)",
         obs(4, 3.0, latency_p90_s=1.0), replace(SETTLED, last_scale_time=NOW - 20), 4, "waiting 60s"),
        ("the last SLO scale-up did not help: the guard steps aside",
         obs(8, 3.0, latency_p90_s=0.98), replace(SETTLED, slo_guard_latency=1.0), 5, "service-bound"),
        ("the last SLO scale-up helped: the guard goes on",
         obs(8, 3.0, latency_p90_s=0.8), replace(SETTLED, slo_guard_latency=1.0), 13, "SLO guard -> 13"),
    ])
    def test_prefill_ttft(self, case: str, observation: PoolObservation, state: PoolState,
                          desired: int, reason_part: str) -> None:
        d = one(self.POLICY, observation, state)
        assert d.desired == desired, case
        assert any(reason_part in r for r in d.reasons), d.reasons

    def test_the_guard_remembers_the_latency_it_acted_on_and_forgets_it_once_met(self) -> None:
        fired = one(self.POLICY, obs(4, 3.0, latency_p90_s=1.0))
        assert fired.state.slo_guard_latency == 1.0
        met = one(self.POLICY, obs(8, 3.0, latency_p90_s=0.4), fired.state, now=NOW + 100)
        assert met.state.slo_guard_latency is None

    def test_decode_itl_guard_is_the_same_rule(self) -> None:
        policy = replace(BASE, target=0.8, slo_latency_s=0.05)
        d = one(policy, obs(3, 0.4, latency_p90_s=0.1), pool=DECODE)
        assert d.desired == 6 and d.pool == DECODE


@pytest.mark.parametrize(("case", "since_change", "desired", "reason_part"), [
    ("pods of a scale-up 15 s ago still starting: no second scale-up", 15.0, 6, "still starting"),
    ("the grace is over: slow pods no longer block", 200.0, 10, "2 ready x 5"),
])
def test_no_second_scale_up_while_the_last_one_is_starting(case: str, since_change: float, desired: int,
                                                           reason_part: str) -> None:
    # Backlog keeps growing on the 2 ready pods while the 4 new ones start.
    d = one(BASE, obs(6, 25.0, ready=2), replace(SETTLED, last_scale_time=NOW - since_change))
    assert d.desired == desired, case
    assert any(reason_part in r for r in d.reasons), d.reasons


@pytest.mark.parametrize(("case", "band", "prefill", "decode", "expected"), [
    ("inside the band: untouched", RatioBand(0.5, 2.0), 4, 4, (4, 4)),
    ("too few prefill: prefill raised", RatioBand(0.5, 2.0), 1, 6, (3, 6)),
    ("too many prefill: decode raised", RatioBand(0.5, 2.0), 10, 3, (10, 5)),
    ("only a lower bound", RatioBand(1.0, None), 2, 5, (5, 5)),
    ("only an upper bound", RatioBand(None, 1.0), 5, 2, (5, 5)),
    ("fractional band rounds towards more capacity", RatioBand(0.34, 0.5), 1, 4, (2, 4)),
])
def test_ratio_band_raises_the_short_side(case: str, band: RatioBand, prefill: int, decode: int,
                                          expected: tuple[int, int]) -> None:
    policies = {PREFILL: replace(BASE, max_replicas=20), DECODE: replace(BASE, max_replicas=20)}
    observations = {PREFILL: obs(prefill, 5.0), DECODE: obs(decode, 5.0)}
    out = decide(policies, observations, {PREFILL: SETTLED, DECODE: SETTLED}, band, NOW)
    assert (out[PREFILL].desired, out[DECODE].desired) == expected, case


@pytest.mark.parametrize(("case", "prefill_bounds", "decode_bounds", "prefill", "decode", "expected", "limited"), [
    ("prefill at its max: decode lowered to fit", (1, 2), (1, 20), 2, 8, (2, 4), False),
    ("decode at its max: prefill lowered to fit", (1, 20), (1, 3), 12, 3, (6, 3), False),
    ("both pinned by min/max: best effort, ScalingLimited", (2, 2), (8, 8), 2, 8, (2, 8), True),
])
def test_ratio_band_lowers_the_other_side_when_it_cannot_raise(
        case: str, prefill_bounds: tuple[int, int], decode_bounds: tuple[int, int], prefill: int,
        decode: int, expected: tuple[int, int], limited: bool) -> None:
    policies = {PREFILL: replace(BASE, min_replicas=prefill_bounds[0], max_replicas=prefill_bounds[1]),
                DECODE: replace(BASE, min_replicas=decode_bounds[0], max_replicas=decode_bounds[1])}
    observations = {PREFILL: obs(prefill, 5.0), DECODE: obs(decode, 5.0)}
    out = decide(policies, observations, {PREFILL: SETTLED, DECODE: SETTLED}, RatioBand(0.5, 2.0), NOW)
    assert (out[PREFILL].desired, out[DECODE].desired) == expected, case
    assert ("RatioBand" in out[PREFILL].limits) is limited


def test_ratio_band_that_cannot_be_met_is_reported_not_forced() -> None:
    band = RatioBand(1.0, 1.0)
    policies = {PREFILL: replace(BASE, min_replicas=4, max_replicas=4),
                DECODE: replace(BASE, min_replicas=2, max_replicas=2)}
    observations = {PREFILL: obs(4, 5.0), DECODE: obs(2, 5.0)}
    out = decide(policies, observations, {PREFILL: SETTLED, DECODE: SETTLED}, band, NOW)
    assert (out[PREFILL].desired, out[DECODE].desired) == (4, 2)
    assert "RatioBand" in out[PREFILL].limits and "RatioBand" in out[DECODE].limits
    assert any("cannot be met" in r for r in out[DECODE].reasons)


def test_ratio_band_moves_only_the_autoscaled_pool() -> None:
    band = RatioBand(0.5, 1.0)
    out = decide({PREFILL: None, DECODE: BASE}, {PREFILL: obs(6, 5.0), DECODE: obs(2, 5.0)},
                 {DECODE: SETTLED}, band, NOW)
    assert (out[PREFILL].desired, out[DECODE].desired) == (6, 6)
    assert any("autoscaling disabled" in r for r in out[PREFILL].reasons)


def test_ratio_band_respects_the_capacity_cap() -> None:
    band = RatioBand(1.0, 1.0)
    capped = replace(SETTLED, capacity_cap=3, capacity_cap_until=NOW + 100)
    policies = {PREFILL: BASE, DECODE: BASE}
    out = decide(policies, {PREFILL: obs(6, 5.0), DECODE: obs(3, 5.0)},
                 {PREFILL: SETTLED, DECODE: capped}, band, NOW)
    assert out[DECODE].desired == 3, "decode could not place more than 3 pods"
    assert out[PREFILL].desired == 3, "so prefill comes down to keep the band"


def test_ratio_change_counts_as_a_change_for_the_cooldown() -> None:
    out = decide({PREFILL: BASE, DECODE: BASE}, {PREFILL: obs(1, 5.0), DECODE: obs(4, 5.0)},
                 {PREFILL: SETTLED, DECODE: SETTLED}, RatioBand(1.0, None), NOW)
    assert out[PREFILL].desired == 4 and out[PREFILL].state.last_scale_time == NOW
    assert out[DECODE].state.last_scale_time is None


def run_loop(policy: PoolPolicy, loads: Sequence[float | None], replicas: int,
             interval: float = 15.0) -> list[int]:
    """Closed loop: the per-pod signal is total load / ready pods; new pods are ready one tick later.

    A None load is a gap in the metrics.
    """
    state, history, starting = PoolState(observed_since=0.0), [], 0
    for i, load in enumerate(loads):
        ready = replicas - starting
        signal = None if load is None else load / ready
        d = one(policy, PoolObservation(replicas, ready, signal=signal), state, now=i * interval)
        starting = max(d.desired - replicas, 0)
        replicas, state = d.desired, d.state
        history.append(replicas)
    return history


def direction_changes(history: list[int]) -> int:
    moves = [b - a for a, b in itertools.pairwise(history) if b != a]
    return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))


def test_flapping_load_does_not_oscillate() -> None:
    # Total load swings between 8 and 2 pods' worth every tick for 10 minutes.
    history = run_loop(BASE, [40.0 if i % 2 == 0 else 10.0 for i in range(40)], replicas=4)
    assert history[0] == 8, "the first peak scales up at once"
    assert direction_changes(history) == 0 and set(history) == {8}, history


def test_spike_then_calm_scales_up_at_once_and_down_only_after_the_window() -> None:
    loads = [20.0] * 4 + [100.0] + [4.0] * 40  # one 5x tick, then quiet for 10 minutes
    history = run_loop(BASE, loads, replicas=4)
    assert history[:5] == [4, 4, 4, 4, 8], "the spike scaled up at once, by the +4 step"
    down_at = next(i for i in range(5, len(history)) if history[i] < history[i - 1])
    assert (down_at - 4) * 15.0 >= BASE.scale_down_stabilization_s
    assert direction_changes(history) == 1 and history[-1] == 1


def test_gaps_in_the_metrics_hold_and_resume() -> None:
    history = run_loop(BASE, [20.0, None, None, 40.0, None, 40.0], replicas=2)
    assert history == [4, 4, 4, 8, 8, 8]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_replicas": 0}, "at least 1"),
    ({"max_replicas": 0, "min_replicas": 1}, "below minReplicas"),
    ({"target": 0.0}, "target must be a positive"),
    ({"target": math.nan}, "target must be a positive"),
    ({"target_tokens": -1.0}, "queued-token target"),
    ({"tolerance": 1.5}, "tolerance"),
    ({"cooldown_s": -1.0}, "cooldown_s"),
    ({"max_scale_up_pods": 0, "max_scale_up_percent": 0.0}, "never grow"),
    ({"slo_latency_s": 0.0}, "SLO latency"),
])
def test_bad_policies_fail_with_a_clear_message(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        replace(BASE, **kwargs)


@pytest.mark.parametrize(("band", "message"), [
    ((2.0, 1.0), "above maxPrefillPerDecode"),
    ((0.0, None), "minPrefillPerDecode must be a positive"),
    ((None, -1.0), "maxPrefillPerDecode must be a positive"),
])
def test_bad_ratio_bands_fail_with_a_clear_message(band: tuple[float | None, float | None],
                                                   message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        RatioBand(*band)


def test_negative_counts_are_rejected() -> None:
    with pytest.raises(PolicyError, match="non-negative"):
        PoolObservation(replicas=-1, ready=0)


def test_state_round_trips_through_json_and_tolerates_garbage() -> None:
    state = PoolState(((1.0, 2), (16.0, 3)), observed_since=1.0, last_scale_time=16.0,
                      capacity_cap=3, capacity_cap_until=316.0)
    assert PoolState.from_dict(state.to_dict()) == state
    assert PoolState.from_dict({"recommendations": "nonsense"}) == PoolState()
    assert PoolState.from_dict(None) == PoolState()
