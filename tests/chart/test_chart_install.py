"""The chart installed into the local control plane (RBAC on), and its RBAC proven rule by rule.

kwok runs no containers, so the operator pod the chart creates never executes. The test runs
`tandem operator` here instead, with exactly the arguments of the chart's Deployment and the
token of the chart's ServiceAccount, i.e. with the chart's RBAC and nothing else.

Each rule of the chart's ClusterRole is then removed in turn (one test each): with it gone, a
fresh resource must fail to become Ready, fail to be deleted, or the operator must log a
forbidden request. A rule whose removal nothing notices is reported as one to drop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, REPO, helm_binary

from tandem.operator import rbac
from tandem.worker.server.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_ID = uuid.uuid4().hex[:6]
RELEASE = f"tandem-{RUN_ID}"
RELEASE_NS = f"chart-sys-{RUN_ID}"
WORK_NS = f"chart-work-{RUN_ID}"
CPU_NODE = f"chart-cpu-{RUN_ID}"
SAMPLE = REPO / "crds" / "samples" / "minimal.yaml"


def cpu_node() -> dict[str, Any]:
    """An untainted kwok node for the router pods (the GPU pools are tainted), and the operator pod."""
    resources = {"cpu": "32", "memory": "128Gi", "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": CPU_NODE,
                         "labels": {"type": "kwok", "kubernetes.io/hostname": CPU_NODE, "kubernetes.io/os": "linux"},
                         "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
            "status": {"capacity": resources, "allocatable": resources}}


def wait(what: str, probe: Callable[[], Any], timeout: float, on_timeout: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})\n{on_timeout()}")


@dataclass
class Installed:
    cluster: Any
    args: list[str]  # the chart Deployment's container args
    kubeconfig: Path  # the chart ServiceAccount's token, nothing else
    cluster_role: dict[str, Any]
    workdir: Path
    notes: str  # what `helm install` printed

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kwargs)  # type: ignore[no-any-return]

    def dm(self, name: str) -> dict[str, Any] | None:
        proc = self.kubectl("get", "dm", name, "-n", WORK_NS, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def set_rules(self, rules: list[dict[str, Any]]) -> None:
        role = {**self.cluster_role, "rules": rules}
        role["metadata"] = {"name": self.cluster_role["metadata"]["name"]}
        self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=chart-test", "-f", "-",
                     input=json.dumps(role))


class Operator:
    """`tandem` with the chart's args, authenticated as the chart's ServiceAccount."""

    def __init__(self, installed: Installed, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env.update(KUBECONFIG=str(installed.kubeconfig), TANDEM_OPERATOR_RESYNC_SECONDS="3")
        self.log_path = log
        with log.open("wb") as out:
            # Listening on this machine only; everything else as the chart says.
            argv = [sys.executable, "-m", "tandem.worker.cli", *installed.args, "--listen-address=127.0.0.1"]
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def forbidden(self) -> str | None:
        lines = [line for line in self.log().splitlines() if "forbidden" in line.lower() or " 403" in line]
        return lines[0] if lines else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def port_of(args: list[str], flag: str) -> int:
    return int(next(a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")))


@pytest.fixture(scope="module")
def installed(k8s_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    workdir = tmp_path_factory.mktemp("chart-install")
    env = k8s_cluster.env
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(cpu_node()))
    k8s_cluster.kubectl("create", "namespace", WORK_NS)
    # Free local ports, since this operator runs here rather than in its (simulated) pod.
    install = [helm_binary(), "install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
               "--set", f"operator.metricsPort={free_port()}", "--set", f"operator.healthPort={free_port()}"]
    proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}\n{proc.stderr}"
        k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                            "crd/disaggregatedmodels.tandem.dev")
        manifest = subprocess.run([helm_binary(), "get", "manifest", RELEASE, "-n", RELEASE_NS], env=env,
                                  capture_output=True, text=True, timeout=60, check=True).stdout
        docs = [d for d in yaml.safe_load_all(manifest) if d]
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["tandem"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        token = k8s_cluster.kubectl("create", "token", account, "-n", RELEASE_NS, "--duration=2h").stdout.strip()
        kubeconfig = json.loads(k8s_cluster.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": "chart-operator", "user": {"token": token}}]
        kubeconfig["contexts"] = [{"name": "chart", "context": {"cluster": kubeconfig["clusters"][0]["name"],
                                                                "user": "chart-operator"}}]
        kubeconfig["current-context"] = "chart"
        (workdir / "kubeconfig").write_text(json.dumps(kubeconfig))
        cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
        yield Installed(k8s_cluster, list(container["args"]), workdir / "kubeconfig", cluster_role, workdir,
                        proc.stdout)
    finally:
        k8s_cluster.delete_custom_resources(WORK_NS)
        subprocess.run([helm_binary(), "uninstall", RELEASE, "-n", RELEASE_NS], env=env, capture_output=True,
                       timeout=120)
        for kind, name in (("namespace", WORK_NS), ("namespace", RELEASE_NS), ("node", CPU_NODE)):
            k8s_cluster.kubectl("delete", kind, name, "--wait=false", check=False)


def sample(name: str) -> str:
    """The minimal sample with kvTransfer.secure, so the rule on Secrets (its keypair) is exercised too."""
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"]["kvTransfer"] = {"secure": True}
    return json.dumps(body)


def ready(installed: Installed, name: str) -> bool:
    dm = installed.dm(name)
    conditions = (dm or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def run_lifecycle(installed: Installed, name: str, timeout: float) -> str | None:
    """Create a resource, wait for Ready, delete it; return what broke, or None."""
    operator = Operator(installed, installed.workdir / f"operator-{name}.log")
    try:
        port = port_of(installed.args, "--health-port")
        wait("the operator's /healthz", lambda: _healthz(port) or operator.proc.poll() is not None, 30,
             operator.log)
        if operator.proc.poll() is not None:
            return f"the operator exited: {operator.log()[-1500:]}"
        installed.kubectl("apply", "-n", WORK_NS, "-f", "-", input=sample(name))
        deadline = time.monotonic() + timeout
        while not ready(installed, name):
            if operator.forbidden() or time.monotonic() > deadline:
                return operator.forbidden() or f"dm/{name} never became Ready"
            time.sleep(0.5)
        installed.kubectl("delete", "dm", name, "-n", WORK_NS, "--wait=false")
        deadline = time.monotonic() + timeout
        while installed.dm(name) is not None:
            if operator.forbidden() or time.monotonic() > deadline:
                return operator.forbidden() or f"dm/{name} was never deleted (finalizer kept)"
            time.sleep(0.5)
        return operator.forbidden()
    finally:
        operator.stop()
        if installed.dm(name) is not None:  # release a finalizer a crippled operator left behind
            installed.kubectl("patch", "dm", name, "-n", WORK_NS, "--type=merge",
                              "-p", '{"metadata":{"finalizers":null}}', check=False)
            installed.kubectl("delete", "dm", name, "-n", WORK_NS, "--wait=false", check=False)


def _healthz(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_chart_install_then_minimal_sample_becomes_ready(installed: Installed) -> None:
    # The NOTES tell a first-time user how to apply a resource and how to upgrade CRDs.
    assert "kind: DisaggregatedModel" in installed.notes and "kubectl -n default wait dm/" in installed.notes
    assert "Helm never upgrades CRDs" in installed.notes
    assert installed.cluster_role["rules"] == rbac.cluster_role_rules()
    problem = run_lifecycle(installed, "tiny", timeout=60)
    assert problem is None, problem


def rule_params() -> list[Any]:
    return [pytest.param(index, id=f"{rule['apiGroups'][0] or 'core'}-{'-'.join(rule['resources'])}".replace("/", "-"))
            for index, rule in enumerate(rbac.cluster_role_rules())]


@pytest.mark.parametrize("index", rule_params())
def test_removing_the_rule_breaks_something(installed: Installed, index: int) -> None:
    rules = rbac.cluster_role_rules()
    removed = rules[index]
    installed.set_rules(rules[:index] + rules[index + 1:])
    try:
        problem = run_lifecycle(installed, f"rbac-{index}", timeout=25)
    finally:
        installed.set_rules(rules)
    print(f"without {removed}: {problem}")  # shown with -rP: what each rule is needed for
    assert problem is not None, (f"nothing noticed the removal of {removed}: the operator created, readied and "
                                 "deleted a resource without it, so the chart could drop it")
