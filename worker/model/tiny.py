"""Tiny random-weight model folders, for tests, demos and `tandem serve --model tiny`.

Writes what a Hugging Face model folder holds: config.json, model.safetensors (random
weights), tokenizer.json (a small byte-level BPE, so any UTF-8 text encodes), tokenizer_config.json
with a ChatML-style chat template, and generation_config.json. Needs torch, safetensors and
tokenizers only (no transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import ModelConfig
from .llama import CausalLM

FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks.",
    "Prefill computes the prompt; decode generates one token at a time. Hello, world! How are you today?",
    "def main():\n    print('hello')\n    return 0\n\nfor i in range(10):\n    total += i * 2\n",
    "Kubernetes runs pods on nodes. The operator reconciles resources and scales the pools on metrics.",
    "Zürich, café, naïve, déjà vu; Москва; 東京; 你好，世界; 🙂🚀 numbers 0123456789 and symbols #$%&*+=<>?@[]{}",
    "user assistant system: you are a helpful assistant. Answer briefly and clearly, please.",
]


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE trained on a fixed small corpus (deterministic); every UTF-8 string encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def tiny_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    architecture, model_type = FAMILIES[family]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": family == "qwen2",
        "bos_token_id": 0,
        "eos_token_id": [1, 3],
        "dtype": "float32",
    }
    if family == "qwen3":
        config["attention_bias"] = False
    if family == "mistral":
        config["sliding_window"] = None
    if family in ("mixtral", "qwen3_moe"):
        config.update(num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        config.update(moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if family in ("gemma2", "gemma3"):
        # Small windows, so a short prompt already has local layers that see only part of it.
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=32,
                      tie_word_embeddings=True)
        del config["hidden_act"]
    if family == "gemma2":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":
        del config["rope_theta"]
        config["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    config.update(overrides)
    if family in ("gemma2", "gemma3") and "layer_types" not in overrides:  # local and global layers alternate
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    return config


def write_tiny_model(path: str | Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight model folder; `overrides` replace config.json keys (e.g. num_hidden_layers=4)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    tokenizer = build_tokenizer(min(config["vocab_size"], 512))
    if tokenizer.get_vocab_size() > config["vocab_size"]:
        raise ValueError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {tokenizer.get_vocab_size()}")
    model_cfg = ModelConfig.from_dict(config, name=out.name)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(model_cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, (param, expert, start, end) in model.checkpoint_layout().items():  # Hugging Face names and shapes
        full = model.get_parameter(param).shape
        shape = (end - start, *(full[1:] if expert is None else full[2:]))
        if name.endswith("norm.weight"):  # Gemma's norms multiply by (1 + w)
            tensors[name] = torch.zeros(shape) if model_cfg.gemma_norms else torch.ones(shape)
        else:
            # A wider spread than the usual 0.02 makes the next-token distribution peaked, so
            # greedy decoding is well defined and tiny numeric noise does not flip tokens.
            tensors[name] = torch.randn(shape, generator=generator) * 0.15
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE,
        "model_max_length": config["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    return out
