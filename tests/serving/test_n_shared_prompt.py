"""`n` choices share their prompt's KV (issue 20): the prompt is prefilled, shipped and held once.

The first choice goes the usual way; the others wait until it decodes, then run on its worker, whose
prefix cache serves the prompt's full blocks (router/dispatch.py PromptShare). Real `tandem serve`
stacks with the official openai client. What the user sees does not change: choice i equals a request of
its own with seed + i. What changes is measured on the workers' own counters: one prefill of the prompt
and one KV transfer for all n, the other choices' prompt blocks served from the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from openai import OpenAI

from .conftest import Stack, metric_value

pytestmark = pytest.mark.integration

N, SEED, BLOCK = 4, 5, 16
PROMPT = list(range(100, 197))  # 97 tokens: 6 full blocks, the last token computed by each choice


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def completions(stack: Stack, prompt: list[int], **kw: Any) -> list[list[int]]:
    resp = client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    return [c.model_extra["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)]


def streamed(stack: Stack, prompt: list[int], **kw: Any) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for chunk in client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8,
                                                  stream=True, extra_body={"ignore_eos": True,
                                                                           "return_token_ids": True}, **kw):
        for c in chunk.choices:
            out.setdefault(c.index, []).extend(c.model_extra["token_ids"])
    return [out[i] for i in sorted(out)]


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1")


def test_n_choices_prefill_and_ship_their_prompt_once(stack: Stack) -> None:
    prefill, decode = stack.procs("prefill")[0]["url"], stack.procs("decode")[0]["url"]

    def counters() -> tuple[float, float, float]:
        return (metric_value(prefill, "tandem_prompt_tokens_total"),
                metric_value(decode, "tandem_kv_transfer_seconds_count", direction="recv"),
                metric_value(decode, "tandem_prefix_cache_hits_total"))

    before = counters()
    together = completions(stack, PROMPT, n=N, seed=SEED)
    after = counters()
    full_blocks = (len(PROMPT) - 1) // BLOCK
    assert after[0] - before[0] == len(PROMPT), "the prefill worker computed the prompt more than once"
    assert after[1] - before[1] == 1, "the prompt's KV was shipped more than once"
    assert after[2] - before[2] == (N - 1) * full_blocks * BLOCK, "the other choices did not reuse its blocks"
    # Each choice is what it is alone, with its own seed.
    alone = [completions(stack, PROMPT, seed=SEED + i)[0] for i in range(N)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # sampled: the choices differ
    assert streamed(stack, PROMPT, n=N, seed=SEED) == together


def test_n_choices_in_monolithic_mode_reuse_the_prompt(mono: Stack) -> None:
    worker = mono.procs("both")[0]["url"]
    prompt = [p + 1 for p in PROMPT]  # not cached yet on this shared stack
    hits = metric_value(worker, "tandem_prefix_cache_hits_total")
    together = completions(mono, prompt, n=N, seed=SEED)
    assert metric_value(worker, "tandem_prefix_cache_hits_total") - hits == (N - 1) * ((len(prompt) - 1) // BLOCK) * BLOCK
    assert together == [completions(mono, prompt, seed=SEED + i)[0] for i in range(N)]
