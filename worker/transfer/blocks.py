"""Moving block bytes between the KV-cache tensor and frame buffers.

The sender reads (layer, K/V, source blocks); when those blocks form one ascending run of
a CPU cache they are already one contiguous slice and go out zero-copy, otherwise they are
gathered once into a staging buffer (and copied to host for a GPU cache). The receiver writes
a verified payload into (layer, K/V, destination blocks) of its own cache.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tandem.worker.kv.layout import KVLayout


def check_cache(layout: KVLayout, kv_cache: torch.Tensor) -> None:
    """Refuse a cache tensor whose shape or dtype does not match the layout (clear error, no guessing)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    expected = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    shape = tuple(kv_cache.shape)
    if kv_cache.dim() != 6 or (shape[0], shape[1], *shape[3:]) != expected:
        raise ValueError(f"kv_cache shape {shape} does not match the layout: expected "
                         f"[{layout.num_layers}, 2, num_blocks, {layout.block_size}, {layout.num_kv_heads}, "
                         f"{layout.head_dim}]")
    if str(kv_cache.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match the layout dtype {layout.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")


def ascending_runs(ids: Sequence[int] | torch.Tensor) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order: [3,4,5,9] -> [(3,3),(9,1)]."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    if values and values[-1] - values[0] == len(values) - 1 and values == list(range(values[0], values[-1] + 1)):
        return [(values[0], len(values))]  # the common case, one run: C-level comparison, no Python loop
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def _address(buffer: memoryview | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _block_geometry(kv_cache: torch.Tensor, layer: int, kind: int) -> tuple[int, int]:
    """(address of block 0 of kv_cache[layer, kind], bytes per block) of a contiguous CPU cache.

    Plain arithmetic instead of torch indexing: this runs per frame, where each torch call's
    overhead (microseconds) adds up to more than the bookkeeping itself.
    """
    num_blocks = kv_cache.shape[2]
    block_bytes = kv_cache.stride(2) * kv_cache.element_size()
    return kv_cache.data_ptr() + (layer * 2 + kind) * num_blocks * block_bytes, block_bytes


def read_blocks(kv_cache: torch.Tensor, layer: int, kind: int, src_ids: Sequence[int] | torch.Tensor) -> memoryview:
    """The bytes of kv_cache[layer, kind, src_ids], in src_ids order, ready to send."""
    count = len(src_ids)
    if kv_cache.device.type == "cpu":
        base, block_bytes = _block_geometry(kv_cache, layer, kind)
        runs = ascending_runs(src_ids)
        if len(runs) == 1:  # one run: a view of the cache itself, zero-copy
            raw = (ctypes.c_char * (count * block_bytes)).from_address(base + runs[0][0] * block_bytes)
            raw.owner = kv_cache  # type: ignore[attr-defined]  # zmq may hold the view after we return
            return memoryview(raw).cast("B")
        # memmove per run rather than index_select: one thread, plain memcpy, no spinning pool
        staging = bytearray(count * block_bytes)
        staging_address, offset = _address(staging), 0
        for first, length in runs:
            ctypes.memmove(staging_address + offset, base + first * block_bytes, length * block_bytes)
            offset += length * block_bytes
        return memoryview(staging)
    region = kv_cache[layer, kind]
    block_bytes = region[0].numel() * region.element_size()
    index = src_ids if isinstance(src_ids, torch.Tensor) else torch.tensor(src_ids, dtype=torch.int64)
    staging = bytearray(count * block_bytes)
    out = torch.frombuffer(staging, dtype=torch.uint8).view(region.dtype).view(count, *region.shape[1:])
    out.copy_(region.index_select(0, index.to(region.device)))
    return memoryview(staging)


def write_blocks(kv_cache: torch.Tensor, layer: int, kind: int, dst_ids: Sequence[int] | torch.Tensor,
                 payload: memoryview) -> None:
    """Copy a verified payload into kv_cache[layer, kind, dst_ids] (payload in dst_ids order)."""
    count = len(dst_ids)
    if kv_cache.device.type == "cpu" and not payload.readonly:
        base, block_bytes = _block_geometry(kv_cache, layer, kind)
        payload_address, offset = _address(payload), 0
        for first, length in ascending_runs(dst_ids):
            ctypes.memmove(base + first * block_bytes, payload_address + offset, length * block_bytes)
            offset += length * block_bytes
        return
    region = kv_cache[layer, kind]
    block_bytes = region[0].numel() * region.element_size()
    source = torch.frombuffer(payload, dtype=torch.uint8).view(region.dtype).view(count, *region.shape[1:])
    index = dst_ids if isinstance(dst_ids, torch.Tensor) else torch.tensor(dst_ids, dtype=torch.int64)
    region.index_copy_(0, index.to(region.device), source.to(region.device))
