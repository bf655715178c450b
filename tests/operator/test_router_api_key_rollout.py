"""spec.router.apiKeySecret rolls the routers when its value changes: the reconcile puts a fingerprint of the
value (router_api_key.py) on the router pod template, as the control token's fingerprint rolls every pod. No
cluster here; tests/operator/test_router_api_key_cluster.py edits a real Secret on a real kube-apiserver."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from tandem.operator import builders, reconcile, router_api_key
from tandem.operator.api import DisaggregatedModelSpec, SecretKeyRef
from tandem.operator.kube import KubeError
from tandem.operator.reconcile import Outcome

from .test_kv_keys import FakeKube

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")
ANNOTATION = builders.API_KEY_FINGERPRINT_ANNOTATION
KEYS = b"first-key second-key"


def spec_of(router: dict[str, Any]) -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate({"model": {"name": "tiny", "source": {"path": "/models/tiny"}},
                                                  "router": router})


def api_key_secret(data: dict[str, bytes], uid: str = "secret-uid-1", name: str = "keys") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def annotations(manifest: dict[str, Any]) -> dict[str, str]:
    return manifest["spec"]["template"]["metadata"]["annotations"]  # type: ignore[no-any-return]


def test_the_router_template_carries_the_fingerprint_and_the_workers_do_not() -> None:
    spec = spec_of({"apiKeySecret": {"name": "keys"}})
    built = {(c["kind"], c["metadata"]["name"]): c
             for c in builders.build_children(OWNER, spec, {"prefill": 1, "decode": 1}, "spec-fp", None, "ctl-fp",
                                              "0123456789ab")}
    assert annotations(built[("Deployment", "tiny-router")])[ANNOTATION] == "0123456789ab"
    for pool in ("prefill", "decode"):
        assert ANNOTATION not in annotations(built[("Deployment", f"tiny-{pool}")])  # workers never see the keys
    assert ANNOTATION not in annotations(builders.router_deployment(OWNER, spec, 1, "ctl-fp"))


def test_the_fingerprint_follows_the_value_and_the_secret_not_the_reconcile() -> None:
    one = router_api_key.fingerprint(KEYS, "uid-a")
    assert one == router_api_key.fingerprint(KEYS, "uid-a") and len(one) == 12
    assert router_api_key.fingerprint(b"first-key second-key third-key", "uid-a") != one  # a key added: a roll
    assert router_api_key.fingerprint(KEYS, "uid-b") != one  # the Secret deleted and made again: a roll too
    # Not a plain hash of the keys: whoever reads the pod template cannot check guesses without the Secret.
    assert hashlib.sha256(KEYS).hexdigest()[:12] != one and b"first-key" not in one.encode()


def test_reading_the_secret() -> None:
    ref = SecretKeyRef(name="keys", key="api-key")
    kube = FakeKube({"keys": api_key_secret({"api-key": KEYS})})
    assert router_api_key.read_fingerprint(kube, "serving", ref) == router_api_key.fingerprint(KEYS, "secret-uid-1")  # type: ignore[arg-type]
    other_key = SecretKeyRef(name="keys", key="other")
    assert router_api_key.read_fingerprint(kube, "serving", other_key) == router_api_key.ABSENT  # type: ignore[arg-type]
    missing = SecretKeyRef(name="not-there")
    assert router_api_key.read_fingerprint(kube, "serving", missing) == router_api_key.ABSENT  # type: ignore[arg-type]
    with pytest.raises(KubeError):
        router_api_key.read_fingerprint(FakeKube(refuse=403), "serving", ref)  # type: ignore[arg-type]


def test_the_reconcile_reads_it_only_when_set_and_applies_nothing_when_it_cannot() -> None:
    kube = FakeKube({"keys": api_key_secret({"api-key": KEYS})})
    outcome = Outcome()
    assert reconcile._api_key_fingerprint(kube, OWNER, spec_of({}), outcome) == ""  # type: ignore[arg-type]
    assert reconcile._api_key_fingerprint(kube, OWNER, spec_of({"apiKeySecret": {"name": "keys"}}),  # type: ignore[arg-type]
                                          outcome) == router_api_key.fingerprint(KEYS, "secret-uid-1")
    assert outcome.apply_error is None
    # A refused read must not look like a missing Secret (that would drop the annotation and roll the routers).
    assert reconcile._api_key_fingerprint(FakeKube(refuse=403), OWNER,  # type: ignore[arg-type]
                                          spec_of({"apiKeySecret": {"name": "keys"}}), outcome) is None
    assert outcome.apply_error is not None and outcome.apply_error.startswith("Secret keys: ")
    assert reconcile._api_key_fingerprint(FakeKube(refuse=403), OWNER, spec_of({}), Outcome()) == ""  # type: ignore[arg-type]
