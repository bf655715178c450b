"""`tandem serve` lifecycle and `tandem bench` end to end, through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .conftest import Stack

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
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["output_tokens"] == 24
    assert 0.5 * 240 <= summary["prompt_tokens"] <= 1.5 * 240  # sized by the measured tokens per word
    assert summary["ttft_s"]["p50"] > 0 and summary["itl_s"]["p99"] >= summary["itl_s"]["p50"]
    assert summary["slo_attainment"] == 1.0


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
