"""Helpers for the operator's integration tests: the operator as a real subprocess, and polling.

(Loaded by tests/operator/conftest.py; not a test module.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tandem.worker.server.ports import free_port

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
TANDEM = REPO / ".venv" / "bin" / "tandem"


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


class OperatorProcess:
    """`tandem operator` watching one namespace, with its log kept for failure messages."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, env: dict[str, str],
                 extra_args: tuple[str, ...] = ()) -> None:
        self.kubeconfig, self.namespace, self.log_path = kubeconfig, namespace, log_path
        self.extra_args = extra_args
        self.env = dict(env, TANDEM_OPERATOR_RESYNC_SECONDS="5")
        self.proc: subprocess.Popen[bytes] | None = None
        self.health_port = self.metrics_port = 0

    def start(self) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it; closed on stop)
        self.proc = subprocess.Popen(
            [str(TANDEM), "operator", "--kubeconfig", str(self.kubeconfig), "--namespace", self.namespace,
             "--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
             "--listen-address", "127.0.0.1", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
        )
        log.close()
        wait_for("the operator's /healthz to answer 200", lambda: self.healthz()[0] == 200 or None,
                 timeout=30, on_timeout=self.log_tail)

    def healthz(self) -> tuple[int, str]:
        if self.proc is None or self.proc.poll() is not None:
            return 0, f"operator not running (exit {self.proc.returncode if self.proc else None})"
        return http_get(f"http://127.0.0.1:{self.health_port}/healthz")

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]

    def kill(self) -> None:
        """SIGKILL: no chance to finish what it was doing."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no operator log)"


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.3,
             on_timeout: Callable[[], str] | None = None) -> T:
    """Poll `probe` until it returns something other than None/False; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except AssertionError as exc:  # a kubectl call failed: keep polling, report it if it persists
            last = exc
        if last is not None and last is not False and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    details = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}\n{details}")


def condition(resource: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (resource.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def as_json(text: str) -> dict[str, Any]:
    return json.loads(text)  # type: ignore[no-any-return]


def rbac_only_kubeconfig(testbed: Any, ns: str, out: Path) -> Path:
    """A kubeconfig at `out` for a ServiceAccount in `ns` (which must exist) bound to tandem.operator.rbac's
    rules and nothing else: the operator's documented RBAC, as the chart grants it."""
    from tandem.operator.rbac import cluster_role

    role = f"tandem-operator-{ns}"
    testbed.kubectl("create", "serviceaccount", "tandem-operator", "-n", ns)
    testbed.kubectl("apply", "-f", "-", input=json.dumps(cluster_role(role)))
    testbed.kubectl("create", "clusterrolebinding", role, f"--clusterrole={role}",
                    f"--serviceaccount={ns}:tandem-operator")
    token = testbed.kubectl("create", "token", "tandem-operator", "-n", ns, "--duration=1h").stdout.strip()
    kubeconfig = json.loads(testbed.cluster.kubeconfig.read_text())
    kubeconfig["users"] = [{"name": "operator", "user": {"token": token}}]
    kubeconfig["contexts"] = [{"name": "operator", "context": {"cluster": kubeconfig["clusters"][0]["name"],
                                                               "user": "operator"}}]
    kubeconfig["current-context"] = "operator"
    out.write_text(json.dumps(kubeconfig))
    return out


def environ_without_kubeconfig() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}


def autoscaled_resource(name: str, model: str, max_replicas: int) -> dict[str, Any]:
    """A DisaggregatedModel whose pools scale with Tandem's autoscaler (queue depth 2, KV utilization 0.5)."""
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": max_replicas, "scaleDownStabilizationSeconds": 600}
    return {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel", "metadata": {"name": name},
        "spec": {
            "model": {"name": model, "source": {"path": f"/models/{model}"}},
            "prefill": {"replicas": 1, "autoscaling": {**auto, "targetQueueDepth": 2}},
            "decode": {"replicas": 1, "autoscaling": {**auto, "targetKVUtilization": 0.5}},
        },
    }
