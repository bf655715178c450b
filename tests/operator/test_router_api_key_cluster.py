"""spec.router.apiKeySecret on the real control plane: the router pod template carries a fingerprint of the
Secret's value, so editing the Secret rolls the routers onto the new keys (they read $TANDEM_API_KEY at start),
and nothing else rolls them. The worker pools are left alone."""

from __future__ import annotations

import base64
import copy
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from operator_harness import condition

from tandem.operator import builders, router_api_key

pytestmark = pytest.mark.integration

Bed = Any  # tests/operator/conftest.py: Testbed
ANNOTATION = builders.API_KEY_FINGERPRINT_ANNOTATION


def wait_ready(testbed: Bed, name: str, timeout: float = 60.0) -> None:
    testbed.wait_for(f"dm/{name} to be Ready at its current generation", lambda: (
        True if (dm := testbed.get("dm", name)) is not None and condition(dm, "Ready").get("status") == "True"
        and dm["status"].get("observedGeneration") == dm["metadata"]["generation"] else None), timeout)


def template(testbed: Bed, name: str, component: str) -> dict[str, Any]:
    return testbed.get("deployment", f"{name}-{component}")["spec"]["template"]  # type: ignore[no-any-return]


def expected(testbed: Bed, secret: str, key: str = "api-key") -> str:
    found = testbed.get("secret", secret)
    return router_api_key.fingerprint(base64.b64decode(found["data"][key]), found["metadata"]["uid"])


def set_keys(testbed: Bed, secret: str, keys: str) -> None:
    testbed.kubectl("patch", "secret", secret, "-n", testbed.namespace, "--type=merge", "-p",
                    json.dumps({"stringData": {"api-key": keys}}))


def router_pods(testbed: Bed, name: str) -> list[dict[str, Any]]:
    return [p for p in testbed.list("pods", f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router")
            if not p["metadata"].get("deletionTimestamp")]


def test_editing_the_api_key_secret_rolls_the_routers_and_only_them(
        testbed: Bed, cleanup: list[str], sample: Callable[[str], dict[str, Any]]) -> None:
    cleanup.append("keyed")
    testbed.kubectl("create", "secret", "generic", "keyed-api-keys", "-n", testbed.namespace,
                    "--from-literal=api-key=first-key")
    body = copy.deepcopy(sample("minimal"))
    body["metadata"]["name"] = "keyed"
    body["spec"]["router"] = {"apiKeySecret": {"name": "keyed-api-keys"}}
    testbed.apply(body)
    wait_ready(testbed, "keyed")

    first = expected(testbed, "keyed-api-keys")
    assert template(testbed, "keyed", "router")["metadata"]["annotations"][ANNOTATION] == first
    assert "first-key" not in json.dumps(testbed.get("deployment", "keyed-router"))  # only the Secret holds it
    workers = {pool: testbed.get("deployment", f"keyed-{pool}")["metadata"]["generation"] for pool in ("prefill", "decode")}
    for pool in workers:
        assert ANNOTATION not in template(testbed, "keyed", pool)["metadata"]["annotations"]
    old_pods = {p["metadata"]["name"] for p in router_pods(testbed, "keyed")}
    assert old_pods and all(p["metadata"]["annotations"][ANNOTATION] == first for p in router_pods(testbed, "keyed"))

    # Resyncs with the Secret unchanged leave the router's template as it is: no roll per reconcile.
    generation = testbed.get("deployment", "keyed-router")["metadata"]["generation"]
    time.sleep(6)  # at least one resync (TANDEM_OPERATOR_RESYNC_SECONDS=5)
    assert testbed.get("deployment", "keyed-router")["metadata"]["generation"] == generation

    # Step 1 of a rotation: the new key beside the old one. The routers roll onto it within a resync.
    set_keys(testbed, "keyed-api-keys", "first-key second-key")
    second = expected(testbed, "keyed-api-keys")
    assert second != first
    testbed.wait_for("the router template to carry the new fingerprint", lambda: (
        template(testbed, "keyed", "router")["metadata"]["annotations"].get(ANNOTATION) == second or None), timeout=30)
    testbed.wait_for("new router pods with the new fingerprint, the old ones gone", lambda: (
        (pods := router_pods(testbed, "keyed")) and all(p["metadata"]["annotations"][ANNOTATION] == second for p in pods)
        and not old_pods & {p["metadata"]["name"] for p in pods}) or None, timeout=60)
    wait_ready(testbed, "keyed")
    # The worker pools did not roll.
    assert {pool: testbed.get("deployment", f"keyed-{pool}")["metadata"]["generation"] for pool in workers} == workers

    # The Secret gone: the template says so (router pods cannot start without it; the running ones stay until
    # a new pod is ready, maxUnavailable 0); made again, the routers roll onto it.
    testbed.kubectl("delete", "secret", "keyed-api-keys", "-n", testbed.namespace)
    testbed.wait_for("the template to say the Secret is absent", lambda: (
        template(testbed, "keyed", "router")["metadata"]["annotations"].get(ANNOTATION) == router_api_key.ABSENT
        or None), timeout=30)
    testbed.kubectl("create", "secret", "generic", "keyed-api-keys", "-n", testbed.namespace,
                    "--from-literal=api-key=third-key")
    third = expected(testbed, "keyed-api-keys")
    testbed.wait_for("the template to carry the recreated Secret's fingerprint", lambda: (
        template(testbed, "keyed", "router")["metadata"]["annotations"].get(ANNOTATION) == third or None), timeout=30)
