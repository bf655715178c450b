"""The one place that decides how many replicas a pool gets, and who owns that number.

Reconcile reads every pool's count through `desired_replicas`, so each owner changes a pool by
writing its own input and nothing else, and the next reconcile applies it (a hand edit of the
child Deployment is reverted either way):

- autoscaling disabled: spec.<pool>.replicas;
- mode tandem: status.<pool>.desiredReplicas, written by Tandem's autoscaler;
- mode external: spec.replicas of the pool's DisaggregatedPool, written through its scale
  subresource by kubectl scale, an HPA or KEDA.

One owner at a time: the mode picks exactly one input; the others are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from tandem.operator.api import DisaggregatedModelSpec, PoolName

ScaledBy = Literal["spec", "autoscaler", "external"]


def scaled_by(spec: DisaggregatedModelSpec, pool: PoolName) -> ScaledBy:
    """Who owns the pool's replica count under this spec."""
    auto = spec.pool(pool).autoscaling
    if not auto.enabled:
        return "spec"
    return "external" if auto.mode == "external" else "autoscaler"


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def desired_replicas(spec: DisaggregatedModelSpec, status: Mapping[str, Any] | None, pool: PoolName,
                     external: int | None = None) -> int:
    """The pool's size: see the module docstring. `external` is the DisaggregatedPool's spec.replicas.

    Until its owner has written a value, an autoscaled pool starts at spec replicas (clamped to
    min/max), so enabling autoscaling never drops a pool to zero by surprise.
    """
    pool_spec = spec.pool(pool)
    owner = scaled_by(spec, pool)
    if owner == "spec":
        return pool_spec.replicas
    if owner == "external":
        chosen = _whole(external)
    else:
        chosen = _whole(((status or {}).get(pool) or {}).get("desiredReplicas"))
    if chosen is None:
        chosen = pool_spec.replicas
    bounds = pool_spec.autoscaling
    return max(bounds.min_replicas, min(bounds.max_replicas, chosen))
