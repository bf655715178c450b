"""The llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Module and parameter names mirror Hugging Face's, so a checkpoint's state dict loads as is.
Family differences are switches on `ModelConfig`: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, RoPE scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv
from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # q, k and v projections run as one GEMM; the checkpoint's separate tensors are loaded
        # into row slices of it (see CausalLM.checkpoint_layout).
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama puts attention_bias on o_proj too; Qwen2 never does.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` runs one engine step: all scheduled tokens of all sequences, flattened."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def checkpoint_layout(self) -> dict[str, tuple[str, int, int]]:
        """Hugging Face tensor name -> (our parameter, first row, end row) it fills."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        packed = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
                  "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
                  "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
                  "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
                  "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter)}
        layout: dict[str, tuple[str, int, int]] = {}
        for name, param in self.named_parameters():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            prefix, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj / weight
            unpacked = [(hf, start, end) for hf, (ours, start, end) in packed.items() if prefix.endswith(ours)]
            if not unpacked:
                layout[name] = (name, 0, param.shape[0])
            for hf, start, end in unpacked:
                layer_prefix = prefix[: len(prefix) - len(packed[hf][0])]
                layout[f"{layer_prefix}{hf}.{leaf}"] = (name, start, end)
        return layout

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` ([len(logits_indices), vocab])."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_cache[i], meta)
            if on_layer_written is not None:
                on_layer_written(i)  # this layer's KV for the step is in the cache
        last = self.model.norm(hidden[logits_indices])
        logits: torch.Tensor = self.lm_head(last)
        return logits.float()
