"""A decode engine under KV pressure, first-token finishes on a prefill engine, and seeded sampling
split across engines: the engine half of the disaggregated path, in one process.

The "transfer" is a tensor copy from the prefill engine's blocks into the decode engine's reservation,
what a transport does across machines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.worker.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

from .conftest import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)


def _engine(model_dir: Path, blocks: int | None = None, **overrides: object) -> LLMEngine:
    probe = LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_bytes=1 << 16))
    size = (blocks * probe.kv_layout.bytes_per_block) if blocks else 1 << 22
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **{"kv_cache_bytes": size, **overrides}))


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for out in engine.iter_outputs():
        outs.setdefault(out.request_id, []).append(out)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _prefill(prefill: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    prefill.add_request(rid, prompt, params)
    [out] = _drain(prefill)[rid]
    assert out.kv_block_ids is not None
    return out


def _hand_over(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
               dst: list[int] | None = None) -> int:
    """Prefill `prompt`, copy its KV into (a new or the given) reservation on `decode`, queue it there."""
    out = _prefill(prefill, rid, prompt, params)
    dst = dst if dst is not None else decode.reserve_kv(rid, len(prompt))
    assert dst is not None and out.kv_block_ids is not None
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, out.kv_block_ids]
    prefill.release_kv(rid)
    decode.add_prefilled_request(rid, prompt, out.new_token_ids[0], params)
    return out.new_token_ids[0]


def test_a_prefilled_request_does_not_wait_behind_one_that_needs_its_blocks(tiny_model_dir: Path) -> None:
    """The audit's deadlock: a local prefill at the head of the queue needs blocks that a prefilled
    request queued behind it owns. The owner runs first, finishes, and gives them back."""
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill")
    decode = _engine(tiny_model_dir, blocks=12, role="decode")  # 192 tokens
    owner, local = random_prompts((100, 90), seed=31)  # 7 and 6 blocks: not both at once
    dst = decode.reserve_kv("owner", len(owner))  # the KV is on its way...
    decode.add_request("local", local, GREEDY)  # ...while a fallback prefill queues (5 blocks free, needs 6)
    first = _hand_over(prefill, decode, "owner", owner, GREEDY, dst)  # ...and lands behind it
    outs = _drain(decode)  # used to raise: "2 waiting requests cannot get KV blocks"
    expected = both.generate([owner, local], GREEDY)
    assert [first, *_tokens(outs["owner"])] == expected[0]
    assert _tokens(outs["local"]) == expected[1]
    stats = decode.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == stats.num_running == 0


def test_waiting_owners_that_cannot_grow_preempt_one_of_them(tiny_model_dir: Path) -> None:
    """Two hand-offs fill the whole cache and each needs one more block for its first token:
    the later one gives its blocks up (a preemption) and is recomputed afterwards."""
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill")
    decode = _engine(tiny_model_dir, blocks=4, role="decode")  # 64 tokens
    prompts = random_prompts((32, 32), seed=32)  # exactly 2 blocks each
    firsts = [_hand_over(prefill, decode, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    assert decode.stats().num_free_blocks == 0
    outs = _drain(decode)
    expected = both.generate(prompts, GREEDY)
    for i in range(2):
        assert [firsts[i], *_tokens(outs[f"r{i}"])] == expected[i]
    assert decode.stats().num_preemptions == 1


def test_blocks_reserved_for_incoming_kv_stall_the_queue_with_a_true_reason(tiny_model_dir: Path) -> None:
    decode = _engine(tiny_model_dir, blocks=12, role="decode")
    [prompt] = random_prompts((100,), seed=33)
    assert decode.reserve_kv("incoming", 150) is not None  # 10 of 12 blocks
    decode.add_request("local", prompt, GREEDY)
    assert decode.step() == [] and decode.stall is not None
    with pytest.raises(RuntimeError, match=r"0 held for outgoing KV transfers .* and 10 reserved for incoming KV"):
        list(decode.iter_outputs())
    decode.cancel_reservation("incoming")
    assert _tokens(_drain(decode)["local"]) == _engine(tiny_model_dir).generate([prompt], GREEDY)[0]
    assert decode.stall is None


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=1, temperature=0),
                                    SamplingParams(max_tokens=5, temperature=0, stop_token_ids=list(range(512)))],
                         ids=["max_tokens", "stop_token"])
def test_a_first_token_finish_on_prefill_still_reports_and_holds_its_blocks(tiny_model_dir: Path,
                                                                            params: SamplingParams) -> None:
    """Its KV may already be on its way to a decode worker (sent layer by layer): the blocks stay
    held until release_kv, so the transfer can end normally instead of failing."""
    prefill = _engine(tiny_model_dir, role="prefill")
    [prompt] = random_prompts((40,), seed=34)
    out = _prefill(prefill, "p", prompt, params)
    assert out.finished and out.finish_reason == ("length" if params.max_tokens == 1 else "stop")
    assert out.kv_block_ids is not None and len(out.kv_block_ids) == 3
    assert prefill.stats().num_held_blocks == 3
    prefill.release_kv("p")
    assert prefill.stats().num_held_blocks == 0
    assert prefill.stats().num_free_blocks == prefill.stats().num_total_blocks


def test_seeded_sampling_split_across_engines_equals_one_engine(tiny_model_dir: Path) -> None:
    """Prefill draws the first token, decode continues the same generator: the tokens are those
    of a single `both` engine, not a sequence lagging one draw behind."""
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill")
    decode = _engine(tiny_model_dir, role="decode")
    [prompt] = random_prompts((27,), seed=35)
    [expected] = both.generate([prompt], SEEDED)
    first = _hand_over(prefill, decode, "s", prompt, SEEDED)
    assert [first, *_tokens(_drain(decode)["s"])] == expected
    # The decode side's local-prefill fallback and a migration: tokens sampled elsewhere end the prompt.
    for k in (1, 5):
        rest = SamplingParams(**{**vars(SEEDED), "max_tokens": SEEDED.max_tokens - k})
        decode.add_request(f"k{k}", prompt + expected[:k], rest, sampled_before=k)
        assert _tokens(_drain(decode)[f"k{k}"]) == expected[k:]


def test_penalised_sampling_split_across_engines_equals_one_engine(tiny_model_dir: Path) -> None:
    """Penalties count the prefill worker's first token, and a migration's tokens, as generated:
    split across engines, the tokens are a single engine's (and the penalties change them)."""
    params = SamplingParams(max_tokens=32, temperature=0.5, seed=99, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=1.0, repetition_penalty=1.1, logit_bias={5: 1.0})
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill")
    decode = _engine(tiny_model_dir, role="decode")
    [prompt] = random_prompts((27,), seed=36)
    [expected] = both.generate([prompt], params)
    assert expected != both.generate([prompt], SamplingParams(**{**vars(params), "presence_penalty": 0.0,
                                                                 "frequency_penalty": 0.0,
                                                                 "repetition_penalty": 1.0, "logit_bias": {}}))[0]
    first = _hand_over(prefill, decode, "s", prompt, params)
    assert [first, *_tokens(_drain(decode)["s"])] == expected
    for k in (1, 5, 20):
        rest = SamplingParams(**{**vars(params), "max_tokens": params.max_tokens - k})
        decode.add_request(f"k{k}", prompt + expected[:k], rest, sampled_before=k)
        assert _tokens(_drain(decode)[f"k{k}"]) == expected[k:]
