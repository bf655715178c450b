"""desired_replicas: the single path through which spec and autoscaler set a pool's size."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.replicas import desired_replicas


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


def test_pools_are_independent() -> None:
    spec = spec_with({"replicas": 5})
    assert desired_replicas(spec, {"prefill": {"desiredReplicas": 9}}, "prefill") == 1
