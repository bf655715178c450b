"""The real node's setup, shared by the e2e checks: `hack/e2e.sh --model DIR --keep`.

The setup is the test bed with its real node, local images, the chart (operator pod, Prometheus
scraping the pods), a hostPath model volume and a DisaggregatedModel with transport auto on a node
without the RDMA resource. Run by hand, the tests start it all themselves and tear it down at the
end; `hack/e2e.sh` without --keep runs them against its own setup (TANDEM_E2E_STATE). The files
run in name order and share one setup: test_real_node.py reads it as set up,
test_real_node_deploy_doc.py runs docs/deploy-gpu.md's commands against it (and rolls the pools once
with pod fields), test_real_node_hub.py adds a second model of its own in its own namespace, then
test_real_node_lifecycle.py scales, kills, rolls and finally deletes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import k8s_build  # noqa: E402
import real_node  # noqa: E402

WORKER_HTTP_PORT = 8000  # operator/builders.py HTTP_PORT: the workers' /metrics


@dataclass
class Setup:
    info: dict[str, Any]
    env: dict[str, str]
    closer: Callable[[], None] | None = None

    def close(self) -> None:
        """Tear the setup down now (once): the last e2e module does, so that the rest of the suite
        does not run beside a real node."""
        closer, self.closer = self.closer, None
        if closer is not None:
            closer()

    @property
    def namespace(self) -> str:
        return str(self.info["namespace"])

    @property
    def name(self) -> str:
        return str(self.info["name"])

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        proc = subprocess.run([str(k8s_build.bin_dir() / "kubectl"), *args], capture_output=True, text=True,
                              env=self.env, timeout=120, input=input)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def resource(self, name: str | None = None) -> Any:
        return self.json("get", "disaggregatedmodel", name or self.name, "-n", self.namespace)

    def client(self, url: str | None = None) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=url or self.info["router"], api_key="unused", max_retries=0, timeout=120)

    def pods(self, component: str, name: str | None = None, *, ready_only: bool = False) -> list[dict[str, Any]]:
        """The model's pods of one component (prefill, decode, router), not those being deleted."""
        selector = f"app.kubernetes.io/instance={name or self.name},app.kubernetes.io/component={component}"
        pods = [p for p in self.json("get", "pods", "-n", self.namespace, "-l", selector)["items"]
                if not p["metadata"].get("deletionTimestamp")]
        return [p for p in pods if is_ready(p)] if ready_only else pods

    def wait(self, what: str, probe: Callable[[], Any], timeout: float = 300, period: float = 2) -> Any:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                if result := probe():
                    return result
            except (AssertionError, OSError, KeyError, ValueError) as exc:
                last = exc
            time.sleep(period)
        events = self.kubectl("get", "events", "-n", self.namespace, "--sort-by=.lastTimestamp", check=False)
        raise AssertionError(f"not true after {timeout:.0f}s: {what} (last error: {last!r}); "
                             f"recent events:\n{events[-3000:]}")

    def pod_metrics(self, pod: dict[str, Any]) -> dict[str, float]:
        """A worker pod's own /metrics, on its pod IP (no label matching: one worker each), summed by name."""
        url = f"http://{pod['status']['podIP']}:{WORKER_HTTP_PORT}/metrics"
        return parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())

    def router_metrics(self, router_url: str | None = None) -> dict[str, float]:
        base = (router_url or self.info["router"]).removesuffix("/v1")
        return parse_metrics(urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode())

    def router_sample(self, name: str, **labels: str) -> float:
        """The sum of a router metric's samples whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        base = self.info["router"].removesuffix("/v1")
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))

    def warnings(self, component: str, since: str = "15m") -> str:
        """The WARNING and ERROR lines (and discovery changes) of a component's running pods, for a failed check."""
        out = []
        for pod in self.pods(component):
            name = pod["metadata"]["name"]
            text = self.kubectl("logs", "-n", self.namespace, name, f"--since={since}", check=False)
            out += [f"{name}: {line}" for line in text.splitlines()
                    if " WARNING " in line or " ERROR " in line or "discovery" in line]
        return "\n".join(out[-60:])

    def ready_condition(self, name: str | None = None) -> str:
        conditions = {c["type"]: c["status"] for c in self.resource(name).get("status", {}).get("conditions", [])}
        return conditions.get("Ready", "Unknown")


def is_ready(pod: dict[str, Any]) -> bool:
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums



def why_no_real_node() -> str | None:
    """Only what truly cannot be had here skips; a missing package is a failure (with its fix)."""
    if sys.platform != "linux":
        return "the real node needs Linux"
    if os.geteuid() != 0:
        return "the real node needs root (network devices, mounts, cgroups)"
    return None


def make_model(folder: Path) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    model = write_tiny_model(folder / "tiny-e2e")
    for path in [folder, model, *model.rglob("*")]:  # the workers run as uid 65532
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


@pytest.fixture(scope="session")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    given = os.environ.get("TANDEM_E2E_STATE")
    if given:  # hack/e2e.sh runs these checks against what it set up, and tears it down itself
        info = json.loads((Path(given) / "e2e.json").read_text())
        yield Setup(info, dict(os.environ, KUBECONFIG=info["kubeconfig"]))
        return
    if reason := why_no_real_node():
        pytest.skip(reason)
    # One real node per machine: reuse one that runs (its owner keeps it), else start our own.
    owner = real_node.owner_of_running_node()
    state = Path(owner) if owner else tmp_path_factory.mktemp("e2e-state")
    model = make_model(tmp_path_factory.mktemp("e2e-model"))
    proc = subprocess.run([str(REPO / "hack" / "e2e.sh"), "--model", str(model), "--keep", "--state", str(state)],
                          capture_output=True, text=True)
    router_line = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not router_line.startswith("router: http://127.0.0.1:"):
        if not owner:  # leave nothing running behind a failed setup
            subprocess.run([str(REPO / "hack" / "cluster.sh"), "down", "--state", str(state)], capture_output=True)
        pytest.fail(f"hack/e2e.sh failed ({proc.returncode}); its last output line {router_line!r}:\n"
                    f"{proc.stderr[-8000:]}", pytrace=False)
    info = json.loads((state / "e2e.json").read_text())

    def tear_down() -> None:
        if owner:
            subprocess.run([str(k8s_build.bin_dir() / "kubectl"), f"--kubeconfig={info['kubeconfig']}", "delete",
                            "namespace", info["namespace"], "--ignore-not-found"], capture_output=True)
            return
        down = subprocess.run([str(REPO / "hack" / "cluster.sh"), "down", "--state", str(state)],
                              capture_output=True, text=True)
        # `down` fails when it leaves anything behind (processes, mounts, links, chains, cgroups, sysctls).
        assert down.returncode == 0, f"hack/cluster.sh down:\n{down.stderr[-4000:]}"

    setup = Setup(info, dict(os.environ, KUBECONFIG=info["kubeconfig"]), closer=tear_down)
    yield setup
    setup.close()  # when the last module did not (run alone, or stopped early)


@pytest.fixture(scope="session")
def hf_greedy(setup: Setup) -> Any:
    """transformers' greedy continuation: the reference the pods must match token for token."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(setup.info["model_dir"], dtype=torch.float32)
    model.eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            # The mask explicitly: inferred from pad_token_id it would hide the chat template's
            # <|begin_of_text|>, which is token 0 in the tiny models.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return list(out[0, len(prompt):].tolist())

    return greedy


@pytest.fixture(scope="session")
def tokenizer(setup: Setup) -> Any:
    from tandem.worker.model.tokenizer import Tokenizer

    return Tokenizer(Path(setup.info["model_dir"]))


# --- steady load ---------------------------------------------------------------------------

@dataclass
class SteadyLoad:
    """Clients that stream greedy completions back to back until stopped; every answer must be
    complete and equal to the first one (the same prompt, greedy): a failed request, a short
    stream or a different token is a failure the user would have seen."""

    client: Any
    model: str
    clients: int = 2
    prompt: str = "The quick brown fox jumps over the lazy dog."
    max_tokens: int = 16
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    expected: list[int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def one(self) -> list[int]:
        ids: list[int] = []
        finish = None
        for chunk in self.client.completions.create(
                model=self.model, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}):
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids") or []
                finish = choice.finish_reason or finish
        if finish != "length" or len(ids) != self.max_tokens:
            raise AssertionError(f"stream ended early: finish_reason {finish}, {len(ids)} tokens")
        return ids

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ids = self.one()
                with self._lock:
                    if ids != self.expected:
                        self.failures.append(f"different tokens: {ids} != {self.expected}")
                    self.completed += 1
            except Exception as exc:  # every failure is recorded and asserted on
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.2)

    def __enter__(self) -> SteadyLoad:
        self.expected = self.one()
        for _ in range(self.clients):
            thread = threading.Thread(target=self._loop, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def wait_completed(self, more: int, timeout: float = 120) -> None:
        target, deadline = self.completed + more, time.monotonic() + timeout
        while self.completed < target and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.completed >= target, f"only {self.completed} of {target} requests completed in {timeout}s"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)


@pytest.fixture
def steady_load(setup: Setup) -> Callable[..., SteadyLoad]:
    def make(**kwargs: Any) -> SteadyLoad:
        return SteadyLoad(client=setup.client(), model=setup.info["model_name"], **kwargs)

    return make
