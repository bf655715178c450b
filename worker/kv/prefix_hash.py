"""Chained hashes of full KV blocks, the keys of the prefix cache.

The hash of block i covers every token from the start of the sequence to the end of block i
(it folds in the parent block's hash), so equal hashes mean equal prefixes, not just equal
blocks. The hashes are stable across processes and machines (sha256 over the token ids), so
a router can compute the same keys to route for prefix affinity.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    payload = parent + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(payload).digest()[:16]


def block_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, reusing the `known` leading ones."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[start:start + block_size]))
    return hashes
