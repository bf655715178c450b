"""The capacity model (sizing arithmetic) and the predictive policy built on it: pure functions."""

from __future__ import annotations

import math

import pytest

from tandem.operator import predictive_policy as pp
from tandem.operator.capacity_model import (
    SIMULATED_H100_8B,
    CapacityError,
    Profile,
    Slo,
    decode_load,
    decode_replicas,
    plan,
    prefill_replicas,
)

SLO = Slo(ttft_s=3.0, itl_s=0.05)
P = SIMULATED_H100_8B


def test_prefill_is_sized_for_its_utilization_cap() -> None:
    # 20,000 prompt tokens/s on 8,000 tokens/s replicas at 80% busy: 3.125 -> 4.
    assert prefill_replicas(20_000, P, SLO) == 4
    assert prefill_replicas(20_000, P, SLO, utilization=1.0) == 3
    assert prefill_replicas(0, P, SLO) == 1


def test_a_backlog_is_drained_within_a_pod_start() -> None:
    # 480,000 queued tokens over 30 s is 16,000 tok/s on top of 4,000 arriving: 20,000 / 8,000 -> 3.
    assert prefill_replicas(4_000, P, SLO, backlog_tokens=480_000) == 3
    assert prefill_replicas(4_000, P, SLO, backlog_tokens=480_000, drain_s=10) == 7


def test_decode_steady_state_is_littles_law_with_the_batch_dependent_itl() -> None:
    load = decode_load(10, 2000, 200, 1, P)
    # N = 10 x 200 x (0.015 + 0.0004 N) -> N = 150, ITL = 75 ms.
    assert load.running == pytest.approx(150)
    assert load.itl_s == pytest.approx(0.075)
    assert load.kv_fill == pytest.approx(150 * 2200 / 160_000)
    assert math.isinf(decode_load(1000, 2000, 200, 1, P).itl_s)  # past saturation: unbounded


def test_decode_takes_the_fewest_replicas_meeting_itl_and_kv() -> None:
    assert decode_replicas(10, 2000, 200, P, SLO) == 2  # 1 replica: ITL 75 ms > 50 ms
    kv_bound = decode_replicas(1, 100_000, 10, P, SLO)
    assert kv_bound >= 1 and decode_load(1, 100_000, 10, kv_bound, P).kv_fill <= 0.85


def test_plan_reports_sizes_ratio_gpus_goodput_and_bottleneck() -> None:
    result = plan(10, 2000, 200, P, SLO)
    assert (result.prefill, result.decode, result.gpus) == (4, 2, 6)
    assert result.ratio() == 2
    assert result.bottleneck.startswith("prefill")
    assert result.goodput_rps == pytest.approx(4 * 8000 * 0.8 / 2000)  # 12.8 req/s


@pytest.mark.parametrize(("args", "message"), [
    ((10, 2000, 200, P, Slo(3.0, 0.01)), "below one decode step"),
    ((10, 30_000, 200, P, SLO), "more than the TTFT SLO"),
    ((0, 2000, 200, P, SLO), "must be positive"),
])
def test_unmeetable_or_bad_loads_say_why(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        plan(*args)  # type: ignore[arg-type]


def test_profiles_are_validated_when_read() -> None:
    with pytest.raises(CapacityError, match="prefill_tps"):
        Profile(0, 1, 0.01, 0)
    with pytest.raises(CapacityError, match="unknown profile fields"):
        Profile.from_dict({**P.to_dict(), "speed": 3})
    assert Profile.from_dict(P.to_dict()) == P


def load(tps: float, trend: float = 0.0, backlog: float = 0.0, busy: float | None = None) -> pp.Load:
    return pp.Load(tps, trend, tps / 2000, 2000, 200, backlog_tokens=backlog, prefill_busy_tps=busy)


def test_a_rising_trend_is_followed_one_pod_start_ahead() -> None:
    flat = pp.size(P, SLO, load(10_000), (1, 1), 0.0, pp.State())
    rising = pp.size(P, SLO, load(10_000, trend=200), (1, 1), 0.0, pp.State())
    assert flat.prefill == 2  # 10,000 / (8,000 x 0.8)
    assert rising.prefill == 3  # 10,000 + 200 x 45 = 19,000 tok/s: 2.97 replicas at 80%


def test_no_scale_down_before_a_full_window_then_down_slowly() -> None:
    settings = pp.Settings(down_window_s=120, max_down_step=2)
    high = pp.size(P, SLO, load(40_000), (1, 1), 0.0, pp.State(), settings)
    assert high.prefill == 7
    state, sizes = high.state, []
    for t in range(15, 300, 15):
        out = pp.size(P, SLO, load(2_000), (high.prefill if not sizes else sizes[-1], 1), float(t), state, settings)
        state = out.state
        sizes.append(out.prefill)
    assert sizes[: 120 // 15 - 1] == [7] * (120 // 15 - 1), "held while the window still shows the high need"
    drops = [a - b for a, b in zip([7, *sizes], sizes, strict=False) if a > b]
    assert drops and max(drops) <= 2 and sizes[-1] == 1


def test_a_wrong_profile_corrects_itself_from_busy_replicas() -> None:
    optimistic = Profile(16_000, 160_000, 0.015, 0.0004)  # twice what the replicas really do
    state = pp.State()
    for t in range(10):
        out = pp.size(optimistic, SLO, load(20_000, busy=8_000), (3, 1), float(t * 15), state)
        state = out.state
    assert state.throughput_factor == pytest.approx(0.5, abs=0.02)
    assert out.prefill == 4  # what the true 8,000 tok/s needs, not the profile's 2


def test_trend_is_the_least_squares_slope() -> None:
    assert pp.trend([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2)
    assert pp.trend([(0, 1)]) == 0
