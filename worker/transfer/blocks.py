"""Moving block bytes between the KV-cache tensor and frame buffers.

The sender reads (layer, K/V, source blocks); when those blocks form one ascending run of
a CPU cache they are already one contiguous slice and go out zero-copy, otherwise they are
gathered once into a staging buffer (and copied to host for a GPU cache). The receiver writes
a verified payload into (layer, K/V, destination blocks) of its own cache.
"""

from __future__ import annotations

import ctypes

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


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying.

    The view keeps the tensor alive (zmq holds the view until the bytes are on the wire).
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw.owner = tensor  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


def ascending_runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order: [3,4,5,9] -> [(3,3),(9,1)]."""
    values = ids.tolist()
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def _address(buffer: memoryview | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def read_blocks(kv_cache: torch.Tensor, layer: int, kind: int, src_ids: torch.Tensor) -> memoryview:
    """The bytes of kv_cache[layer, kind, src_ids], in src_ids order, ready to send."""
    region = kv_cache[layer, kind]
    count = src_ids.numel()
    block_bytes = region[0].numel() * region.element_size()
    if kv_cache.device.type == "cpu":
        runs = ascending_runs(src_ids)
        if len(runs) == 1:
            return tensor_memoryview(region[runs[0][0]:runs[0][0] + count])
        # memmove per run rather than index_select: one thread, plain memcpy, no spinning pool
        staging = bytearray(count * block_bytes)
        base, offset = _address(staging), 0
        for first, length in runs:
            ctypes.memmove(base + offset, region[first].data_ptr(), length * block_bytes)
            offset += length * block_bytes
        return memoryview(staging)
    staging = bytearray(count * block_bytes)
    out = torch.frombuffer(staging, dtype=torch.uint8).view(region.dtype).view(count, *region.shape[1:])
    out.copy_(region.index_select(0, src_ids.to(region.device)))
    return memoryview(staging)


def write_blocks(kv_cache: torch.Tensor, layer: int, kind: int, dst_ids: torch.Tensor,
                 payload: memoryview) -> None:
    """Copy a verified payload into kv_cache[layer, kind, dst_ids] (payload in dst_ids order)."""
    region = kv_cache[layer, kind]
    count = dst_ids.numel()
    block_bytes = region[0].numel() * region.element_size()
    if kv_cache.device.type == "cpu" and not payload.readonly:
        base, offset = _address(payload), 0
        for first, length in ascending_runs(dst_ids):
            ctypes.memmove(region[first].data_ptr(), base + offset, length * block_bytes)
            offset += length * block_bytes
        return
    source = torch.frombuffer(payload, dtype=torch.uint8).view(region.dtype).view(count, *region.shape[1:])
    region.index_copy_(0, dst_ids.to(region.device), source.to(region.device))
