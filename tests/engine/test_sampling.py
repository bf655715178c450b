"""Sampling: seeded reproducibility, filters, logprobs, stop conditions and streamed text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.worker.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from tandem.worker.engine.sampler import sample

from .conftest import random_prompts, run_requests, tokens_of


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 22))


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: LLMEngine) -> None:
    prompt, other = random_prompts((12, 30), seed=2)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = tokens_of(run_requests(engine, {"a": (prompt, params)})["a"])
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = run_requests(engine, {"x": (other, noise), "b": (prompt, params), "y": (other[:5], noise)})
    assert tokens_of(batched["b"]) == alone
    different = tokens_of(run_requests(engine, {"c": (prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                                    ignore_eos=True))})["c"])
    assert different != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(engine: LLMEngine) -> None:
    [prompt] = random_prompts((20,), seed=4)
    greedy = tokens_of(run_requests(engine, {"g": (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))})["g"])
    for i, params in enumerate([SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True),
                                SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, ignore_eos=True),
                                SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, ignore_eos=True)]):
        assert tokens_of(run_requests(engine, {f"r{i}": (prompt, params)})[f"r{i}"]) == greedy, params


def test_filters_keep_only_allowed_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        # probabilities ~[.64,.24,.09,.03,.01]: the smallest set reaching 0.8 is {0, 1}
        (SamplingParams(top_p=0.8), {0, 1}),
        (SamplingParams(min_p=0.3), {0, 1}),  # keeps tokens with p >= 0.3 * 0.64
        # A top_p that is 0 in float32 (the router's fuzz run sent 5e-324): the best token, not a failed request.
        (SamplingParams(top_p=5e-324), {0}),
        (SamplingParams(), {0, 1, 2, 3, 4}),
    ]
    for params, allowed in cases:
        seen = {sample(logits, [params], [None], gen).tokens[0] for _ in range(400)}
        assert seen == allowed, params


def test_logprobs_are_the_models_log_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, 1.0]])
    sampled = sample(logits, [SamplingParams(temperature=0, logprobs=True)] * 2, [None, None], torch.Generator())
    tokens, logprobs = sampled.tokens, sampled.logprobs
    assert tokens == [0, 1]
    assert logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs == pytest.approx([expected[0, 0].item(), expected[1, 1].item()])
    assert all(lp <= 0 for lp in logprobs)


def test_top_logprobs_are_each_rows_best_tokens_cut_to_its_own_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0], [0.0, 3.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=4), SamplingParams(temperature=0)]
    top = sample(logits, params, [None] * 3, torch.Generator()).top_logprobs
    expected = torch.log_softmax(logits, dim=-1)
    assert top is not None and [[t for t, _ in row] for row in top] == [[3, 0], [1, 2, 0, 3], []]
    assert [lp for _, lp in top[1]] == pytest.approx(expected[1, [1, 2, 0, 3]].tolist())


def test_top_logprobs_need_logprobs_and_stay_in_range() -> None:
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_engine_returns_one_logprob_per_token(engine: LLMEngine) -> None:
    [prompt] = random_prompts((9,), seed=11)
    outs = run_requests(engine, {"lp": (prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=True,
                                                       ignore_eos=True))})["lp"]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(lps) == 5 and all(-math.inf < lp <= 0 for lp in lps)


def test_stop_string_cuts_exactly_and_streams_consistently(engine: LLMEngine) -> None:
    [prompt] = random_prompts((15,), seed=12)
    free_run = run_requests(engine, {"full": (prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))})
    full_text = _text(free_run["full"])
    assert len(full_text) > 20
    stop = full_text[12:15]
    cut = full_text.index(stop)
    stopped = run_requests(engine, {"s": (prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop],
                                                         ignore_eos=True))})["s"]
    assert _text(stopped) == full_text[:cut]
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"
    assert all(not o.finished for o in stopped[:-1])
    assert stop not in "".join(o.new_text for o in stopped)


def test_stop_token_ids_and_max_tokens(engine: LLMEngine) -> None:
    [prompt] = random_prompts((15,), seed=13)
    full = tokens_of(run_requests(engine, {"f": (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))})["f"])
    target = full[4]
    first = full.index(target)
    outs = run_requests(engine, {"t": (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[target]))})["t"]
    assert tokens_of(outs) == full[: first + 1]
    assert outs[-1].finish_reason == "stop"
    outs = run_requests(engine, {"m": (prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))})["m"]
    assert tokens_of(outs) == full[:3] and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3


def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    [prompt] = random_prompts((15,), seed=14)
    full = tokens_of(run_requests(engine, {"f": (prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))})["f"])
    engine.tokenizer.eos_token_ids.add(full[2])  # pretend the third token is an end-of-sequence token
    try:
        outs = run_requests(engine, {"e": (prompt, SamplingParams(max_tokens=8, temperature=0))})["e"]
    finally:
        engine.tokenizer.eos_token_ids.discard(full[2])
    assert tokens_of(outs) == full[: full.index(full[2]) + 1] and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(min_p=2), dict(stop=[""]), dict(stop_token_ids=[-3])])
def test_invalid_sampling_params_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
