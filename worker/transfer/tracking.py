"""Receiver-side bookkeeping: what a reserved transfer still expects, and frame checks.

A reservation is created by `expect()` on the decode worker: these destination blocks, every
layer, K and V. Each arriving frame is checked against it (layer, kind, block ids that belong
to the reservation and have not arrived yet) before a single byte is written; the transfer is
complete when every (layer, K/V, block) has arrived and verified.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.worker.kv.layout import KVLayout

from . import wire
from .errors import CORRUPT_FRAME, INVALID_FRAME, TransferError

DoneCallback = Callable[[str, "TransferError | None"], None]


def validate_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> list[int]:
    """Check caller-supplied block ids (ints, in range, no repeats) and return a copy as a list."""
    # Plain Python, C-level builtins where possible: called per transfer and per layer, on lists
    # of a few to a few thousand ids, where a torch tensor's per-call overhead cost more than the work.
    if not block_ids:
        raise ValueError(f"{what}: no block ids given")
    ids = list(block_ids)
    if set(map(type, ids)) != {int} and not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        raise ValueError(f"{what}: block ids must be integers")
    low, high = min(ids), max(ids)
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{what}: block id out of range 0..{num_blocks - 1} (got {low}..{high})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: block ids repeat")
    return ids


@dataclass
class Reservation:
    transfer_id: str
    block_ids: list[int]  # in the order the sender was told
    num_layers: int
    deadline: float  # time.monotonic()
    on_done: DoneCallback
    session: str | None = None  # the sender session that began it
    begun_at: float | None = None
    begin_seen: bool = False  # its BEGIN arrived (a transfer completes only after it: it names the prompt)
    prompt_digest: bytes | None = None  # what BEGIN declared (wire.prompt_digest of the sender's prompt)
    finish_requested: bool = False
    bytes_received: int = 0
    # Plain Python bookkeeping: a frame names tens of blocks, where torch's per-call overhead
    # (searchsorted, unique, masks) cost more than the lookups themselves (measured: ~0.1 ms a frame).
    _position: dict[int, int] = field(init=False, repr=False)  # block id -> position in block_ids
    _received: list[bytearray] = field(init=False, repr=False)  # [layer * 2 + K/V][position] = 1 once written
    _remaining: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.block_ids, torch.Tensor):
            self.block_ids = self.block_ids.tolist()
        ids = self.block_ids
        self._position = {block: position for position, block in enumerate(ids)}
        self._received = [bytearray(len(ids)) for _ in range(2 * self.num_layers)]
        self._remaining = 2 * self.num_layers * len(ids)

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    @property
    def missing(self) -> int:
        """(layer, K/V, block) pieces not yet received."""
        return self._remaining

    @property
    def received(self) -> int:
        """(layer, K/V, block) pieces received and verified."""
        return 2 * self.num_layers * len(self._position) - self._remaining

    def claim(self, session: str) -> None:
        """Bind the reservation to the sender session that first touched it."""
        if self.session is None:
            self.session, self.begun_at = session, time.monotonic()

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def positions(self, layer: int, kind: int, dst_ids: Sequence[int] | torch.Tensor) -> list[int]:
        """Positions of dst_ids in this reservation; raises TransferError if the frame does not fit."""
        if not 0 <= layer < self.num_layers:
            raise TransferError(INVALID_FRAME, f"layer {layer} out of range 0..{self.num_layers - 1}",
                                self.transfer_id)
        if kind not in (wire.K, wire.V, wire.KV):
            raise TransferError(INVALID_FRAME, f"kind {kind} is not K (0), V (1) or KV (2)", self.transfer_id)
        ids = dst_ids.tolist() if isinstance(dst_ids, torch.Tensor) else dst_ids
        try:
            positions = list(map(self._position.__getitem__, ids))
        except KeyError:
            raise TransferError(INVALID_FRAME, "frame names blocks outside the reservation",
                                self.transfer_id) from None
        if len(set(positions)) != len(positions):
            raise TransferError(INVALID_FRAME, "frame repeats a block", self.transfer_id)
        low, high = min(positions), max(positions)
        contiguous = high - low == len(positions) - 1  # distinct, so exactly low..high: slice operations
        for k in _kinds(kind):
            flags = self._received[2 * layer + k]
            seen = flags.find(1, low, high + 1) != -1 if contiguous else any(map(flags.__getitem__, positions))
            if seen:
                raise TransferError(INVALID_FRAME, f"layer {layer}: a block arrived twice", self.transfer_id)
        return positions

    def mark(self, layer: int, kind: int, positions: Sequence[int], nbytes: int) -> None:
        """Record verified pieces (positions from positions(), which checked they are new and distinct)."""
        kinds = _kinds(kind)
        low, high = min(positions), max(positions)
        for k in kinds:
            flags = self._received[2 * layer + k]
            if high - low == len(positions) - 1:  # distinct, so exactly low..high: one slice
                flags[low:high + 1] = b"\x01" * len(positions)
            else:
                for p in positions:
                    flags[p] = 1
        self._remaining -= len(positions) * len(kinds)
        self.bytes_received += nbytes


def _kinds(kind: int) -> list[int]:
    return [wire.K, wire.V] if kind == wire.KV else [kind]


def check_data_frame(layout: KVLayout, header: wire.FrameHeader, transfer_id: bytes,
                     ids_part: memoryview, *payloads: memoryview, tag_bytes: int = 0) -> list[int]:
    """Check a frame's sizes and digest against the layout; return its destination block ids.

    Raises TransferError(INVALID_FRAME) for sizes that do not fit, CORRUPT_FRAME for a bad checksum.
    A sealed frame (sealing.py, `tag_bytes` > 0) has a GCM tag after each payload and no digest: its
    tags are checked when it is opened.
    """
    tid = transfer_id.decode(errors="replace")
    if header.flags & ~wire.ACK_ME:
        raise TransferError(INVALID_FRAME, f"unknown frame flags {header.flags:#x}", tid)
    if header.block_count <= 0:
        raise TransferError(INVALID_FRAME, "frame carries no blocks", tid)
    if len(ids_part) != 4 * header.block_count:
        raise TransferError(INVALID_FRAME, f"frame lists {len(ids_part) // 4} block ids but its header "
                            f"says {header.block_count}", tid)
    expected = header.block_count * layout.bytes_per_block_layer_kv
    sizes = [len(payload) - tag_bytes for payload in payloads]
    if header.byte_count != expected * len(payloads) or any(size != expected for size in sizes):
        raise TransferError(INVALID_FRAME, f"frame of {header.block_count} blocks must carry {expected} bytes "
                            f"per K/V part for this layout; header says {header.byte_count} in all, parts have "
                            f"{sizes}", tid)
    if tag_bytes:
        return list(struct.unpack(f"<{header.block_count}i", ids_part))
    digest = wire.frame_digest(header.seq, header.layer, header.kind, header.block_count, header.byte_count,
                               transfer_id, ids_part, *payloads, flags=header.flags)
    if digest != header.digest:
        raise TransferError(CORRUPT_FRAME, f"checksum mismatch on frame {header.seq} (layer {header.layer}, "
                            f"{('K', 'V', 'K+V')[header.kind] if header.kind in (0, 1, 2) else '?'}): the frame was damaged "
                            "in transit", tid)
    return list(struct.unpack(f"<{header.block_count}i", ids_part))
