"""Optional CUDA fast path: flash-attn's paged decode kernel, used only where it can run.

`flash_attn.flash_attn_with_kvcache` reads the block tables directly (no gather), and our cache
layout per layer, [num_blocks, block_size, kv_heads, head_dim] for K and for V, is exactly its
paged layout. flash-attn 2 needs pages of a multiple of 256 tokens, so this path is taken only
with such a block size, on CUDA, in float16/bfloat16, when the package is importable. The first
call is checked against the plain torch path on the same data; on any error or mismatch the
fast path switches itself off for the process (with a warning) and torch serves every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"kernel": None, "loaded": False, "verified": False, "disabled": False}


def _kernel() -> Callable[..., torch.Tensor] | None:
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            from flash_attn import flash_attn_with_kvcache

            _state["kernel"] = flash_attn_with_kvcache
        except Exception:  # not installed, or built for another torch/CUDA: plain torch it is
            _state["kernel"] = None
    kernel: Callable[..., torch.Tensor] | None = _state["kernel"]
    return kernel


def usable(q: torch.Tensor, block_size: int) -> bool:
    return (not _state["disabled"] and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and block_size % 256 == 0 and _kernel() is not None)


def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
           scale: float, reference: Callable[[], torch.Tensor]) -> torch.Tensor:
    """q: [batch, heads, head_dim], one query per sequence. `reference` computes the torch result."""
    kernel = _kernel()
    assert kernel is not None
    try:
        out = kernel(q.unsqueeze(1), kv_cache[0], kv_cache[1], cache_seqlens=context_lens.to(torch.int32),
                     block_table=block_tables.to(torch.int32), softmax_scale=scale, causal=True).squeeze(1)
    except Exception as exc:  # an unexpected build or version: never fail a request over the fast path
        log.warning("flash-attn decode failed (%s); using torch attention from now on", exc)
        _state["disabled"] = True
        return reference()
    if not _state["verified"]:
        expected = reference()
        if not torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2):
            log.warning("flash-attn decode disagrees with torch attention; using torch attention from now on")
            _state["disabled"] = True
            return expected
        _state["verified"] = True
    return out
