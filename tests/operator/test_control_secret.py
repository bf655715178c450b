"""The worker control token Secret (tandem.operator.control_secret) and how pods get it (builders), no cluster.

The Secret's creation, ownership and rotation on a real kube-apiserver are in test_cluster_operator.py.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tandem.operator import builders, conditions, control_secret
from tandem.operator.api import API_VERSION, DisaggregatedModelSpec
from tandem.operator.kube import KubeError
from tandem.worker.server.control_token import ControlTokens

from .test_kv_keys import FakeKube

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")
SPEC = DisaggregatedModelSpec.model_validate({"model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}}})
TOKEN = "a-control-token-for-tests-0123456789"
FINGERPRINT = builders.control_token_fingerprint((TOKEN,))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def flag(args: list[str], name: str) -> str | None:
    return builders.flag_value(args, name)


def test_the_secret_is_owned_by_the_model_and_holds_one_token() -> None:
    secret = builders.control_token_secret(OWNER, TOKEN)
    meta = secret["metadata"]
    assert (secret["kind"], secret["type"], meta["name"], meta["namespace"]) == \
        ("Secret", "Opaque", "tiny-control-token", "serving")
    assert meta["ownerReferences"] == [{"apiVersion": API_VERSION, "kind": "DisaggregatedModel",
                                        "name": "tiny", "uid": "uid-1", "controller": True}]
    assert meta["labels"]["app.kubernetes.io/component"] == "control-token"
    assert secret["data"] == {"token": b64(TOKEN)}
    assert control_secret.from_secret(secret) == (TOKEN,)


def test_the_secret_as_the_kubelet_mounts_it_is_what_the_worker_loads(tmp_path: Path) -> None:
    for key, value in builders.control_token_secret(OWNER, TOKEN)["data"].items():
        (tmp_path / key).write_bytes(base64.b64decode(value))
    assert f"{builders.CONTROL_TOKEN_MOUNT}/{builders.CONTROL_TOKEN_KEY}" == builders.CONTROL_TOKEN_FILE
    assert ControlTokens.from_file(tmp_path / builders.CONTROL_TOKEN_KEY).tokens == (TOKEN,)


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_worker_pods_mount_the_token_pass_its_file_and_carry_its_fingerprint(pool: str) -> None:
    template = builders.worker_pod_template(OWNER, SPEC, pool, "spec-fp", control_token_fingerprint=FINGERPRINT)
    container = template["spec"]["containers"][0]
    assert flag(container["args"], "--control-token-file") == "/etc/tandem/control/token"
    assert {"name": "control-token", "secret": {"secretName": "tiny-control-token", "defaultMode": 0o444,
                                                "items": [{"key": "token", "path": "token"}]}} \
        in template["spec"]["volumes"]
    assert {"name": "control-token", "mountPath": "/etc/tandem/control", "readOnly": True} in container["volumeMounts"]
    assert template["metadata"]["annotations"]["tandem.dev/control-token-fingerprint"] == FINGERPRINT
    assert TOKEN not in str(template)


def test_the_router_pod_mounts_the_token_and_passes_its_file() -> None:
    deployment = builders.router_deployment(OWNER, SPEC, 1, FINGERPRINT)
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert flag(container["args"], "--control-token-file") == "/etc/tandem/control/token"
    assert builders.control_token_volume(OWNER) in template["spec"]["volumes"]
    assert {"name": "control-token", "mountPath": "/etc/tandem/control", "readOnly": True} in container["volumeMounts"]
    assert template["metadata"]["annotations"]["tandem.dev/control-token-fingerprint"] == FINGERPRINT
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_a_new_token_changes_only_the_fingerprint_on_every_pod_template() -> None:
    other = builders.control_token_fingerprint(("another-control-token-0123456789",))
    assert other != FINGERPRINT
    before = builders.build_children(OWNER, SPEC, {"prefill": 1, "decode": 1}, "spec-fp", None, FINGERPRINT)
    after = builders.build_children(OWNER, SPEC, {"prefill": 1, "decode": 1}, "spec-fp", None, other)
    deployments = [(b, a) for b, a in zip(before, after, strict=True) if b["kind"] == "Deployment"]
    assert len(deployments) == 3  # both pools and the router roll
    for b, a in deployments:
        annotations = a["spec"]["template"]["metadata"]["annotations"]
        assert annotations.pop("tandem.dev/control-token-fingerprint") == other
        assert b["spec"]["template"]["metadata"]["annotations"].pop("tandem.dev/control-token-fingerprint") == FINGERPRINT
        assert a == b
    assert [c for c in before if c["kind"] == "Secret"] == []  # created once by control_secret.ensure, never applied


def test_a_missing_secret_is_created_once_and_then_used() -> None:
    kube = FakeKube()
    tokens, created = control_secret.ensure(kube, OWNER)  # type: ignore[arg-type]
    assert created and len(tokens) == 1 and len(tokens[0]) >= 40
    assert kube.created == [builders.control_token_secret(OWNER, tokens[0])]
    assert control_secret.ensure(kube, OWNER) == (tokens, False)  # type: ignore[arg-type]
    assert len(kube.created) == 1


def test_a_users_secret_is_used_as_it_is_and_the_create_race_is_lost_gracefully() -> None:
    theirs = {"metadata": {"name": "tiny-control-token"}, "data": {"token": b64(f"{TOKEN}\nold-token-0123456789\n")}}
    kube = FakeKube({"tiny-control-token": theirs})
    assert control_secret.ensure(kube, OWNER) == ((TOKEN, "old-token-0123456789"), False)  # type: ignore[arg-type]
    racing = FakeKube(appears_on_create=builders.control_token_secret(OWNER, TOKEN))
    assert control_secret.ensure(racing, OWNER) == ((TOKEN,), False)  # type: ignore[arg-type]
    with pytest.raises(KubeError, match="forbidden"):
        control_secret.ensure(FakeKube(refuse=403), OWNER)  # type: ignore[arg-type]


@pytest.mark.parametrize(("data", "why"), [
    ({}, "no key 'token'"),
    ({"token": "!!not base64!!"}, "not base64"),
    ({"token": b64("short")}, "has 5 characters"),
    ({"token": b64("# only a comment\n")}, "holds no control token"),
])
def test_a_secret_without_a_usable_token_is_reported_never_replaced(data: dict[str, Any], why: str) -> None:
    kube = FakeKube({"tiny-control-token": {"metadata": {"name": "tiny-control-token"}, "data": data}})
    with pytest.raises(control_secret.InvalidToken) as caught:
        control_secret.ensure(kube, OWNER)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("Secret tiny-control-token does not hold a usable worker control token"), message
    assert why in message and "delete it" in message
    assert kube.created == []


def test_an_unusable_token_secret_degrades_the_model_and_blocks_the_rollout() -> None:
    problems = conditions.Problems(control_token="Secret tiny-control-token does not hold a usable ...")
    observations = [conditions.PoolObservation(component=c, desired=1, deployment=None, unschedulable=[])
                    for c in conditions.COMPONENTS]
    by_type = {c.type: c for c in conditions.compute_conditions(observations, problems)}
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == ("True", "ControlTokenInvalid")
    assert (by_type["Progressing"].status, by_type["Progressing"].reason) == ("False", "ControlTokenInvalid")
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", "ControlTokenInvalid")
