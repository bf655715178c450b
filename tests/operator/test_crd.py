"""The generated CRD: up to date, structural, and documented field by field."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.operator.crd import custom_resource_definition, openapi_schema

REPO = Path(__file__).resolve().parents[2]


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_crd", REPO / "hack" / "gen_crd.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_crd_and_reference_are_up_to_date() -> None:
    for path, text in _generator().generated_files().items():
        assert path.exists(), f"{path} is missing; run: python hack/gen_crd.py"
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale; run: python hack/gen_crd.py"


def test_generator_check_mode_flags_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    gen = _generator()
    stale = tmp_path / "crd.yaml"
    stale.write_text("old")
    monkeypatch.setattr(gen, "generated_files", lambda: {stale: "new"})
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "crd.yaml" in capsys.readouterr().err
    assert stale.read_text() == "old"
    assert gen.main([]) == 0
    assert stale.read_text() == "new"


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    for path, node in _walk(openapi_schema()):
        assert not {"$ref", "$defs", "title", "anyOf", "oneOf", "allOf"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and path != ".metadata":  # the API server owns metadata's schema
            assert ("properties" in node or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_crd_shape() -> None:
    crd = custom_resource_definition()
    assert crd["metadata"]["name"] == "disaggregatedmodels.tandem.dev"
    assert crd["spec"]["names"]["shortNames"] == ["dm"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Prefill", "Decode", "Ready", "Endpoint", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["properties"]) >= {"model", "image", "kvTransfer", "prefill", "decode", "router", "slo", "ratio"}
    assert spec["properties"]["decode"]["properties"]["autoscaling"]["properties"]["targetKVUtilization"] == {
        "default": 0.75, "description": "Fraction of KV-cache blocks in use (0 < x <= 1) to aim for.",
        "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "type": "number"}


def test_nested_defaults_are_complete_so_a_minimal_resource_works() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    assert spec["prefill"]["default"]["replicas"] == 1
    assert spec["prefill"]["default"]["autoscaling"]["enabled"] is False
    assert spec["kvTransfer"]["default"] == {"transport": "auto", "blockSize": 16,
                                             "rdmaResource": "rdma/rdma_shared_device_a", "secure": False}


def test_every_field_is_in_the_reference() -> None:
    docs = (REPO / "docs" / "crd.md").read_text()
    schema = openapi_schema()
    for part in ("spec", "status"):
        for path, node in _walk(schema["properties"][part], part):
            if "{}" in path or path.endswith("[]"):  # map values and list items are documented with their parent
                continue
            assert f"| `{path}` |" in docs, f"{path} missing from docs/crd.md"
            if path.count(".") > 0:
                assert node.get("description"), f"{path} has no description"


def test_committed_samples_are_valid_against_the_models() -> None:
    from tandem.operator.api import DisaggregatedModelSpec

    for sample in ("minimal", "full"):
        resource = yaml.safe_load((REPO / "crds" / "samples" / f"{sample}.yaml").read_text())
        assert resource["apiVersion"] == "tandem.dev/v1alpha1" and resource["kind"] == "DisaggregatedModel"
        DisaggregatedModelSpec.model_validate(resource["spec"])


def test_operator_docs_list_exactly_the_rbac_rules() -> None:
    from tandem.operator.rbac import markdown_table

    assert markdown_table() in (REPO / "docs" / "operator.md").read_text(), \
        "docs/operator.md's RBAC table differs from tandem.operator.rbac.RULES"


def test_pool_crd_exposes_a_scale_subresource() -> None:
    from tandem.operator.crd import pool_custom_resource_definition, pool_openapi_schema

    crd = pool_custom_resource_definition()
    assert crd["metadata"]["name"] == "disaggregatedpools.tandem.dev"
    assert crd["spec"]["names"]["shortNames"] == ["dmpool"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    schema = pool_openapi_schema()
    assert schema["properties"]["spec"]["required"] == ["model", "pool", "replicas"]
    for path, node in _walk(schema):
        assert not {"$ref", "$defs", "title", "anyOf"} & set(node), path
    docs = (REPO / "docs" / "crd.md").read_text()
    for part in ("spec", "status"):
        for path, _ in _walk(schema["properties"][part], part):
            assert f"| `{path}` |" in docs, f"{path} (DisaggregatedPool) missing from docs/crd.md"


def test_autoscaling_knobs_have_the_policy_defaults() -> None:
    from tandem.operator.autoscaling import PoolPolicy

    auto = openapi_schema()["properties"]["spec"]["properties"]["prefill"]["properties"]["autoscaling"]["properties"]
    policy = PoolPolicy(min_replicas=1, max_replicas=1, target=1.0)
    assert auto["tolerance"]["default"] == policy.tolerance
    assert auto["maxScaleUpPods"]["default"] == policy.max_scale_up_pods
    assert auto["maxScaleUpPercent"]["default"] == policy.max_scale_up_percent
    assert auto["cooldownSeconds"]["default"] == policy.cooldown_s
    assert auto["mode"]["enum"] == ["tandem", "external"] and auto["mode"]["default"] == "tandem"
    assert "lowest" in auto["scaleUpStabilizationSeconds"]["description"]
