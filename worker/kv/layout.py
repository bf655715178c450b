"""The KV-cache layout shared by the engine, the KV transfer and the operator.

Two workers may exchange KV blocks only if they agree on everything that decides where a
byte lives. `layout_hash()` condenses that into a short string; it is carried in every
transfer handshake, set on every worker pod (label and env), and peers with different
hashes refuse each other.

Tensor layout of a worker's cache (one tensor, so RDMA can register it as one region):
    kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
index 0 of the second axis is K, 1 is V. For one layer, the K (or V) data of one block is
contiguous: block_bytes_per_layer_kv = block_size * num_kv_heads * head_dim * itemsize.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    model: str  # model identity (name or config fingerprint), not a local path
    dtype: str  # float32 | bfloat16 | float16
    block_size: int
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    tensor_parallel: int = 1
    # What a block's bytes mean beyond their shape: the sliding-window layers and the window
    # (`ModelConfig.attention_signature`, e.g. "window=4096;layers=SFSF"). Empty: every layer
    # attends alike; then it is left out of the hash, so such layouts hash as before it existed.
    attention: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        for field in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel"):
            if getattr(self, field) <= 0:
                raise ValueError(f"KVLayout.{field} must be positive, got {getattr(self, field)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_block_layer_kv(self) -> int:
        """Bytes of K (or V) for one block in one layer: the unit a transfer copies."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return 2 * self.num_layers * self.bytes_per_block_layer_kv

    def layout_hash(self) -> str:
        fields = asdict(self)
        if not fields["attention"]:
            del fields["attention"]
        payload = json.dumps({"v": LAYOUT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
