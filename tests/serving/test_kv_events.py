"""Prefill workers' prefix-cache events reach the router's placement (issue 24; kv/events.py).

A real `tandem serve` stack (2 prefill workers, 1 decode) and a second router over the same workers, as
a Deployment with `router.replicas: 2` runs them. What one router sent where, the other learns from the
workers' own account (GET /kv/events, read beside each poll): a prompt the first router placed is placed
by the second on the worker that holds it, and the second router's expected hits equal what that
worker's cache served. Then a restarted prefill worker (tandem serve starts it again) is pictured
empty: its log's epoch changed, so the router read a snapshot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tandem.worker.server.ports import free_port

from .conftest import Stack, control_headers, metric_value

pytestmark = pytest.mark.integration

BLOCK = 16
PROMPT = [(i * 13) % 480 + 3 for i in range(193)]  # 12 full blocks
POLL_S = 0.5  # the router's poll interval


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "2", "--decode-workers", "1")


@pytest.fixture(scope="module")
def second_router(stack: Stack, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "tandem.worker.cli", "router", "--port", str(port), "--model", str(tiny_model),
            "--model-name", "tiny", *(x for p in stack.procs("prefill") for x in ("--prefill", p["url"])),
            *(x for p in stack.procs("decode") for x in ("--decode", p["url"]))]
    log = tmp_path_factory.mktemp("router2") / "router.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        assert popen.poll() is None, log.read_text()
        try:
            workers = httpx.get(f"{url}/workers", headers=control_headers(), timeout=2).json()
            if sum(w["usable"] for w in workers) == 3:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    yield url
    popen.send_signal(signal.SIGTERM)
    popen.wait(30)


def complete(url: str, prompt: list[int]) -> None:
    OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0)


def hits(stack: Stack) -> dict[str, float]:
    return {p["url"]: metric_value(p["url"], "tandem_prefix_cache_hits_total") for p in stack.procs("prefill")}


def test_a_router_places_a_prompt_where_another_router_left_its_kv(stack: Stack, second_router: str) -> None:
    complete(stack.url, PROMPT)  # the first router: one prefill worker computes it
    time.sleep(3 * POLL_S)  # the second router reads that worker's events
    before = hits(stack)
    expected_before = metric_value(second_router, "tandem_router_prefix_expected_hit_tokens_total")
    complete(second_router, PROMPT)
    after = hits(stack)
    served = {url: after[url] - before[url] for url in after}
    full = (len(PROMPT) - 1) // BLOCK * BLOCK
    assert sorted(served.values()) == [0, full], f"the second router did not place it where it is cached: {served}"
    expected = metric_value(second_router, "tandem_router_prefix_expected_hit_tokens_total") - expected_before
    assert expected == full, "the second router's picture did not know the worker held the prompt"


def test_a_restarted_prefill_worker_is_pictured_empty(stack: Stack, second_router: str) -> None:
    prompt = [t + 1 for t in PROMPT]
    complete(second_router, prompt)
    time.sleep(3 * POLL_S)
    holder = max(hits(stack).items(), key=lambda kv: kv[1])[0]  # not needed to be exact: kill both's caches
    for p in stack.procs("prefill"):
        os.kill(p["pid"], signal.SIGKILL)  # tandem serve starts them again, with empty caches
    limit = time.monotonic() + 90
    while time.monotonic() < limit:
        workers = httpx.get(f"{second_router}/workers", headers=control_headers(), timeout=5).json()
        if sum(w["usable"] for w in workers if w["role"] == "prefill") == 2:
            break
        time.sleep(0.5)
    time.sleep(3 * POLL_S)
    expected_before = metric_value(second_router, "tandem_router_prefix_expected_hit_tokens_total")
    complete(second_router, prompt)
    assert metric_value(second_router, "tandem_router_prefix_expected_hit_tokens_total") == expected_before, \
        f"the router still pictured {holder}'s cache from before its restart"
