"""A fresh `tandem worker` process: what it logs about its KV transport and what /metrics lists before any request.

Real worker processes on 127.0.0.1 with the tiny model (no router, no request sent): the labelled
counters a dashboard queries must be on /metrics at 0 from the start, so rate() gives 0 and not
"no data", and the transport decision must be logged once, with the reason that applies.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker.transfer.errors import REASONS

from .conftest import free_port

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def worker(tiny_model: Path, log: Path, *args: str) -> Iterator[str]:
    """A ready `tandem worker` (its URL); stopped with SIGTERM afterwards."""
    port = free_port()
    argv = [sys.executable, "-m", "tandem.worker.cli", "worker", "--model", str(tiny_model), "--model-name", "tiny",
            "--port", str(port), "--kv-port", str(free_port()), "--kv-cache-bytes", str(8 << 20), *args]
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        limit = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > limit:
                pytest.fail(f"tandem worker {' '.join(args)} did not get ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def samples(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of a /metrics page."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def transport_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "KV transport:" in line]


def test_a_fresh_decode_worker_lists_its_counters_at_zero_and_logs_the_transport_once(
        tiny_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    with worker(tiny_model, log, "--role", "decode", "--transport", "auto", "--pool", "decode") as url:
        found = samples(url)
        common = {"model": "tiny", "role": "decode", "pool": "decode"}

        assert found.get("tandem_fallback_prefills_total") == [(common, 0.0)]
        failures = {labels["reason"]: value for labels, value in found.get("tandem_kv_transfer_failures_total", [])
                    if labels.items() >= {**common, "transport": "tcp"}.items()}
        assert failures == dict.fromkeys(REASONS, 0.0), "every failure reason at 0 for the worker's transport"
        assert ({**common, "transport": "tcp", "direction": "recv"}, 0.0) in found["tandem_kv_transfer_bytes_total"]
        requests = {labels["reason"]: value for labels, value in found.get("tandem_requests_total", [])}
        assert requests == {"stop": 0.0, "length": 0.0}
        assert "tandem_migrations_total" not in found, "migrations are counted by the router, not a worker"

    lines = transport_lines(log)
    if "rdma" in lines[0].split("(")[0]:
        pytest.skip("this machine has a usable RDMA device")
    assert len(lines) == 1, f"the transport decision is logged once:\n{lines}"
    assert "KV transport: tcp (auto: " in lines[0] and "falling back to tcp" in lines[0]
    assert "tcp was requested" not in lines[0]


def test_a_prefill_worker_asked_for_tcp_says_so_once(tiny_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    with worker(tiny_model, log, "--role", "prefill", "--transport", "tcp") as url:
        found = samples(url)
        common = {"model": "tiny", "role": "prefill", "pool": "local"}
        failures = [labels["reason"] for labels, value in found["tandem_kv_transfer_failures_total"]
                    if value == 0 and labels.items() >= {**common, "transport": "tcp"}.items()]
        assert sorted(failures) == sorted(REASONS)
        assert ({**common, "transport": "tcp", "direction": "send"}, 0.0) in found["tandem_kv_transfer_bytes_total"]
        assert found["tandem_requests_total"] == [({**common, "reason": "prefilled"}, 0.0)]
        assert found["tandem_prefix_cache_hits_total"] == [(common, 0.0)]
    assert [line.split(" INFO ")[-1] for line in transport_lines(log)] == [
        "tandem.worker.transfer.select: KV transport: tcp (tcp: tcp was requested)"]
