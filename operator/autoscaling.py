"""Pure autoscaling policy: observations + history -> desired replicas per pool, with reasons.

No I/O and no clock: the caller passes `now` (seconds) and the previous `PoolState`, and gets a
`PoolDecision` whose `state` it hands back on the next tick. The rules follow the Kubernetes HPA
algorithm where one exists (ceil(current x signal / target), tolerance band, stabilization windows
that take the max/min recommendation over the window, credit for pods that are not ready yet),
and dask-kubernetes for the cooldown (after a change, no scale-down until it expires).

Order of the rules for one pool:
  1. pods that could not be scheduled -> scale back to what was placed, cap scale-ups for a while;
  2. signal missing -> hold the current size (never fall to min on missing data);
  3. raw recommendation (tolerance, credit for starting pods, no second scale-up while the last
     one's pods start), then the SLO guard (latency above the SLO while the pool is busy);
  4. stabilization windows (up: min over window, down: max over window);
  5. cooldown (blocks scale-down only: a late scale-up costs SLO, a late scale-down only GPU time);
  6. max step up per interval (the larger of pods and percent, as HPA's default behaviour);
  7. min/max replicas, and the capacity cap from step 1.
Then `decide` enforces the P:D ratio band on both pools together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

PREFILL = "prefill"
DECODE = "decode"
POOLS = (PREFILL, DECODE)

# Ratios within this of a whole number are treated as that number (3 * 0.1 / 0.1 must be 3).
_EPS = 1e-9


class PolicyError(ValueError):
    """A policy or observation that cannot be acted on (bad configuration or inputs)."""


@dataclass(frozen=True)
class PoolPolicy:
    """How one pool scales. `target` is the signal per ready replica the pool aims for."""

    min_replicas: int
    max_replicas: int
    target: float  # prefill: queued requests per replica; decode: KV-cache usage ratio (0..1]
    target_tokens: float | None = None  # prefill only: queued prompt tokens per replica
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_scale_up_pods: int = 4
    max_scale_up_percent: float = 100.0
    cooldown_s: float = 60.0
    slo_latency_s: float | None = None  # TTFT p90 bound for prefill, ITL p90 bound for decode
    # Latency quantiles come from a rate window; right after a change they still show the old
    # load, so the SLO guard waits this long after a change before adding more replicas.
    slo_holdoff_s: float = 60.0
    # The SLO guard acts only while the pool is at least this busy (signal / target): below it,
    # nothing waits, so a high p90 is stale or service-bound and more replicas would not lower it.
    slo_guard_min_load: float = 0.5
    # While pods from the last scale-up are starting (up to this long after it), no second
    # scale-up: the signal on the ready pods includes backlog that those pods will absorb.
    startup_grace_s: float = 120.0
    # After pods could not be scheduled, scale-ups stop at what was placed for this long.
    unschedulable_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise PolicyError(
                f"minReplicas must be at least 1 (got {self.min_replicas}): the scaling signals "
                "come from the pool's own workers, so an empty pool could never scale up again")
        if self.max_replicas < self.min_replicas:
            raise PolicyError(f"maxReplicas ({self.max_replicas}) is below minReplicas ({self.min_replicas})")
        if not (math.isfinite(self.target) and self.target > 0):
            raise PolicyError(f"the target must be a positive number (got {self.target})")
        if self.target_tokens is not None and not (
                math.isfinite(self.target_tokens) and self.target_tokens > 0):
            raise PolicyError(f"the queued-token target must be positive (got {self.target_tokens})")
        if not 0 <= self.tolerance < 1:
            raise PolicyError(f"tolerance must be in [0, 1) (got {self.tolerance})")
        for name in ("scale_up_stabilization_s", "scale_down_stabilization_s", "cooldown_s",
                     "slo_holdoff_s", "unschedulable_backoff_s", "max_scale_up_percent", "slo_guard_min_load",
                     "startup_grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PolicyError(f"{name} must be a non-negative number (got {value})")
        if self.max_scale_up_pods < 0:
            raise PolicyError(f"maxScaleUpPods must be non-negative (got {self.max_scale_up_pods})")
        if self.max_scale_up_pods == 0 and self.max_scale_up_percent == 0:
            raise PolicyError("maxScaleUpPods and maxScaleUpPercent are both 0: the pool could never grow")
        if self.slo_latency_s is not None and not (
                math.isfinite(self.slo_latency_s) and self.slo_latency_s > 0):
            raise PolicyError(f"the SLO latency must be positive (got {self.slo_latency_s})")


@dataclass(frozen=True)
class RatioBand:
    """Allowed prefill replicas per decode replica; either bound may be absent."""

    min_prefill_per_decode: float | None = None
    max_prefill_per_decode: float | None = None

    def __post_init__(self) -> None:
        lo, hi = self.min_prefill_per_decode, self.max_prefill_per_decode
        for name, value in (("minPrefillPerDecode", lo), ("maxPrefillPerDecode", hi)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PolicyError(f"{name} must be a positive number (got {value})")
        if lo is not None and hi is not None and lo > hi:
            raise PolicyError(f"minPrefillPerDecode ({lo}) is above maxPrefillPerDecode ({hi})")

    def describe(self) -> str:
        lo = "-" if self.min_prefill_per_decode is None else f"{self.min_prefill_per_decode:g}"
        hi = "-" if self.max_prefill_per_decode is None else f"{self.max_prefill_per_decode:g}"
        return f"[{lo}, {hi}]"


@dataclass(frozen=True)
class PoolObservation:
    """What the pool looks like now. Signals are per ready replica; None means missing."""

    replicas: int  # the Deployment's desired count now (ready + starting + unschedulable)
    ready: int
    unschedulable: int = 0  # pods Pending with PodScheduled=False, reason Unschedulable
    signal: float | None = None
    signal_tokens: float | None = None  # prefill only
    latency_p90_s: float | None = None  # None: no traffic in the window, not an error

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.ready < 0 or self.unschedulable < 0:
            raise PolicyError(f"replica counts must be non-negative: {self}")


@dataclass(frozen=True)
class PoolState:
    """What the policy remembers between ticks (JSON-friendly; see to_dict/from_dict)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, raw recommendation)
    observed_since: float | None = None  # first tick with a signal (restart-safe scale-down)
    last_scale_time: float | None = None
    capacity_cap: int | None = None  # replicas that could be placed last time pods were unschedulable
    capacity_cap_until: float | None = None
    slo_guard_latency: float | None = None  # p90 when the SLO guard last scaled up

    def to_dict(self) -> dict[str, object]:
        return {
            "recommendations": [[t, r] for t, r in self.recommendations],
            "observedSince": self.observed_since,
            "lastScaleTime": self.last_scale_time,
            "capacityCap": self.capacity_cap,
            "capacityCapUntil": self.capacity_cap_until,
            "sloGuardLatency": self.slo_guard_latency,
        }

    @staticmethod
    def from_dict(data: Mapping[str, object] | None) -> PoolState:
        """Tolerant reader: anything malformed starts a fresh (conservative) state."""
        if not data:
            return PoolState()
        try:
            raw_recs: Any = data.get("recommendations") or ()
            cap = _opt_float(data.get("capacityCap"))
            return PoolState(
                recommendations=tuple((float(t), int(r)) for t, r in raw_recs),
                observed_since=_opt_float(data.get("observedSince")),
                last_scale_time=_opt_float(data.get("lastScaleTime")),
                capacity_cap=None if cap is None else int(cap),
                capacity_cap_until=_opt_float(data.get("capacityCapUntil")),
                slo_guard_latency=_opt_float(data.get("sloGuardLatency")),
            )
        except (TypeError, ValueError):
            return PoolState()


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    desired: int
    recommendation: int | None  # raw load-based recommendation; None when metrics are missing
    signal: float | None
    reasons: tuple[str, ...]  # human-readable, in the order the rules applied
    limits: tuple[str, ...] = ()  # why the pool could not go where the load wanted (ScalingLimited)
    metrics_missing: bool = False
    state: PoolState = field(default_factory=PoolState)
    limit_notes: tuple[str, ...] = ()  # the message for each entry of `limits`

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "none"


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def load_ratio(policy: PoolPolicy, obs: PoolObservation) -> tuple[float, str]:
    """signal / target (the largest over the pool's signals, as HPA does with several metrics)."""
    signal = obs.signal if obs.signal is not None else math.nan
    ratio = signal / policy.target
    what = f"signal {signal:.3g} vs target {policy.target:g}"
    if policy.target_tokens is not None and obs.signal_tokens is not None \
            and math.isfinite(obs.signal_tokens) and obs.signal_tokens / policy.target_tokens > ratio:
        ratio = obs.signal_tokens / policy.target_tokens
        what = f"queued tokens {obs.signal_tokens:.3g} vs target {policy.target_tokens:g}"
    return ratio, what


def recommend(pool: str, policy: PoolPolicy, obs: PoolObservation, now: float,
              state: PoolState) -> tuple[int | None, list[str]]:
    """The raw recommendation from the signal (before the SLO guard), or None when it cannot be computed."""
    if obs.signal is None or not math.isfinite(obs.signal) or obs.signal < 0:
        return None, [f"{pool} signal missing or invalid ({obs.signal}); holding {obs.replicas} replicas"]
    if obs.ready == 0:
        return None, [f"{pool} has no ready replicas to measure; holding {obs.replicas} replicas"]
    ratio, what = load_ratio(policy, obs)
    reasons: list[str] = []
    pending = obs.replicas - obs.ready
    if abs(ratio - 1) <= policy.tolerance:
        rec = obs.replicas
        reasons.append(f"{what}: within tolerance {policy.tolerance:g}")
    else:
        # Load is measured on ready pods; pods still starting count towards the answer, so
        # they get credit for the load they will absorb (no second scale-up for it).
        need = _ceil(obs.ready * ratio)
        rec = max(obs.replicas, need) if ratio > 1 else min(obs.replicas, need)
        reasons.append(f"{what}: {obs.ready} ready x {ratio:.3g} -> {need} replicas")
        if ratio > 1 and need <= obs.replicas and pending > 0:
            reasons.append(f"{pending} starting pods will absorb the load")
        elif rec > obs.replicas and pending > 0 and state.last_scale_time is not None \
                and now - state.last_scale_time < policy.startup_grace_s:
            rec = obs.replicas
            reasons.append(f"{pending} pods from the last scale-up are still starting: no second "
                           f"scale-up until they are ready (at most {policy.startup_grace_s:g}s)")
    return rec, reasons


def slo_guard(policy: PoolPolicy, obs: PoolObservation, rec: int, now: float,
              state: PoolState) -> tuple[int, list[str], float | None]:
    """Latency above the SLO: no scale-down, and scale up even below the signal's target.

    Only while the pool is busy (signal at least slo_guard_min_load x target). Returns the new recommendation, reasons, and the latency to remember for the next check.
    The guard only keeps adding replicas while that helps: if the p90 did not fall by at least
    the tolerance since its last scale-up, latency is service-bound (long prompts, a slow model)
    and more replicas would not fix it, so the guard steps aside and the signal target decides.
    """
    latency, slo = obs.latency_p90_s, policy.slo_latency_s
    if slo is None or latency is None or not math.isfinite(latency) or latency <= slo:
        return rec, [], None  # met (or no traffic): forget the guard's last latency
    lat = f"p90 latency {latency * 1000:.0f} ms above SLO {slo * 1000:.0f} ms"
    load, _ = load_ratio(policy, obs)
    if load < policy.slo_guard_min_load:
        return rec, [f"{lat}, but the pool is at {load:.0%} of its target: nothing waits, "
                     "so more replicas would not lower it"], None
    last = state.slo_guard_latency
    if last is not None and latency > last * (1 - policy.tolerance):
        return rec, [f"{lat}, and the last SLO scale-up did not lower it ({last * 1000:.0f} ms): "
                     "latency looks service-bound, the signal target decides"], last
    reasons: list[str] = []
    if rec < obs.replicas:
        rec = obs.replicas
        reasons.append(f"{lat}: no scale-down")
    if latency <= slo * (1 + policy.tolerance):
        return rec, reasons, last
    pending = obs.replicas - obs.ready
    slo_need = _ceil(obs.ready * latency / slo)
    if pending > 0:
        reasons.append(f"{lat}: {pending} starting pods get credit first")
    elif state.last_scale_time is not None and now - state.last_scale_time < policy.slo_holdoff_s:
        reasons.append(f"{lat}: waiting {policy.slo_holdoff_s:g}s after the last change")
    elif slo_need > rec:
        reasons.append(f"{lat}: SLO guard -> {slo_need} replicas")
        return slo_need, reasons, latency
    return rec, reasons, last


def stabilize(policy: PoolPolicy, current: int, rec: int, history: tuple[tuple[float, int], ...],
              now: float, observed_since: float) -> tuple[int, list[str]]:
    """HPA stabilization: scale up to the lowest and down to the highest recommendation in the windows."""
    up_cut = now - policy.scale_up_stabilization_s
    down_cut = now - policy.scale_down_stabilization_s
    up_rec = min([rec, *(r for t, r in history if t > up_cut)])
    down_rec = max([rec, *(r for t, r in history if t > down_cut)])
    value, reasons = current, []
    if value < up_rec:
        value = up_rec
    if value > down_rec:
        value = down_rec
    if rec > current and value < rec:
        reasons.append(f"scale-up window {policy.scale_up_stabilization_s:g}s: lowest recent "
                       f"recommendation is {up_rec}")
    if rec < current and value > rec:
        reasons.append(f"scale-down window {policy.scale_down_stabilization_s:g}s: highest recent "
                       f"recommendation is {down_rec}")
    if value < current and now - observed_since < policy.scale_down_stabilization_s:
        # After a (re)start the window has no history yet: wait for a full one before shrinking.
        value = current
        reasons.append(f"scale-down window {policy.scale_down_stabilization_s:g}s not yet filled "
                       "since the autoscaler started watching")
    return value, reasons


def decide_pool(pool: str, policy: PoolPolicy, obs: PoolObservation, state: PoolState,
                now: float) -> PoolDecision:
    """Apply every per-pool rule (see the module docstring for the order).

    The returned state still carries the previous lastScaleTime; `decide` stamps it.
    """
    current = obs.replicas
    cap, cap_until = state.capacity_cap, state.capacity_cap_until
    if cap_until is not None and now >= cap_until:
        cap = cap_until = None  # backoff over: allow one more try at growing
    if obs.unschedulable > 0:
        placed = max(current - obs.unschedulable, 0)
        desired = min(max(placed, policy.min_replicas), policy.max_replicas)
        cap, cap_until = placed, now + policy.unschedulable_backoff_s
        msg = (f"{obs.unschedulable} {pool} pods could not be scheduled; scaling back to the "
               f"{placed} that were placed, no scale-up for {policy.unschedulable_backoff_s:g}s")
        if desired > placed:
            msg += f" (held at minReplicas {policy.min_replicas})"
        new_state = replace(state, capacity_cap=cap, capacity_cap_until=cap_until)
        return PoolDecision(pool, current, desired, None, obs.signal, (msg,), ("Unschedulable",),
                            False, new_state, (msg,))

    rec, reasons = recommend(pool, policy, obs, now, state)
    guard_latency = state.slo_guard_latency
    if rec is not None:
        rec, why, guard_latency = slo_guard(policy, obs, rec, now, state)
        reasons += why
    if rec is None:
        desired = min(max(current, policy.min_replicas), policy.max_replicas)
        bounds: tuple[str, ...] = ()
        notes: tuple[str, ...] = ()
        if desired != current:
            bounds = ("MinMax",)
            notes = (f"replicas {current} outside [{policy.min_replicas}, {policy.max_replicas}] -> {desired}",)
            reasons += notes
        new_state = replace(state, capacity_cap=cap, capacity_cap_until=cap_until)
        return PoolDecision(pool, current, desired, None, obs.signal, tuple(reasons), bounds, True, new_state,
                            notes)

    keep_s = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    history = tuple((t, r) for t, r in state.recommendations if t > now - keep_s)
    observed_since = state.observed_since if state.observed_since is not None else now
    value, why = stabilize(policy, current, rec, history, now, observed_since)
    reasons += why
    limits: list[tuple[str, str]] = []  # (code, message)

    def limit(code: str, message: str) -> None:
        reasons.append(message)
        limits.append((code, message))

    if value < current and state.last_scale_time is not None \
            and now - state.last_scale_time < policy.cooldown_s:
        left = policy.cooldown_s - (now - state.last_scale_time)
        reasons.append(f"cooldown: last change {now - state.last_scale_time:.0f}s ago, "
                       f"no scale-down for another {left:.0f}s")
        value = current
    if value > current:
        step = max(policy.max_scale_up_pods, math.ceil(current * policy.max_scale_up_percent / 100))
        if value > current + step:
            limit("MaxStep", f"max step: +{step} per interval (of {value - current} wanted)")
            value = current + step
    if value > policy.max_replicas:
        limit("MaxReplicas", f"capped at maxReplicas {policy.max_replicas} (load wants {max(rec, value)})")
        value = policy.max_replicas
    if value < policy.min_replicas:
        reasons.append(f"held at minReplicas {policy.min_replicas}")
        value = policy.min_replicas
    if cap is not None and value > max(cap, current):
        limit("Unschedulable", f"capped at {max(cap, current)}: only {cap} pods could be scheduled recently")
        value = max(cap, current)

    new_state = PoolState(
        recommendations=(*history, (now, rec)),
        observed_since=observed_since,
        last_scale_time=state.last_scale_time,  # stamped by `decide`, after the ratio band
        capacity_cap=cap,
        capacity_cap_until=cap_until,
        slo_guard_latency=guard_latency,
    )
    return PoolDecision(pool, current, value, rec, obs.signal, tuple(reasons), tuple(c for c, _ in limits),
                        False, new_state, tuple(msg for _, msg in limits))


def _upper(policy: PoolPolicy, decision: PoolDecision) -> int:
    """How far the ratio band may raise a pool: its max, and no further than pods could be placed."""
    cap = decision.state.capacity_cap
    hi = policy.max_replicas
    return hi if cap is None else min(hi, max(cap, decision.desired))


def enforce_ratio(band: RatioBand, prefill: PoolDecision, decode: PoolDecision,
                  policies: Mapping[str, PoolPolicy | None]) -> tuple[PoolDecision, PoolDecision]:
    """Keep prefill/decode inside the band, preferring to raise the short side over cutting the other.

    A pool without a policy (autoscaling off) is fixed: only the other pool moves.
    """
    p, d = prefill.desired, decode.desired
    pp, dp = policies.get(PREFILL), policies.get(DECODE)
    lo, hi = band.min_prefill_per_decode, band.max_prefill_per_decode
    notes: dict[str, list[str]] = {PREFILL: [], DECODE: []}
    for _ in range(2):  # a second pass fixes what integer rounding in the first may have broken
        if lo is not None and p < lo * d - _EPS:
            if pp is not None:
                p = max(p, min(_ceil(lo * d), _upper(pp, prefill)))
                notes[PREFILL].append(f"P:D ratio band {band.describe()}: prefill raised to {p} for {d} decode")
            if p < lo * d - _EPS and dp is not None:
                d = max(math.floor(p / lo + _EPS), dp.min_replicas)
                notes[DECODE].append(f"P:D ratio band {band.describe()}: decode lowered to {d} for {p} prefill")
        if hi is not None and p > hi * d + _EPS:
            if dp is not None:
                d = max(d, min(_ceil(p / hi), _upper(dp, decode)))
                notes[DECODE].append(f"P:D ratio band {band.describe()}: decode raised to {d} for {p} prefill")
            if p > hi * d + _EPS and pp is not None:
                p = max(math.floor(hi * d + _EPS), pp.min_replicas)
                notes[PREFILL].append(f"P:D ratio band {band.describe()}: prefill lowered to {p} for {d} decode")
    violated = (lo is not None and p < lo * d - _EPS) or (hi is not None and p > hi * d + _EPS)
    out = []
    for dec, value in ((prefill, p), (decode, d)):
        reasons, limits, limit_notes = list(dec.reasons) + notes[dec.pool], list(dec.limits), list(dec.limit_notes)
        if violated:
            msg = (f"P:D ratio band {band.describe()} cannot be met within the pools' "
                   f"min/max and capacity ({p}:{d})")
            reasons.append(msg)
            limits.append("RatioBand")
            limit_notes.append(msg)
        out.append(replace(dec, desired=value, reasons=tuple(dict.fromkeys(reasons)),
                           limits=tuple(limits), limit_notes=tuple(limit_notes)))
    return out[0], out[1]


def decide(policies: Mapping[str, PoolPolicy | None], observations: Mapping[str, PoolObservation],
           states: Mapping[str, PoolState], band: RatioBand | None, now: float,
           adjust: Callable[[str, PoolPolicy, PoolDecision], PoolDecision] | None = None) -> dict[str, PoolDecision]:
    """Both pools' decisions for one tick. A pool whose policy is None keeps its current size.

    `adjust` may replace an autoscaled pool's decision before the ratio band (the predictive
    policy: tandem.operator.autoscaler_timer), given the reactive one.
    """
    decisions: dict[str, PoolDecision] = {}
    for pool in POOLS:
        obs = observations[pool]
        policy = policies.get(pool)
        if policy is None:
            decisions[pool] = PoolDecision(pool, obs.replicas, obs.replicas, None, obs.signal,
                                           ("autoscaling disabled: replicas come from spec",),
                                           state=states.get(pool, PoolState()))
        else:
            decisions[pool] = decide_pool(pool, policy, obs, states.get(pool, PoolState()), now)
            if adjust is not None:
                decisions[pool] = adjust(pool, policy, decisions[pool])
    if band is not None and any(policies.get(p) is not None for p in POOLS):
        decisions[PREFILL], decisions[DECODE] = enforce_ratio(
            band, decisions[PREFILL], decisions[DECODE], policies)
    for pool, dec in decisions.items():
        # Stamped here, after the ratio band, so a ratio adjustment counts as a change too.
        if dec.desired != dec.current:
            decisions[pool] = replace(dec, state=replace(dec.state, last_scale_time=now))
    return decisions
