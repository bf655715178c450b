"""The in-process engine API: validation, abort, stats, and the prefill/decode roles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.worker.engine import EngineConfig, LayerWrite, LLMEngine, RequestOutput, SamplingParams

from .conftest import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **{"kv_cache_bytes": 1 << 22, **overrides}))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return _engine(tiny_model_dir)


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for out in engine.iter_outputs():
        outs.setdefault(out.request_id, []).append(out)
    return outs


def test_bad_requests_get_clear_errors(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request("long", [5] * engine.max_model_len, GREEDY)
    with pytest.raises(ValueError, match="token ids must be integers"):
        engine.add_request("vocab", [10**6], GREEDY)
    engine.add_request("dup", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6, 7], GREEDY)
    engine.abort("dup")
    assert _drain(engine)["dup"][-1].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_bad_config_gets_clear_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="role"):
        EngineConfig(model_dir=str(tiny_model_dir), role="middle")
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(model_dir=str(tiny_model_dir), block_size=12)
    with pytest.raises(ValueError, match="at most one"):
        EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1, kv_cache_fraction=0.5)
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        _engine(tiny_model_dir, kv_cache_bytes=64 << 10, max_model_len=1024)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        _engine(tmp_path)
    with pytest.raises(ValueError, match="holds no block"):
        _engine(tiny_model_dir, kv_cache_bytes=1024)


def test_abort_mid_generation_frees_blocks_and_stats_track_the_queue(engine: LLMEngine) -> None:
    total = engine.stats().num_total_blocks
    prompts = random_prompts((40, 10), seed=21)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    before = engine.stats()
    assert (before.num_waiting, before.num_running, before.queued_prompt_tokens) == (2, 0, 50)
    engine.step()
    engine.step()
    during = engine.stats()
    assert during.num_running == 2 and during.queued_prompt_tokens == 0
    assert during.num_free_blocks < total and 0 < during.kv_usage < 1
    engine.abort("a")
    engine.abort("unknown-id")  # no-op
    outs = _drain(engine)
    assert outs["a"][-1].finish_reason == "abort" and outs["b"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs["b"]) == 50 - 2
    after = engine.stats()
    assert after.num_free_blocks == total and after.num_running == after.num_waiting == 0


def test_prefill_role_hands_over_first_token_and_blocks(tiny_model_dir: Path) -> None:
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill", max_num_batched_tokens=16)
    [prompt] = random_prompts((37,), seed=22)
    expected = both.generate([prompt], GREEDY)[0]
    writes: list[tuple[int, LayerWrite]] = []
    prefill.set_layer_callback(lambda layer, ws: writes.extend((layer, w) for w in ws))
    prefill.add_request("p", prompt, GREEDY)
    outs = _drain(prefill)["p"]
    [last] = outs
    assert last.finished and last.finish_reason == "prefilled"
    assert last.new_token_ids == expected[:1]
    assert last.kv_block_ids is not None and len(last.kv_block_ids) == 3  # 37 tokens / 16 per block
    stats = prefill.stats()
    assert stats.num_held_blocks == 3 and stats.num_free_blocks == stats.num_total_blocks - 3
    # 3 chunks (16 + 16 + 5 tokens) x 2 layers, in layer order within each step, covering every position
    assert [(layer, w.start_pos, w.end_pos) for layer, w in writes] == [
        (0, 0, 16), (1, 0, 16), (0, 16, 32), (1, 16, 32), (0, 32, 37), (1, 32, 37)]
    assert writes[-1][1].block_ids == last.kv_block_ids[2:]
    prefill.release_kv("p")
    assert prefill.stats().num_free_blocks == stats.num_total_blocks


def test_prefill_decode_handoff_continues_exactly(tiny_model_dir: Path) -> None:
    """KV computed by a prefill engine, copied block by block into a decode engine, decodes like `both`."""
    both = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill")
    decode = _engine(tiny_model_dir, role="decode", kv_cache_bytes=2 << 20)
    prompts = random_prompts((21, 50, 3), seed=23)
    expected = both.generate(prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, GREEDY)
    handed = {o.request_id: o for o in prefill.iter_outputs()}
    for i, prompt in enumerate(prompts):
        out = handed[f"r{i}"]
        dst = decode.reserve_kv(f"r{i}", len(prompt))
        assert dst is not None and out.kv_block_ids is not None and len(dst) == len(out.kv_block_ids)
        # the "transfer": what a transport does across machines, here a tensor copy per block
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, out.kv_block_ids]
        prefill.release_kv(f"r{i}")
        decode.add_prefilled_request(f"r{i}", prompt, out.new_token_ids[0], GREEDY)
    outs = _drain(decode)
    for i in range(len(prompts)):
        tokens = [handed[f"r{i}"].new_token_ids[0]] + [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert tokens == expected[i]
        assert outs[f"r{i}"][-1].num_output_tokens == GREEDY.max_tokens
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks


def test_decode_reservations(tiny_model_dir: Path) -> None:
    decode = _engine(tiny_model_dir, role="decode")
    bytes_per_block = decode.kv_layout.bytes_per_block
    small = _engine(tiny_model_dir, role="decode", kv_cache_bytes=4 * bytes_per_block)
    assert small.reserve_kv("a", 40) == [0, 1, 2]
    assert small.reserve_kv("b", 40) is None  # does not fit now
    assert small.stats().num_reserved_blocks == 3
    small.cancel_reservation("a")
    assert small.reserve_kv("b", 40) is not None
    with pytest.raises(ValueError, match="no KV reservation"):
        decode.add_prefilled_request("nope", [1, 2, 3], 5, GREEDY)
    decode.reserve_kv("x", 3)
    with pytest.raises(ValueError, match="do not match"):
        decode.add_prefilled_request("x", [1] * 40, 5, GREEDY)
    assert decode.stats().num_reserved_blocks == 1  # kept for the caller to cancel
    decode.cancel_reservation("x")
    # a first token that already ends the request finishes it without decoding
    decode.reserve_kv("y", 3)
    decode.add_prefilled_request("y", [4, 5, 6], 9, SamplingParams(max_tokens=1))
    [out] = decode.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks


def test_held_blocks_that_starve_the_queue_raise_instead_of_hanging(tiny_model_dir: Path) -> None:
    probe = _engine(tiny_model_dir)
    prefill = _engine(tiny_model_dir, role="prefill", kv_cache_bytes=4 * probe.kv_layout.bytes_per_block)
    first, second = random_prompts((40, 40), seed=26)
    prefill.add_request("held", first, GREEDY)
    assert [o.finish_reason for o in prefill.iter_outputs()] == ["prefilled"]  # 3 of 4 blocks now held
    prefill.add_request("starved", second, GREEDY)
    with pytest.raises(RuntimeError, match="3 held for outgoing KV transfers"):
        list(prefill.iter_outputs())
    prefill.release_kv("held")
    assert [o.finish_reason for o in prefill.iter_outputs()] == ["prefilled"]


def test_decode_role_also_prefills_locally(tiny_model_dir: Path, engine: LLMEngine) -> None:
    decode = _engine(tiny_model_dir, role="decode")
    [prompt] = random_prompts((30,), seed=24)
    assert decode.generate([prompt], GREEDY) == engine.generate([prompt], GREEDY)


def test_progress_reports_loading_stages(tiny_model_dir: Path) -> None:
    seen: list[tuple[str, float]] = []
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 20),
                       progress=lambda stage, fraction: seen.append((stage, fraction)))
    assert ("load_weights", 1.0) in seen and seen[-1] == ("ready", 1.0)
    assert engine.model_name == "tiny-llama"
    assert engine.kv_cache.shape == (2, 2, engine.stats().num_total_blocks, 16, 2, 16)
    assert engine.kv_layout.layout_hash() == _engine(tiny_model_dir).kv_layout.layout_hash()


def test_bfloat16_runs(tiny_model_dir: Path, engine: LLMEngine) -> None:
    bf16 = _engine(tiny_model_dir, dtype="bfloat16")
    assert bf16.kv_cache.dtype == torch.bfloat16
    [prompt] = random_prompts((12,), seed=25)
    [tokens] = bf16.generate([prompt], GREEDY)
    assert len(tokens) == GREEDY.max_tokens
    # bfloat16 rounding may change later tokens of a random model, not the first few
    assert tokens[:2] == engine.generate([prompt], GREEDY)[0][:2]


def test_kv_budget_from_a_fraction_of_memory(tiny_model_dir: Path) -> None:
    from tandem.worker.engine.kv_budget import available_ram_bytes

    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_fraction=1e-4))
    budget = engine.stats().num_total_blocks * engine.kv_layout.bytes_per_block
    assert 0.8e-4 * available_ram_bytes() <= budget + engine.kv_layout.bytes_per_block <= 1.2e-4 * available_ram_bytes()
    assert engine.kv_cache.numel() * engine.kv_cache.element_size() == budget


def test_memory_utilization_holds_weights_plus_kv(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu-memory-utilization: the share of memory free at start covers the weights and the KV cache."""
    from tandem.worker.engine import llm_engine

    monkeypatch.setattr(llm_engine, "free_memory_bytes", lambda device: 64 << 20)  # 64 MiB "free"
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), memory_utilization=0.25))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.kv_cache.numel() * engine.kv_cache.element_size()
    assert 0 < kv <= (16 << 20) - weights < kv + engine.kv_layout.bytes_per_block

    with pytest.raises(ValueError, match="weights alone"):
        LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), memory_utilization=weights / (64 << 20) / 2))
    with pytest.raises(ValueError, match="at most one of"):
        EngineConfig(model_dir=str(tiny_model_dir), memory_utilization=0.5, kv_cache_bytes=1 << 20)
