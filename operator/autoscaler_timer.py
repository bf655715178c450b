"""The body of the per-resource autoscaler timer: spec/status + signals + clock -> what to write.

Kept free of kopf and of the Kubernetes client so it can be tested and simulated directly. The
operator registers it as a kopf timer (default every 15 s) and then:
  - writes `result.status` into status.<pool> (desiredReplicas, lastScaleTime, signal,
    scaleReason): reconcile reads desiredReplicas through tandem.operator.replicas, the same
    path as spec replicas, so the reconcile stays level-based;
  - merges `result.conditions` (ScalingActive, ScalingLimited) with its own conditions;
  - posts `result.events`, and keeps `result.state` for the next tick (kopf memo or status);
  - calls `AutoscalerMetrics.record`.
With autoscaling disabled on a pool, nothing here touches that pool: its replicas come from spec.

A pool with autoscaling.policy predictive is sized by tandem.operator.predictive_policy from the
routers' arrival rates (signals.arrival_queries), spec.capacityProfile and spec.slo, then clamped
to its min/max, the capacity cap after unschedulable pods, and the P:D ratio band, as a reactive
decision is. Its memory (need history, throughput correction) is kept beside the reactive one in
autoscalerState.predictive. While an arrival value is missing, or the profile cannot meet the
SLO, the pool takes the reactive decision instead, and scaleReason and ScalingActive say so.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.operator import predictive_policy as pp
from tandem.operator import signals as sig
from tandem.operator.api import POOLS, DisaggregatedModelSpec, PoolName
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
from tandem.operator.capacity_model import CapacityError, Profile, Slo
from tandem.operator.conditions import ConditionValue
from tandem.operator.replicas import desired_replicas
from tandem.operator.telemetry import operator_metric
from tandem.worker import metrics as m

DEFAULT_INTERVAL_S = 15.0
SCALING_ACTIVE = "ScalingActive"
SCALING_LIMITED = "ScalingLimited"
# ScalingLimited reasons, most important first.
_LIMIT_REASONS = (
    ("Unschedulable", "Unschedulable"),
    ("RatioBand", "RatioBandUnmet"),
    ("MaxReplicas", "TooManyReplicas"),
    ("MaxStep", "ScaleUpLimited"),
    ("MinMax", "OutOfBounds"),
)
_MAX_REASON_CHARS = 1000


@dataclass(frozen=True)
class AutoscalerSettings:
    """Operator-level settings (from the environment of the operator pod)."""

    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    interval_s: float = DEFAULT_INTERVAL_S
    queries: sig.QuerySettings = field(default_factory=sig.QuerySettings)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s >= 1):
            raise PolicyError(f"autoscaler interval must be at least 1 s (got {self.interval_s})")
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise PolicyError(f"Prometheus URL must start with http:// or https:// (got {self.prometheus_url!r})")

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> AutoscalerSettings:
        """TANDEM_PROMETHEUS_URL, TANDEM_AUTOSCALER_INTERVAL (s), TANDEM_AUTOSCALER_QUANTILE,
        TANDEM_AUTOSCALER_RATE_WINDOW."""
        try:
            return AutoscalerSettings(
                prometheus_url=env.get("TANDEM_PROMETHEUS_URL", AutoscalerSettings.prometheus_url),
                interval_s=float(env.get("TANDEM_AUTOSCALER_INTERVAL", DEFAULT_INTERVAL_S)),
                queries=sig.QuerySettings(
                    quantile=float(env.get("TANDEM_AUTOSCALER_QUANTILE", 0.9)),
                    rate_window=env.get("TANDEM_AUTOSCALER_RATE_WINDOW", "1m")),
            )
        except ValueError as exc:
            raise PolicyError(f"bad autoscaler setting in the environment: {exc}") from exc


@dataclass(frozen=True)
class PoolCounts:
    """The pool's pods as the cluster reports them."""

    ready: int
    unschedulable: int = 0


def count_unschedulable(pods: Iterable[Mapping[str, Any]]) -> int:
    """Pods the scheduler could not place (Pending, PodScheduled=False, reason Unschedulable)."""
    count = 0
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                count += 1
                break
    return count


def pool_counts(deployment: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> PoolCounts:
    """A pool's counts from its Deployment (status.readyReplicas) and its pods, as API dicts."""
    ready = ((deployment or {}).get("status") or {}).get("readyReplicas")
    return PoolCounts(ready=ready if isinstance(ready, int) and ready >= 0 else 0,
                      unschedulable=count_unschedulable(pods))


def policy_for(spec: DisaggregatedModelSpec, pool: PoolName) -> tuple[PoolPolicy | None, list[str]]:
    """The pool's PoolPolicy (None when autoscaling is off) and notes on how the spec was read."""
    auto = spec.pool(pool).autoscaling
    if not auto.enabled or auto.mode != "tandem":
        return None, []  # spec replicas, or an external scaler, owns the pool
    notes = []
    min_replicas = auto.min_replicas
    if min_replicas < 1:
        notes.append(f"{pool}: minReplicas {min_replicas} is treated as 1 (the signals come from the "
                     "pool's own workers, so an empty pool could not scale up again)")
        min_replicas = 1
    if pool == PREFILL:
        target = float(getattr(auto, "target_queue_depth"))  # noqa: B009 (per-pool model field)
        slo_s = spec.slo.ttft_ms / 1000
    else:
        target = float(getattr(auto, "target_kv_utilization"))  # noqa: B009
        slo_s = spec.slo.itl_ms / 1000
    # Fields the CRD may not carry yet fall back to the policy defaults.
    defaults = PoolPolicy(min_replicas=1, max_replicas=1, target=1.0)
    optional = {
        "tolerance": getattr(auto, "tolerance", None),
        "max_scale_up_pods": getattr(auto, "max_scale_up_pods", None),
        "max_scale_up_percent": getattr(auto, "max_scale_up_percent", None),
        "cooldown_s": getattr(auto, "cooldown_seconds", None),
        "target_tokens": getattr(auto, "target_queue_tokens", None),
    }
    policy = PoolPolicy(
        min_replicas=min_replicas,
        max_replicas=max(auto.max_replicas, min_replicas),
        target=target,
        scale_up_stabilization_s=float(auto.scale_up_stabilization_seconds),
        scale_down_stabilization_s=float(auto.scale_down_stabilization_seconds),
        slo_latency_s=slo_s,
        tolerance=defaults.tolerance if optional["tolerance"] is None else float(optional["tolerance"]),
        max_scale_up_pods=(defaults.max_scale_up_pods if optional["max_scale_up_pods"] is None
                           else int(optional["max_scale_up_pods"])),
        max_scale_up_percent=(defaults.max_scale_up_percent if optional["max_scale_up_percent"] is None
                              else float(optional["max_scale_up_percent"])),
        cooldown_s=defaults.cooldown_s if optional["cooldown_s"] is None else float(optional["cooldown_s"]),
        target_tokens=None if optional["target_tokens"] is None else float(optional["target_tokens"]),
    )
    return policy, notes


def ratio_band(spec: DisaggregatedModelSpec) -> RatioBand | None:
    """spec.ratio as a band; a 0 lower bound means no lower bound."""
    lo = spec.ratio.min_prefill_per_decode
    hi = spec.ratio.max_prefill_per_decode
    band = RatioBand(lo if lo > 0 else None, hi if hi > 0 else None)
    return None if band == RatioBand() else band


# ---------------------------------------------------------------- the predictive policy

PREDICTIVE = "predictive"
REACTIVE_FALLBACK = "ReactiveFallback"
# The arrival values the predictive policy cannot size without (the others only refine it).
_NEEDED = (sig.ARRIVAL_PROMPT_TPS, sig.ARRIVAL_PROMPT_TREND, sig.ARRIVAL_REQUEST_RATE, sig.ARRIVAL_OUTPUT_TPS,
           sig.ARRIVAL_FINISHED_RATE, sig.ARRIVAL_BACKLOG_TOKENS)


def predictive_pools(spec: DisaggregatedModelSpec, policies: Mapping[str, PoolPolicy | None]) -> list[PoolName]:
    """The autoscaled pools whose policy is predictive."""
    return [p for p in POOLS if policies.get(p) is not None and getattr(spec.pool(p).autoscaling, "policy",
                                                                         "reactive") == PREDICTIVE]


def capacity_profile(spec: DisaggregatedModelSpec) -> Profile | None:
    """spec.capacityProfile as a capacity_model.Profile (None when unset)."""
    cp = spec.capacity_profile
    if cp is None:
        return None
    return Profile(cp.prefill_tokens_per_second, cp.kv_tokens, cp.itl_base_seconds, cp.itl_per_request_seconds,
                   cp.startup_seconds, 1, "spec.capacityProfile")


def arrival_load(fetched: sig.PoolSignals) -> tuple[pp.Load | None, str, list[str]]:
    """The predictive policy's Load from one arrival fetch, or (None, why) when a needed value is missing.

    A value that is absent stays missing: no zero is made up for it (0/0 is missing too, except
    that with nothing arriving there is no length to know and none needed)."""
    missing = [f"{n} {fetched.problems.get(n) or 'missing'}" for n in _NEEDED if fetched.get(n) is None]
    if missing:
        return None, "; ".join(missing), []
    v = fetched.values
    negative = [n for n in _NEEDED if n != sig.ARRIVAL_PROMPT_TREND and v[n] < 0]
    if negative or not all(math.isfinite(v[n]) for n in _NEEDED):
        return None, f"invalid arrival values {({n: v[n] for n in _NEEDED})}", []
    tps, rps = v[sig.ARRIVAL_PROMPT_TPS], v[sig.ARRIVAL_REQUEST_RATE]
    if rps > 0:
        mean_prompt = tps / rps
    elif tps > 0:
        return None, "prompt tokens arrive but no request reached its first token in the window", []
    else:
        mean_prompt = 0.0
    finished = v[sig.ARRIVAL_FINISHED_RATE]
    if finished > 0:
        mean_output = v[sig.ARRIVAL_OUTPUT_TPS] / finished
    elif rps > 0:
        return None, "requests arrive but none finished in the window: mean output length unknown", []
    else:
        mean_output = 0.0
    notes: list[str] = []
    waiting = v.get(sig.ARRIVAL_DECODE_WAITING)
    if waiting is None:
        notes.append("decode waiting requests unknown (not counted)")
        waiting = 0.0
    busy = v.get(sig.ARRIVAL_PREFILL_BUSY_TPS)
    return pp.Load(tps, v[sig.ARRIVAL_PROMPT_TREND], rps, mean_prompt, mean_output,
                   backlog_tokens=v[sig.ARRIVAL_BACKLOG_TOKENS],
                   kv_waiting_tokens=max(waiting, 0.0) * (mean_prompt + mean_output),
                   prefill_busy_tps=busy if busy is not None and busy > 0 and math.isfinite(busy) else None), "", notes


def predictive_state_to_dict(state: pp.State) -> dict[str, Any]:
    return {"history": [[t, p, d] for t, p, d in state.history], "throughputFactor": state.throughput_factor,
            "observedSince": state.observed_since}


def predictive_state_from_dict(data: Any) -> pp.State:
    """Tolerant reader, as PoolState.from_dict: anything malformed starts afresh."""
    if not isinstance(data, Mapping):
        return pp.State()
    try:
        factor = float(data.get("throughputFactor", 1.0))
        since = data.get("observedSince")
        return pp.State(history=tuple((float(t), int(p), int(d)) for t, p, d in data.get("history") or ()),
                        throughput_factor=factor if math.isfinite(factor) and factor > 0 else 1.0,
                        observed_since=None if since is None else float(since))
    except (TypeError, ValueError):
        return pp.State()


def _own_reasons(pool: str, reasons: Iterable[str]) -> list[str]:
    other = DECODE if pool == PREFILL else PREFILL
    return [r for r in reasons if not r.startswith(f"{other}:")]


@dataclass
class _Predictive:
    """One tick's predictive sizing: the inputs, and what it decided per pool (for state and conditions)."""

    pools: list[PoolName]
    profile: Profile | None
    slo: Slo
    load: pp.Load | None
    missing: str
    notes: list[str]
    current: tuple[int, int]
    now: float
    interval_s: float
    states: dict[str, pp.State]
    fallbacks: dict[str, str] = field(default_factory=dict)

    def adjust(self, pool: str, policy: PoolPolicy, dec: PoolDecision) -> PoolDecision:
        if pool not in self.pools:
            return dec
        if "Unschedulable" in dec.limits and dec.recommendation is None and not dec.metrics_missing:
            # Pods could not be placed: the reactive rule scales back to what was; arrivals cannot change that.
            return replace(dec, reasons=("predictive: pods could not be scheduled, the capacity rule decides",
                                         *dec.reasons))
        why = self.missing
        sizes = None
        if self.profile is None:
            why = "no spec.capacityProfile"
        elif self.load is not None:
            settings = pp.Settings(lookahead_s=self.profile.startup_s + self.interval_s,
                                   down_window_s=policy.scale_down_stabilization_s,
                                   min_replicas=policy.min_replicas, max_replicas=10_000)
            try:
                sizes = pp.size(self.profile, self.slo, self.load, self.current, self.now, self.states[pool], settings)
            except CapacityError as exc:
                why = f"the capacity profile cannot be sized: {exc}"
        if sizes is None:
            self.fallbacks[pool] = why
            return replace(dec, reasons=(f"predictive: {why}; reactive fallback", *dec.reasons))
        self.states[pool] = sizes.state
        need = sizes.prefill if pool == PREFILL else sizes.decode
        value = need
        limits: list[tuple[str, str]] = []
        if value > policy.max_replicas:
            limits.append(("MaxReplicas", f"capped at maxReplicas {policy.max_replicas} (load wants {need})"))
            value = policy.max_replicas
        current = dec.current
        cap = dec.state.capacity_cap
        if cap is not None and value > max(cap, current):
            limits.append(("Unschedulable", f"capped at {max(cap, current)}: only {cap} pods could be scheduled "
                                            "recently"))
            value = max(cap, current)
        reasons = ("predictive: " + "; ".join([*_own_reasons(pool, sizes.reasons), *self.notes]),
                   *(msg for _, msg in limits))
        return replace(dec, desired=value, recommendation=need, reasons=reasons, metrics_missing=False,
                       limits=tuple(c for c, _ in limits), limit_notes=tuple(msg for _, msg in limits))


def _predictive(spec: DisaggregatedModelSpec, pools: list[PoolName], source: sig.ArrivalSource | None,
                namespace: str, name: str, current: tuple[int, int], now: float, interval_s: float,
                state: Mapping[str, Any] | None) -> _Predictive:
    load: pp.Load | None = None
    missing, notes = "", list[str]()
    if source is None:
        missing = "the signal source has no arrival queries"
    else:
        try:
            fetched = source.fetch_arrivals(namespace, name)
        except Exception as exc:  # a broken source is missing data, never a crashed timer
            fetched = sig.PoolSignals({}, {"error": f"signal source failed: {type(exc).__name__}: {exc}"})
        if "error" in fetched.problems:
            missing = fetched.problems["error"]
        else:
            load, missing, notes = arrival_load(fetched)
    states: dict[str, pp.State] = {p: predictive_state_from_dict(((state or {}).get(p) or {}).get(PREDICTIVE)) for p in pools}
    return _Predictive(pools, capacity_profile(spec), Slo(spec.slo.ttft_ms / 1000, spec.slo.itl_ms / 1000), load,
                       missing, notes, current, now, interval_s, states)


@dataclass(frozen=True)
class ScaleEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class TickResult:
    desired: dict[str, int]  # per autoscaled pool: the new status.<pool>.desiredReplicas
    status: dict[str, dict[str, Any]]  # per autoscaled pool: fields to merge into status.<pool>
    conditions: list[ConditionValue]
    events: list[ScaleEvent]
    decisions: dict[str, PoolDecision]
    state: dict[str, Any]  # hand back as `state` on the next tick
    targets: dict[str, float] = field(default_factory=dict)
    max_replicas: dict[str, int] = field(default_factory=dict)  # per autoscaled pool


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _observation(pool: PoolName, current: int, counts: PoolCounts, fetched: sig.PoolSignals) -> PoolObservation:
    primary = sig.QUEUE_REQUESTS if pool == PREFILL else sig.KV_USAGE
    return PoolObservation(
        replicas=current, ready=counts.ready, unschedulable=counts.unschedulable,
        signal=fetched.get(primary),
        signal_tokens=fetched.get(sig.QUEUE_TOKENS) if pool == PREFILL else None,
        latency_p90_s=fetched.get(sig.LATENCY_P),
    )


def _limited_condition(decisions: Mapping[str, PoolDecision], no_signal: Mapping[PoolName, str]) -> ConditionValue:
    """`no_signal`: the autoscaled pools held for want of a load signal, with why."""
    limited = {p: d for p, d in decisions.items() if d.limits}
    unknown = "; ".join(f"{p}: no load signal ({why}), held at {decisions[p].desired}"
                        for p, why in no_signal.items() if p not in limited)
    if not limited:
        if unknown:
            # Without a signal there is no load to compare with: neither "limited" nor "within range".
            return ConditionValue(SCALING_LIMITED, "Unknown", "MetricsUnavailable", unknown[:_MAX_REASON_CHARS])
        return ConditionValue(SCALING_LIMITED, "False", "DesiredWithinRange",
                              "every pool is where its load wants it")
    present = {lim for d in limited.values() for lim in d.limits}
    reason = next(r for key, r in _LIMIT_REASONS if key in present)
    message = "; ".join([*(f"{p}: {'; '.join(d.limit_notes)}" for p, d in limited.items()), *filter(None, [unknown])])
    return ConditionValue(SCALING_LIMITED, "True", reason, message[:_MAX_REASON_CHARS])


def _previous_status(status: Mapping[str, Any] | None, type_: str) -> str | None:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def _previous_reason(status: Mapping[str, Any] | None, type_: str) -> str | None:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("reason"))
    return None


def autoscale_tick(
    *,
    spec: DisaggregatedModelSpec,
    status: Mapping[str, Any] | None,
    namespace: str,
    name: str,
    counts: Mapping[str, PoolCounts],
    signals: sig.SignalSource,
    clock: Callable[[], float],
    state: Mapping[str, Any] | None = None,
    external: Mapping[str, int | None] | None = None,
    arrivals: sig.ArrivalSource | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> TickResult:
    """One autoscaler tick for the DisaggregatedModel `name` in `namespace`. Never raises on bad metrics: it holds.

    `external`: each DisaggregatedPool's spec.replicas, the size of a pool in mode external (which
    the ratio band then treats as fixed, like a pool with autoscaling off). `arrivals`: where a
    predictive pool's arrival values come from (default: `signals`, when it has fetch_arrivals).
    `interval_s`: the timer's interval (the predictive policy looks a pod start plus this ahead).
    """
    now = clock()
    policies: dict[str, PoolPolicy | None] = {}
    notes: list[str] = []
    try:
        for pool in POOLS:
            policies[pool], pool_notes = policy_for(spec, pool)
            notes += pool_notes
        band = ratio_band(spec)
    except PolicyError as exc:
        return TickResult({}, {}, [ConditionValue(SCALING_ACTIVE, "False", "InvalidPolicy", str(exc))],
                          [ScaleEvent("Warning", "InvalidAutoscalingPolicy", str(exc))], {}, dict(state or {}))
    if all(p is None for p in policies.values()):
        return TickResult({}, {}, [ConditionValue(SCALING_ACTIVE, "False", "AutoscalingDisabled",
                                                  "no pool is scaled by Tandem's autoscaler (autoscaling disabled or mode external)")],
                          [], {}, dict(state or {}))

    observations: dict[str, PoolObservation] = {}
    fetch_problems: dict[str, str] = {}
    for pool in POOLS:
        current = desired_replicas(spec, status, pool, (external or {}).get(pool))
        pool_counts = counts.get(pool, PoolCounts(ready=0))
        if policies[pool] is None:
            observations[pool] = PoolObservation(current, pool_counts.ready, pool_counts.unschedulable)
            continue
        try:
            fetched = signals.fetch(pool, sig.Selector(namespace, name, pool))
        except Exception as exc:  # a broken source is missing data, never a crashed timer
            fetched = sig.PoolSignals({}, {"error": f"signal source failed: {type(exc).__name__}: {exc}"})
        observations[pool] = _observation(pool, current, pool_counts, fetched)
        primary = sig.QUEUE_REQUESTS if pool == PREFILL else sig.KV_USAGE
        fetch_problems[pool] = fetched.problems.get(primary) or fetched.problems.get("error") or ""

    states: dict[str, PoolState] = {p: PoolState.from_dict((state or {}).get(p)) for p in POOLS}
    predictive: _Predictive | None = None
    if pools := predictive_pools(spec, policies):
        source = arrivals if arrivals is not None else signals if isinstance(signals, sig.ArrivalSource) else None
        predictive = _predictive(spec, pools, source, namespace, name,
                                 (observations[PREFILL].replicas, observations[DECODE].replicas), now, interval_s,
                                 state)
    decisions = decide(policies, observations, states, band, now,
                       predictive.adjust if predictive is not None else None)
    # Held for want of data: the fetch's own reason, or the policy's (e.g. no ready replica yet).
    problems = {p: fetch_problems.get(p) or decisions[p].reasons[0] for p in POOLS
                if policies[p] is not None and decisions[p].metrics_missing}

    desired: dict[str, int] = {}
    status_patch: dict[str, dict[str, Any]] = {}
    events: list[ScaleEvent] = []
    targets: dict[str, float] = {}
    maxima: dict[str, int] = {}
    for pool in POOLS:
        policy, dec = policies[pool], decisions[pool]
        if policy is None:
            continue
        targets[pool] = policy.target
        maxima[pool] = policy.max_replicas
        reasons = "; ".join([*dec.reasons, *(n for n in notes if n.startswith(pool))])
        desired[pool] = dec.desired
        patch: dict[str, Any] = {"desiredReplicas": dec.desired, "signal": dec.signal,
                                 "scaleReason": reasons[:_MAX_REASON_CHARS]}
        if dec.state.last_scale_time is not None:
            patch["lastScaleTime"] = rfc3339(dec.state.last_scale_time)
        status_patch[pool] = patch
        if dec.desired != dec.current:
            if "Unschedulable" in dec.limits and dec.desired < dec.current:
                kind, reason = "Warning", "ScaledBackUnschedulable"
            else:
                kind, reason = "Normal", "ScaledUp" if dec.desired > dec.current else "ScaledDown"
            events.append(ScaleEvent(kind, reason, f"{pool} {dec.current} -> {dec.desired}: {reasons}"
                                     [:_MAX_REASON_CHARS]))

    if problems:
        held = ", ".join(f"{p} at {decisions[p].desired}" for p in problems)
        message = (f"holding {held}: " + "; ".join(f"{p}: {why}" for p, why in problems.items()))
        active = ConditionValue(SCALING_ACTIVE, "False", "MetricsUnavailable", message[:_MAX_REASON_CHARS])
        if _previous_status(status, SCALING_ACTIVE) != "False":
            events.append(ScaleEvent("Warning", "MetricsUnavailable", active.message))
    elif predictive is not None and predictive.fallbacks:
        message = "; ".join(f"{p}: predictive sizing unavailable ({why}), reactive decision used"
                            for p, why in predictive.fallbacks.items())
        active = ConditionValue(SCALING_ACTIVE, "True", REACTIVE_FALLBACK, message[:_MAX_REASON_CHARS])
        if _previous_reason(status, SCALING_ACTIVE) != REACTIVE_FALLBACK:
            events.append(ScaleEvent("Warning", "PredictiveFallback", active.message))
    else:
        shown = ", ".join(f"{p} {decisions[p].signal:.3g}/{targets[p]:g}" for p in targets
                          if decisions[p].signal is not None)
        if predictive is not None:
            shown += "; predictive: " + ", ".join(predictive.pools)
        active = ConditionValue(SCALING_ACTIVE, "True", "ValidMetrics", f"signal/target: {shown}")
    new_state: dict[str, Any] = {p: decisions[p].state.to_dict() for p in POOLS if policies[p] is not None}
    if predictive is not None:
        for p in predictive.pools:
            new_state[p][PREDICTIVE] = predictive_state_to_dict(predictive.states[p])
    return TickResult(desired, status_patch, [active, _limited_condition(
        {p: d for p, d in decisions.items() if policies[p] is not None}, problems)], events, decisions, new_state,
        targets, maxima)


class AutoscalerMetrics:
    """The operator's autoscaler metrics (names from tandem.worker.metrics).

    By default the process-wide collectors of tandem.operator.telemetry (the registry the
    operator's /metrics serves); a test passes its own registry.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        def make(d: m.MetricDef) -> Any:
            if registry is None:
                return operator_metric(d)
            kind = Counter if d.kind == "counter" else Gauge
            return kind(d.name, d.help, list(d.labels), registry=registry)

        self.desired = make(m.AUTOSCALER_DESIRED)
        self.current = make(m.AUTOSCALER_CURRENT)
        self.signal = make(m.AUTOSCALER_SIGNAL)
        self.target = make(m.AUTOSCALER_TARGET)
        self.max_replicas = make(m.AUTOSCALER_MAX)
        self.scale_events = make(m.AUTOSCALER_SCALE_EVENTS)

    def record(self, namespace: str, name: str, result: TickResult) -> None:
        for pool, dec in result.decisions.items():
            if pool not in result.desired:
                continue
            labels = {m.LABEL_NAMESPACE: namespace, m.LABEL_NAME: name, m.LABEL_POOL: pool}
            self.desired.labels(**labels).set(dec.desired)
            self.current.labels(**labels).set(dec.current)
            self.target.labels(**labels).set(result.targets.get(pool, math.nan))
            self.max_replicas.labels(**labels).set(result.max_replicas.get(pool, math.nan))
            # A missing signal is NaN in the gauge, not 0, so dashboards show a gap.
            self.signal.labels(**labels).set(math.nan if dec.signal is None else dec.signal)
            if dec.direction != "none":
                self.scale_events.labels(**labels, direction=dec.direction).inc()


__all__ = [
    "DECODE",
    "PREFILL",
    "AutoscalerMetrics",
    "AutoscalerSettings",
    "PoolCounts",
    "ScaleEvent",
    "TickResult",
    "arrival_load",
    "autoscale_tick",
    "capacity_profile",
    "count_unschedulable",
    "policy_for",
    "pool_counts",
    "ratio_band",
]
