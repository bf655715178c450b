"""The rdma transport (RC queue pairs, RDMA WRITE). UNTESTED on RDMA hardware in this repository.

Same control plane as tcp (zmq: handshake, BEGIN/FINISH/ABORT, deadlines, peer-death
detection); the blocks themselves move by RDMA WRITE:

- the decode side registers its whole KV-cache tensor as one memory region without remote access
  (a CUDA tensor is registered directly, which needs GPUDirect RDMA: nvidia_peermem loaded) and
  sends only its QP number, LID, GID (and its index) and active MTU in the handshake reply; both
  sides use the smaller MTU. No key to the pool ever leaves the receiver;
- the prefill side registers its own cache (the WRITE source) and connects an RC QP per
  connection. When the receiver claims a transfer for it (BEGIN), it grants that sender's QP
  remote-write keys to exactly the reservation's blocks: one range per (layer, K/V) per run of
  consecutive destination blocks (type-2 memory windows bound on the receiver's QP for that
  sender, so a key is useless from any other QP; a registration per range where the device has
  no type-2 windows), sent in the ACKs that answer BEGIN (GRANT parts, then BEGUN);
- for each send_layer() the sender posts one WRITE per run of blocks contiguous on both sides,
  straight into the reserved destination blocks, with the key of the range it lands in (after
  synchronising the cache's CUDA device, so the NIC never reads blocks the GPU is still writing);
- finish() waits for every WRITE's completion, then sends FINISH over zmq with a digest of every
  piece. The receiver revokes the keys, then recomputes the digests over the reserved blocks and
  only then reports done (a WRITE after FINISH cannot change verified bytes).

Revoking keeps the API's promise "after on_done(error) or cancel(), nothing more is written into
those blocks": whenever a reservation ends (FINISH, ABORT, timeout, cancel(), peer lost) its keys
are invalidated before on_done runs or cancel() returns. A WRITE still on the wire then fails at
its sender with IBV_WC_REM_ACCESS_ERR, and, RC being RC, both QPs of that connection go to ERR:
the sender's other transfers on it fail, the next connect() makes a new connection. To spare the
connection, a sender holds a failed transfer's ABORT until its WRITEs completed (at most
drain_timeout_s, default 3 s; then it moves its own QP to ERR and sends the ABORT). A key that
cannot be invalidated (a failing dealloc) gets its sender's QP fenced and destroyed instead.

This module is the transport logic only: it talks to a NIC through the small Verbs interface of
rdma_verbs.py, whose PyverbsVerbs is the only code that touches pyverbs, and which
rdma_loopback.LoopbackVerbs (an in-process emulated NIC, for tests only) also implements.
Settings: TANDEM_RDMA_DEVICE, TANDEM_RDMA_GID_INDEX (rdma_probe.py).
"""

from __future__ import annotations

import bisect
import logging
import struct
import threading
import time
from typing import Any

import torch

from tandem.worker.kv.keys import KVKeys
from tandem.worker.kv.layout import KVLayout

from . import wire
from .blocks import check_cache, read_blocks
from .errors import (
    CLOSED,
    CORRUPT_FRAME,
    INCOMPLETE,
    INVALID_FRAME,
    PEER_LOST,
    TIMEOUT,
    UNAVAILABLE,
    VERSION_MISMATCH,
    TransferError,
)
from .limits import HEADER_ROOM, ReceiverLimits
from .rdma_verbs import MAX_WINDOW_BYTES, QP_DEPTH, PyverbsVerbs, VerbsFactory
from .sealing import SealSecrets
from .tcp_receiver import TcpReceiver
from .tcp_sender import SILENCE_TIMEOUT_S, OutgoingTransfer, TcpConnection, TcpSender
from .telemetry import TransferTelemetry
from .tracking import Reservation
from .zmqutil import check_deadline

log = logging.getLogger(__name__)

_POLL_BATCH = 64
DRAIN_TIMEOUT_S = 3.0
REASON_GRACE_S = 0.2  # how long a refused WRITE waits for the receiver's own reason before it breaks the QP
_SEQ = struct.Struct("<Q")
BEGUN_SEQ = 2**64 - 1  # an ACK with this sequence number: "this transfer is yours, you may WRITE" (+ keys)
GRANT_SEQ = 2**64 - 2  # an ACK with this one: more of the transfer's keys (BEGUN follows)
_BEGUN, _GRANT = _SEQ.pack(BEGUN_SEQ), _SEQ.pack(GRANT_SEQ)
_KEYS_PER_RESERVATION = "per-reservation"  # in both rdma endpoints: peers from before scoped keys refuse clearly
_GRANT_BYTES = 256 << 10  # keys per ACK part, well under the sender's MAX_REPLY_BYTES


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src block, first dst block, count) for each run contiguous on both sides."""
    runs, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs


def _offset(layout: KVLayout, num_blocks: int, layer: int, kind: int, block: int) -> int:
    return int(((layer * 2 + kind) * num_blocks + block) * layout.bytes_per_block_layer_kv)


# --- decode side ----------------------------------------------------------------------------

def block_runs(block_ids: list[int], max_blocks: int) -> list[tuple[int, int]]:
    """(first block, count) for each run of consecutive ids, in sorted order, at most max_blocks long."""
    runs: list[tuple[int, int]] = []
    for block in sorted(block_ids):
        if runs and runs[-1][0] + runs[-1][1] == block and runs[-1][1] < max_blocks:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def grant_messages(transfer_id: str, base: int, runs: list[tuple[int, int]], rkeys: list[int],
                   num_layers: int) -> list[list[bytes]]:
    """The ACKs that hand a sender its keys: GRANT parts, then BEGUN (which may carry keys too).

    Each part: the receiver's cache address (u64), then per run its first block and count (u32 each)
    and its 2 * num_layers keys (u32, in layer-major K/V order, as the cache)."""
    per_run = 2 * num_layers
    record = 8 + 4 * per_run
    runs_per_part = max(1, _GRANT_BYTES // record)
    head, tid = _SEQ.pack(base), transfer_id.encode()
    parts = []
    for first in range(0, max(len(runs), 1), runs_per_part):
        body = [head]
        for n in range(first, min(first + runs_per_part, len(runs))):
            body.append(struct.pack(f"<II{per_run}I", *runs[n], *rkeys[n * per_run:(n + 1) * per_run]))
        parts.append([wire.ACK, tid, _GRANT, b"".join(body)])
    parts[-1][2] = _BEGUN
    return parts


class RdmaReceiver(TcpReceiver):
    """Decode side: registers kv_cache, grants each claimed reservation's sender keys to exactly its
    blocks, verifies at FINISH, revokes the keys before the blocks are given back."""

    transport = "rdma"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                 layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                 keep_freed_buffers: bool = True, keys: KVKeys | None = None,
                 verbs_factory: VerbsFactory | None = None, limits: ReceiverLimits | None = None,
                 seal: SealSecrets | None = None) -> None:
        check_cache(layout, kv_cache)  # before anything is registered
        self._verbs = (verbs_factory or PyverbsVerbs)(kv_cache, True)
        self._rdma_lock = threading.Lock()  # _qps, _grants, every verb: the I/O thread and cancel()
        self._qps: dict[str, Any] = {}  # session -> its QP
        self._grants: dict[str, tuple[str, list[int]]] = {}  # transfer -> (its session, the keys it holds)
        self._unit = layout.bytes_per_block_layer_kv
        try:
            super().__init__(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                             keep_freed_buffers=keep_freed_buffers, keys=keys, limits=limits, seal=seal)
        except BaseException:
            self._verbs.close()
            raise

    def _max_part_bytes(self) -> int:
        """No data frames come over zmq here, but FINISH lists every piece with its digest: at worst one
        piece per (layer, K/V, block) of the pool, each `[layer,kind,[block],[digest high,digest low]],`."""
        piece = 64 + len(str(self.num_blocks))
        return max(super()._max_part_bytes(), 2 * self.layout.num_layers * self.num_blocks * piece + HEADER_ROOM)

    def _welcome_extra(self, session_id: str, peer: dict[str, object]) -> dict[str, object]:
        """Only the QP's endpoint: memory keys come per reservation, when the sender begins it."""
        remote = peer.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, "the sender sent no RDMA endpoint in its handshake")
        if remote.get("keys") != _KEYS_PER_RESERVATION:
            raise TransferError(VERSION_MISMATCH, "the rdma sender expects a key to the whole KV pool (an older "
                                "Tandem); this receiver grants keys per reservation: run one version on every worker")
        with self._rdma_lock:
            qp = None
            try:
                qp = self._verbs.new_qp(False)
                self._verbs.connect(qp, remote)
                endpoint = self._verbs.endpoint(qp)
            except Exception as exc:
                if qp is not None:
                    self._verbs.close_qp(qp)
                if isinstance(exc, TransferError):
                    raise
                raise TransferError(UNAVAILABLE, f"cannot set up an RDMA queue pair for this sender: "
                                    f"{type(exc).__name__}: {exc}") from exc
            self._qps[session_id] = qp
        return {"rdma": {**endpoint, "keys": _KEYS_PER_RESERVATION}}

    def _session_closed(self, session_id: str) -> None:
        with self._rdma_lock:
            for transfer_id in [t for t, (session, _keys) in self._grants.items() if session == session_id]:
                self._revoke_locked(transfer_id)
            qp = self._qps.pop(session_id, None)
            if qp is not None:
                self._verbs.close_qp(qp)

    def close(self) -> None:
        super().close()
        with self._rdma_lock:
            self._qps.clear()
            self._grants.clear()
            self._verbs.close()  # destroys every window, QP, then the region

    def _on_transfer_control(self, identity: bytes, kind: bytes, msg: dict[str, object]) -> None:
        super()._on_transfer_control(identity, kind, msg)
        if kind == wire.BEGIN:
            self._grant(identity, str(msg.get("transfer_id")))

    def _grant(self, identity: bytes, transfer_id: str) -> None:
        """The reservation is this sender's now: grant its QP keys to exactly these blocks, and say so."""
        session_id = self._identity_session.get(identity)
        layers = self.layout.num_layers
        with self._rdma_lock:  # cancel() revokes under it too: a key is never granted to a reservation gone
            with self._lock:
                reservation = self._reservations.get(transfer_id)
            if reservation is None or reservation.session != session_id or not reservation.begin_seen:
                return  # BEGIN was refused (and answered), or the reservation already ended
            qp = self._qps.get(session_id or "")
            runs = block_runs(reservation.block_ids, max(1, MAX_WINDOW_BYTES // self._unit))
            ranges = [(self._verbs.base + _offset(self.layout, self.num_blocks, layer, kind, first), count * self._unit)
                      for first, count in runs for layer in range(layers) for kind in (wire.K, wire.V)]
            error: TransferError | None = None
            if qp is None:
                error = TransferError(PEER_LOST, "this sender's queue pair is gone: reconnect", transfer_id)
            else:
                try:
                    rkeys = self._verbs.grant(qp, ranges)
                    self._grants[transfer_id] = (session_id or "", rkeys)
                except TransferError as exc:
                    error = TransferError(exc.reason, f"cannot grant memory keys for the reservation: {exc.message}",
                                          transfer_id)
        if error is not None:
            self._fail(reservation, error, self._control_identity(identity))
            return
        for message in grant_messages(transfer_id, self._verbs.base, runs, rkeys, layers):
            self._send(self._control_identity(identity), message)

    def _revoke(self, transfer_id: str) -> None:
        with self._rdma_lock:
            self._revoke_locked(transfer_id)

    def _revoke_locked(self, transfer_id: str) -> None:
        """Invalidate a reservation's keys; if that fails, its sender's QP is fenced and destroyed instead."""
        granted = self._grants.pop(transfer_id, None)
        if granted is None:
            return
        session_id, rkeys = granted
        try:
            self._verbs.revoke(rkeys)
        except TransferError as exc:
            log.error("KV receiver %s: %s; destroying the sender's queue pair instead", self.address, exc.message)
            qp = self._qps.pop(session_id, None)
            if qp is not None:
                try:
                    self._verbs.fence(qp)
                finally:
                    self._verbs.close_qp(qp)

    def _reservation_ended(self, reservation: Reservation, error: TransferError) -> None:
        """Failed or cancelled (before on_done runs / cancel() returns): its keys die first, so no WRITE
        still on the wire lands in blocks that are about to be freed; it fails at its sender instead."""
        self._revoke(reservation.transfer_id)

    def _complete(self, reservation: Reservation) -> None:
        self._revoke(reservation.transfer_id)  # already done at FINISH; here for any other way of completing
        super()._complete(reservation)

    def _on_finish(self, reservation: Reservation, msg: dict[str, object]) -> None:
        # The sender promises its WRITEs are done: its keys go first, so the bytes verified below
        # are the bytes the decode side will use (a WRITE after FINISH cannot change them).
        self._revoke(reservation.transfer_id)
        if not reservation.begin_seen:  # a sender WRITEs only after BEGIN was answered; BEGIN names the prompt
            self._fail(reservation, TransferError(INVALID_FRAME, "FINISH before BEGIN", reservation.transfer_id),
                       None)
            return
        pieces = msg.get("pieces")
        if not isinstance(pieces, list):
            self._fail(reservation, TransferError(INCOMPLETE, "FINISH without piece digests",
                                                  reservation.transfer_id), None)
            return
        raw_id = reservation.transfer_id.encode()
        try:
            for seq, (layer, kind, dst, digest) in enumerate(pieces):
                ids = torch.tensor(dst, dtype=torch.int64)
                positions = reservation.positions(int(layer), int(kind), ids)
                payload = read_blocks(self.kv_cache, int(layer), int(kind), ids)
                ids_bytes = struct.pack(f"<{len(dst)}i", *dst)
                mine = wire.frame_digest(seq, int(layer), int(kind), len(dst), len(payload), raw_id, ids_bytes, payload)
                if list(mine) != list(digest):
                    raise TransferError(CORRUPT_FRAME, f"piece {seq} (layer {layer}) does not match its digest",
                                        reservation.transfer_id)
                reservation.mark(int(layer), int(kind), positions, len(payload))
        except (TransferError, ValueError, TypeError) as exc:
            error = exc if isinstance(exc, TransferError) else TransferError(
                INCOMPLETE, f"malformed FINISH: {exc}", reservation.transfer_id)
            self._fail(reservation, error, None)
            return
        reservation.finish_requested = True
        if reservation.complete:
            self._complete(reservation)
        else:
            self._fail(reservation, TransferError(INCOMPLETE, f"{reservation.missing} pieces never written",
                                                  reservation.transfer_id), None)


# --- prefill side ---------------------------------------------------------------------------

class GrantedKeys:
    """The keys a receiver granted for one transfer: per run of destination blocks, one per (layer, K/V)."""

    def __init__(self, num_layers: int) -> None:
        self.per_run = 2 * num_layers
        self.base = 0
        self._firsts: list[int] = []  # sorted first blocks of the runs
        self._runs: dict[int, tuple[int, tuple[int, ...]]] = {}  # first block -> (count, keys)

    def add(self, part: bytes) -> None:
        """One ACK part of grant_messages()."""
        record = struct.Struct(f"<II{self.per_run}I")
        if len(part) < _SEQ.size or (len(part) - _SEQ.size) % record.size:
            raise ValueError(f"{len(part)} bytes is not an address and whole runs of {self.per_run} keys")
        self.base = _SEQ.unpack_from(part)[0]
        for first, count, *keys in record.iter_unpack(part[_SEQ.size:]):
            bisect.insort(self._firsts, first)
            self._runs[first] = (count, tuple(keys))

    def rkey(self, layer: int, kind: int, first: int, count: int, transfer_id: str) -> int:
        """The key of the granted range [first, first + count) lies in (blocks, one layer's K or V)."""
        pieces = self.split(layer, kind, first, count, transfer_id)
        if len(pieces) != 1:
            raise TransferError(INVALID_FRAME, f"blocks {first}..{first + count - 1} span {len(pieces)} granted "
                                "ranges", transfer_id)
        return pieces[0][2]

    def split(self, layer: int, kind: int, first: int, count: int, transfer_id: str) -> list[tuple[int, int, int]]:
        """(first block, count, key) per granted range that [first, first + count) falls in: one, unless
        the receiver split a long run (a window covers at most MAX_WINDOW_BYTES)."""
        pieces, end = [], first + count
        while first < end:
            at = bisect.bisect_right(self._firsts, first) - 1
            run_first = self._firsts[at] if at >= 0 else -1
            run_count, keys = self._runs.get(run_first, (0, ()))
            if first >= run_first + run_count:
                raise TransferError(INVALID_FRAME, f"the receiver granted no key covering blocks {first}.."
                                    f"{end - 1}", transfer_id)
            take = min(end, run_first + run_count) - first
            pieces.append((first, take, keys[layer * 2 + kind]))
            first += take
        return pieces


class RdmaConnection(TcpConnection):
    """One RC QP to a receiver; the zmq socket carries only control messages.

    Locks: `cv` (TcpConnection's) guards the bookkeeping below; `_qp_lock` serialises every verb
    on the QP (post, poll, fence, close). Never take `_qp_lock` while holding `cv`.
    """

    transport = "rdma"

    def __init__(self, sender: RdmaSender, address: str) -> None:
        self._verbs = sender.verbs
        self._drain_s = sender.drain_timeout_s
        self._qp_lock = threading.Lock()
        self._qp_closed = False
        self._next_wr = 0
        self._outstanding: dict[int, OutgoingTransfer] = {}  # wr_id -> transfer
        self._writes: dict[str, int] = {}  # transfer_id -> WRITEs not yet completed
        self._held: dict[str, tuple[dict[str, Any], float]] = {}  # ABORTs waiting for WRITEs (body, until)
        self._pieces: dict[str, list[list[Any]]] = {}
        self._begun: set[str] = set()  # transfers the receiver claimed for us
        self._keys: dict[str, GrantedKeys] = {}  # transfer -> the keys the receiver granted for its blocks
        self._peer_gone = False
        self._qp = self._verbs.new_qp(True)
        try:
            super().__init__(sender, address)
        except BaseException:
            self._close_qp()
            raise

    def _hello_extra(self) -> dict[str, Any]:
        return {"rdma": {**self._verbs.endpoint(self._qp), "keys": _KEYS_PER_RESERVATION}}

    def _on_welcome(self, reply: dict[str, Any]) -> None:
        remote = reply.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, f"the receiver at {self.address} is not an rdma receiver")
        if remote.get("keys") != _KEYS_PER_RESERVATION:
            raise TransferError(VERSION_MISMATCH, f"the rdma receiver at {self.address} hands out a key to its whole "
                                "KV pool (an older Tandem); run one version on every worker")
        try:
            with self._qp_lock:
                self._verbs.connect(self._qp, remote)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(UNAVAILABLE, f"the receiver at {self.address} sent a malformed RDMA endpoint: "
                                f"{exc!r}") from exc
        self._local_base = self._verbs.base

    # --- data path (the caller's thread) --------------------------------------------------------

    def transmit(self, transfer: OutgoingTransfer, layer: int, src: list[int], dst: list[int]) -> None:
        tid = transfer.transfer_id
        # A receiver that gave up on this transfer has revoked its keys: hear that before posting, so the
        # transfer fails with the receiver's reason instead of a refused WRITE that breaks the connection.
        self.poll_replies()
        with self.cv:
            if transfer._state.error is not None:
                raise transfer._state.error
            begun = tid in self._begun
        if not begun:
            self.wait(transfer, lambda _state: tid in self._begun, "before the receiver accepted the transfer")
        if self.kv_cache.is_cuda:  # the NIC must not read blocks the GPU is still writing
            torch.cuda.synchronize(self.kv_cache.device)
        self._reap()  # notice a failed WRITE early
        for kind in (wire.K, wire.V):
            self._write(transfer, layer, kind, src, dst)
        with self.cv:
            transfer._state.next_seq += 1  # frames, as tcp counts them (K and V together)

    def _write(self, transfer: OutgoingTransfer, layer: int, kind: int, src: list[int], dst: list[int]) -> None:
        unit = self.layout.bytes_per_block_layer_kv
        with self.cv:
            keys = self._keys.get(transfer.transfer_id)
        if keys is None:
            raise transfer._state.error or TransferError(INVALID_FRAME, "the receiver granted no memory keys",
                                                         transfer.transfer_id)
        for s_run, d_run, run_count in paired_runs(src, dst):
            for d_first, count, rkey in keys.split(layer, kind, d_run, run_count, transfer.transfer_id):
                s_first = s_run + d_first - d_run
                wr_id = self._post_slot(transfer)
                self._post(transfer, wr_id,
                           self._local_base + _offset(self.layout, self.local_blocks, layer, kind, s_first),
                           count * unit, keys.base + _offset(self.layout, self.remote_blocks, layer, kind, d_first),
                           rkey)
        payload = read_blocks(self.kv_cache, layer, kind, src)
        with self.cv:
            seq = len(self._pieces.get(transfer.transfer_id, ()))
        ids = struct.pack(f"<{len(dst)}i", *dst)
        digest = wire.frame_digest(seq, layer, kind, len(dst), len(payload), transfer.raw_id, ids, payload)
        with self.cv:
            if transfer._state.error is None:  # a failed transfer's pieces are dropped, not kept
                self._pieces.setdefault(transfer.transfer_id, []).append([layer, kind, dst, list(digest)])
                transfer._state.bytes_sent += len(payload)

    def _post_slot(self, transfer: OutgoingTransfer) -> int:
        """A work request id, once fewer than QP_DEPTH WRITEs are outstanding on this QP."""
        while True:
            with self.cv:
                if transfer._state.error is not None:
                    raise transfer._state.error
                if len(self._outstanding) < QP_DEPTH:
                    self._next_wr += 1
                    self._outstanding[self._next_wr] = transfer
                    self._writes[transfer.transfer_id] = self._writes.get(transfer.transfer_id, 0) + 1
                    return self._next_wr
            self._wait_a_little(transfer, "waiting for RDMA completions")

    def _post(self, transfer: OutgoingTransfer, wr_id: int, local: int, length: int, remote: int, rkey: int) -> None:
        failure: TransferError | None = None
        with self._qp_lock:
            refused = transfer._state.error or self._broken or (
                TransferError(CLOSED, "the connection is closed", transfer.transfer_id) if self._qp_closed else None)
            if refused is None:
                try:
                    self._verbs.post_write(self._qp, wr_id, local, length, remote, rkey)
                    return
                except TransferError as exc:
                    failure = exc
        with self.cv:
            self._write_done_locked(wr_id)  # never posted: free its slot
        if failure is not None:
            self._break(TransferError(failure.reason, f"could not post an RDMA WRITE to {self.address}: "
                                      f"{failure.message}"))
        raise transfer._state.error or refused or TransferError(PEER_LOST, "the connection broke", transfer.transfer_id)

    def _wait_a_little(self, transfer: OutgoingTransfer, what: str) -> None:
        """Enforce the deadline, reap completions, and sleep briefly when there were none."""
        if time.monotonic() >= transfer.deadline:
            self.fail(transfer, TransferError(TIMEOUT, f"deadline passed {what}", transfer.transfer_id),
                      tell_receiver=True)
            return
        if self._reap() == 0:
            self.poll_replies()  # the receiver may have failed it meanwhile
            time.sleep(0.0002)

    def prepare_finish(self, transfer: OutgoingTransfer) -> dict[str, Any]:
        """Wait until every WRITE of the transfer completed: FINISH promises nothing more is coming."""
        while True:
            with self.cv:
                if transfer._state.error is not None:
                    raise transfer._state.error
                if not self._writes.get(transfer.transfer_id):
                    return {"pieces": self._pieces.pop(transfer.transfer_id, [])}
            self._wait_a_little(transfer, "waiting for RDMA completions")

    # --- completions, fencing ------------------------------------------------------------------

    def _reap(self) -> int:
        """Poll the completion queue once; an error completion breaks the connection."""
        failure: TransferError | None = None
        with self._qp_lock:
            if self._qp_closed:
                return 0
            try:
                completions = self._verbs.poll(self._qp, _POLL_BATCH)
            except TransferError as exc:
                completions, failure = [], exc
        if any(c.reason is not None for c in completions):
            self._await_receivers_reason([c.wr_id for c in completions if c.reason is not None])
        with self.cv:
            bad = next((c for c in completions if c.reason is not None), None)
            if bad is not None:  # before any held ABORT is released: the QP is in ERR now
                hint = (" (the receiver refused the memory key: outside the blocks it was granted for, revoked, "
                        "or used from another queue pair)" if "IBV_WC_REM_ACCESS_ERR" in bad.status else "")
                failure = TransferError(bad.reason or PEER_LOST,
                                        f"an RDMA WRITE to {self.address} failed: {bad.status}{hint}")
                self._break_locked(failure)
            for completion in completions:
                self._write_done_locked(completion.wr_id)
            if completions:
                self.cv.notify_all()
        if failure is not None:
            self._break(failure)
        return len(completions)

    def _await_receivers_reason(self, wr_ids: list[int]) -> None:
        """A refused WRITE usually means the receiver ended its reservation (deadline, cancel) and revoked
        its keys; its FAILED, sent just before, names the cause better than the access error. Wait for it
        briefly (REASON_GRACE_S), for WRITEs of transfers that are still pending here only."""
        until = time.monotonic() + REASON_GRACE_S
        while True:
            self.poll_replies()
            with self.cv:
                owners = [self._outstanding.get(wr_id) for wr_id in wr_ids]
                waiting = any(o is not None and o._state.error is None and not o._state.done for o in owners)
            if not waiting or time.monotonic() >= until:
                return
            time.sleep(0.002)

    def _write_done_locked(self, wr_id: int) -> None:
        owner = self._outstanding.pop(wr_id, None)
        if owner is None:
            return
        tid = owner.transfer_id
        left = self._writes.get(tid, 1) - 1
        if left:
            self._writes[tid] = left
            return
        self._writes.pop(tid, None)
        held = self._held.pop(tid, None)
        if held is not None:
            self._queue_abort_locked(held[0])

    def _queue_abort_locked(self, body: dict[str, Any]) -> None:
        if not self._peer_gone:
            self._outbox.append(self.control(wire.ABORT, body))
            self._wakeup.set()

    def _fail_locked(self, transfer: OutgoingTransfer, error: TransferError, tell_receiver: bool) -> None:
        state = transfer._state
        if state.error is not None or state.done:
            return
        super()._fail_locked(transfer, error, False)  # the ABORT is ours to send (or hold) below
        self._pieces.pop(transfer.transfer_id, None)
        if not tell_receiver:
            return
        body: dict[str, Any] = {"transfer_id": transfer.transfer_id, "message": f"{error.reason}: {error.message}"}
        if self._broken is not None:  # our QP is in ERR: nothing of ours can land any more
            self._queue_abort_locked(body)
        elif self._writes.get(transfer.transfer_id):  # else the receiver's revoke would fail them, and break us
            self._held[transfer.transfer_id] = (body, time.monotonic() + self._drain_s)
            self._wakeup.set()  # the I/O thread reaps until they complete
        else:
            self._queue_abort_locked(body)

    def _release_locked(self, transfer: OutgoingTransfer) -> None:
        super()._release_locked(transfer)
        self._begun.discard(transfer.transfer_id)
        self._keys.pop(transfer.transfer_id, None)

    def _break_locked(self, error: TransferError) -> None:
        """The QP is unusable (error completion, WRITEs that never completed, a fencing receiver):
        fail every transfer on it; TcpSender.connect() makes a new connection (alive is False)."""
        if self._broken is None:
            log.error("KV sender: rdma connection to %s broken: %s", self.address, error.message)
            self._broken = error
        for body, _until in self._held.values():
            self._queue_abort_locked(body)
        self._held.clear()
        for transfer in list(self._transfers.values()):
            self._fail_locked(transfer, TransferError(error.reason, error.message, transfer.transfer_id), True)

    def _break(self, error: TransferError) -> None:
        with self.cv:
            self._break_locked(error)
        self._fence()

    def _fence(self) -> None:
        with self._qp_lock:
            if self._qp_closed:
                return
            try:
                self._verbs.fence(self._qp)
            except TransferError as exc:
                log.error("KV sender: could not move the queue pair to %s to ERR: %s", self.address, exc.message)

    def _close_qp(self) -> None:
        with self._qp_lock:
            if not self._qp_closed:
                self._qp_closed = True
                self._verbs.close_qp(self._qp)

    # --- control replies and the I/O thread -----------------------------------------------------

    def _on_reply(self, parts: list[bytes]) -> None:
        if parts[0] == wire.ACK and len(parts) == 4 and parts[2] in (_GRANT, _BEGUN):
            transfer_id = parts[1].decode(errors="replace")
            with self.cv:
                transfer = self._transfers.get(transfer_id)
                if transfer is None:
                    return  # already over here: its keys die with its reservation
                try:
                    self._keys.setdefault(transfer_id, GrantedKeys(self.layout.num_layers)).add(parts[3])
                except ValueError as exc:
                    self._fail_locked(transfer, TransferError(INVALID_FRAME, f"the receiver at {self.address} "
                                      f"sent malformed memory keys: {exc}", transfer_id), True)
                else:
                    if parts[2] == _BEGUN:
                        self._begun.add(transfer_id)
                self.cv.notify_all()
            return
        super()._on_reply(parts)

    @property
    def alive(self) -> bool:
        self.poll_replies()
        self._reap()  # a refused WRITE whose transfer had already failed still leaves the QP in ERR
        return super().alive

    def _peer_lost(self, why: str = "closed the connection") -> None:
        with self.cv:
            self._peer_gone = True
            self._held.clear()
        super()._peer_lost(why)
        self._fence()

    def _poll_timeout_ms(self) -> int:
        timeout = super()._poll_timeout_ms()
        return min(timeout, 2) if self._held else timeout  # (under cv) reap soon while ABORTs wait

    def _expire(self) -> None:
        super()._expire()
        with self.cv:
            waiting = bool(self._held)
        if not waiting:
            return
        self._reap()
        now = time.monotonic()
        with self.cv:
            late = [tid for tid, (_body, until) in self._held.items() if now >= until]
            if late:
                self._break_locked(TransferError(PEER_LOST, f"RDMA WRITEs of transfer {late[0]} did not complete "
                                                 f"within {self._drain_s:g}s after it failed; fencing the connection"))
        if late:
            self._fence()

    def close(self) -> None:
        with self.cv:
            if self._closing:
                return
            for transfer in list(self._transfers.values()):
                self._fail_locked(transfer, TransferError(CLOSED, "the sender was closed", transfer.transfer_id), True)
        until = time.monotonic() + self._drain_s
        while True:  # let held ABORTs go out before the I/O thread stops
            with self.cv:
                if not self._held:
                    break
            if time.monotonic() >= until:
                self._expire()  # breaks the connection: fencing ABORTs instead
                break
            if self._reap() == 0:
                time.sleep(0.001)
        super().close()
        self._close_qp()


class RdmaSender(TcpSender):
    """Prefill side of the rdma transport; see tandem.worker.transfer for the API."""

    transport = "rdma"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, layout_tag: str | None = None,
                 frame_bytes: int = 2 << 20, connect_timeout_s: float = 5.0,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S,
                 telemetry: TransferTelemetry | None = None, keys: KVKeys | None = None,
                 seal: SealSecrets | None = None,
                 verbs_factory: VerbsFactory | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                 **_tcp_only: Any) -> None:
        check_cache(layout, kv_cache)  # before anything is registered
        self.drain_timeout_s = check_deadline(drain_timeout_s)
        self.verbs = (verbs_factory or PyverbsVerbs)(kv_cache, False)
        try:
            super().__init__(layout, kv_cache, layout_tag=layout_tag, streams=1, frame_bytes=frame_bytes,
                             connect_timeout_s=connect_timeout_s, silence_timeout_s=silence_timeout_s,
                             telemetry=telemetry, keys=keys, seal=seal)
        except BaseException:
            self.verbs.close()
            raise

    def _open(self, address: str) -> TcpConnection:
        return RdmaConnection(self, address)

    def close(self) -> None:
        super().close()
        self.verbs.close()
