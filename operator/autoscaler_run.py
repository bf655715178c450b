"""One autoscaler pass for one DisaggregatedModel against the cluster: read, decide, write status.

The kopf timer in main.py calls `autoscale_resource` every --autoscale-interval seconds, then a
reconcile when a pool's desired count changed, so the decision reaches the Deployments at once
(the reconcile reads it back through replicas.desired_replicas, like any other trigger would).

What the pass writes, all in the resource's status: per autoscaled pool desiredReplicas,
signal, scaleReason, lastScaleTime and autoscalerState (the policy's memory: recommendation
windows, last scale time, capacity cap; kept there so an operator restart keeps them), and the
ScalingActive / ScalingLimited conditions. It also posts the tick's Events and sets the
operator's autoscaler metrics.

The same timer runs `verify_output` for every resource, autoscaled or not: the OutputVerified
condition from the routers' output canary (tandem.operator.output_check), read from the same
Prometheus client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator import builders, conditions, output_check, pool_scale
from tandem.operator import signals as sig
from tandem.operator.api import API_VERSION, KIND, POOLS
from tandem.operator.autoscaler_timer import (
    DEFAULT_INTERVAL_S,
    SCALING_ACTIVE,
    AutoscalerMetrics,
    AutoscalerSettings,
    PoolCounts,
    TickResult,
    autoscale_tick,
    pool_counts,
)
from tandem.operator.kube import Kube
from tandem.operator.reconcile import EventSink, now_rfc3339, parse_spec, resource_lock
from tandem.operator.replicas import desired_replicas, scaled_by

COMPONENT_LABEL = "app.kubernetes.io/component"


def signal_source(prometheus_url: str | None) -> sig.SignalSource:
    """PrometheusSignals for --prometheus-url (query settings from TANDEM_AUTOSCALER_*), else NoSignals."""
    if not prometheus_url:
        return sig.NoSignals()
    settings = AutoscalerSettings.from_env()
    return sig.PrometheusSignals(prometheus_url, settings=settings.queries)


@dataclass(frozen=True)
class AutoscaleOutcome:
    result: TickResult
    changed: bool  # some pool's desired count changed: apply it now


def _counts(kube: Kube, owner: builders.Owner) -> dict[str, PoolCounts]:
    selector = builders.instance_labels(owner)
    deployments = {d["metadata"]["name"]: d for d in kube.list("apps/v1", "Deployment", owner.namespace, selector)}
    pods = kube.list("v1", "Pod", owner.namespace, selector)
    return {pool: pool_counts(deployments.get(builders.child_name(owner, pool)),
                              [p for p in pods if (p["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == pool])
            for pool in POOLS}


def _status_patch(result: TickResult) -> dict[str, Any]:
    return {pool: {**fields, "autoscalerState": result.state.get(pool)} for pool, fields in result.status.items()}


def autoscale_resource(kube: Kube, namespace: str, name: str, signals: sig.SignalSource, emit: EventSink,
                       metrics: AutoscalerMetrics, clock: Callable[[], float] = time.time,
                       interval_s: float = DEFAULT_INTERVAL_S) -> AutoscaleOutcome | None:
    """One tick for one resource; None when there is nothing to do (gone, invalid, or never autoscaled)."""
    body = kube.get(API_VERSION, KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    spec, _ = parse_spec(body)
    if spec is None:
        return None  # the reconcile reports the invalid spec
    old_status: Mapping[str, Any] = body.get("status") or {}
    autoscaled = [p for p in POOLS if scaled_by(spec, p) == "autoscaler"]
    had_condition = any(c.get("type") == SCALING_ACTIVE for c in old_status.get("conditions") or [])
    if not autoscaled and not had_condition:
        return None  # never autoscaled: no ScalingActive condition to keep up to date

    meta = body["metadata"]
    owner = builders.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    pools = pool_scale.read(kube, owner)
    external: dict[str, int | None] = {p: pools.external(p) for p in POOLS}
    state: dict[str, Any] = {p: (old_status.get(p) or {}).get("autoscalerState") for p in autoscaled}
    # Signals are fetched outside the reconcile lock: a slow Prometheus must not hold up reconciles.
    result = autoscale_tick(spec=spec, status=old_status, namespace=namespace, name=name,
                            counts=_counts(kube, owner), signals=signals, clock=clock, state=state, external=external,
                            interval_s=interval_s)

    with resource_lock(namespace, name):
        # Re-read the conditions: a reconcile may have written its own since; keep them.
        fresh = kube.get(API_VERSION, KIND, namespace, name)
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return None
        fresh_status = fresh.get("status") or {}
        patch = _status_patch(result)
        patch["conditions"] = conditions.merge_conditions(
            fresh_status.get("conditions") or [], result.conditions, now_rfc3339(), int(meta.get("generation", 0)))
        kube.patch_status(namespace, name, patch)

    for event in result.events:
        emit(body, event.type, event.reason, event.message)
    metrics.record(namespace, name, result)
    changed = any(result.desired[p] != desired_replicas(spec, old_status, p) for p in POOLS if p in result.desired)
    return AutoscaleOutcome(result, changed)


def _same(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> bool:
    keys = ("status", "reason", "message", "observedGeneration")
    return before is not None and all(before.get(k) == after.get(k) for k in keys)


def verify_output(kube: Kube, namespace: str, name: str, source: output_check.PromQuery,
                  emit: EventSink) -> conditions.ConditionValue | None:
    """Set the OutputVerified condition from the routers' canary; None when the resource is gone.

    Writes status only when the condition changed. Events: a Warning CanaryMismatch when it turns
    False, a Normal OutputVerified when it turns True after having been False.
    """
    body = kube.get(API_VERSION, KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    # Prometheus is asked outside the reconcile lock, like the autoscaler's signals.
    cond = output_check.read_output_condition(source, namespace, name)
    with resource_lock(namespace, name):
        fresh = kube.get(API_VERSION, KIND, namespace, name)
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return None
        old = (fresh.get("status") or {}).get("conditions") or []
        merged = conditions.merge_conditions(old, [cond], now_rfc3339(),
                                             int(fresh["metadata"].get("generation", 0)))
        before = next((c for c in old if c.get("type") == cond.type), None)
        if _same(before, merged[0]):
            return cond
        kube.patch_status(namespace, name, {"conditions": merged})
    previous = (before or {}).get("status")
    if cond.status == "False" and previous != "False":
        emit(fresh, "Warning", cond.reason, cond.message)
    elif cond.status == "True" and previous == "False":
        emit(fresh, "Normal", output_check.OUTPUT_VERIFIED, cond.message)
    return cond
