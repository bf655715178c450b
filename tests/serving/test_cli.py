"""`tandem serve` lifecycle and `tandem bench` end to end, through the real command line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .conftest import Stack, control_headers, free_port

pytestmark = pytest.mark.integration


def tandem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_reports_latencies_and_writes_json(mono: Stack, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = tandem("bench", "--url", f"{mono.url}/v1", "-n", "6", "--rate", "0", "--prompt-tokens", "40",
                 "--output-tokens", "4", "--slo-ttft", "30", "--slo-itl", "30", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TTFT" in res.stdout and "goodput" in res.stdout
    assert "all 6 requests at once (--rate 0)" in res.stdout
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["output_tokens"] == 24
    assert 0.5 * 240 <= summary["prompt_tokens"] <= 1.5 * 240  # sized by the measured tokens per word
    assert summary["ttft_s"]["p50"] > 0 and summary["itl_s"]["p99"] >= summary["itl_s"]["p50"]
    assert summary["slo_attainment"] == 1.0


def test_bench_per_token_measures_every_gap(mono: Stack, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = tandem("bench", "--url", mono.url, "-n", "4", "--rate", "0", "--prompt-tokens", "16",
                 "--output-tokens", "9", "--per-token", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 4
    assert summary["itl_s"]["count"] == 4 * 8, "one gap between every two of the 9 tokens of each request"


def test_bench_replays_a_scaled_trace(mono: Stack, tmp_path: Path) -> None:
    if not Path("/work/shared/traces/azure_llm_2023_code.csv").is_file():
        pytest.skip("the shared Azure trace is not on this machine")
    out = tmp_path / "trace.json"
    res = tandem("bench", "--url", mono.url, "-n", "5", "--trace", "azure-code", "--rate", "5",
                 "--prompt-tokens", "48", "--max-output-tokens", "4", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 5
    assert any("azure_llm_2023_code.csv" in n and "arrival times x" in n for n in data["notes"])


def test_bench_exits_1_when_the_server_refuses_every_request(mono: Stack) -> None:
    # 3000-token prompts do not fit the tiny model's 2048-token context: the real router answers 400.
    res = tandem("bench", "--url", mono.url, "-n", "3", "--rate", "0", "--prompt-tokens", "3000",
                 "--output-tokens", "2")
    assert res.returncode == 1, res.stdout + res.stderr
    out = " ".join(res.stdout.split())  # rich wraps long lines
    assert "0 completed, 3 failed" in out
    assert "bench failed: all 3 requests failed; the first error: HTTP 400" in out
    assert "context_length_exceeded" in "".join(out.split())  # the server's own error, first of the 3


def test_bench_refuses_a_negative_rate() -> None:
    res = tandem("bench", "--url", "http://127.0.0.1:1", "--rate", "-2")
    assert res.returncode == 2 and "is not a request rate" in res.stderr


def test_bench_refuses_a_bad_url() -> None:
    res = tandem("bench", "--url", "ftp://127.0.0.1:1")
    assert res.returncode == 2 and "not an http" in res.stderr


def test_serve_rejects_a_folder_without_a_model(tmp_path: Path) -> None:
    res = tandem("serve", "--model", str(tmp_path), timeout=60)
    assert res.returncode == 2 and "no config.json" in res.stderr


def test_chunked_mode_serves_and_sigterm_stops_every_process(start_stack: Callable[..., Stack]) -> None:
    stack = start_stack("--mode", "chunked", "--decode-workers", "1", "--max-num-batched-tokens", "32")
    assert [p["role"] for p in stack.state["processes"]] == ["both", "router"]
    resp = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "a prompt long enough to need several 32-token chunks " * 3, "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    assert stack.stop() == 0
    for p in stack.state["processes"]:
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)


def test_rdma_without_a_device_fails_fast_with_the_reason(tmp_path: Path) -> None:
    res = tandem("serve", "--model", "tiny", "--port", str(free_port()), "--transport", "rdma",
                 "--log-dir", str(tmp_path), timeout=120)
    if res.returncode == 0:
        pytest.skip("this machine has a usable RDMA device")
    assert res.returncode == 1
    assert "failed to load" in res.stdout and "rdma" in res.stdout.lower()


def test_worker_refuses_a_foreign_layout_hash(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "worker", "--role", "decode", "--model",
                             str(tiny_model), "--port", str(port), "--kv-port", str(free_port())],
                            env={**os.environ, "TANDEM_LAYOUT_HASH": "0123456789abcdef"}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        body: dict[str, object] = {}
        for _ in range(300):
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1)
                body = resp.json()
                if body.get("error"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert resp.status_code == 503
        assert "0123456789abcdef" in str(body["error"]) and "layout hash" in str(body["error"])
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 500
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_request_deadline_gives_504_and_frees_the_worker(mono: Stack, tmp_path: Path) -> None:
    worker = mono.procs("both")[0]["url"]
    port = free_port()
    with (tmp_path / "router.log").open("wb") as log:
        router = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "router", "--port", str(port),
                                   "--decode", worker, "--request-timeout", "1"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "go on and on", "max_tokens": 1900, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert "deadline" in events[-2] and events[-1] == "data: [DONE]"
        for _ in range(50):  # the worker aborted what the router gave up on
            if httpx.get(f"{worker}/info", headers=control_headers(), timeout=5).json()["stats"]["num_running"] == 0:
                break
            time.sleep(0.1)
        assert httpx.get(f"{worker}/info", headers=control_headers(), timeout=5).json()["stats"]["num_running"] == 0
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
