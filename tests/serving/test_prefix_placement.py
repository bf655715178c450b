"""Prefix-aware prefill placement on a real stack (issue 24): chat conversations that share one system
prompt, through `tandem serve --prefill-workers 3` and the openai client.

Keyed on the prompt's first block (the old policy), every prompt of every conversation went to one
prefill worker (prompt tokens per worker, max/mean = 3.00) and two idled. Keyed on the longest cached
prefix with bounded load, the conversations spread over the three workers and each turn finds most of
its history in its worker's prefix cache. Both figures come from the workers' own /metrics."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest
from openai import OpenAI

from tandem.worker.bench.workload import WORDS

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

CONVERSATIONS = 4
TURNS = 6


def chat_traffic(stack: Stack) -> None:
    """4 conversations of 6 turns, taking turns (as concurrent users would), one system prompt for all."""
    rng = random.Random(24)
    system = "You are a careful assistant. " + " ".join(rng.choice(WORDS) for _ in range(120))
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(TURNS):
        for messages in chats:
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))})
            resp = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                  max_completion_tokens=12, temperature=0)
            messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})


def placement_figures(stack: Stack) -> tuple[list[float], float]:
    """(prompt tokens per prefill worker, prefix-cache hit rate over the prefill pool)."""
    urls = [p["url"] for p in stack.procs("prefill")]
    tokens = [metric_value(u, "tandem_prompt_tokens_total") for u in urls]
    hits = sum(metric_value(u, "tandem_prefix_cache_hits_total") for u in urls)
    queries = sum(metric_value(u, "tandem_prefix_cache_queries_total") for u in urls)
    return tokens, hits / queries


@pytest.mark.slow
def test_chat_conversations_spread_over_prefill_workers_and_hit_their_cache(
        start_stack: Callable[..., Stack]) -> None:
    stack = start_stack("--prefill-workers", "3", "--decode-workers", "1", "--canary-interval", "0")
    wait_until_disaggregated(stack)
    chat_traffic(stack)
    tokens, hit_rate = placement_figures(stack)
    print(f"prompt tokens per prefill worker {tokens}, max/mean {max(tokens) / statistics.mean(tokens):.2f}, "
          f"prefix-cache hit rate {hit_rate:.2f}")
    assert sum(tokens) > 0
    assert max(tokens) / statistics.mean(tokens) <= 1.25, tokens
    # Measured: all on one worker (first-block, least-loaded) hits 0.83 here, round robin 0.58, this 0.76.
    assert hit_rate >= 0.65
