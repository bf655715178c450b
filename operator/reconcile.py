"""Level-based reconcile of one DisaggregatedModel: desired children applied, status derived from them.

Every call does the whole job from the current state, whatever triggered it (a spec change, a
child Deployment edited or deleted, a timer, an operator restart), so it is idempotent and
converges. Children are written with server-side apply by name, so a repeat never duplicates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from tandem.operator import (
    builders,
    conditions,
    control_secret,
    kv_keys,
    network_policy,
    pool_scale,
    router_api_key,
)
from tandem.operator.api import API_VERSION, KIND, POOLS, DisaggregatedModelSpec, PoolName, name_problem
from tandem.operator.fingerprint import spec_fingerprint
from tandem.operator.kube import Kube, KubeError
from tandem.operator.network_policy import NetworkPolicySettings
from tandem.operator.replicas import desired_replicas, scaled_by
from tandem.operator.rules import describe_validation_error

# (resource, event type Normal|Warning, reason, message) -> a Kubernetes Event on the resource
EventSink = Callable[[Mapping[str, Any], str, str, str], None]

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def resource_lock(namespace: str, name: str) -> threading.Lock:
    """Handlers for the resource and for its children may run at once; one reconcile per resource at a time."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@dataclass
class Outcome:
    """What a reconcile did, for the handler (retry or not) and for tests."""

    applied: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # e.g. "NetworkPolicy tiny-router" once policies are turned off
    status: dict[str, Any] = field(default_factory=dict)
    apply_error: str | None = None
    invalid_spec: str | None = None
    invalid_kv_keys: str | None = None
    invalid_control_token: str | None = None


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_spec(body: Mapping[str, Any]) -> tuple[DisaggregatedModelSpec | None, str | None]:
    """The spec as a model, or the reason it cannot be served (the API server normally refuses these)."""
    problem = name_problem(str(body.get("metadata", {}).get("name", "")))
    if problem:
        return None, problem
    try:
        return DisaggregatedModelSpec.model_validate(body.get("spec") or {}), None
    except ValidationError as exc:
        return None, describe_validation_error(exc)


def _unschedulable_by_component(pods: list[dict[str, Any]]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Pending" or pod["metadata"].get("deletionTimestamp"):
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                component = pod["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
                found.setdefault(component, []).append(str(cond.get("message", "")))
    return found


def _scale_events(before: Mapping[str, dict[str, Any]], owner: builders.Owner,
                  desired: Mapping[str, int]) -> list[tuple[str, str, str]]:
    events = []
    for component, want in desired.items():
        name = builders.child_name(owner, component)
        current = before.get(name)
        if current is None:
            events.append(("Normal", "Created", f"created Deployment {name} with {want} replicas"))
        elif (current.get("spec") or {}).get("replicas") != want:
            was = (current.get("spec") or {}).get("replicas")
            events.append(("Normal", "Scaled", f"{component}: {was} -> {want} replicas"))
    return events


def reconcile(kube: Kube, namespace: str, name: str, emit: EventSink,
              policies: NetworkPolicySettings | None = None) -> Outcome:
    """Reconcile the resource as it is now (re-read under the lock, so a queued trigger never acts on a stale copy).

    `policies`: the operator's NetworkPolicy setting (`tandem operator --network-policy ...`; default: on)."""
    with resource_lock(namespace, name):
        body = kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome()  # gone or going: owner references let the garbage collector remove the children
        return _reconcile_locked(kube, body, lambda *event: emit(body, *event), policies or NetworkPolicySettings())


def _kv_keys_fingerprint(kube: Kube, owner: builders.Owner, outcome: Outcome,
                         emit: Callable[[str, str, str], None]) -> str | None:
    """kvTransfer.secure: read (or create once) the keys Secret; None, with the problem recorded, if unusable."""
    name = builders.kv_keys_secret_name(owner)
    try:
        keys, created = kv_keys.ensure(kube, owner)
    except kv_keys.InvalidKeys as exc:
        outcome.invalid_kv_keys = str(exc)
        return None
    except KubeError as exc:
        if exc.status == 0:
            raise
        outcome.apply_error = "; ".join(filter(None, (outcome.apply_error, f"Secret {name}: {exc}")))
        return None
    fingerprint = builders.kv_keys_fingerprint(keys)
    if created:
        outcome.applied.append(f"Secret {name}")
        emit("Normal", "KVKeysCreated", f"created Secret {name} with a new KV transfer keypair ({fingerprint})")
    return fingerprint


def _control_token_fingerprint(kube: Kube, owner: builders.Owner, outcome: Outcome,
                               emit: Callable[[str, str, str], None]) -> str | None:
    """Read (or create once) the worker control token Secret; None, with the problem recorded, if unusable."""
    name = builders.control_token_secret_name(owner)
    try:
        tokens, created = control_secret.ensure(kube, owner)
    except control_secret.InvalidToken as exc:
        outcome.invalid_control_token = str(exc)
        return None
    except KubeError as exc:
        if exc.status == 0:
            raise
        outcome.apply_error = "; ".join(filter(None, (outcome.apply_error, f"Secret {name}: {exc}")))
        return None
    fingerprint = builders.control_token_fingerprint(tokens)
    if created:
        outcome.applied.append(f"Secret {name}")
        emit("Normal", "ControlTokenCreated", f"created Secret {name} with a new worker control token ({fingerprint})")
    return fingerprint


def _api_key_fingerprint(kube: Kube, owner: builders.Owner, spec: DisaggregatedModelSpec,
                         outcome: Outcome) -> str | None:
    """spec.router.apiKeySecret: the fingerprint of its value for the router pod template ("" when unset), so
    new keys roll the routers (router_api_key.py); None, with the problem recorded, when it cannot be read."""
    ref = spec.router.api_key_secret
    if ref is None:
        return ""
    try:
        return router_api_key.read_fingerprint(kube, owner.namespace, ref)
    except KubeError as exc:
        if exc.status == 0:
            raise
        outcome.apply_error = "; ".join(filter(None, (outcome.apply_error, f"Secret {ref.name}: {exc}")))
        return None


def _apply_children(kube: Kube, owner: builders.Owner, spec: DisaggregatedModelSpec, desired: Mapping[str, int],
                    fingerprint: str, kv_keys_fingerprint: str | None, control_token_fingerprint: str,
                    outcome: Outcome, emit: Callable[[str, str, str], None],
                    before: Mapping[str, dict[str, Any]], policies: NetworkPolicySettings) -> None:
    api_key = _api_key_fingerprint(kube, owner, spec, outcome)
    if api_key is None:
        return  # a failed read must not drop the annotation and roll the routers: nothing is applied this pass
    # The NetworkPolicies first: a new model's pods start out with only their legitimate paths open.
    children = [*network_policy.network_policies(owner, policies),
                *builders.build_children(owner, spec, {p: desired[p] for p in POOLS}, fingerprint,
                                         kv_keys_fingerprint, control_token_fingerprint, api_key or None)]
    for child in children:
        label = f"{child['kind']} {child['metadata']['name']}"
        try:
            kube.apply(child)
            outcome.applied.append(label)
        except KubeError as exc:
            if exc.status == 0:
                raise  # the API server is unreachable: let the handler retry, status cannot be written either
            outcome.apply_error = f"{label}: {exc}"
            break
    if not policies.enabled:
        _remove_network_policies(kube, owner, outcome, emit)
    for event in _scale_events(before, owner, desired):
        emit(*event)


def _remove_network_policies(kube: Kube, owner: builders.Owner, outcome: Outcome,
                             emit: Callable[[str, str, str], None]) -> None:
    """Policies turned off (`--no-network-policy`): delete the ones an earlier run made for this model."""
    try:
        removed = network_policy.remove(kube, owner)
    except KubeError as exc:
        if exc.status == 0:
            raise
        outcome.apply_error = "; ".join(filter(None, (outcome.apply_error, f"removing NetworkPolicies: {exc}")))
        return
    if removed:
        outcome.removed += [f"{network_policy.KIND} {name}" for name in removed]
        emit("Normal", "NetworkPoliciesRemoved",
             f"deleted NetworkPolicy {', '.join(removed)}: the operator runs with NetworkPolicies off")


def _observe(kube: Kube, owner: builders.Owner, desired: Mapping[str, int],
             outcome: Outcome) -> list[conditions.PoolObservation]:
    selector = builders.instance_labels(owner)
    try:
        deployments = {d["metadata"]["name"]: d for d in kube.list("apps/v1", "Deployment", owner.namespace, selector)}
        unschedulable = _unschedulable_by_component(kube.list("v1", "Pod", owner.namespace, selector))
    except KubeError as exc:
        if exc.status == 0:
            raise
        # Say so in the status (e.g. missing RBAC) rather than only in the operator's log.
        outcome.apply_error = outcome.apply_error or f"reading the children: {exc}"
        deployments, unschedulable = {}, {}
    return [
        conditions.PoolObservation(
            component=component,
            desired=desired.get(component, 0),
            deployment=deployments.get(builders.child_name(owner, component)),
            unschedulable=unschedulable.get(component, []),
        )
        for component in conditions.COMPONENTS
    ]


def _reconcile_locked(kube: Kube, body: Mapping[str, Any], emit: Callable[[str, str, str], None],
                      policies: NetworkPolicySettings) -> Outcome:
    meta = body["metadata"]
    owner = builders.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    generation = int(meta.get("generation", 0))
    old_status: Mapping[str, Any] = body.get("status") or {}
    outcome = Outcome()
    spec, outcome.invalid_spec = parse_spec(body)

    desired: dict[str, int] = {}
    pools = pool_scale.PoolResources()
    if spec is not None:
        fingerprint = spec_fingerprint(spec)
        before = {d["metadata"]["name"]: d for d in
                  kube.list("apps/v1", "Deployment", owner.namespace, builders.instance_labels(owner))}
        pools = _pool_resources(kube, owner, spec, old_status, before, outcome)
        desired = {pool: desired_replicas(spec, old_status, pool, pools.external(pool)) for pool in POOLS}
        desired["router"] = spec.router.replicas
        keys = _kv_keys_fingerprint(kube, owner, outcome, emit) if spec.kv_transfer.secure else None
        control = _control_token_fingerprint(kube, owner, outcome, emit)
        if (keys is not None or not spec.kv_transfer.secure) and control is not None:
            _apply_children(kube, owner, spec, desired, fingerprint, keys, control, outcome, emit, before, policies)
        # else: nothing is applied (the pods as they run stay) until the Secrets are usable again.

    observations = _observe(kube, owner, desired, outcome)
    problems = conditions.Problems(invalid_spec=outcome.invalid_spec, apply_failed=outcome.apply_error,
                                   kv_keys=outcome.invalid_kv_keys, control_token=outcome.invalid_control_token)
    new_conditions = conditions.merge_conditions(
        old_status.get("conditions") or [], conditions.compute_conditions(observations, problems),
        now_rfc3339(), generation,
    )
    status: dict[str, Any] = {"observedGeneration": generation, "conditions": new_conditions}
    if spec is not None:
        status["endpoint"] = builders.endpoint_url(owner, spec)
        status["specFingerprint"] = fingerprint
        for obs in observations:
            pool_status = conditions.pool_status(obs)
            if obs.component in POOLS:
                pool_status["scaledBy"] = scaled_by(spec, obs.component)
                if pool_status["scaledBy"] == "autoscaler":
                    # The autoscaler owns desiredReplicas then; writing it back here could undo its latest choice.
                    pool_status.pop("desiredReplicas")
            status[obs.component] = pool_status
        pool_scale.write_status(kube, owner.namespace, pool_scale.status_patches(
            owner, spec, pools, desired, {o.component: o.deployment for o in observations}))
    outcome.status = status

    if _differs(old_status, status):
        kube.patch_status(owner.namespace, owner.name, status)
        for event in conditions.transitions(old_status.get("conditions") or [], new_conditions):
            emit(*event)
    return outcome


def _pool_resources(kube: Kube, owner: builders.Owner, spec: DisaggregatedModelSpec, old_status: Mapping[str, Any],
                    before: Mapping[str, dict[str, Any]], outcome: Outcome) -> pool_scale.PoolResources:
    """Read (and create, or hand over) the pools' DisaggregatedPools; a failure is reported, not raised."""
    pools = pool_scale.read(kube, owner)
    current: dict[PoolName, int | None] = {pool: ((before.get(builders.child_name(owner, pool)) or {}).get("spec") or {}).get("replicas")
               for pool in POOLS}
    fallback: dict[PoolName, int] = {pool: desired_replicas(spec, old_status, pool) for pool in POOLS}
    try:
        outcome.applied += pool_scale.ensure(kube, owner, spec, pools, current, fallback)
    except KubeError as exc:
        if exc.status == 0:
            raise
        pools.error = f"DisaggregatedPool: {exc}"
    if pools.error:
        outcome.apply_error = pools.error
    return pools


def _differs(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing `new` (a merge patch) would change `old`."""
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            if _differs(old[key], value):
                return True
        elif old.get(key) != value:
            return True
    return False
