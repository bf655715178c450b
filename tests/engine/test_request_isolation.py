"""One request's failure stays its own (issue 18): a row that cannot be sampled, a tiny temperature,
or an error in one request's bookkeeping fails that request alone and the rest of the batch goes on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.worker.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.worker.engine.sampler import NAN_LOGITS, bad_logit_rows, bad_prob_rows, sample

from .conftest import random_prompts, run_requests, tokens_of


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 22))


@pytest.mark.parametrize("temperature", [1e-50, 1e-30, 5e-324, 1e-6])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("kwargs", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1e-9}, {"top_p": math.nan},
    {"min_p": math.nan}, {"seed": 2**64}, {"seed": -(2**63) - 1},
])
def test_non_finite_or_out_of_range_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_rows_are_found() -> None:
    logits = torch.tensor([[1.0, 2.0], [math.nan, 0.0], [math.inf, 0.0], [-math.inf, 0.0]])
    assert bad_logit_rows(logits) == [1, 2]  # -inf is a masked token, not a failure
    probs = torch.tensor([[0.5, 0.5], [0.0, 0.0], [math.nan, 0.5], [1.0, 0.0]])
    assert bad_prob_rows(probs) == [1, 2]


def test_a_nan_row_fails_alone() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0], [math.nan, 1.0, 0.0], [0.0, 1.0, 5.0]])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    sampled = sample(logits, params, [None] * 3, torch.Generator().manual_seed(0))
    assert sampled.errors == {1: NAN_LOGITS}
    assert sampled.tokens[0] in (0, 1) and sampled.tokens[2] == 2


def test_a_row_whose_settings_slipped_past_validation_fails_alone() -> None:
    # A temperature that escaped the floor (a bug's stand-in): 1e-50 is 0.0 in float32, the row's
    # probabilities are NaN, and multinomial used to raise for the whole batch.
    logits = torch.tensor([[4.0, 3.0, 0.0], [1e4, -1e4, 0.0]])
    sampled = sample(logits, [SamplingParams(temperature=1.0), _NotGreedy(1e-50)], [None, None],
                     torch.Generator().manual_seed(0))
    assert set(sampled.errors) == {1}
    assert sampled.tokens[0] in (0, 1, 2)


class _NotGreedy(SamplingParams):
    """Sampling settings whose temperature escaped the floor (a bug's stand-in)."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    @property
    def greedy(self) -> bool:
        return False


def test_engine_fails_one_request_and_finishes_the_others(engine: LLMEngine) -> None:
    a, b, c = random_prompts((10, 14, 7), seed=21)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = {rid: tokens_of(run_requests(engine, {rid: (p, greedy)})[rid]) for rid, p in (("a", a), ("c", c))}
    outs = run_requests(engine, {"a": (a, greedy), "bad": (b, _NotGreedy(1e-50)), "c": (c, greedy)})
    assert tokens_of(outs["a"]) == alone["a"] and tokens_of(outs["c"]) == alone["c"]
    [last] = outs["bad"]
    assert last.finished and last.finish_reason == "error" and last.error and not last.new_token_ids
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks  # its blocks were freed


def test_an_error_in_one_requests_bookkeeping_fails_it_alone(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    a, b = random_prompts((9, 11), seed=5)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = tokens_of(run_requests(engine, {"a": (a, greedy)})["a"])
    real = LLMEngine._stop_reason

    def broken_for_b(self: LLMEngine, seq: Any, token: int) -> str | None:
        if seq.request_id == "b":
            raise RuntimeError("a detokenizer bug")
        return real(self, seq, token)

    monkeypatch.setattr(LLMEngine, "_stop_reason", broken_for_b)
    outs = run_requests(engine, {"a": (a, greedy), "b": (b, greedy)})
    assert tokens_of(outs["a"]) == expected
    assert outs["b"][-1].finish_reason == "error" and "RuntimeError" not in (outs["b"][-1].error or "")
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_batch_that_raises_is_sampled_row_by_row(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.worker.engine import llm_engine

    a, b = random_prompts((9, 11), seed=6)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = tokens_of(run_requests(engine, {"a": (a, greedy)})["a"])
    real = llm_engine.sample

    def raises_with_b(logits: torch.Tensor, params: Any, generators: Any, default: torch.Generator,
                      raw_logits: torch.Tensor | None = None) -> Any:
        if any(p.max_tokens == 4 for p in params):  # "b" is the request with max_tokens 4
            raise RuntimeError("one request's settings broke the batch")
        return real(logits, params, generators, default, raw_logits)

    monkeypatch.setattr(llm_engine, "sample", raises_with_b)
    outs = run_requests(engine, {"a": (a, greedy), "b": (b, SamplingParams(max_tokens=4, temperature=0))})
    assert tokens_of(outs["a"]) == expected
    assert outs["b"][-1].finish_reason == "error"


def test_sampled_before_is_bounded_by_the_prompt(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="sampled_before"):
        engine.add_request("skip", [5, 6, 7], SamplingParams(seed=1), sampled_before=300_000)
    assert not engine.has_unfinished_requests()
