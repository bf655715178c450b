"""Workers going away under load: drained prefill workers and killed decode workers.

One stack (2 prefill + 3 decode workers) for the module; the drain tests run first and leave one
prefill and two decode workers, the kill test then leaves one decode worker.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from .conftest import Stack, control_headers, metric_value

pytestmark = pytest.mark.integration

PROMPT = "Kubernetes runs pods on nodes. The operator reconciles resources and scales the pools on metrics."


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "2", "--decode-workers", "3")


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def stream_ids(stack: Stack, max_tokens: int, on_token: Callable[[int], None] | None = None) -> list[int]:
    ids: list[int] = []
    for chunk in client(stack).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        for choice in chunk.choices:
            ids += choice.model_extra["token_ids"]
            if on_token:
                on_token(len(ids))
    return ids


def pid_exited(pid: int, timeout: float) -> bool:
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def sigterm_a_busy_worker(procs: list[dict[str, Any]], timeout: float = 20.0) -> dict[str, Any]:
    """SIGTERM the first of `procs` seen with a request in flight (so the drain has work to finish)."""
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        for p in procs:
            try:
                busy = httpx.get(f"{p['url']}/info", headers=control_headers(), timeout=2).json()["in_flight"]
            except httpx.HTTPError:
                continue
            if busy > 0:
                os.kill(p["pid"], signal.SIGTERM)
                return p
        time.sleep(0.005)
    raise AssertionError("no worker was ever seen busy")


def assert_drained_with_work(proc: dict[str, Any]) -> None:
    assert pid_exited(proc["pid"], 30), "a drained worker exits on its own"
    log = Path(proc["log_path"]).read_text()
    in_flight = [int(m) for m in re.findall(r"draining: (\d+) requests in flight", log)]
    assert in_flight and in_flight[0] >= 1, f"the drain should have had work to finish: {in_flight}"
    assert "drained" in log and "drain timeout" not in log


def test_sigterm_to_a_prefill_worker_under_load_fails_no_request(stack: Stack) -> None:
    long_prompt = PROMPT * 25  # about a thousand tokens: prefill takes long enough to be caught busy

    def one(i: int) -> int:
        time.sleep(0.05 * i)
        resp = client(stack).completions.create(model="tiny", prompt=f"request {i}: {long_prompt}", max_tokens=8,
                                                temperature=0, extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        victim = sigterm_a_busy_worker(stack.procs("prefill"))
        results = [f.result() for f in futures]  # raises if any request failed
    assert results == [8] * len(results)
    assert_drained_with_work(victim)


def test_sigterm_to_a_decode_worker_lets_its_streams_finish(stack: Stack) -> None:
    def one(i: int) -> list[int]:
        time.sleep(0.1 * i)
        return stream_ids(stack, 60)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        time.sleep(0.5)
        victim = sigterm_a_busy_worker(stack.procs("decode"))
        results = [f.result() for f in futures]
    assert all(r == results[0] for r in results) and len(results[0]) == 60  # greedy: same prompt, same tokens
    assert_drained_with_work(victim)


def test_killed_decode_worker_mid_stream_completes_with_same_tokens(stack: Stack) -> None:
    n = 150
    undisturbed = stream_ids(stack, n)
    decode_urls = {p["url"]: p["pid"] for p in stack.procs("decode")}
    killed: list[int] = []

    def kill_busy_decode(count: int) -> None:
        if count != 20 or killed:
            return
        for url, pid in decode_urls.items():
            try:
                info = httpx.get(f"{url}/info", headers=control_headers(), timeout=5).json()
            except httpx.HTTPError:
                continue  # the worker drained by the previous test
            if info["stats"]["num_running"] > 0:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    disturbed = stream_ids(stack, n, kill_busy_decode)
    assert killed, "no decode worker was running the request when 20 tokens had arrived"
    assert disturbed == undisturbed
    assert metric_value(stack.url, "tandem_migrations_total") == 1
    # The survivor keeps serving new requests.
    assert stream_ids(stack, 5) == undisturbed[:5]
