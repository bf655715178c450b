"""Pure: what the children look like -> per-pool status and the Ready/Progressing/Degraded conditions.

Conditions follow the Kubernetes API conventions: type, status, reason, message,
lastTransitionTime (kept while status does not change) and observedGeneration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COMPONENTS = ("prefill", "decode", "router")
READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


@dataclass(frozen=True)
class PoolObservation:
    """One component as read from the cluster after the apply."""

    component: str  # prefill | decode | router
    desired: int
    deployment: Mapping[str, Any] | None  # None: the Deployment does not exist
    unschedulable: Sequence[str] = ()  # scheduler messages of this pool's Pending pods


@dataclass(frozen=True)
class ConditionValue:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Problems:
    """What went wrong outside the children themselves."""

    invalid_spec: str | None = None
    apply_failed: str | None = None
    kv_keys: str | None = None  # the kvTransfer.secure Secret holds no usable keypair (nothing was applied)
    control_token: str | None = None  # the control token Secret holds no usable token (nothing was applied)

    def blocking_secret(self) -> tuple[str, str] | None:
        """(reason, what to fix) for a Secret that keeps anything from being applied, if any."""
        if self.kv_keys:
            return "KVKeysInvalid", "the kvTransfer.secure keys Secret holds a usable keypair"
        if self.control_token:
            return "ControlTokenInvalid", "the worker control token Secret holds a usable token"
        return None


def _count(deployment: Mapping[str, Any] | None, key: str) -> int:
    if deployment is None:
        return 0
    value = (deployment.get("status") or {}).get(key)
    return int(value) if isinstance(value, int) else 0


def pool_status(obs: PoolObservation) -> dict[str, Any]:
    ready = _count(obs.deployment, "readyReplicas")
    return {
        "replicas": _count(obs.deployment, "replicas"),
        "readyReplicas": ready,
        "updatedReplicas": _count(obs.deployment, "updatedReplicas"),
        "desiredReplicas": obs.desired,
        "summary": f"{ready}/{obs.desired}",
    }


def rolled_out(obs: PoolObservation) -> bool:
    """The Deployment runs exactly the desired number of pods, all on the current template."""
    dep = obs.deployment
    if dep is None:
        return False
    observed = (dep.get("status") or {}).get("observedGeneration", 0)
    return (
        observed >= dep.get("metadata", {}).get("generation", 0)
        and (dep.get("spec") or {}).get("replicas") == obs.desired
        and _count(dep, "updatedReplicas") == obs.desired
        and _count(dep, "replicas") == obs.desired
        and _count(dep, "availableReplicas") >= obs.desired
    )


def _deployment_condition(dep: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
    for cond in (dep or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def unschedulable_message(component: str, messages: Sequence[str]) -> str:
    """Name the pool and the missing resource, e.g. 'prefill pool: 2 pods cannot be scheduled: not enough nvidia.com/gpu'."""
    count = len(messages)
    pods = f"{count} pod{'s' if count != 1 else ''}"
    resources = sorted({r for msg in messages for r in re.findall(r"Insufficient ([\w./-]+)", msg)})
    why = f"not enough {', '.join(resources)} on any matching node" if resources else "no node fits"
    return f"{component} pool: {pods} cannot be scheduled: {why} (scheduler: {messages[0].strip()})"


def degraded_reasons(observations: Sequence[PoolObservation], problems: Problems) -> list[tuple[str, str]]:
    reasons: list[tuple[str, str]] = []
    if problems.invalid_spec:
        reasons.append(("InvalidSpec", problems.invalid_spec))
    if problems.kv_keys:
        reasons.append(("KVKeysInvalid", problems.kv_keys))
    if problems.control_token:
        reasons.append(("ControlTokenInvalid", problems.control_token))
    if problems.apply_failed:
        reasons.append(("ApplyFailed", problems.apply_failed))
    for obs in observations:
        if obs.unschedulable:
            reasons.append(("Unschedulable", unschedulable_message(obs.component, obs.unschedulable)))
        failure = _deployment_condition(obs.deployment, "ReplicaFailure")
        if failure.get("status") == "True":
            reasons.append(("ReplicaFailure", f"{obs.component} pool: {failure.get('message', '')}"))
        progress = _deployment_condition(obs.deployment, "Progressing")
        if progress.get("reason") == "ProgressDeadlineExceeded":
            reasons.append(("ProgressDeadlineExceeded", f"{obs.component} pool: {progress.get('message', '')}"))
    return reasons


def compute_conditions(observations: Sequence[PoolObservation], problems: Problems) -> list[ConditionValue]:
    if problems.invalid_spec:
        return [
            ConditionValue(READY, "False", "InvalidSpec", problems.invalid_spec),
            ConditionValue(PROGRESSING, "False", "InvalidSpec", "fix the spec; nothing was applied"),
            ConditionValue(DEGRADED, "True", "InvalidSpec", problems.invalid_spec),
        ]
    counts = ", ".join(f"{o.component} {_count(o.deployment, 'readyReplicas')}/{o.desired}" for o in observations)
    missing = [o.component for o in observations if o.deployment is None]
    zero = [o.component for o in observations if o.desired == 0]
    short = [o.component for o in observations if _count(o.deployment, "readyReplicas") < o.desired]
    blocked = problems.blocking_secret()
    if missing and blocked:
        ready = ConditionValue(READY, "False", blocked[0],
                               f"the {', '.join(missing)} Deployment(s) are not created until {blocked[1]}")
    elif missing:
        ready = ConditionValue(READY, "False", "Creating", f"waiting for the {', '.join(missing)} Deployment(s)")
    elif zero:
        ready = ConditionValue(READY, "False", "ScaledToZero", f"no replicas wanted for: {', '.join(zero)}")
    elif short:
        ready = ConditionValue(READY, "False", "PoolsNotReady", f"ready/desired: {counts}")
    else:
        ready = ConditionValue(READY, "True", "AllPoolsReady", f"ready/desired: {counts}")

    pending = [o.component for o in observations if not rolled_out(o)]
    if blocked:
        # Nothing was applied this time: whatever runs stays as it is, so nothing is rolling out.
        progressing = ConditionValue(PROGRESSING, "False", blocked[0],
                                     f"blocked: nothing is applied until {blocked[1]} (see Degraded)")
    elif pending:
        progressing = ConditionValue(PROGRESSING, "True", "RollingOut", f"rolling out: {', '.join(pending)}")
    else:
        progressing = ConditionValue(PROGRESSING, "False", "RolloutComplete", "every pool runs the current spec")

    reasons = degraded_reasons(observations, problems)
    if reasons:
        degraded = ConditionValue(DEGRADED, "True", reasons[0][0], "; ".join(msg for _, msg in reasons))
    else:
        degraded = ConditionValue(DEGRADED, "False", "AsExpected", "")
    return [ready, progressing, degraded]


def merge_conditions(old: Sequence[Mapping[str, Any]], new: Sequence[ConditionValue], now: str,
                     generation: int) -> list[dict[str, Any]]:
    """New conditions as status entries, keeping lastTransitionTime where the status did not change.

    Conditions of other types (the autoscaler's ScalingLimited, say) are kept as they are: a status
    merge patch replaces the whole list, so dropping them here would erase them.
    """
    previous = {c.get("type"): c for c in old}
    ours = {cond.type for cond in new}
    merged: list[dict[str, Any]] = []
    for cond in new:
        before = previous.get(cond.type)
        unchanged = before is not None and before.get("status") == cond.status and before.get("lastTransitionTime")
        merged.append({
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": before["lastTransitionTime"] if unchanged and before else now,
            "observedGeneration": generation,
        })
    merged.extend(dict(c) for c in old if c.get("type") not in ours)
    return merged


def transitions(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for the condition changes worth a Kubernetes Event."""
    before = {c.get("type"): c.get("status") for c in old}
    events = []
    for cond in new:
        type_, status = cond["type"], cond["status"]
        if before.get(type_) == status:
            continue
        if type_ == READY and status == "True":
            events.append(("Normal", "Ready", cond["message"]))
        elif type_ == READY and before.get(type_) == "True":
            events.append(("Warning", "NotReady", cond["message"]))
        elif type_ == DEGRADED and status == "True":
            events.append(("Warning", cond["reason"], cond["message"]))
        elif type_ == DEGRADED and before.get(type_) == "True":
            events.append(("Normal", "Recovered", "no longer degraded"))
    return events
