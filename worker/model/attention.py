"""Attention over the paged KV cache, in plain torch (CPU and CUDA).

One step's tokens arrive flattened: first the sequences that add a single token (decodes),
then the sequences that add several (prefill chunks). Decodes are attended in one batched
call over their gathered blocks; each prefill chunk gets its own call, with a causal mask
shifted by the context it already has in the cache.

Sliding-window layers (Gemma 2/3) use masks that also hide keys `window` or more positions
behind the query; the runner builds them once per step, only when some context is that long.
Attention-logit soft-capping (Gemma 2) has no fused SDPA kernel: those layers compute scores,
cap them with tanh, mask and softmax explicitly (`_attend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import flash


@dataclass
class PrefillSpan:
    start: int  # offset of the chunk's first token in the flattened batch
    num_tokens: int  # tokens added by this chunk
    context_len: int  # tokens in the cache after this step (cached + chunk)
    block_table: torch.Tensor  # [num_blocks] long, on the device
    mask: torch.Tensor | None = None  # [num_tokens, context_len] causal mask shifted by the cached context;
    # None when the chunk is the whole context so far (plain causal attention)
    window_mask: torch.Tensor | None = None  # the same for sliding-window layers; None when no query
    # reaches past the window (then `mask` is exact for them too)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot (block * block_size + offset) per token
    num_decode_tokens: int  # the first tokens of the batch, one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size]: True = attend
    decode_context_lens: torch.Tensor | None  # [num_decodes] tokens in the cache, this step's included
    prefills: list[PrefillSpan]
    decode_window_mask: torch.Tensor | None = None  # decode_mask for sliding-window layers (None: no window)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([num_tokens, kv_heads, head_dim]) into one layer's block caches."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding: bool = False,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k/v: this step's keys/values (already in the cache too);
    kv_cache: one layer's [2, num_blocks, block_size, kv_heads, head_dim]. `sliding`: this layer
    attends within the window only; `softcap`: tanh soft-capping of the attention logits.

    Returns [num_tokens, heads, head_dim].
    """
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        tables, mask = meta.decode_block_tables, meta.decode_mask
        windowed = sliding and meta.decode_window_mask is not None
        if windowed:
            assert meta.decode_window_mask is not None
            mask = meta.decode_window_mask

        def torch_decode() -> torch.Tensor:
            keys, values = _gather(kv_cache, tables)  # each [nd, kv_heads, max_len, head_dim]
            # Masked positions (the rest of a last block, padding blocks) hold whatever their last owner
            # left there: a weight of 0 times a NaN there is NaN, so one failed request's NaN KV would
            # spoil every stream that later shares a block with it. Zero them (the gather is a copy).
            hidden = ~mask[:, 0, 0, :, None].unsqueeze(1)  # [nd, 1, max_len, 1]
            keys.masked_fill_(hidden, 0.0)
            values.masked_fill_(hidden, 0.0)
            return _attend(q[:nd].unsqueeze(2), keys, values, mask, scale, softcap).squeeze(2)

        if (meta.decode_context_lens is not None and not windowed and softcap is None
                and flash.usable(q, kv_cache.shape[2])):
            out[:nd] = flash.decode(q[:nd], kv_cache, tables, meta.decode_context_lens, scale, torch_decode)
        else:
            out[:nd] = torch_decode()
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        span_mask = span.window_mask if sliding and span.window_mask is not None else span.mask
        if span.mask is None:  # nothing cached before: attend to this chunk only
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            keys, values = _gather(kv_cache, span.block_table[None])
            keys, values = keys[..., : span.context_len, :], values[..., : span.context_len, :]
        attn = _attend(query, keys, values, span_mask, scale, softcap)
        out[rows] = attn.squeeze(0).transpose(0, 1)
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None) -> torch.Tensor:
    """query [b, heads, q, d], keys/values [b, kv_heads, k, d]; mask (True = attend) broadcastable to
    [b, heads, q, k], None = causal with q == k."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(query.shape[2], keys.shape[2], dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)


def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, num_blocks, block_size, kv_heads, head_dim] -> K and V, each [batch, kv_heads, blocks * block_size, head_dim].

    One index_select over K and V together: several times faster than advanced indexing on CPU.
    """
    batch, nb = block_tables.shape
    blocks = torch.index_select(kv_cache, 1, block_tables.reshape(-1))  # [2, batch * nb, bs, heads, dim]
    _, _, bs, heads, dim = blocks.shape
    kv = blocks.view(2, batch, nb * bs, heads, dim).transpose(2, 3)
    return kv[0], kv[1]
