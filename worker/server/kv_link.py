"""Glue between the engine and the KV transfer, on both sides of a disaggregated request.

Prefill side (`KVShipper`): the engine's per-layer callback sends each layer's newly completed
blocks while later layers compute (pipelining); blocks the callback never saw (a prefix-cache
hit, or the partial last block) are sent from the finished request's block list before
`finish()` waits for the receiver's confirmation.

Decode side (`KVIntake`): a reservation per request id, tied to the receiver's `expect()`;
its outcome is an asyncio future, so the decode handler can wait for it with a deadline. A transfer
that arrived also leaves the prompt digest its sender declared (`Reservation.prompt_digest`): the
decode handler uses the blocks only for a request whose prompt has that digest (issue 18).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.worker.transfer.errors import INCOMPLETE, TransferError

log = logging.getLogger(__name__)


@dataclass
class _Outgoing:
    transfer: Any  # OutgoingTransfer
    num_blocks: int  # destination blocks this request's prompt fills
    prompt_len: int
    sent: list[list[bool]]  # [layer][dst position]
    error: TransferError | None = None


class KVShipper:
    def __init__(self, sender: Any, num_layers: int, block_size: int) -> None:
        self.sender = sender
        self.num_layers = num_layers
        self.block_size = block_size
        self._active: dict[str, _Outgoing] = {}
        self._lock = threading.Lock()
        # Test hook (faults.py swap-kv-blocks): each position gets the KV of the mirrored position, to the right
        # destination blocks, so the receiver cannot tell; what the router's canary must catch.
        self.mirror_sources = False

    def begin(self, request_id: str, kv_address: str, transfer_id: str, dst_block_ids: list[int],
              prompt_len: int, deadline_s: float, prompt_digest: bytes | None = None) -> None:
        """Open the transfer (raises TransferError when the receiver refuses or is unreachable).
        `prompt_digest`: wire.prompt_digest of the token ids the engine prefills for this request; it
        goes in BEGIN, and without it the decode worker will not use the KV."""
        needed = math.ceil(prompt_len / self.block_size)
        if len(dst_block_ids) < needed:
            raise ValueError(f"decode reserved {len(dst_block_ids)} blocks, the prompt needs {needed}")
        conn = self.sender.connect(kv_address)
        transfer = conn.begin(transfer_id, dst_block_ids[:needed], deadline_s, prompt_digest=prompt_digest)
        with self._lock:
            self._active[request_id] = _Outgoing(transfer, needed, prompt_len,
                                                 [[False] * needed for _ in range(self.num_layers)])

    def on_layer(self, layer: int, writes: list[Any]) -> None:
        """Engine layer callback (engine thread): ship the blocks this step completed."""
        with self._lock:
            targets = [(w, self._active.get(w.request_id)) for w in writes]
        for w, out in targets:
            if out is None or out.error is not None:
                continue
            first = w.start_pos // self.block_size
            last = w.end_pos // self.block_size if w.end_pos < out.prompt_len else out.num_blocks
            src = {first + i: b for i, b in enumerate(w.block_ids)}
            self._send_runs(out, layer, [p for p in range(first, min(last, out.num_blocks))
                                         if not out.sent[layer][p] and p in src], src)

    def _send_runs(self, out: _Outgoing, layer: int, positions: list[int], src: dict[int, int]) -> None:
        """Send positions (ascending) as contiguous destination runs."""
        i = 0
        while i < len(positions) and out.error is None:
            j = i
            while j + 1 < len(positions) and positions[j + 1] == positions[j] + 1:
                j += 1
            run = positions[i:j + 1]
            try:
                sources = [src[p] for p in run]
                if self.mirror_sources:  # the test hook; the real path above builds nothing more
                    mirrored = [out.num_blocks - 1 - p for p in run]
                    sources = [src[q] for q in mirrored] if all(q in src for q in mirrored) else sources
                out.transfer.send_layer(layer, sources, run[0])
                for p in run:
                    out.sent[layer][p] = True
            except TransferError as exc:
                out.error = exc
            i = j + 1

    def finish(self, request_id: str, block_ids: list[int]) -> float:
        """Send what the callback did not, then wait for the receiver's ack (blocking). Returns seconds."""
        with self._lock:
            out = self._active.pop(request_id, None)
        if out is None:
            raise TransferError("aborted", "no transfer was begun for this request")
        start = time.monotonic()
        src = dict(enumerate(block_ids))
        for layer in range(self.num_layers):
            missing = [p for p in range(out.num_blocks) if not out.sent[layer][p]]
            if any(p not in src for p in missing):
                out.error = out.error or TransferError(
                    INCOMPLETE, f"{len(block_ids)} source blocks given, the prompt fills {out.num_blocks}")
            if missing and out.error is None:
                self._send_runs(out, layer, missing, src)
        if out.error is not None:
            out.transfer.abort(str(out.error))
            raise out.error
        out.transfer.finish()
        return time.monotonic() - start

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            out = self._active.pop(request_id, None)
        if out is not None:
            out.transfer.abort(reason)


@dataclass
class Reservation:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    outcome: asyncio.Future[TransferError | None]
    expiry: asyncio.TimerHandle | None = None
    claimed: bool = False
    created: float = field(default_factory=time.monotonic)
    peer: str = ""  # who asked for it; its blocks count against that peer's quota until claimed
    quota_blocks: int = 0
    # Set with a successful outcome: the prompt digest the sender declared in BEGIN (None: it declared none).
    prompt_digest: bytes | None = None


class PeerQuota:
    """What one peer (a caller's address) may hold in unclaimed reservations: at most `max_blocks`
    KV blocks and `max_reservations` reservations. A reservation holds its blocks until it is claimed
    or expires; without a cap, one caller could set the whole pool aside and stall every request
    (issue 18: 64 reservations took all 8,192 blocks). The router reserves only for requests being
    prefilled, and when refused it goes on without a reservation (decode prefills locally)."""

    def __init__(self, max_blocks: int, max_reservations: int) -> None:
        self.max_blocks = max_blocks
        self.max_reservations = max_reservations
        self._held: dict[str, tuple[int, int]] = {}  # peer -> (reservations, blocks)

    def take(self, peer: str, blocks: int) -> str | None:
        """Count a reservation of `blocks` against `peer`; None, or why it is refused."""
        count, held = self._held.get(peer, (0, 0))
        if count + 1 > self.max_reservations:
            return f"this caller already holds {count} unclaimed KV reservations here (at most {self.max_reservations})"
        if held + blocks > self.max_blocks:
            return (f"this caller's unclaimed KV reservations would hold {held + blocks} blocks here "
                    f"(at most {self.max_blocks})")
        self._held[peer] = (count + 1, held + blocks)
        return None

    def give_back(self, peer: str, blocks: int) -> None:
        count, held = self._held.get(peer, (1, blocks))
        if count <= 1:
            self._held.pop(peer, None)
        else:
            self._held[peer] = (count - 1, held - blocks)


EARLY_CANCEL_MEMORY_S = 120.0  # how long a cancel that found no reservation is remembered
EARLY_CANCEL_LIMIT = 100_000  # and how many at most (oldest forgotten first): ~10 MB, bounded under any flood


class KVIntake:
    """Decode-side reservations. All methods run on the event loop thread."""

    def __init__(self, receiver: Any, release: Callable[[str], Any], quota: PeerQuota | None = None) -> None:
        self.receiver = receiver
        self._release = release  # async-schedules engine.cancel_reservation(request_id)
        # The caller of open() took the reservation's share of it; claim() gives that back.
        self.quota = quota or PeerQuota(max_blocks=2**62, max_reservations=2**62)
        self.reservations: dict[str, Reservation] = {}
        # Cancels that came before their reservation, oldest first, with when they are forgotten. The
        # router sends a cancel on another connection than the reserve it cancels, so it can overtake
        # that reserve; the reservation it finally makes must not outlive the cancel.
        self._early_cancels: dict[str, float] = {}

    def open(self, request_id: str, block_ids: list[int], deadline_s: float, peer: str = "",
             quota_blocks: int = 0) -> Reservation:
        loop = asyncio.get_running_loop()
        transfer_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        fut: asyncio.Future[TransferError | None] = loop.create_future()
        res = Reservation(request_id, transfer_id, block_ids, fut, peer=peer, quota_blocks=quota_blocks)

        def settle(err: TransferError | None, digest: bytes | None) -> None:
            if not fut.done():
                res.prompt_digest = digest
                fut.set_result(err)

        def done(tid: str, err: TransferError | None) -> None:  # receiver I/O thread
            # Read inside on_done, where the receiver is sure to still know it.
            digest = self.receiver.prompt_digest(tid) if err is None else None
            loop.call_soon_threadsafe(settle, err, digest)

        self.receiver.expect(transfer_id, block_ids, deadline_s, done)
        # Nobody claimed it (router gone?): give the blocks back a little after the transfer deadline.
        res.expiry = loop.call_later(deadline_s + 5.0, self._expire, request_id)
        self.reservations[request_id] = res
        return res

    def claim(self, request_id: str) -> Reservation | None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            if res.expiry is not None:
                res.expiry.cancel()
            self.quota.give_back(res.peer, res.quota_blocks)
        return res

    def drop(self, res: Reservation) -> None:
        """Abandon a reservation: nothing more lands in its blocks, and the engine frees them."""
        self.receiver.cancel(res.transfer_id)
        self._release(res.request_id)

    def cancel(self, request_id: str) -> bool:
        """Give a reservation's blocks back. One that is not made yet is refused when it comes."""
        res = self.claim(request_id)
        if res is None:
            self._early_cancels.pop(request_id, None)  # re-inserted: the dict stays ordered by expiry
            self._forget_old_cancels(room=1)
            self._early_cancels[request_id] = time.monotonic() + EARLY_CANCEL_MEMORY_S
            return False
        self.drop(res)
        return True

    def cancelled_early(self, request_id: str) -> bool:
        """Whether a cancel for this request came before any reservation for it."""
        self._forget_old_cancels()
        return request_id in self._early_cancels

    def _forget_old_cancels(self, room: int = 0) -> None:
        """Forget cancels past their time, and the oldest beyond EARLY_CANCEL_LIMIT - room."""
        now = time.monotonic()
        while self._early_cancels:
            oldest, forget_at = next(iter(self._early_cancels.items()))
            if forget_at > now and len(self._early_cancels) <= EARLY_CANCEL_LIMIT - room:
                break
            del self._early_cancels[oldest]

    def _expire(self, request_id: str) -> None:
        res = self.claim(request_id)
        if res is not None:
            log.warning("reservation %s was never claimed; freeing its %d blocks", request_id, len(res.block_ids))
            self.drop(res)
