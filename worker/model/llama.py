"""The decoder of every supported family over a paged KV cache.

Llama 2/3, Mistral, Qwen2, Qwen3, the mixtures of experts Mixtral and Qwen3-MoE, Gemma 2 and 3.
Module and parameter names mirror Hugging Face's where the layout is the same; `checkpoint_layout`
maps the rest (packed q/k/v and gate/up, stacked experts). Family differences are switches on
`ModelConfig`: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3, Qwen3-MoE, Gemma 3), routed
experts (`MoE`), Gemma's (1 + w) norms around attention and MLP, scaled embeddings, logit
soft-capping and sliding-window layers with their own RoPE base (Gemma 3).

Tensor parallelism (`tensor_parallel.py`): built with a `TensorParallel` of size > 1, the modules
hold only their rank's heads and intermediate rows, and attention and the MLP/experts each end in
one all-reduce; `checkpoint_layout` then describes the rank's part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv
from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary, inverse_frequencies
from .tensor_parallel import TensorParallel, row_parallel


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


class GemmaRMSNorm(RMSNorm):
    """Gemma's: the weight is stored minus one, and the product is taken in float32 before the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return GemmaRMSNorm(size, cfg.rms_norm_eps) if cfg.gemma_norms else RMSNorm(size, cfg.rms_norm_eps)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    return F.silu


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = len(tp.q_heads(cfg)), len(tp.kv_heads(cfg))  # this rank's
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sliding = cfg.window_of(layer) is not None
        self.softcap = cfg.attn_logit_softcapping
        # q, k and v projections run as one GEMM; the checkpoint's separate tensors are loaded
        # into row slices of it (see CausalLM.checkpoint_layout).
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama puts attention_bias on o_proj too; Qwen2 never does.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None

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
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding, self.softcap)
        return row_parallel(self.o_proj, out.reshape(n, self.q_size), self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = len(tp.split(cfg.intermediate_size))  # this rank's
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return row_parallel(self.down_proj, self.act(gate) * up, self.tp)


class MoE(nn.Module):
    """Routed experts (Mixtral, Qwen3-MoE): softmax over the router's logits, the top k experts per
    token, their weights renormalised to sum to 1 where the family does (Mixtral always, Qwen3-MoE
    with norm_topk_prob). Expert weights are stacked: gate_up_proj [experts, 2 * inter, hidden],
    down_proj [experts, hidden, inter].

    Batching: the (token, expert) pairs are sorted by expert, so each expert runs once, as two GEMMs
    over the contiguous run of its tokens; the weighted results are summed back per token with one
    index_add_. The Python loop is over experts (skipping idle ones), never over tokens.

    Tensor parallel: each rank holds its rows of every expert's intermediate size and routes all
    tokens itself; the weighted partial sums are all-reduced once.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        # transformers weighs Mixtral's expert outputs in float32 but Qwen3-MoE's in the activation dtype;
        # the same rounding keeps bfloat16/float16 tokens as close to theirs as it can.
        self.weigh_in_float32 = cfg.family == "mixtral"
        self.inter = len(tp.split(cfg.moe_intermediate_size))  # this rank's
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * self.inter, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, self.inter))
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [tokens, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        token_of_pair = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one device sync per layer
        inputs = x[token_of_pair]
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = F.linear(inputs[rows], self.gate_up_proj[expert])
            outputs[rows] = F.linear(self.act(gate_up[:, : self.inter]) * gate_up[:, self.inter:],
                                     self.down_proj[expert])
            start += count
        pair_weights = weights.reshape(-1)[order, None]
        if self.weigh_in_float32:
            weighted = (outputs * pair_weights).to(x.dtype)
        else:
            weighted = outputs * pair_weights.to(x.dtype)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, token_of_pair, weighted))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp: nn.Module = MoE(cfg, tp) if cfg.is_moe_layer(layer) else MLP(cfg, tp)
        # Gemma: the post-attention norm acts on the attention's output, and the MLP has its own pair.
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.gemma_norms else None
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.gemma_norms else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
            hidden = hidden + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
            gemma_out: torch.Tensor = hidden + self.post_feedforward_layernorm(mlp)
            return gemma_out
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated (tensor_parallel.py)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    """`forward` runs one engine step: all scheduled tokens of all sequences, flattened.
    `tp`: the rank's part of a tensor-parallel model (default: the whole model)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TensorParallel()
        self.tp.check(cfg)
        self.model = DecoderModel(cfg, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's sliding layers rotate with their own base; None: every layer uses `rotary`.
        self.rotary_local = (RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling)
                             if cfg.local_rope_theta is not None else None)

    def init_buffers(self, device: torch.device | str) -> None:
        """Buffers are not in checkpoints: compute the RoPE frequencies (in float32) on the device."""
        cfg = self.config
        self.rotary.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        if self.rotary_local is not None and cfg.local_rope_theta is not None:
            self.rotary_local.inv_freq = inverse_frequencies(cfg.head_dim, cfg.local_rope_theta,
                                                             cfg.local_rope_scaling).to(device)

    def checkpoint_layout(self) -> dict[str, tuple[str, int | None, int, int]]:
        """Hugging Face tensor name -> (our parameter, expert index or None, first row, end row) it fills.
        Tensor parallel: the rows of this rank's parameters; `TensorParallel.shard_of` says which part of
        the checkpoint tensor goes there."""
        cfg, tp = self.config, self.tp
        q, kv = len(tp.q_heads(cfg)) * cfg.head_dim, len(tp.kv_heads(cfg)) * cfg.head_dim
        inter = len(tp.split(cfg.intermediate_size))
        packed = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
                  "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
                  "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
                  "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
                  "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter)}
        layout: dict[str, tuple[str, int | None, int, int]] = {}
        for name, param in self.named_parameters():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            prefix, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj / weight
            if prefix.endswith(".mlp") and leaf in ("gate_up_proj", "down_proj"):  # stacked experts
                layout.update(self._expert_layout(prefix, leaf, name))
                continue
            if prefix.endswith(".mlp.gate") and cfg.family == "mixtral":
                layout[f"{prefix[:-len('.mlp.gate')]}.block_sparse_moe.gate.{leaf}"] = (name, None, 0, param.shape[0])
                continue
            unpacked = [(hf, start, end) for hf, (ours, start, end) in packed.items() if prefix.endswith(ours)]
            if not unpacked:
                layout[name] = (name, None, 0, param.shape[0])
            for hf, start, end in unpacked:
                layer_prefix = prefix[: len(prefix) - len(packed[hf][0])]
                layout[f"{layer_prefix}{hf}.{leaf}"] = (name, None, start, end)
        return layout

    def _expert_layout(self, prefix: str, leaf: str, name: str) -> dict[str, tuple[str, int | None, int, int]]:
        """One checkpoint tensor per expert and projection, as Hugging Face ships them: Mixtral's
        block_sparse_moe.experts.E.w1/w3/w2 (gate/up/down), Qwen3-MoE's mlp.experts.E.gate_proj/up_proj/down_proj."""
        cfg = self.config
        inter, hidden = len(self.tp.split(cfg.moe_intermediate_size)), cfg.hidden_size
        if cfg.family == "mixtral":
            base, names = prefix[: -len(".mlp")] + ".block_sparse_moe.experts", ("w1", "w3", "w2")
        else:
            base, names = prefix + ".experts", ("gate_proj", "up_proj", "down_proj")
        gate, up, down = names
        parts = ([(gate, 0, inter), (up, inter, 2 * inter)] if leaf == "gate_up_proj" else [(down, 0, hidden)])
        return {f"{base}.{e}.{hf}.weight": (name, e, start, end)
                for e in range(cfg.num_experts) for hf, start, end in parts}

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` ([len(logits_indices), vocab])."""
        cfg = self.config
        hidden = self.model.embed_tokens(input_ids)
        if cfg.gemma_norms:  # Gemma scales embeddings by sqrt(hidden_size), rounded to the activation dtype
            hidden = hidden * torch.tensor(cfg.hidden_size ** 0.5, dtype=hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        local = self.rotary_local.cos_sin(positions, hidden.dtype) if self.rotary_local is not None else (cos, sin)
        for i, layer in enumerate(self.model.layers):
            layer_cos, layer_sin = local if cfg.window_of(i) is not None else (cos, sin)
            hidden = layer(hidden, layer_cos, layer_sin, kv_cache[i], meta)
            if on_layer_written is not None:
                on_layer_written(i)  # this layer's KV for the step is in the cache
        last = self.model.norm(hidden[logits_indices])
        logits: torch.Tensor = self.lm_head(last).float()
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
