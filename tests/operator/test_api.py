"""The resource models: defaults, aliases, and the same refusals the API server gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tandem.operator.api import DisaggregatedModelSpec, name_problem
from tandem.operator.reconcile import parse_spec


def test_minimal_sample_gets_working_defaults(sample: Callable[[str], dict[str, Any]]) -> None:
    spec = DisaggregatedModelSpec.model_validate(sample("minimal")["spec"])
    assert (spec.prefill.replicas, spec.decode.replicas, spec.router.replicas) == (1, 1, 1)
    assert spec.prefill.gpus_per_replica == 1
    assert spec.kv_transfer.transport == "auto"
    assert spec.kv_transfer.block_size == 16
    assert spec.kv_transfer.rdma_resource == "rdma/rdma_shared_device_a"
    assert spec.model.dtype == "bfloat16"
    assert not spec.prefill.autoscaling.enabled
    assert spec.router.service.port == 8000


def test_full_sample_round_trips_with_wire_names(sample: Callable[[str], dict[str, Any]]) -> None:
    raw = sample("full")["spec"]
    spec = DisaggregatedModelSpec.model_validate(raw)
    assert spec.decode.autoscaling.target_kv_utilization == 0.8
    assert spec.model.source.pvc is not None and spec.model.source.pvc.claim_name == "model-weights"
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["decode"]["autoscaling"]["targetKVUtilization"] == 0.8
    assert dumped["kvTransfer"]["transport"] == "rdma"
    assert DisaggregatedModelSpec.model_validate(dumped) == spec


def test_invalid_resource_is_refused_naming_the_field(invalid_case: dict[str, Any],
                                                      make_invalid: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    resource = make_invalid(invalid_case)
    spec, problem = parse_spec(resource)
    assert spec is None, f"{invalid_case['id']} was accepted: {yaml.safe_dump(resource['spec'])}"
    assert problem is not None and invalid_case["field"] in problem, problem
    assert invalid_case.get("message", "") in problem, problem


@pytest.mark.parametrize(("name", "ok"), [
    ("tiny", True), ("a" * 55, True), ("a" * 56, False), ("tiny.v2", False), ("9lives", False), ("Tiny", False),
])
def test_resource_names_leave_room_for_child_names(name: str, ok: bool) -> None:
    assert (name_problem(name) is None) == ok


@pytest.mark.parametrize("source", [
    {"uri": "https://models.example/tiny.tar.gz"},  # TLS checks who sends the archive
    {"uri": "http://10.0.0.5:8080/tiny.tar.gz", "sha256": "0123456789abcdef" * 4},  # the checksum checks what
])
def test_a_uri_source_is_https_or_carries_a_checksum(source: dict[str, str]) -> None:
    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "tiny", "source": source}})
    assert spec.model.source.uri == source["uri"]
