"""The one place that decides how many replicas a pool gets.

Reconcile reads every pool's count through `desired_replicas`, so the autoscaler changes a
pool by writing status.<pool>.desiredReplicas and nothing else: the next reconcile applies it,
and a hand edit of the child Deployment is reverted either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.operator.api import DisaggregatedModelSpec, PoolName


def desired_replicas(spec: DisaggregatedModelSpec, status: Mapping[str, Any] | None, pool: PoolName) -> int:
    """spec.<pool>.replicas, or, with autoscaling enabled, the autoscaler's choice clamped to its bounds.

    Until the autoscaler has written a value, an autoscaled pool starts at spec replicas
    (clamped), so enabling autoscaling never drops a pool to zero by surprise.
    """
    pool_spec = spec.pool(pool)
    if not pool_spec.autoscaling.enabled:
        return pool_spec.replicas
    pool_status = (status or {}).get(pool) or {}
    chosen = pool_status.get("desiredReplicas")
    if not isinstance(chosen, int) or isinstance(chosen, bool):
        chosen = pool_spec.replicas
    bounds = pool_spec.autoscaling
    return max(bounds.min_replicas, min(bounds.max_replicas, chosen))
