"""Each pool's DisaggregatedPool: the scale subresource that kubectl scale, HPA and KEDA drive.

The operator creates one per pool (owned by the DisaggregatedModel) and keeps its status in
step with the pool's Deployment. Its spec.replicas is an *input*: the operator reads it only
while the pool's autoscaling is `{enabled: true, mode: external}`, and never writes it except
once, when a pool is handed over to an external scaler (it starts from the pool's current
size, not from a stale number). So the operator and an external autoscaler never write the
same field: one owner at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.operator import builders
from tandem.operator.api import API_VERSION, POOL_KIND, POOLS, DisaggregatedModelSpec, PoolName
from tandem.operator.kube import Kube, KubeError
from tandem.operator.replicas import ScaledBy, scaled_by

CRD_MISSING = ("the DisaggregatedPool CRD is not installed (kubectl apply --server-side -f "
               "crds/tandem.dev_disaggregatedpools.yaml); pools cannot be scaled externally")


@dataclass
class PoolResources:
    """The model's DisaggregatedPools as read, and what their spec.replicas asks for."""

    found: dict[PoolName, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    def external(self, pool: PoolName) -> int | None:
        value = ((self.found.get(pool) or {}).get("spec") or {}).get("replicas")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(kube: Kube, owner: builders.Owner) -> PoolResources:
    try:
        items = kube.list(API_VERSION, POOL_KIND, owner.namespace, builders.instance_labels(owner))
    except KubeError as exc:
        if exc.status == 0:
            raise
        return PoolResources(error=CRD_MISSING if exc.status == 404 else f"reading DisaggregatedPools: {exc}")
    found: dict[PoolName, dict[str, Any]] = {}
    for item in items:
        for pool in POOLS:
            if (item.get("spec") or {}).get("pool") == pool and item["metadata"].get("name") == \
                    builders.child_name(owner, pool):
                found[pool] = item
    return PoolResources(found)


def _handed_over(obj: Mapping[str, Any]) -> bool:
    return (obj.get("status") or {}).get("scaledBy") == "external"


def ensure(kube: Kube, owner: builders.Owner, spec: DisaggregatedModelSpec, pools: PoolResources,
           current: Mapping[PoolName, int | None], fallback: Mapping[PoolName, int]) -> list[str]:
    """Create missing DisaggregatedPools and hand pools newly in mode external over at their current size.

    `current` is each pool's Deployment spec.replicas (None when it does not exist yet); `fallback`
    the size to start from otherwise. Returns what was done (for the reconcile's outcome); updates
    `pools.found` so the caller reads the values that now hold.
    """
    done: list[str] = []
    if pools.error:
        return done
    for pool in POOLS:
        start = current.get(pool)
        start = fallback[pool] if start is None else start
        obj = pools.found.get(pool)
        if obj is None:
            created = kube.create(builders.pool_resource(owner, pool, start))
            pools.found[pool] = created
            done.append(f"{POOL_KIND} {builders.child_name(owner, pool)}")
        elif scaled_by(spec, pool) == "external" and not _handed_over(obj) and pools.external(pool) != start:
            # One-time handover: the external scaler starts from what runs now.
            name = builders.child_name(owner, pool)
            pools.found[pool] = kube.patch(API_VERSION, POOL_KIND, owner.namespace, name,
                                           {"spec": {"replicas": start}})
            done.append(f"{POOL_KIND} {name} handed over at {start} replicas")
    return done


def _message(owner_now: ScaledBy, asked: int | None, desired: int, spec: DisaggregatedModelSpec,
             pool: PoolName) -> str:
    if owner_now == "external":
        auto = spec.pool(pool).autoscaling
        if asked is not None and asked != desired:
            return (f"spec.replicas {asked} is outside [{auto.min_replicas}, {auto.max_replicas}] "
                    f"(autoscaling min/max): {desired} applied")
        return "spec.replicas sets the pool's size (autoscaling mode external)"
    if owner_now == "spec":
        why = (f"the DisaggregatedModel's spec.{pool}.replicas sets the size, because autoscaling is "
               f"disabled on the {pool} pool")
    else:
        why = f"Tandem's autoscaler sets the size of the {pool} pool (autoscaling mode tandem)"
    return (f"spec.replicas is ignored: {why}. To scale the pool here, set spec.{pool}.autoscaling to "
            "{enabled: true, mode: external} on the DisaggregatedModel.")


def status_patches(owner: builders.Owner, spec: DisaggregatedModelSpec, pools: PoolResources,
                   desired: Mapping[str, int], deployments: Mapping[str, Mapping[str, Any] | None]
                   ) -> dict[str, dict[str, Any]]:
    """Per DisaggregatedPool name: the status to write, only where it differs from what is there."""
    patches: dict[str, dict[str, Any]] = {}
    for pool, obj in pools.found.items():
        dep_status = (deployments.get(pool) or {}).get("status") or {}
        owner_now = scaled_by(spec, pool)
        status = {
            "replicas": int(dep_status.get("replicas") or 0),
            "readyReplicas": int(dep_status.get("readyReplicas") or 0),
            "desiredReplicas": desired[pool],
            "selector": builders.pool_selector(owner, pool),
            "scaledBy": owner_now,
            "message": _message(owner_now, pools.external(pool), desired[pool], spec, pool),
            "observedGeneration": int(obj["metadata"].get("generation") or 0),
        }
        old = obj.get("status") or {}
        if any(old.get(key) != value for key, value in status.items()):
            patches[builders.child_name(owner, pool)] = status
    return patches


def write_status(kube: Kube, namespace: str, patches: Mapping[str, Mapping[str, Any]]) -> None:
    for name, status in patches.items():
        kube.patch_status(namespace, name, status, kind=POOL_KIND)
