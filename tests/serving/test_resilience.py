"""Workers going away under load: drained prefill workers and killed decode workers.

One stack (2 prefill + 2 decode workers) for the module; the drain test runs first and leaves
one prefill worker, the kill test then leaves one decode worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from .conftest import Stack, metric_value

pytestmark = pytest.mark.integration

PROMPT = "Kubernetes runs pods on nodes. The operator reconciles resources and scales the pools on metrics."


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "2", "--decode-workers", "2")


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


def test_sigterm_to_a_prefill_worker_under_load_fails_no_request(stack: Stack) -> None:
    victim = stack.procs("prefill")[0]
    prompts = [f"request {i}: {PROMPT}" for i in range(24)]

    def one(i: int) -> int:
        time.sleep(0.1 * i)  # arrivals spread over the drain
        resp = client(stack).completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGTERM)
        results = [f.result() for f in futures]  # raises if any request failed
    assert results == [8] * len(prompts)
    assert pid_exited(victim["pid"], 30), "the drained prefill worker should exit on its own"
    log = Path(victim["log_path"]).read_text()
    assert "draining" in log and "drained" in log and "drain timeout" not in log


def test_killed_decode_worker_mid_stream_completes_with_same_tokens(stack: Stack) -> None:
    n = 150
    undisturbed = stream_ids(stack, n)
    decode_urls = {p["url"]: p["pid"] for p in stack.procs("decode")}
    killed: list[int] = []

    def kill_busy_decode(count: int) -> None:
        if count != 20 or killed:
            return
        for url, pid in decode_urls.items():
            info = httpx.get(f"{url}/info", timeout=5).json()
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
