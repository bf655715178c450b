"""Fixtures for the real components integration tests run against.

- `k8s_cluster`: the local control plane from hack/cluster.sh (etcd, kube-apiserver with RBAC,
  controller-manager, scheduler, kwok with fake GPU pools), started once per test session.
- `prometheus`: a factory that starts Debian's prometheus on 127.0.0.1 with given scrape targets.

Neither skips: if a binary cannot be built or started, the test errors and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.server.ports import free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "hack"))
import k8s_build  # noqa: E402


@dataclass
class Cluster:
    state: Path
    kubeconfig: Path
    bin_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return str(json.loads(self.kubeconfig.read_text())["clusters"][0]["cluster"]["server"])

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.bin_dir / "kubectl"), *args], input=input, capture_output=True,
                              text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def kubectl_json(self, *args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.kubectl(*args, "-o", "json").stdout)  # type: ignore[no-any-return]

    def install_crds(self) -> None:
        """Apply Tandem's CRDs (crds/*.yaml) and wait until the API server serves them."""
        crds = sorted((REPO / "crds").glob("*.yaml"))
        for crd in crds:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        names = [f"crd/{path.stem.split('_', 1)[1]}.{path.stem.split('_', 1)[0]}" for path in crds]
        self.kubectl("wait", "--for=condition=Established", "--timeout=30s", *names)

    def delete_custom_resources(self, namespace: str, timeout_s: int = 45) -> None:
        """Teardown: delete the namespace's DisaggregatedModels, waiting for the operator's finalizer.

        If that does not finish (e.g. a test killed the operator), warn visibly and strip the
        finalizers, so one stuck resource cannot break every later test."""
        try:
            proc = self.kubectl("delete", "disaggregatedmodels", "--all", "-n", namespace, f"--timeout={timeout_s}s",
                                check=False, timeout=timeout_s + 15)
            if proc.returncode == 0:
                return
            why = proc.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            why = "kubectl timed out"
        stuck = self.kubectl("get", "disaggregatedmodels", "-n", namespace, "-o", "name", check=False).stdout.split()
        for name in stuck:
            self.kubectl("patch", name, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                         check=False)
        warnings.warn(f"teardown: deleting {stuck} in {namespace} did not finish ({why}); "
                      "finalizers removed by hand", stacklevel=2)

    def new_namespace(self, prefix: str) -> str:
        """Create a namespace with a random suffix, so test modules never see each other's objects."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        return name


# Every worker and router a test starts (itself, or through `tandem serve`) takes its worker control token
# from $TANDEM_CONTROL_TOKEN, set here once for the session; a test calls them with control_headers().
CONTROL_TOKEN = f"tandem-test-{uuid.uuid4().hex}"


@pytest.fixture(scope="session", autouse=True)
def control_token_env() -> Iterator[str]:
    from tandem.worker.server.control_token import ENV_TOKEN

    before = os.environ.get(ENV_TOKEN)
    os.environ[ENV_TOKEN] = CONTROL_TOKEN
    yield CONTROL_TOKEN
    if before is None:
        os.environ.pop(ENV_TOKEN, None)
    else:
        os.environ[ENV_TOKEN] = before


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[Cluster]:
    state = Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
    script = REPO / "hack" / "cluster.sh"
    proc = subprocess.run([str(script), "up", "--state", str(state)], capture_output=True, text=True)
    if proc.returncode != 0:
        subprocess.run([str(script), "down", "--state", str(state)], capture_output=True)
        pytest.fail(f"hack/cluster.sh up failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}",
                    pytrace=False)
    bins = k8s_build.bin_dir()
    env = dict(os.environ, KUBECONFIG=str(state / "kubeconfig"),
               PATH=f"{bins}{os.pathsep}{os.environ.get('PATH', '')}")
    cluster = Cluster(state=state, kubeconfig=state / "kubeconfig", bin_dir=bins, env=env)
    try:
        yield cluster
    finally:
        subprocess.run([str(script), "down", "--state", str(state)], capture_output=True)


# --- Prometheus -----------------------------------------------------------------------------

@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    workdir: Path

    def query(self, promql: str) -> list[dict]:  # type: ignore[type-arg]
        from urllib.parse import urlencode

        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urlencode({'query': promql})}",
                                    timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def wait_for_targets_up(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query("up") and all(r["value"][1] == "1" for r in self.query("up")):
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus targets not all up after {timeout}s: {self.query('up')}")


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if path is None:
        pytest.fail("the prometheus binary is missing: install Debian's `prometheus` package "
                    "(.ci/run does: apt-get install -y prometheus)", pytrace=False)
    return path


def start_prometheus(targets: list[str], workdir: Path, scrape_interval: str = "1s",
                     extra_labels: dict[str, str] | None = None,
                     more_targets: Sequence[tuple[list[str], dict[str, str]]] = ()) -> Prometheus:
    """`more_targets`: further (targets, labels) groups, e.g. pods of another resource."""
    port = free_port()
    static: dict[str, Any] = {"targets": targets}
    if extra_labels:
        static["labels"] = extra_labels
    groups = [static, *({"targets": t, "labels": labels} for t, labels in more_targets)]
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": "tandem", "static_configs": groups}],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (the child process keeps it open)
    proc = subprocess.Popen(
        [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({proc.returncode}):\n"
                                 f"{(workdir / 'prometheus.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                if resp.status == 200:
                    return Prometheus(url=url, proc=proc, workdir=workdir)
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("prometheus did not become ready within 30s")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """Factory: prometheus(targets=["127.0.0.1:PORT"]) -> a ready Prometheus scraping them."""
    started: list[Prometheus] = []

    def factory(targets: list[str], **kwargs: object) -> Prometheus:
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        prom = start_prometheus(targets, workdir, **kwargs)  # type: ignore[arg-type]
        started.append(prom)
        return prom

    yield factory
    for prom in started:
        prom.proc.terminate()
        try:
            prom.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.proc.kill()
