"""The router's output canary (worker/router/canary.py) on real `tandem serve` stacks.

A healthy disaggregated stack counts matches and no mismatch. A stack whose prefill worker writes the KV
into the decode worker's blocks in reverse order (the `swap-kv-blocks` test hook, TANDEM_ENABLE_FAULTS=1)
serves wrong tokens without a single error: no transfer fails, no status code says so. Only the canary
sees it, and counts mismatches.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
import pytest

from tandem.worker import metrics as m

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

PROBES = m.exposed_name(m.ROUTER_CANARY_PROBES)
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 12, 301, 64, 9, 150, 33, 2, 88, 190, 7, 45, 123, 61, 18, 240, 36, 4, 270,
          52, 11, 199, 83, 27, 140, 66, 21, 310, 95, 14, 170, 58, 6]  # 40 tokens: 3 KV blocks of 16


def probes(stack: Stack, result: str) -> float:
    return metric_value(stack.url, PROBES, result=result)


def wait_for_probes(stack: Stack, results: tuple[str, ...], count: int, timeout: float = 90) -> None:
    limit = time.monotonic() + timeout
    while sum(probes(stack, r) for r in results) < count:
        assert time.monotonic() < limit, f"fewer than {count} canary probes with results {results}: " \
                                         f"{ {r: probes(stack, r) for r in ('match', 'mismatch', 'skipped', 'error')} }"
        time.sleep(0.5)


def completion(stack: Stack, prompt: list[int]) -> list[int]:
    resp = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


@pytest.mark.slow
def test_a_healthy_stack_matches_and_a_block_swap_is_caught(start_stack: Callable[..., Stack],
                                                             hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    healthy = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                          "--canary-interval", "1")
    wait_until_disaggregated(healthy)
    wait_for_probes(healthy, ("match", "mismatch"), 2)
    assert probes(healthy, "mismatch") == 0
    assert probes(healthy, "error") == 0
    # The probes stay out of the workers' request metrics (the autoscaler and the SLO rules read them).
    requests = m.exposed_name(m.REQUESTS)
    for proc in healthy.procs("prefill") + healthy.procs("decode"):
        assert metric_value(proc["url"], requests) == 0, proc["name"]
    assert completion(healthy, PROMPT) == hf_greedy(PROMPT, 8)
    assert sum(metric_value(p["url"], requests) for p in healthy.procs("prefill") + healthy.procs("decode")) == 2
    healthy.stop()

    env = {**os.environ, "TANDEM_ENABLE_FAULTS": "1"}
    broken = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                         "--canary-interval", "1", "--prefill-fault", "swap-kv-blocks", env=env)
    wait_until_disaggregated(broken)
    wait_for_probes(broken, ("match", "mismatch"), 2)
    assert probes(broken, "mismatch") >= 2 and probes(broken, "match") == 0
    # What a user gets meanwhile: a 200 with the wrong tokens, and no failed transfer anywhere.
    assert completion(broken, PROMPT) != hf_greedy(PROMPT, 8)
    for proc in broken.procs("decode"):
        assert metric_value(proc["url"], m.exposed_name(m.KV_TRANSFER_FAILURES)) == 0
