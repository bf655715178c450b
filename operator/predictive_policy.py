"""Predictive pool sizing: measured arrival rates + a capacity profile + the SLOs -> replicas.

Where the reactive policy (tandem.operator.autoscaling) waits for a queue to form and sizes from
it, this one sizes from what is arriving: prompt tokens/s for prefill (with the backlog drained
inside the TTFT SLO), request rate and lengths for decode (ITL at the resulting batch, KV fill).
It scales ahead of a rising trend by the pod start time, scales down only to the highest need
of a recent window, and corrects the profile's prefill throughput from what busy replicas
actually did, so a wrong profile corrects itself.

Pure: the caller passes the time and the previous state. The operator's timer body
(tandem.operator.autoscaler_timer) runs it for pools with autoscaling.policy predictive, from the
arrival queries of tandem.operator.signals; the load-model simulation (hack/load_model.py) runs
that same timer body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.operator.capacity_model import (
    PREFILL_MAX_UTILIZATION,
    Profile,
    Slo,
    decode_replicas,
    prefill_replicas,
)


@dataclass(frozen=True)
class Load:
    """What the pools see, as rates over the signal window (Prometheus rate()/deriv())."""

    prompt_tps: float  # prompt tokens/s arriving
    prompt_tps_trend: float  # change of prompt_tps per second (deriv over the window)
    request_rate: float  # requests/s arriving
    mean_prompt: float
    mean_output: float
    backlog_tokens: float = 0.0  # prompt tokens queued for prefill, whole pool
    kv_waiting_tokens: float = 0.0  # prefilled requests waiting for decode KV: their prompt+output
    prefill_busy_tps: float | None = None  # prompt tokens/s per ready replica while the queue never emptied


@dataclass(frozen=True)
class Settings:
    lookahead_s: float = 45.0  # pod start + one interval: how far ahead a rising trend is followed
    down_window_s: float = 120.0  # scale down only to the highest need of this window
    max_down_step: int = 2  # replicas removed per decision at most
    prefill_utilization: float = PREFILL_MAX_UTILIZATION  # steady-state busy fraction prefill is sized for
    correction_weight: float = 0.3  # EWMA weight of one busy observation of per-replica throughput
    min_replicas: int = 1
    max_replicas: int = 1000


@dataclass(frozen=True)
class State:
    history: tuple[tuple[float, int, int], ...] = ()  # (time, prefill need, decode need)
    throughput_factor: float = 1.0  # observed / profile prefill tokens/s per replica
    observed_since: float | None = None  # first decision: no scale-down before a full window


@dataclass(frozen=True)
class Sizes:
    prefill: int
    decode: int
    reasons: tuple[str, ...]
    state: State


def corrected(profile: Profile, load: Load, state: State, weight: float) -> tuple[Profile, State, str | None]:
    """The profile with prefill throughput scaled by what busy replicas measured (EWMA)."""
    factor = state.throughput_factor
    note = None
    if load.prefill_busy_tps is not None and load.prefill_busy_tps > 0:
        seen = load.prefill_busy_tps / profile.prefill_tps
        factor = (1 - weight) * factor + weight * seen
        note = f"busy prefill replicas did {load.prefill_busy_tps:.0f} tok/s each: profile x {factor:.2f}"
    return replace(profile, prefill_tps=profile.prefill_tps * factor), replace(state, throughput_factor=factor), note


def size(profile: Profile, slo: Slo, load: Load, current: tuple[int, int], now: float, state: State,
         settings: Settings = Settings()) -> Sizes:
    """Replicas for both pools now. `current` is (prefill, decode) as the Deployments stand."""
    eff, state, note = corrected(profile, load, state, settings.correction_weight)
    reasons = [note] if note else []
    # Follow a rising trend to where it will be when pods started now are ready.
    ahead = load.prompt_tps + max(load.prompt_tps_trend, 0.0) * settings.lookahead_s
    scale = ahead / load.prompt_tps if load.prompt_tps > 0 else 1.0
    p_need = prefill_replicas(ahead, eff, slo, backlog_tokens=load.backlog_tokens, mean_prompt=load.mean_prompt,
                              utilization=settings.prefill_utilization)
    d_need = decode_replicas(load.request_rate * scale, load.mean_prompt, load.mean_output, eff, slo,
                             extra_kv_tokens=load.kv_waiting_tokens) if load.request_rate > 0 else 1
    reasons.append(f"arriving {load.prompt_tps:.0f} prompt tok/s (trend {load.prompt_tps_trend:+.0f}/s, "
                   f"{ahead:.0f} in {settings.lookahead_s:g}s), backlog {load.backlog_tokens:.0f} tokens -> "
                   f"{p_need} prefill; {load.request_rate:.2f} req/s of {load.mean_prompt:.0f}/"
                   f"{load.mean_output:.0f} tokens -> {d_need} decode")
    cut = now - settings.down_window_s
    since = now if state.observed_since is None else state.observed_since
    state = replace(state, observed_since=since)
    history = (*(h for h in state.history if h[0] > cut), (now, p_need, d_need))
    out = []
    for i, (cur, need) in enumerate(zip(current, (p_need, d_need), strict=True)):
        window_max = int(max(h[i + 1] for h in history))
        if need >= cur:
            value = need
        elif now - since < settings.down_window_s:
            value = cur  # the window has no history yet (start, restart): nothing to scale down on
        else:
            value = max(window_max, cur - settings.max_down_step)
            if value > need:
                reasons.append(f"{('prefill', 'decode')[i]}: down to {value}, the highest need of the last "
                               f"{settings.down_window_s:g}s (at most -{settings.max_down_step} per step)")
        out.append(min(max(value, settings.min_replicas), settings.max_replicas))
    return Sizes(out[0], out[1], tuple(reasons), replace(state, history=history))


def trend(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (time, value) samples (what PromQL deriv() computes); 0 when undefined."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0 or not math.isfinite(var):
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var
