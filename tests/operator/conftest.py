"""Shared data for the operator tests: the samples and the table of invalid resources."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "crds" / "samples"
INVALID = Path(__file__).with_name("invalid_resources.yaml")


def load_sample(name: str) -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())  # type: ignore[no-any-return]


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    """Deep merge; a None value removes the key."""
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def invalid_resource(case: dict[str, Any]) -> dict[str, Any]:
    """The minimal sample with one case's change applied."""
    resource = load_sample("minimal")
    resource["metadata"]["name"] = case.get("name", f"bad-{case['id']}")
    for dotted in case.get("remove", []):
        *parents, last = dotted.split(".")
        node = resource["spec"]
        for part in parents:
            node = node[part]
        del node[last]
    _merge(resource["spec"], case.get("spec", {}))
    return resource


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "invalid_case" in metafunc.fixturenames:
        cases = yaml.safe_load(INVALID.read_text())
        metafunc.parametrize("invalid_case", cases, ids=[c["id"] for c in cases])


@pytest.fixture
def make_invalid() -> Callable[[dict[str, Any]], dict[str, Any]]:
    return invalid_resource


@pytest.fixture
def sample() -> Callable[[str], dict[str, Any]]:
    return load_sample


# --- integration: a namespace, the CRD and a running operator ---------------------

sys.path.insert(0, str(Path(__file__).parent))
from operator_harness import OperatorProcess, wait_for  # noqa: E402


class Testbed:
    """What an operator integration test works with."""

    def __init__(self, cluster: Any, namespace: str, operator: OperatorProcess) -> None:
        self.cluster, self.namespace, self.operator = cluster, namespace, operator

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, input=input, check=check)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        proc = self.kubectl("get", kind, name, "-n", self.namespace, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name}: {proc.stderr}")
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def list(self, kind: str, selector: str) -> list[dict[str, Any]]:
        out = self.kubectl("get", kind, "-n", self.namespace, "-l", selector, "-o", "json").stdout
        return json.loads(out)["items"]  # type: ignore[no-any-return]

    def apply(self, resource: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(resource))

    def wait_for(self, what: str, probe: Any, timeout: float = 60.0) -> Any:
        return wait_for(what, probe, timeout=timeout,
                        on_timeout=lambda: f"--- operator log (tail) ---\n{self.operator.log_tail()}")


@pytest.fixture(scope="module")
def testbed(k8s_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    namespace = k8s_cluster.new_namespace("op")
    k8s_cluster.install_crds()
    # Router pods land on the cluster's untainted `system` pool (hack/cluster-nodes.json).
    operator = OperatorProcess(k8s_cluster.kubeconfig, namespace, tmp_path_factory.mktemp("operator") / "operator.log",
                               k8s_cluster.env)
    operator.start()
    try:
        yield Testbed(k8s_cluster, namespace, operator)
    finally:
        # The operator must still run to release its finalizer (kopf adds one for the resync timer).
        if not operator.alive():
            operator.start()
        k8s_cluster.delete_custom_resources(namespace)
        operator.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def cleanup(testbed: Testbed) -> Iterator[list[str]]:
    """Names of resources to delete after the test (their pods would otherwise hold GPUs)."""
    names: list[str] = []
    yield names
    for name in names:
        testbed.kubectl("delete", "dm", name, "-n", testbed.namespace, "--timeout=45s", check=False)
