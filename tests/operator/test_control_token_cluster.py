"""The worker control token Secret on the real control plane: created once per model, mounted into every
worker and router pod, owned by the model (gone with it), rotated by deleting it, reported when unusable."""

from __future__ import annotations

import base64
import copy
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from operator_harness import condition

from tandem.operator import builders, control_secret

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed
COMPONENTS = ("prefill", "decode", "router")
ANNOTATION = "tandem.dev/control-token-fingerprint"


def resource(sample: Callable[[str], dict[str, Any]], name: str) -> dict[str, Any]:
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = name
    return body


def wait_ready(testbed: Bed, name: str, timeout: float = 60.0) -> None:
    testbed.wait_for(f"dm/{name} to be Ready at its current generation", lambda: (
        True if (dm := testbed.get("dm", name)) is not None and condition(dm, "Ready").get("status") == "True"
        and dm["status"].get("observedGeneration") == dm["metadata"]["generation"] else None), timeout)


def template_fingerprints(testbed: Bed, name: str) -> dict[str, str | None]:
    return {c: testbed.get("deployment", f"{name}-{c}")["spec"]["template"]["metadata"]["annotations"].get(ANNOTATION)
            for c in COMPONENTS}


def fingerprint_of(secret: dict[str, Any]) -> str:
    return builders.control_token_fingerprint(control_secret.from_secret(secret))


def test_every_model_gets_a_control_token_secret_its_pods_mount_until_it_is_rotated(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("ctl")
    testbed.apply(resource(sample, "ctl"))
    wait_ready(testbed, "ctl")

    secret = testbed.get("secret", "ctl-control-token")
    assert secret is not None and secret["type"] == "Opaque"
    assert [(r["kind"], r["name"], r.get("controller")) for r in secret["metadata"]["ownerReferences"]] == \
        [("DisaggregatedModel", "ctl", True)]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 40
    fingerprint = fingerprint_of(secret)
    assert template_fingerprints(testbed, "ctl") == dict.fromkeys(COMPONENTS, fingerprint)
    for component in COMPONENTS:
        pod = testbed.get("deployment", f"ctl-{component}")["spec"]["template"]["spec"]
        assert builders.control_token_volume(builders.Owner("ctl", testbed.namespace, "")) in pod["volumes"]
        container = pod["containers"][0]
        assert {"name": "control-token", "mountPath": "/etc/tandem/control", "readOnly": True} \
            in container["volumeMounts"]
        assert container["args"][container["args"].index("--control-token-file") + 1] == "/etc/tandem/control/token"
        assert token not in json.dumps(pod)  # the token itself is in the Secret only
        pods = testbed.list("pods", f"app.kubernetes.io/instance=ctl,app.kubernetes.io/component={component}")
        assert pods and all(p["metadata"]["annotations"][ANNOTATION] == fingerprint for p in pods)
    events = json.loads(testbed.kubectl("get", "events", "-n", testbed.namespace, "-o", "json").stdout)["items"]
    created = [e for e in events if e["involvedObject"]["name"] == "ctl" and e["reason"] == "ControlTokenCreated"]
    assert len(created) == 1 and token not in created[0]["message"]

    # Reconciles (a spec change, resyncs) leave it alone: no new token per reconcile.
    testbed.kubectl("patch", "dm", "ctl", "-n", testbed.namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"image": "registry.example/tandem:2"}}))
    testbed.wait_for("the new image everywhere", lambda: all(
        testbed.get("deployment", f"ctl-{c}")["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example/tandem:2" for c in COMPONENTS) or None)
    time.sleep(6)  # at least one resync (TANDEM_OPERATOR_RESYNC_SECONDS=5)
    after = testbed.get("secret", "ctl-control-token")
    assert after["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    assert template_fingerprints(testbed, "ctl") == dict.fromkeys(COMPONENTS, fingerprint)

    # Deleting it rotates the token: a new one, and both pools and the router roll onto it.
    testbed.kubectl("delete", "secret", "ctl-control-token", "-n", testbed.namespace)
    renewed = testbed.wait_for("a new ctl-control-token", lambda: (
        s if (s := testbed.get("secret", "ctl-control-token")) and s["metadata"]["uid"] != secret["metadata"]["uid"]
        else None), timeout=30)
    assert base64.b64decode(renewed["data"]["token"]).decode() != token
    new_fingerprint = fingerprint_of(renewed)
    testbed.wait_for("every template to carry the new fingerprint", lambda: template_fingerprints(
        testbed, "ctl") == dict.fromkeys(COMPONENTS, new_fingerprint) or None, timeout=30)
    testbed.wait_for("every pod to carry the new fingerprint", lambda: all(
        p["metadata"]["annotations"][ANNOTATION] == new_fingerprint
        for p in testbed.list("pods", "app.kubernetes.io/instance=ctl") if not p["metadata"].get("deletionTimestamp"))
        or None)
    wait_ready(testbed, "ctl")

    # Owned by the model: deleting the model takes the Secret with it.
    testbed.kubectl("delete", "dm", "ctl", "-n", testbed.namespace, "--timeout=30s")
    testbed.wait_for("the control token Secret to be garbage-collected",
                     lambda: testbed.get("secret", "ctl-control-token") is None or None, timeout=45)


def test_a_control_token_secret_without_a_usable_token_is_degraded_and_never_replaced(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("badtoken")
    testbed.kubectl("create", "secret", "generic", "badtoken-control-token", "-n", testbed.namespace,
                    "--from-literal=token=short")
    try:
        testbed.apply(resource(sample, "badtoken"))
        dm = testbed.wait_for("dm/badtoken to be Degraded", lambda: (
            d if condition(d := testbed.get("dm", "badtoken"), "Degraded").get("status") == "True" else None))
        degraded = condition(dm, "Degraded")
        assert degraded["reason"] == "ControlTokenInvalid", degraded
        assert "Secret badtoken-control-token" in degraded["message"] and "short" not in degraded["message"]
        assert condition(dm, "Progressing")["reason"] == "ControlTokenInvalid"
        assert not testbed.list("deployments", "app.kubernetes.io/instance=badtoken")  # no pod would start without a usable token
        assert base64.b64decode(testbed.get("secret", "badtoken-control-token")["data"]["token"]) == b"short"
    finally:
        testbed.kubectl("delete", "secret", "badtoken-control-token", "-n", testbed.namespace, check=False)
    wait_ready(testbed, "badtoken")  # deleting it lets the operator make one of its own
    assert testbed.get("secret", "badtoken-control-token")["metadata"]["ownerReferences"][0]["name"] == "badtoken"
