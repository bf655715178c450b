"""spec.router.apiKeySecret: the router pod reads its API keys from a Secret through TANDEM_API_KEY (never its
args), and the resource refuses an env that would set the same variable. The real router reading that
variable is tested in tests/serving/test_router_edge.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tandem.operator import builders
from tandem.operator.api import API_KEY_ENV, DisaggregatedModelSpec

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")


def spec_of(router: dict[str, Any]) -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate({"model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}},
                                                  "router": router})


def router_container(spec: DisaggregatedModelSpec) -> dict[str, Any]:
    return builders.router_deployment(OWNER, spec, 1)["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_the_router_reads_its_keys_from_the_secret_through_the_environment() -> None:
    c = router_container(spec_of({"apiKeySecret": {"name": "tiny-api-keys", "key": "keys"}}))
    assert [e for e in c["env"] if e["name"] == API_KEY_ENV] == [
        {"name": "TANDEM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "tiny-api-keys", "key": "keys"}}}]
    assert not any("api-key" in a for a in c["args"])  # nothing about keys on the command line


def test_the_secret_key_defaults_to_api_key_and_user_env_is_kept() -> None:
    c = router_container(spec_of({"apiKeySecret": {"name": "keys"}, "env": [{"name": "A", "value": "1"}]}))
    names = [e["name"] for e in c["env"]]
    assert names[-2:] == ["A", API_KEY_ENV]
    assert c["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}


def test_without_the_field_the_router_asks_no_key() -> None:
    assert all(e["name"] != API_KEY_ENV for e in router_container(spec_of({}))["env"])


def test_env_must_not_set_the_variable_the_secret_sets() -> None:
    with pytest.raises(ValidationError, match="apiKeySecret sets TANDEM_API_KEY"):
        spec_of({"apiKeySecret": {"name": "keys"}, "env": [{"name": API_KEY_ENV, "value": "in-the-clear"}]})
    spec_of({"env": [{"name": API_KEY_ENV, "value": "allowed without the Secret"}]})


@pytest.mark.parametrize("ref", [{"name": "Bad_Name"}, {"name": ""}, {"name": "ok", "key": "a/b"}, {"key": "x"}])
def test_a_malformed_secret_reference_is_refused(ref: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        spec_of({"apiKeySecret": ref})
