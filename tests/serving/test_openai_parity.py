"""Through the official `openai` client: disaggregated == monolithic == transformers (greedy).

Stacks are real `tandem serve` process trees (router + workers) on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from openai import OpenAI

from .conftest import Stack, metric_value

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks.",
    "Zürich, café, naïve; 東京; 🙂 " * 6,  # multi-byte text over several KV blocks
]
MAX_TOKENS = 12


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(stack: Stack, prompt: Any, **kw: Any) -> Any:
    """Greedy completion with ignore_eos and the token ids next to the text."""
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    return client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                                            temperature=0, extra_body=extra, **kw)


def stream_complete(stack: Stack, prompt: str, **kw: Any) -> tuple[str, list[int], Any]:
    text, ids, usage = "", [], None
    for chunk in client(stack).completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True}, **kw):
        for choice in chunk.choices:
            text += choice.text
            ids += choice.model_extra["token_ids"]
        if chunk.usage:
            usage = chunk.usage
    return text, ids, usage


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "sentence", "multibyte"])
def test_disaggregated_equals_monolithic_equals_transformers(disagg: Stack, mono: Stack, prompt: str, tokenizer: Any,
                                                             hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    d = complete(disagg, prompt).choices[0]
    m = complete(mono, prompt).choices[0]
    reference = hf_greedy(tokenizer.encode(prompt), MAX_TOKENS)
    assert m.model_extra["token_ids"] == reference
    assert d.model_extra["token_ids"] == reference
    assert d.text == m.text
    assert d.finish_reason == m.finish_reason == "length"


@pytest.mark.parametrize("prompt", PROMPTS[1:], ids=["sentence", "multibyte"])
def test_streaming_equals_whole_response(disagg: Stack, mono: Stack, prompt: str) -> None:
    whole = complete(mono, prompt)
    for stack in (disagg, mono):
        text, ids, usage = stream_complete(stack, prompt)
        assert ids == whole.choices[0].model_extra["token_ids"]
        assert text == whole.choices[0].text
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completions_match_across_modes(disagg: Stack, mono: Stack, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello to Zürich."}]
    answers = []
    for stack in (disagg, mono):
        resp = client(stack).chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                                     temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].message.role == "assistant"
        assert resp.usage.completion_tokens == 8
        answers.append(resp.choices[0].message.content)
        streamed = "".join(c.choices[0].delta.content or "" for c in client(stack).chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert streamed == answers[-1]
    assert answers[0] == answers[1]
    # The chat template wrapped the messages: the prompt is longer than the bare user text.
    assert resp.usage.prompt_tokens > len(tokenizer.encode("Say hello to Zürich."))


def test_seeded_sampling_is_reproducible(mono: Stack) -> None:
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 16}
    outs = [client(mono).completions.create(model="tiny", prompt="Kubernetes runs pods", **kw,
                                            extra_body={"top_k": 50, "return_token_ids": True, "ignore_eos": True})
            .choices[0].model_extra["token_ids"] for _ in range(2)]
    assert outs[0] == outs[1]
    greedy = complete(mono, "Kubernetes runs pods", max_tokens=16).choices[0].model_extra["token_ids"]
    assert len(outs[0]) == len(greedy) == 16


def test_stop_string_is_cut_out_of_the_text(mono: Stack) -> None:
    full = complete(mono, PROMPTS[1], max_tokens=20).choices[0].text
    stop = full[5:8]
    assert stop and stop not in full[:5], "pick a stop string that first occurs at offset 5"
    resp = complete(mono, PROMPTS[1], max_tokens=20, stop=[stop]).choices[0]
    assert resp.text == full[:full.index(stop)]
    assert resp.finish_reason == "stop"


def test_logprobs_and_max_tokens_one(disagg: Stack) -> None:
    resp = complete(disagg, PROMPTS[1], max_tokens=1, logprobs=1).choices[0]
    assert len(resp.model_extra["token_ids"]) == 1
    assert resp.finish_reason == "length"
    assert len(resp.logprobs.token_logprobs) == 1 and resp.logprobs.token_logprobs[0] <= 0.0
    chat = client(disagg).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, temperature=0, logprobs=True,
                                                  extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3


def test_models_health_and_metrics(disagg: Stack) -> None:
    import httpx

    assert [m.id for m in client(disagg).models.list().data] == ["tiny"]
    assert httpx.get(f"{disagg.url}/health").status_code == 200
    complete(disagg, "count me")
    assert metric_value(disagg.url, "tandem_generation_tokens_total", role="router") >= MAX_TOKENS
    decode = disagg.procs("decode")[0]["url"]
    prefill = disagg.procs("prefill")[0]["url"]
    assert metric_value(decode, "tandem_kv_transfer_bytes_total", direction="recv") > 0
    assert metric_value(prefill, "tandem_kv_transfer_bytes_total", direction="send") > 0
    assert metric_value(decode, "tandem_fallback_prefills_total") == 0
    assert metric_value(decode, "tandem_kv_cache_total_blocks") > 0


def test_prefix_cache_hit_on_prefill_still_ships_the_whole_kv(disagg: Stack, mono: Stack) -> None:
    """A repeated prompt is partly served from the prefill worker's prefix cache; those blocks are
    never computed (no layer callback), so they must be shipped from the block list before finish."""
    prompt = "Prefix caching: " + "kettle lemon mirror needle ocean pepper " * 12
    prefill = disagg.procs("prefill")[0]["url"]
    decode = disagg.procs("decode")[0]["url"]
    hits_before = metric_value(prefill, "tandem_prefix_cache_hits_total")
    fallbacks_before = metric_value(decode, "tandem_fallback_prefills_total")
    first = complete(disagg, prompt, max_tokens=10).choices[0].model_extra["token_ids"]
    again = complete(disagg, prompt, max_tokens=10).choices[0].model_extra["token_ids"]
    assert metric_value(prefill, "tandem_prefix_cache_hits_total") - hits_before >= 32
    assert metric_value(decode, "tandem_fallback_prefills_total") == fallbacks_before
    assert first == again == complete(mono, prompt, max_tokens=10).choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["short", "sentence"])
def test_seeded_sampling_is_the_same_draw_in_both_modes(disagg: Stack, mono: Stack, prompt: str) -> None:
    """The decode worker continues the prefill worker's draws (its generator skips the first one)."""
    kw = {"temperature": 0.9, "seed": 42, "max_tokens": MAX_TOKENS,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    d = [client(disagg).completions.create(model="tiny", prompt=prompt, **kw).choices[0] for _ in range(2)]
    m = client(mono).completions.create(model="tiny", prompt=prompt, **kw).choices[0]
    assert d[0].model_extra["token_ids"] == d[1].model_extra["token_ids"]
    assert d[0].model_extra["token_ids"] == m.model_extra["token_ids"]
    assert d[0].text == m.text
