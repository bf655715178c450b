"""desired_replicas: the single path through which spec and autoscaler set a pool's size."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.replicas import desired_replicas, scaled_by


def spec_with(decode: dict[str, Any]) -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate(
        {"model": {"name": "m", "source": {"path": "/m"}}, "decode": decode})


@pytest.mark.parametrize(("decode", "status", "expected"), [
    pytest.param({"replicas": 3}, None, 3, id="spec-only"),
    pytest.param({"replicas": 3}, {"decode": {"desiredReplicas": 7}}, 3, id="autoscaler-value-ignored-when-disabled"),
    pytest.param({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 10}},
                 {"decode": {"desiredReplicas": 7}}, 7, id="autoscaler-value-used"),
    pytest.param({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 10}},
                 None, 3, id="autoscaler-not-run-yet-starts-at-spec"),
    pytest.param({"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 10}},
                 {}, 2, id="start-clamped-to-min"),
    pytest.param({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}},
                 {"decode": {"desiredReplicas": 9}}, 4, id="clamped-to-max"),
    pytest.param({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}},
                 {"decode": {"desiredReplicas": "9"}}, 3, id="garbage-in-status-ignored"),
])
def test_desired_replicas(decode: dict[str, Any], status: dict[str, Any] | None, expected: int) -> None:
    assert desired_replicas(spec_with(decode), status, "decode") == expected


EXTERNAL = {"enabled": True, "mode": "external", "minReplicas": 0, "maxReplicas": 6}


@pytest.mark.parametrize(("decode", "status", "external", "expected"), [
    pytest.param({"replicas": 2, "autoscaling": EXTERNAL}, None, 5, 5, id="external-value-used"),
    pytest.param({"replicas": 2, "autoscaling": EXTERNAL}, None, 0, 0, id="external-scale-to-zero-with-min-0"),
    pytest.param({"replicas": 2, "autoscaling": EXTERNAL}, None, 40, 6, id="external-clamped-to-max"),
    pytest.param({"replicas": 2, "autoscaling": EXTERNAL}, None, None, 2, id="external-not-written-yet-starts-at-spec"),
    pytest.param({"replicas": 2, "autoscaling": EXTERNAL}, {"decode": {"desiredReplicas": 4}}, 3, 3,
                 id="external-owner-wins-over-a-stale-autoscaler-value"),
    pytest.param({"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6}},
                 {"decode": {"desiredReplicas": 4}}, 5, 4, id="tandem-mode-ignores-the-pool-resource"),
    pytest.param({"replicas": 2}, None, 5, 2, id="disabled-ignores-the-pool-resource"),
])
def test_one_owner_at_a_time(decode: dict[str, Any], status: dict[str, Any] | None, external: int | None,
                             expected: int) -> None:
    assert desired_replicas(spec_with(decode), status, "decode", external) == expected


@pytest.mark.parametrize(("autoscaling", "owner"), [
    ({}, "spec"), ({"enabled": True}, "autoscaler"), ({"enabled": True, "mode": "external"}, "external"),
    ({"enabled": False, "mode": "external"}, "spec"),
])
def test_scaled_by(autoscaling: dict[str, Any], owner: str) -> None:
    assert scaled_by(spec_with({"autoscaling": autoscaling}), "decode") == owner


def test_pools_are_independent() -> None:
    spec = spec_with({"replicas": 5})
    assert desired_replicas(spec, {"prefill": {"desiredReplicas": 9}}, "prefill") == 1
