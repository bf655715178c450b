"""Receiver-side bookkeeping: what a reserved transfer still expects, and frame checks.

A reservation is created by `expect()` on the decode worker: these destination blocks, every
layer, K and V. Each arriving frame is checked against it (layer, kind, block ids that belong
to the reservation and have not arrived yet) before a single byte is written; the transfer is
complete when every (layer, K/V, block) has arrived and verified.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.worker.kv.layout import KVLayout

from . import wire
from .errors import CORRUPT_FRAME, INVALID_FRAME, TransferError

DoneCallback = Callable[[str, "TransferError | None"], None]


def validate_block_ids(block_ids: list[int], num_blocks: int, what: str) -> torch.Tensor:
    """Check caller-supplied block ids (ints, in range, no repeats) and return them as a tensor."""
    if not block_ids:
        raise ValueError(f"{what}: no block ids given")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        raise ValueError(f"{what}: block ids must be integers")
    ids = torch.tensor(block_ids, dtype=torch.int64)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{what}: block id out of range 0..{num_blocks - 1} (got {low}..{high})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{what}: block ids repeat")
    return ids


@dataclass
class Reservation:
    transfer_id: str
    block_ids: torch.Tensor  # int64, in the order the sender was told
    num_layers: int
    deadline: float  # time.monotonic()
    on_done: DoneCallback
    session: str | None = None  # the sender session that began it
    begun_at: float | None = None
    finish_requested: bool = False
    bytes_received: int = 0
    _sorted_ids: torch.Tensor = field(init=False, repr=False)
    _order: torch.Tensor = field(init=False, repr=False)
    _received: torch.Tensor = field(init=False, repr=False)
    _remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self._sorted_ids, self._order = torch.sort(self.block_ids)
        self._received = torch.zeros(self.num_layers, 2, self.block_ids.numel(), dtype=torch.bool)
        self._remaining = self._received.numel()

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    @property
    def missing(self) -> int:
        return self._remaining

    def claim(self, session: str) -> None:
        """Bind the reservation to the sender session that first touched it."""
        if self.session is None:
            self.session, self.begun_at = session, time.monotonic()

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def positions(self, layer: int, kind: int, dst_ids: torch.Tensor) -> torch.Tensor:
        """Positions of dst_ids in this reservation; raises TransferError if the frame does not fit."""
        if not 0 <= layer < self.num_layers:
            raise TransferError(INVALID_FRAME, f"layer {layer} out of range 0..{self.num_layers - 1}",
                                self.transfer_id)
        if kind not in (wire.K, wire.V, wire.KV):
            raise TransferError(INVALID_FRAME, f"kind {kind} is not K (0), V (1) or KV (2)", self.transfer_id)
        idx = torch.searchsorted(self._sorted_ids, dst_ids).clamp_(max=self._sorted_ids.numel() - 1)
        if not bool(torch.equal(self._sorted_ids[idx], dst_ids)):
            raise TransferError(INVALID_FRAME, "frame names blocks outside the reservation", self.transfer_id)
        positions = self._order[idx]
        if torch.unique(positions).numel() != positions.numel():
            raise TransferError(INVALID_FRAME, "frame repeats a block", self.transfer_id)
        if bool(self._received[layer, _kinds(kind)][:, positions].any()):
            raise TransferError(INVALID_FRAME, f"layer {layer}: a block arrived twice", self.transfer_id)
        return positions

    def mark(self, layer: int, kind: int, positions: torch.Tensor, nbytes: int) -> None:
        kinds = _kinds(kind)
        self._received[layer, kinds[0]:kinds[-1] + 1, positions] = True
        self._remaining -= positions.numel() * len(kinds)
        self.bytes_received += nbytes


def _kinds(kind: int) -> list[int]:
    return [wire.K, wire.V] if kind == wire.KV else [kind]


def check_data_frame(layout: KVLayout, header: wire.FrameHeader, transfer_id: bytes,
                     ids_part: memoryview, *payloads: memoryview) -> torch.Tensor:
    """Check a frame's sizes and digest against the layout; return its destination block ids.

    Raises TransferError(INVALID_FRAME) for sizes that do not fit, CORRUPT_FRAME for a bad checksum.
    """
    tid = transfer_id.decode(errors="replace")
    if header.block_count <= 0:
        raise TransferError(INVALID_FRAME, "frame carries no blocks", tid)
    if len(ids_part) != 4 * header.block_count:
        raise TransferError(INVALID_FRAME, f"frame lists {len(ids_part) // 4} block ids but its header "
                            f"says {header.block_count}", tid)
    expected = header.block_count * layout.bytes_per_block_layer_kv
    sizes = [len(payload) for payload in payloads]
    if header.byte_count != expected * len(payloads) or any(size != expected for size in sizes):
        raise TransferError(INVALID_FRAME, f"frame of {header.block_count} blocks must carry {expected} bytes "
                            f"per K/V part for this layout; header says {header.byte_count} in all, parts have "
                            f"{sizes}", tid)
    digest = wire.frame_digest(header.seq, header.layer, header.kind, header.block_count, header.byte_count,
                               transfer_id, ids_part, *payloads)
    if digest != header.digest:
        raise TransferError(CORRUPT_FRAME, f"checksum mismatch on frame {header.seq} (layer {header.layer}, "
                            f"{('K', 'V', 'K+V')[header.kind] if header.kind in (0, 1, 2) else '?'}): the frame was damaged "
                            "in transit", tid)
    return torch.frombuffer(ids_part, dtype=torch.int32).to(torch.int64)
