"""The optional flash-attn decode path guards itself: checked once, switched off on error or mismatch.

flash-attn cannot run here (no CUDA), so its kernel is stood in for by plain-torch functions
with the same signature; what is under test is the guard around it, which is what protects
requests on machines where the real kernel misbehaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tandem.worker.model import attention, flash


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    saved = dict(flash._state)
    yield
    flash._state.clear()
    flash._state.update(saved)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 6, 4, 2, 8, generator=gen)  # [2, blocks, block_size, kv_heads, head_dim]
    q = torch.randn(2, 4, 8, generator=gen)  # 2 sequences, 4 query heads
    tables = torch.tensor([[1, 3], [5, 0]])
    lens = torch.tensor([7, 2])
    width = tables.shape[1] * 4
    mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]

    def reference() -> torch.Tensor:
        keys, values = attention._gather(kv_cache, tables)
        out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                                               scale=8 ** -0.5, enable_gqa=True)
        return out.squeeze(2)

    return q, kv_cache, tables, lens, reference


def _faithful_kernel(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):  # type: ignore[no-untyped-def]
    """flash_attn_with_kvcache's contract, in torch: q [batch, 1, heads, dim] -> same shape."""
    out = []
    for i in range(q.shape[0]):
        n = int(cache_seqlens[i])
        keys = k_cache[block_table[i].long()].reshape(-1, *k_cache.shape[2:])[:n].transpose(0, 1)
        values = v_cache[block_table[i].long()].reshape(-1, *v_cache.shape[2:])[:n].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[i].transpose(0, 1), keys, values, scale=softmax_scale, enable_gqa=True).transpose(0, 1))
    return torch.stack(out)


def test_a_faithful_kernel_is_verified_once_and_then_used() -> None:
    q, kv_cache, tables, lens, reference = _inputs()
    calls = {"reference": 0}

    def counted() -> torch.Tensor:
        calls["reference"] += 1
        return reference()

    flash._state.update(kernel=_faithful_kernel, loaded=True, verified=False, disabled=False)
    first = flash.decode(q, kv_cache, tables, lens, 8 ** -0.5, counted)
    second = flash.decode(q, kv_cache, tables, lens, 8 ** -0.5, counted)
    assert torch.allclose(first, reference(), atol=1e-5) and torch.allclose(second, first)
    assert calls["reference"] == 1 and flash._state["verified"] and not flash._state["disabled"]


def test_a_wrong_kernel_is_switched_off_and_torch_answers() -> None:
    q, kv_cache, tables, lens, reference = _inputs()
    flash._state.update(kernel=lambda q, *a, **k: torch.zeros_like(q), loaded=True, verified=False, disabled=False)
    out = flash.decode(q, kv_cache, tables, lens, 8 ** -0.5, reference)
    assert torch.allclose(out, reference()) and flash._state["disabled"]


def test_a_failing_kernel_is_switched_off_and_torch_answers() -> None:
    q, kv_cache, tables, lens, reference = _inputs()

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("page size must be a multiple of 256")

    flash._state.update(kernel=broken, loaded=True, verified=False, disabled=False)
    out = flash.decode(q, kv_cache, tables, lens, 8 ** -0.5, reference)
    assert torch.allclose(out, reference()) and flash._state["disabled"]


def test_never_used_on_cpu_or_with_small_blocks() -> None:
    flash._state.update(kernel=_faithful_kernel, loaded=True, verified=False, disabled=False)
    assert not flash.usable(torch.zeros(1, 1, 8, dtype=torch.bfloat16), 256)  # CPU tensor
