"""Logit adjustments: repetition penalty as transformers' processor, presence/frequency as OpenAI
defines them (generated tokens only), logit_bias added; and that the engine counts tokens another
worker generated (the prefill worker's first token, a migration's) as generated."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.engine.penalties import adjust_logits
from tandem.worker.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])


def test_repetition_penalty_equals_transformers_processor() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    context = [[0, 1, 1, 4], [2]]
    got = adjust_logits(LOGITS, [SamplingParams(repetition_penalty=1.7)] * 2, context, [0, 0])
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.7)
    for row in range(2):
        expected = processor(torch.tensor([context[row]]), LOGITS[row:row + 1].clone())[0]
        assert got[row].tolist() == pytest.approx(expected.tolist())


def test_presence_and_frequency_count_only_generated_tokens() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Context: prompt [3, 3], then generated [0, 0, 2]: token 3 is not penalised, 0 twice, 2 once.
    got = adjust_logits(LOGITS[:1], [params], [[3, 3, 0, 0, 2]], [3])[0]
    assert got.tolist() == pytest.approx([2.0 - 0.5 - 0.5, -1.0, 0.5 - 0.5 - 0.25, 3.0, 0.0])


def test_logit_bias_is_added_and_rows_that_ask_nothing_are_untouched() -> None:
    got = adjust_logits(LOGITS, [SamplingParams(), SamplingParams(logit_bias={1: 100.0, 4: -100.0})], [[0], [0]], [0, 0])
    assert got[0].tolist() == LOGITS[0].tolist()
    assert got[1].tolist() == pytest.approx([1.0, 101.0, 1.0, 1.0, -99.0])


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                                 {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                 {"repetition_penalty": 5e-324}, {"repetition_penalty": float("nan")},
                                 {"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}}])
def test_out_of_range_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_min_tokens_bans_eos_and_stop_token_ids_until_enough_are_generated() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[1])
    early = adjust_logits(LOGITS[:1], [params], [[9, 9, 0]], [1], eos_token_ids={3})[0]
    assert early[1] == early[3] == float("-inf") and early[0] == LOGITS[0, 0]
    assert adjust_logits(LOGITS[:1], [params], [[9, 0, 0]], [2], eos_token_ids={3})[0].tolist() == LOGITS[0].tolist()
    # ignore_eos: EOS does not end the request anyway, so only the stop ids are banned.
    eos_kept = adjust_logits(LOGITS[:1], [SamplingParams(min_tokens=2, stop_token_ids=[1], ignore_eos=True)],
                             [[9]], [0], eos_token_ids={3})[0]
    assert eos_kept[3] == LOGITS[0, 3] and eos_kept[1] == float("-inf")
