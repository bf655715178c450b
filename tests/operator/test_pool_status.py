"""Pure parts of the per-pool scale resources: the manifest the operator creates and the status it writes."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator import builders, pool_scale
from tandem.operator.api import DisaggregatedModelSpec

OWNER = builders.Owner(name="llama", namespace="team-a", uid="u-1")


def spec_with(decode: dict[str, Any]) -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate({"model": {"name": "m", "source": {"path": "/m"}}, "decode": decode})


def pool_object(replicas: int, status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = builders.pool_resource(OWNER, "decode", replicas)
    obj["metadata"]["generation"] = 2
    obj["status"] = status or {}
    return obj


def test_pool_resource_is_an_owned_child_with_the_pool_labels() -> None:
    obj = builders.pool_resource(OWNER, "prefill", 3)
    assert (obj["apiVersion"], obj["kind"], obj["metadata"]["name"]) == (
        "tandem.dev/v1alpha1", "DisaggregatedPool", "llama-prefill")
    assert obj["spec"] == {"replicas": 3, "model": "llama", "pool": "prefill"}
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "prefill"
    assert builders.pool_selector(OWNER, "prefill") == (
        "app.kubernetes.io/component=prefill,app.kubernetes.io/instance=llama,app.kubernetes.io/name=tandem")


DEPLOYMENT = {"status": {"replicas": 3, "readyReplicas": 2}}


@pytest.mark.parametrize(("autoscaling", "asked", "desired", "scaled_by", "says"), [
    ({}, 5, 2, "spec", "is ignored"),
    ({"enabled": True}, 5, 2, "autoscaler", "Tandem's autoscaler"),
    ({"enabled": True, "mode": "external", "maxReplicas": 4}, 3, 3, "external", "sets the pool's size"),
    ({"enabled": True, "mode": "external", "maxReplicas": 4}, 9, 4, "external", "outside [1, 4]"),
])
def test_status_says_who_owns_the_count(autoscaling: dict[str, Any], asked: int, desired: int, scaled_by: str,
                                        says: str) -> None:
    pools = pool_scale.PoolResources({"decode": pool_object(asked)})
    patches = pool_scale.status_patches(OWNER, spec_with({"replicas": 2, "autoscaling": autoscaling}), pools,
                                        {"decode": desired}, {"decode": DEPLOYMENT})
    status = patches["llama-decode"]
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (3, 2, desired)
    assert status["scaledBy"] == scaled_by and says in status["message"]
    assert status["selector"] == builders.pool_selector(OWNER, "decode") and status["observedGeneration"] == 2


@pytest.mark.parametrize(("pool", "autoscaling", "expected"), [
    ("prefill", {}, "spec.replicas is ignored: the DisaggregatedModel's spec.prefill.replicas sets the size, because "
     "autoscaling is disabled on the prefill pool. To scale the pool here, set spec.prefill.autoscaling to "
     "{enabled: true, mode: external} on the DisaggregatedModel."),
    ("decode", {"enabled": True}, "spec.replicas is ignored: Tandem's autoscaler sets the size of the decode pool "
     "(autoscaling mode tandem). To scale the pool here, set spec.decode.autoscaling to "
     "{enabled: true, mode: external} on the DisaggregatedModel."),
])
def test_ignored_scale_message_names_the_pool(pool: str, autoscaling: dict[str, Any], expected: str) -> None:
    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "m", "source": {"path": "/m"}},
                                                  pool: {"replicas": 1, "autoscaling": autoscaling}})
    obj = builders.pool_resource(OWNER, pool, 5)  # type: ignore[arg-type]
    obj["metadata"]["generation"] = 1
    patches = pool_scale.status_patches(OWNER, spec, pool_scale.PoolResources({pool: obj}),  # type: ignore[dict-item]
                                        {pool: 1}, {pool: DEPLOYMENT})
    message = patches[f"llama-{pool}"]["message"]
    assert message == expected
    assert "<pool>" not in message


def test_status_is_written_only_when_it_changes() -> None:
    spec = spec_with({"replicas": 2})
    pools = pool_scale.PoolResources({"decode": pool_object(2)})
    first = pool_scale.status_patches(OWNER, spec, pools, {"decode": 2}, {"decode": DEPLOYMENT})
    pools.found["decode"]["status"] = first["llama-decode"]
    assert pool_scale.status_patches(OWNER, spec, pools, {"decode": 2}, {"decode": DEPLOYMENT}) == {}


@pytest.mark.parametrize(("value", "expected"), [(3, 3), (0, 0), (None, None), ("3", None), (True, None)])
def test_external_value_is_read_only_when_it_is_a_count(value: Any, expected: int | None) -> None:
    obj = pool_object(1)
    obj["spec"]["replicas"] = value
    assert pool_scale.PoolResources({"decode": obj}).external("decode") == expected
