"""Every dashboard and rule expression that reads worker metrics returns data from a real
Prometheus scraping real `tandem worker` and `tandem router` processes.

The processes are started as the operator starts them in pods (one prefill pool, one decode
pool, a router), on 127.0.0.1 with a tiny random model. Prometheus adds the target labels the
chart's PodMonitor would (`namespace`, `tandem_dev_model`). So that the failure and fallback
series exist too, a second router sends one request to a decode worker that advertises a KV
address nothing listens on (127.0.0.2): the prefill worker's connection fails for real, and
decode prefills locally. Expressions that read the operator's series run in the control-plane
test instead; this test only counts them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_inventory as inventory
import pytest

from tandem.worker.server.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE = "tandem-test"
RESOURCE = "tiny-dm"  # the DisaggregatedModel name, as the PodMonitor's target label carries it
MODEL = "tiny"  # the served model name
# Series that exist only after a decode worker dies mid-stream; nothing here kills one.
NEEDS_A_MIGRATION = {"tandem_migrations_total"}


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, *args: str) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))

    def wait_ready(self, name: str, url: str, timeout: float = 90.0) -> None:
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}):\n{self.log(name)}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{name} not ready after {timeout}s:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Worker and router processes; name -> host:port."""
    from tandem.worker.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    procs = Processes(tmp_path)
    names = ("prefill", "decode", "decode-unreachable", "router", "router-failing")
    ports = {name: free_port() for name in names}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    common = ["--model", str(model), "--model-name", MODEL, "--host", "127.0.0.1", "--transport", "tcp",
              "--kv-cache-bytes", str(8 << 20)]
    try:
        procs.start("prefill", "worker", "--role", "prefill", "--pool", "prefill",
                    "--port", str(ports["prefill"]), "--kv-port", str(free_port()), *common)
        procs.start("decode", "worker", "--role", "decode", "--pool", "decode", "--port", str(ports["decode"]),
                    "--kv-port", str(free_port()), *common)
        procs.start("decode-unreachable", "worker", "--role", "decode", "--pool", "decode",
                    "--port", str(ports["decode-unreachable"]), "--kv-port", str(free_port()),
                    "--kv-host", "127.0.0.2", *common)
        for name in ("prefill", "decode", "decode-unreachable"):
            procs.wait_ready(name, url[name])
        procs.start("router", "router", "--host", "127.0.0.1", "--port", str(ports["router"]),
                    "--model-name", MODEL, "--prefill", url["prefill"], "--decode", url["decode"])
        procs.start("router-failing", "router", "--host", "127.0.0.1", "--port", str(ports["router-failing"]),
                    "--model-name", MODEL, "--prefill", url["prefill"], "--decode", url["decode-unreachable"])
        for name in ("router", "router-failing"):
            procs.wait_ready(name, url[name])
        yield {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        procs.stop()


def drive_traffic(router: str, requests: int = 16) -> None:
    """Streamed completions, half sharing a long prefix so the prefix cache sees repeats."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{router}/v1", api_key="unused", timeout=60, max_retries=0)
    shared = "the quick brown fox jumps over the lazy dog " * 6
    for i in range(requests):
        prompt = shared + f"request {i}" if i % 2 else f"a different prompt number {i} about cats"
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) is not None


def wait_for(query: Callable[[str], list[dict[str, Any]]], expr: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if query(expr):
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never returned data for {expr}")


def test_every_worker_expression_returns_data(stack: dict[str, str], prometheus: Any) -> None:
    prom = prometheus(list(stack.values()), extra_labels={"namespace": NAMESPACE, "tandem_dev_model": RESOURCE})
    prom.wait_for_targets_up()
    drive_traffic(stack["router"])
    drive_traffic(stack["router-failing"], requests=1)  # waits out the 5 s KV connect timeout once
    # Everything the traffic produced must have been scraped, failures included.
    wait_for(prom.query, 'sum(tandem_requests_total{pool="router"}) >= 17')
    wait_for(prom.query, "tandem_fallback_prefills_total")
    wait_for(prom.query, "tandem_kv_transfer_failures_total")
    time.sleep(2.5)  # two more scrapes, so rate() sees the final counts

    queries = inventory.all_queries()
    records = inventory.record_needs(queries)
    variables = {"namespace": NAMESPACE, "model": MODEL, "resource": RESOURCE}
    worker_only = [q for q in queries if q.needs(records) == {"worker"}]
    deferred = [q for q in queries if "operator" in q.needs(records)]
    assert len(worker_only) >= 30 and deferred, (len(worker_only), len(deferred))

    empty = []
    for q in worker_only:
        if any(name in q.expr for name in NEEDS_A_MIGRATION):
            continue
        for selector in inventory.selectors(q.expr):
            if not prom.query(inventory.render(selector, variables)):
                empty.append(f"{q.source}: selector {selector}")
        if q.kind == "alert":
            prom.query(inventory.render(q.expr, variables))  # must run; fires only when something is wrong
        elif not prom.query(inventory.render(q.expr, variables, rate_interval="5m")):
            empty.append(f"{q.source}: {q.expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)
