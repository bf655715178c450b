"""Greedy tokens must equal transformers' generate (float32) for every supported family."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

from tandem.worker.engine import SamplingParams

from .conftest import FAMILIES, GREEDY, HFModel, random_prompts

MIXED = (3, 17, 40, 64, 100, 9)
NEW_TOKENS = 12


def _params(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=max_tokens)


def _assert_parity(hf: HFModel, got: list[list[int]], prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> None:
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == hf.greedy(prompt, max_tokens), f"prompt {i} ({len(prompt)} tokens) diverged"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_mixed_batch_matches_transformers(hf_model: Callable[..., HFModel], family: str, chunked: bool) -> None:
    hf = hf_model(family)
    # A 32-token budget splits the longer prompts into several chunks that share steps with decodes.
    engine = hf.engine(enable_chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else 2048)
    prompts = random_prompts(MIXED)
    _assert_parity(hf, engine.generate(prompts, _params()), prompts)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefix_cache_hits_keep_tokens_identical(hf_model: Callable[..., HFModel], family: str) -> None:
    hf = hf_model(family)
    engine = hf.engine(block_size=16)
    shared = random_prompts((48,), seed=7)[0]
    tails = random_prompts((5, 20, 1), seed=8)
    first = [shared + tails[0]]
    engine.generate(first, _params())  # fills the cache with the shared 48-token prefix
    later = [shared + t for t in tails] + [shared]
    got = engine.generate(later, _params())
    stats = engine.stats()
    # 3 full blocks of the shared prefix hit for each later prompt (the bare prefix keeps its last token to compute: 2 blocks)
    assert stats.prefix_cache_hits == 3 * 48 + 32
    assert stats.prefix_cache_queries == sum(len(p) for p in first + later)
    _assert_parity(hf, got, later)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_under_a_small_kv_budget(hf_model: Callable[..., HFModel], family: str) -> None:
    hf = hf_model(family)
    prompts = random_prompts((30, 45, 20, 60, 33), seed=3)
    max_tokens = 20
    probe = hf.engine()
    bytes_per_block = probe.kv_layout.bytes_per_block
    # 9 blocks of 16 tokens: the longest request (80 tokens, 5 blocks) fits alone, all five together do not.
    engine = hf.engine(kv_cache_bytes=9 * bytes_per_block, max_num_batched_tokens=64)
    got = engine.generate(prompts, _params(max_tokens))
    assert engine.stats().num_preemptions > 0, "the budget was meant to force preemption"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    _assert_parity(hf, got, prompts, max_tokens)


def test_llama3_rope_scaling(hf_model: Callable[..., HFModel]) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = hf_model("llama", rope_parameters=rope)
    saved = json.loads((hf.path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "llama3"
    prompts = random_prompts((50, 90), seed=5)  # past original_max_position_embeddings, where scaling bites
    _assert_parity(hf, hf.engine().generate(prompts, _params()), prompts)


def test_llama3_rope_scaling_in_the_transformers_4_spelling(hf_model: Callable[..., HFModel]) -> None:
    """Published Llama 3.x folders spell it `rope_theta` + `rope_scaling`; both must load the same."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = hf_model("llama", rope_parameters=rope)
    config = json.loads((hf.path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (hf.path / "config.json").write_text(json.dumps(config))
    prompts = random_prompts((70,), seed=6)
    _assert_parity(hf, hf.engine().generate(prompts, _params()), prompts)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_embeddings(hf_model: Callable[..., HFModel], family: str) -> None:
    hf = hf_model(family, tie_word_embeddings=True)
    prompts = random_prompts((10, 37), seed=9)
    _assert_parity(hf, hf.engine().generate(prompts, _params()), prompts)


def test_sharded_checkpoint_with_index(hf_model: Callable[..., HFModel]) -> None:
    hf = hf_model("mistral", max_shard_size="100KB")
    shards = sorted(p.name for p in hf.path.glob("*.safetensors"))
    assert len(shards) > 1 and (hf.path / "model.safetensors.index.json").is_file()
    prompts = random_prompts((25, 8), seed=10)
    _assert_parity(hf, hf.engine().generate(prompts, _params()), prompts)


def test_logprobs_match_transformers(hf_model: Callable[..., HFModel]) -> None:
    import torch

    hf = hf_model("qwen2")
    [prompt] = random_prompts((23,), seed=11)
    engine = hf.engine()
    engine.add_request("lp", prompt, dataclasses.replace(GREEDY, max_tokens=5, logprobs=True, top_logprobs=3))
    outs = list(engine.iter_outputs())
    tokens = [t for o in outs for t in o.new_token_ids]
    got = [lp for o in outs for lp in (o.logprobs or [])]
    ref = hf.model.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    expected = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(ref.logits, tokens, strict=True)]
    assert tokens == ref.sequences[0, len(prompt):].tolist()
    assert got == pytest.approx(expected, abs=1e-4)
    tops = [top for o in outs for top in (o.top_logprobs or [])]
    for top, step in zip(tops, ref.logits, strict=True):  # the 3 most likely tokens, with transformers' logprobs
        ref_lp = torch.log_softmax(step[0].float(), dim=-1)
        assert [t for t, _ in top] == torch.topk(ref_lp, 3).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(torch.topk(ref_lp, 3).values.tolist(), abs=1e-4)
