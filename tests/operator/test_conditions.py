"""Children as read from the cluster -> status and conditions."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.conditions import (
    PoolObservation,
    Problems,
    compute_conditions,
    merge_conditions,
    pool_status,
    transitions,
)

UNSCHEDULABLE = ("0/12 nodes are available: 4 Insufficient nvidia.com/gpu, 8 node(s) didn't match "
                 "Pod's node affinity/selector. preemption: 0/12 nodes are available.")


def deployment(desired: int, ready: int, updated: int | None = None, replicas: int | None = None,
               generation: int = 1, observed: int = 1, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    updated = ready if updated is None else updated
    replicas = max(desired, updated) if replicas is None else replicas
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": desired},
        "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                   "updatedReplicas": updated, "availableReplicas": ready, "conditions": conditions or []},
    }


def observe(prefill: dict[str, Any] | None, decode: dict[str, Any] | None, router: dict[str, Any] | None,
            unschedulable: dict[str, list[str]] | None = None) -> list[PoolObservation]:
    found = unschedulable or {}
    return [PoolObservation(name, (dep or {}).get("spec", {}).get("replicas", 1), dep, found.get(name, []))
            for name, dep in (("prefill", prefill), ("decode", decode), ("router", router))]


def by_type(conditions: list[Any]) -> dict[str, Any]:
    return {c.type: c for c in conditions}


@pytest.mark.parametrize(("observations", "problems", "expected"), [
    pytest.param(observe(deployment(1, 1), deployment(2, 2), deployment(1, 1)), Problems(),
                 {"Ready": ("True", "AllPoolsReady"), "Progressing": ("False", "RolloutComplete"),
                  "Degraded": ("False", "AsExpected")}, id="all-ready"),
    pytest.param(observe(deployment(1, 0), deployment(1, 1), deployment(1, 1)), Problems(),
                 {"Ready": ("False", "PoolsNotReady"), "Progressing": ("True", "RollingOut"),
                  "Degraded": ("False", "AsExpected")}, id="prefill-starting"),
    pytest.param(observe(None, deployment(1, 1), deployment(1, 1)), Problems(),
                 {"Ready": ("False", "Creating"), "Progressing": ("True", "RollingOut")}, id="child-missing"),
    pytest.param(observe(deployment(1, 1), deployment(0, 0), deployment(1, 1)), Problems(),
                 {"Ready": ("False", "ScaledToZero")}, id="decode-scaled-to-zero"),
    pytest.param(observe(deployment(2, 2, updated=1, replicas=3), deployment(1, 1), deployment(1, 1)), Problems(),
                 {"Ready": ("True", "AllPoolsReady"), "Progressing": ("True", "RollingOut")}, id="rolling-while-serving"),
    pytest.param(observe(deployment(1, 1, generation=2, observed=1), deployment(1, 1), deployment(1, 1)), Problems(),
                 {"Progressing": ("True", "RollingOut")}, id="controller-not-caught-up"),
    pytest.param(observe(deployment(2, 1), deployment(1, 1), deployment(1, 1), {"prefill": [UNSCHEDULABLE]}), Problems(),
                 {"Ready": ("False", "PoolsNotReady"), "Degraded": ("True", "Unschedulable")}, id="unschedulable"),
    pytest.param(observe(deployment(1, 1), deployment(1, 0, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}]),
        deployment(1, 1)), Problems(), {"Degraded": ("True", "ProgressDeadlineExceeded")}, id="deadline"),
    pytest.param(observe(deployment(1, 1), deployment(1, 1), deployment(1, 1)), Problems(apply_failed="Deployment x: forbidden"),
                 {"Ready": ("True", "AllPoolsReady"), "Degraded": ("True", "ApplyFailed")}, id="apply-failed"),
    pytest.param(observe(None, None, None), Problems(kv_keys="Secret tiny-kv-keys does not hold a usable KV transfer keypair"),
                 {"Ready": ("False", "KVKeysInvalid"), "Progressing": ("False", "KVKeysInvalid"),
                  "Degraded": ("True", "KVKeysInvalid")}, id="kv-keys-invalid"),
    # Keys made unusable after the pools exist: the running pods stay, but nothing rolls out.
    pytest.param(observe(deployment(2, 1, updated=1), deployment(1, 1), deployment(1, 1)),
                 Problems(kv_keys="Secret tiny-kv-keys does not hold a usable KV transfer keypair"),
                 {"Ready": ("False", "PoolsNotReady"), "Progressing": ("False", "KVKeysInvalid"),
                  "Degraded": ("True", "KVKeysInvalid")}, id="kv-keys-invalid-after-rollout"),
    pytest.param(observe(None, None, None), Problems(invalid_spec="spec.model.name: Field required"),
                 {"Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                  "Degraded": ("True", "InvalidSpec")}, id="invalid-spec"),
])
def test_conditions(observations: list[PoolObservation], problems: Problems,
                    expected: dict[str, tuple[str, str]]) -> None:
    got = by_type(compute_conditions(observations, problems))
    assert set(got) == {"Ready", "Progressing", "Degraded"}
    for type_, (status, reason) in expected.items():
        assert (got[type_].status, got[type_].reason) == (status, reason), got[type_]


def test_unschedulable_message_names_the_pool_and_the_missing_resource() -> None:
    observations = observe(deployment(2, 1), deployment(1, 1), deployment(1, 1), {"prefill": [UNSCHEDULABLE]})
    message = by_type(compute_conditions(observations, Problems()))["Degraded"].message
    assert message.startswith("prefill pool: 1 pod cannot be scheduled: not enough nvidia.com/gpu")


def test_pool_status_counts_and_summary() -> None:
    obs = PoolObservation("decode", 3, deployment(3, 2, updated=3), [])
    assert pool_status(obs) == {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3, "desiredReplicas": 3,
                                "summary": "2/3"}
    assert pool_status(PoolObservation("decode", 2, None, []))["summary"] == "0/2"


def test_transition_time_is_kept_while_status_holds() -> None:
    ready = observe(deployment(1, 1), deployment(1, 1), deployment(1, 1))
    first = merge_conditions([], compute_conditions(ready, Problems()), "2026-01-01T00:00:00Z", 1)
    same = merge_conditions(first, compute_conditions(ready, Problems()), "2026-01-01T00:05:00Z", 2)
    assert all(c["lastTransitionTime"] == "2026-01-01T00:00:00Z" for c in same)
    assert all(c["observedGeneration"] == 2 for c in same)
    broken = observe(deployment(1, 0), deployment(1, 1), deployment(1, 1))
    changed = {c["type"]: c for c in merge_conditions(same, compute_conditions(broken, Problems()),
                                                      "2026-01-01T00:09:00Z", 2)}
    assert changed["Ready"]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    assert changed["Degraded"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_events_only_for_transitions() -> None:
    ready = merge_conditions([], compute_conditions(observe(deployment(1, 1), deployment(1, 1), deployment(1, 1)),
                                                    Problems()), "t0", 1)
    stuck = merge_conditions(ready, compute_conditions(
        observe(deployment(2, 1), deployment(1, 1), deployment(1, 1), {"prefill": [UNSCHEDULABLE]}), Problems()), "t1", 2)
    assert [e[:2] for e in transitions([], ready)] == [("Normal", "Ready")]
    assert transitions(ready, ready) == []
    assert [e[:2] for e in transitions(ready, stuck)] == [("Warning", "NotReady"), ("Warning", "Unschedulable")]
    assert [e[:2] for e in transitions(stuck, ready)] == [("Normal", "Ready"), ("Normal", "Recovered")]


def test_other_writers_conditions_are_kept() -> None:
    scaling = {"type": "ScalingLimited", "status": "True", "reason": "AtMax", "message": "decode at maxReplicas",
               "lastTransitionTime": "t0", "observedGeneration": 1}
    ready = observe(deployment(1, 1), deployment(1, 1), deployment(1, 1))
    merged = merge_conditions([scaling], compute_conditions(ready, Problems()), "t1", 1)
    assert [c["type"] for c in merged] == ["Ready", "Progressing", "Degraded", "ScalingLimited"]
    assert merged[-1] == scaling
