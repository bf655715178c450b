"""Mixture-of-experts (Mixtral, Qwen3-MoE) and Gemma 2/3: greedy tokens equal transformers' (float32).

The models are tiny random configs written by transformers itself (`hf_model`). Gemma's (and a
Mistral's) windows are 8 tokens, so the prompts (up to 100 tokens) run far past them on the sliding layers, in
prefill chunks, in whole prompts, after prefix-cache hits and in decodes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tandem.worker.engine import SamplingParams
from tandem.worker.kv.layout import KVLayout
from tandem.worker.model.config import ModelConfig

from .conftest import GREEDY, HFModel, random_prompts

MIXED = (3, 17, 40, 64, 100, 9)
NEW_TOKENS = 12
WINDOW = 8

# family -> the transformers config keys of its tiny test model (on top of conftest.TINY)
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Qwen3-MoE as published: the top-k weights are not renormalised (norm_topk_prob false) ...
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    # ... and with renormalised weights, 3 of 6 experts, and a dense MLP layer among the sparse ones.
    "qwen3_moe-dense-layer": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                                  num_hidden_layers=3, mlp_only_layers=[1]),
    # layer 0 sliding, layer 1 global (transformers' pattern); attention and final logit soft-capping.
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # local, global, local; the local layers rotate with base 10 000, the global one with 1 000 000.
    "gemma3": dict(sliding_window=WINDOW, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Mistral's window on every layer: masked, so prompts may run past it (it used to cap the context).
    "mistral-window": dict(sliding_window=WINDOW),
    "mixtral-window": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    # Qwen2 slides only with use_sliding_window, on the layers from max_window_layers on: layer 1 here.
    "qwen2-window": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
FAMILY_OF = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "qwen3_moe-dense-layer": "qwen3_moe",
             "gemma2": "gemma2", "gemma3": "gemma3", "mistral-window": "mistral",
             "mixtral-window": "mixtral", "qwen2-window": "qwen2"}


def _model(hf_model: Callable[..., HFModel], name: str, **extra: Any) -> HFModel:
    return hf_model(FAMILY_OF[name], **{**CONFIGS[name], **extra})


def _params(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=max_tokens)


def _assert_parity(hf: HFModel, got: list[list[int]], prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> None:
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == hf.greedy(prompt, max_tokens), f"prompt {i} ({len(prompt)} tokens) diverged"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_mixed_batch_matches_transformers(hf_model: Callable[..., HFModel], name: str, chunked: bool) -> None:
    hf = _model(hf_model, name)
    # A 32-token budget splits the longer prompts into chunks that share steps with decodes.
    engine = hf.engine(enable_chunked_prefill=chunked, max_num_batched_tokens=32 if chunked else 2048)
    prompts = random_prompts(MIXED)
    _assert_parity(hf, engine.generate(prompts, _params()), prompts)


def test_the_families_load_as_what_they_are(hf_model: Callable[..., HFModel]) -> None:
    """Guards against a parity that holds by accident (a family silently taken for another)."""
    cfg = {name: ModelConfig.from_dir(_model(hf_model, name).path) for name in CONFIGS}
    assert cfg["mixtral"].family == "mixtral" and cfg["mixtral"].norm_topk_prob
    assert (cfg["mixtral"].num_experts, cfg["mixtral"].num_experts_per_tok) == (4, 2)
    assert cfg["qwen3_moe"].family == "qwen3_moe" and not cfg["qwen3_moe"].norm_topk_prob and cfg["qwen3_moe"].qk_norm
    assert cfg["qwen3_moe-dense-layer"].moe_layers == (True, False, True)
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    assert g2.layer_windows == (WINDOW, None) and g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 30.0
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.query_pre_attn_scalar == 256
    assert g3.layer_windows == (WINDOW, None, WINDOW) and g3.qk_norm and g3.attn_logit_softcapping is None
    assert (g3.rope_theta, g3.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg["mistral-window"].layer_windows == (WINDOW, WINDOW)
    assert cfg["mixtral-window"].layer_windows == (WINDOW, WINDOW)
    assert cfg["qwen2-window"].layer_windows == (None, WINDOW)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window", "mixtral-window", "qwen2-window"])
def test_the_window_changes_the_reference(hf_model: Callable[..., HFModel], name: str) -> None:
    """The parity above would not notice a missing window mask unless the window changes tokens."""
    windowed = _model(hf_model, name)
    unwindowed = _model(hf_model, name, sliding_window=4096)
    prompts = random_prompts(MIXED)
    assert any(windowed.greedy(p, NEW_TOKENS) != unwindowed.greedy(p, NEW_TOKENS) for p in prompts)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_sliding_window_after_prefix_cache_hits(hf_model: Callable[..., HFModel], name: str) -> None:
    hf = _model(hf_model, name)
    engine = hf.engine(block_size=16)
    shared = random_prompts((48,), seed=7)[0]
    tails = random_prompts((5, 20, 1), seed=8)
    engine.generate([shared + tails[0]], _params())
    later = [shared + t for t in tails]
    got = engine.generate(later, _params())
    assert engine.stats().prefix_cache_hits >= 3 * 48  # the later prompts start after 48 cached tokens
    _assert_parity(hf, got, later)


@pytest.mark.parametrize("name", ["mixtral", "gemma2"])
def test_preemption_under_a_small_kv_budget(hf_model: Callable[..., HFModel], name: str) -> None:
    hf = _model(hf_model, name)
    prompts = random_prompts((30, 45, 20, 60, 33), seed=3)
    probe = hf.engine()
    engine = hf.engine(kv_cache_bytes=9 * probe.kv_layout.bytes_per_block, max_num_batched_tokens=64)
    got = engine.generate(prompts, _params(20))
    assert engine.stats().num_preemptions > 0, "the budget was meant to force preemption"
    _assert_parity(hf, got, prompts, 20)


def test_gemma3_in_the_transformers_4_spelling(hf_model: Callable[..., HFModel]) -> None:
    """Published Gemma 3 folders say rope_theta (global), rope_local_base_freq and
    sliding_window_pattern, with a linear RoPE scaling that applies to the global layers only."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    hf = _model(hf_model, "gemma3", rope_parameters=rope, num_hidden_layers=4,
                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    config = json.loads((hf.path / "config.json").read_text())
    del config["rope_parameters"], config["layer_types"]
    config.update(rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  rope_local_base_freq=10000.0, sliding_window_pattern=4)
    (hf.path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(hf.path)
    assert cfg.layer_windows == (WINDOW, WINDOW, WINDOW, None) and cfg.rope_scaling == {"rope_type": "linear",
                                                                                        "factor": 8.0}
    prompts = random_prompts((70, 12), seed=6)
    _assert_parity(hf, hf.engine().generate(prompts, _params()), prompts)


def test_kv_layout_hash_covers_the_sliding_window_layers(hf_model: Callable[..., HFModel]) -> None:
    """Two Gemma workers whose windows or local/global pattern differ must refuse each other's KV."""
    engine = _model(hf_model, "gemma2").engine()
    layout = engine.kv_layout
    assert layout.attention == f"window={WINDOW};layers=SF"
    for other in (dataclasses.replace(layout, attention="window=16;layers=SF"),
                  dataclasses.replace(layout, attention=f"window={WINDOW};layers=FS"),
                  dataclasses.replace(layout, attention="")):
        assert other.layout_hash() != layout.layout_hash()
    # Models whose layers all attend alike keep the hash they had before the field existed.
    plain = KVLayout(model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
    assert plain.layout_hash() == "7b25d82ba5d1dcfc"  # computed by the code before this change


def test_moe_runs_each_expert_once_per_layer(hf_model: Callable[..., HFModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """Batching over experts: a step of many tokens calls each expert's GEMMs once, not once per token."""
    import torch.nn.functional as F

    from tandem.worker.model import llama

    hf = _model(hf_model, "mixtral")
    engine = hf.engine(max_num_batched_tokens=2048)
    calls: list[tuple[int, ...]] = []
    real_linear = F.linear

    def counting_linear(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(tuple(weight.shape))
        return real_linear(x, weight, *args)

    monkeypatch.setattr(llama.F, "linear", counting_linear)
    prompts = random_prompts((100, 60), seed=4)
    engine.generate(prompts, _params(1))
    expert_calls = [c for c in calls if c == (2 * 128, 64)]  # gate_up of one expert
    # one prefill step of 160 tokens, 2 layers, at most 4 experts each
    assert 0 < len(expert_calls) <= 2 * 4


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gemma2", "gemma3"])
def test_tiny_model_writer_families_load_in_transformers(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    """`tandem make-tiny-model --family F` (and `serve --model tiny --family F`) folders are real ones:
    transformers loads them and agrees with the engine."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    from tandem.worker.engine import EngineConfig, LLMEngine
    from tandem.worker.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / f"tiny-{family}", family=family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf = HFModel(path, reference)
    engine = LLMEngine(EngineConfig(model_dir=str(path), kv_cache_bytes=1 << 22))
    prompts = random_prompts((50, 7), seed=12)  # past the tiny Gemma's 32-token window
    _assert_parity(hf, engine.generate(prompts, _params()), prompts)


def test_a_peer_with_other_windows_is_refused_over_tcp() -> None:
    """The real tcp handshake: a receiver whose local layers or window differ refuses the sender."""
    from tandem.worker.transfer import TransferError
    from tandem.worker.transfer.conformance import TINY_LAYOUT, transport_pair

    mine = dataclasses.replace(TINY_LAYOUT, attention="window=8;layers=SFS")
    for theirs in ("window=16;layers=SFS", "window=8;layers=FSF", ""):
        with transport_pair("tcp", mine, sender_layout=dataclasses.replace(TINY_LAYOUT, attention=theirs)) as pair:
            with pytest.raises(TransferError) as refused:
                pair.sender.connect(pair.receiver.address)
            assert refused.value.reason == "layout_mismatch"
            assert "window=8;layers=SFS" in str(refused.value)  # the message shows both layouts
    with transport_pair("tcp", mine) as pair:  # the same windows connect
        pair.sender.connect(pair.receiver.address)


# config.json of published checkpoints (transformers 4.x spelling, shapes as released), written out here
# because the Hub is out of reach; transformers' own config classes read the same files for comparison.
PUBLISHED = {
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": [1, 106]},
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "vocab_size": 256000},
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936},
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1e6, "sliding_window": None, "vocab_size": 32000},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(name: str) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    raw = PUBLISHED[name]
    ours = ModelConfig.from_dict(raw, name=name)
    theirs = transformers.AutoConfig.for_model(**raw)
    layer_types = getattr(theirs, "layer_types", None) or ["full_attention"] * raw["num_hidden_layers"]
    window = getattr(theirs, "sliding_window", None)
    expected = tuple(window if t == "sliding_attention" else None for t in layer_types)
    assert (ours.layer_windows or (None,) * ours.num_layers) == expected
    if ours.family == "gemma3":
        params = theirs.rope_parameters
        assert (ours.rope_theta, ours.local_rope_theta) == (params["full_attention"]["rope_theta"],
                                                           params["sliding_attention"]["rope_theta"])
        assert ours.qk_norm and ours.gemma_norms and ours.layer_windows.count(None) == 4  # layers 6, 12, 18, 24
    if ours.family in ("mixtral", "qwen3_moe"):
        assert (ours.num_experts, ours.num_experts_per_tok) == ((8, 2) if ours.family == "mixtral" else (128, 8))
        assert ours.norm_topk_prob and all(ours.moe_layers)
    if ours.family == "gemma2":
        assert ours.layer_windows[:2] == (4096, None) and ours.final_logit_softcapping == 30.0
