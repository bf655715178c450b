"""The rdma transport (RC queue pairs, RDMA WRITE). UNTESTED on RDMA hardware in this repository.

Same control plane as tcp (zmq: handshake, BEGIN/FINISH/ABORT, deadlines, peer-death
detection); the blocks themselves move by RDMA WRITE:

- the decode side registers its whole KV-cache tensor as one memory region (a CUDA tensor is
  registered directly, which needs GPUDirect RDMA: nvidia_peermem loaded) and sends the
  region's address and rkey plus its QP number, LID, GID (and its index) and active MTU in the
  handshake reply; both sides use the smaller MTU;
- the prefill side registers its own cache (the WRITE source), connects an RC QP per
  connection, waits until the receiver has claimed a transfer for it (an ACK carrying BEGUN_SEQ
  answers BEGIN), and for each send_layer() posts one WRITE per run of blocks that is contiguous
  on both sides, straight into the reserved destination blocks (after synchronising the cache's
  CUDA device, so the NIC never reads blocks the GPU is still writing);
- finish() waits for every WRITE's completion, then sends FINISH over zmq with a digest of every
  piece. The receiver recomputes the digests over the reserved blocks and only then reports done.

Fencing keeps the API's promise "after on_done(error) or cancel(), nothing more is written into
those blocks", although the rkey covers the whole pool:
- sender: a failed transfer's ABORT is held back until all its WRITEs have completed (at most
  drain_timeout_s, default 3 s). If they do not complete, or any WRITE completes with an error, the
  connection is broken: its QP moves to ERR and every ABORT it still sends carries "fence", so the
  receiver fences its side before it frees anything. The next connect() makes a new connection.
- receiver: when a claimed reservation fails or is cancelled while its sender may still be writing
  (timeout, cancel(), peer lost, a fencing ABORT: anything but a FINISH or a plain ABORT, both of
  which the sender sends only once its WRITEs completed), the session's QP is moved to ERR and
  destroyed *before* on_done runs or cancel() returns. Later WRITEs of that sender fail; its other
  transfers fail with peer_lost and a message saying so, and the sender is told to reconnect.

This module is the transport logic only: it talks to a NIC through the small Verbs interface of
rdma_verbs.py, whose PyverbsVerbs is the only code that touches pyverbs, and which
rdma_loopback.LoopbackVerbs (an in-process emulated NIC, for tests only) also implements.
Settings: TANDEM_RDMA_DEVICE, TANDEM_RDMA_GID_INDEX (rdma_probe.py).
"""

from __future__ import annotations

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
    TransferError,
)
from .limits import HEADER_ROOM, ReceiverLimits
from .rdma_verbs import QP_DEPTH, PyverbsVerbs, VerbsFactory
from .tcp_receiver import TcpReceiver
from .tcp_sender import SILENCE_TIMEOUT_S, OutgoingTransfer, TcpConnection, TcpSender
from .telemetry import TransferTelemetry
from .tracking import Reservation
from .zmqutil import check_deadline

log = logging.getLogger(__name__)

_POLL_BATCH = 64
DRAIN_TIMEOUT_S = 3.0
_SEQ = struct.Struct("<Q")
BEGUN_SEQ = 2**64 - 1  # an ACK with this sequence number: "this transfer is yours, you may WRITE"
_BEGUN = _SEQ.pack(BEGUN_SEQ)


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

class RdmaReceiver(TcpReceiver):
    """Decode side: registers kv_cache, lets senders WRITE into reservations, verifies at FINISH."""

    transport = "rdma"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                 layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                 keep_freed_buffers: bool = True, keys: KVKeys | None = None,
                 verbs_factory: VerbsFactory | None = None, limits: ReceiverLimits | None = None) -> None:
        check_cache(layout, kv_cache)  # before anything is registered
        self._verbs = (verbs_factory or PyverbsVerbs)(kv_cache, True)
        self._rdma_lock = threading.Lock()  # _qps, _fenced, _fence_queue: the I/O thread and cancel()
        self._qps: dict[str, Any] = {}  # session -> its QP
        self._fenced: dict[str, str] = {}  # session -> why it was fenced (until the sender disconnects)
        self._fence_queue: list[tuple[str, str]] = []  # fenced sessions whose other transfers must fail
        self._sender_quiet: set[str] = set()  # transfers whose FINISH / plain ABORT is being handled
        self._fenced_transfers: dict[str, str] = {}  # transfer -> why its sender was fenced (for its FAILED)
        try:
            super().__init__(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                             keep_freed_buffers=keep_freed_buffers, keys=keys, limits=limits)
        except BaseException:
            self._verbs.close()
            raise

    def _max_part_bytes(self) -> int:
        """No data frames come over zmq here, but FINISH lists every piece with its digest: at worst one
        piece per (layer, K/V, block) of the pool, each `[layer,kind,[block],[digest high,digest low]],`."""
        piece = 64 + len(str(self.num_blocks))
        return max(super()._max_part_bytes(), 2 * self.layout.num_layers * self.num_blocks * piece + HEADER_ROOM)

    def _welcome_extra(self, session_id: str, peer: dict[str, object]) -> dict[str, object]:
        remote = peer.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, "the sender sent no RDMA endpoint in its handshake")
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
        return {"rdma": {**endpoint, "addr": self._verbs.base, "rkey": self._verbs.rkey}}

    def _session_closed(self, session_id: str) -> None:
        with self._rdma_lock:
            qp = self._qps.pop(session_id, None)
            self._fenced.pop(session_id, None)
            if qp is not None:
                self._verbs.close_qp(qp)

    def close(self) -> None:
        super().close()
        with self._rdma_lock:
            self._qps.clear()
            self._verbs.close()  # destroys every QP, then the region

    def _on_transfer_control(self, identity: bytes, kind: bytes, msg: dict[str, object]) -> None:
        session_id = self._identity_session.get(identity)
        with self._rdma_lock:
            fenced = self._fenced.get(session_id or "")
        transfer_id = str(msg.get("transfer_id"))
        if fenced is not None:
            self._send(self._control_identity(identity), self._fenced_msg(transfer_id, fenced))
            return
        # FINISH and a plain ABORT come only after the sender's WRITEs completed: no fence needed.
        quiet = kind == wire.FINISH or (kind == wire.ABORT and not msg.get("fence"))
        if quiet:
            self._sender_quiet.add(transfer_id)
        try:
            super()._on_transfer_control(identity, kind, msg)
        finally:
            self._sender_quiet.discard(transfer_id)
        if kind == wire.BEGIN:
            with self._lock:
                reservation = self._reservations.get(transfer_id)
            if reservation is not None and reservation.session == session_id:
                self._send(self._control_identity(identity), [wire.ACK, transfer_id.encode(), _BEGUN])

    def _reservation_ended(self, reservation: Reservation, error: TransferError) -> None:
        """Fence the sender's QP if it may still be writing into these blocks (see the docstring)."""
        session_id = reservation.session
        if session_id is None or reservation.transfer_id in self._sender_quiet:
            return  # unclaimed: no sender was told it may write; quiet: its WRITEs all completed
        why = f"transfer {reservation.transfer_id} failed here ({error.reason}) while the sender could still write"
        with self._rdma_lock:
            qp = self._qps.pop(session_id, None)
            if qp is None:
                return  # already fenced, or the session is gone (its QP destroyed)
            try:
                self._verbs.fence(qp)
            except TransferError as exc:
                log.error("KV receiver: could not move a queue pair to ERR (%s); destroying it", exc.message)
            self._verbs.close_qp(qp)
            self._fenced[session_id] = why
            self._fence_queue.append((session_id, why))
            self._fenced_transfers[reservation.transfer_id] = why
        log.warning("KV receiver %s fenced an rdma sender: %s", self.address, why)
        self._wakeup.set()  # the I/O thread fails the session's other transfers

    def _expire(self) -> None:
        super()._expire()
        while True:
            with self._rdma_lock:
                if not self._fence_queue:
                    return
                session_id, why = self._fence_queue.pop(0)
            session = self._sessions.get(session_id)
            with self._rdma_lock:
                self._fenced_transfers.clear()  # their FAILED went out (or none will: cancel())
            if session is not None:
                self._send(session.control, self._fenced_msg("", why))
            with self._lock:
                others = [r for r in self._reservations.values() if r.session == session_id]
            for reservation in others:
                self._fail(reservation, TransferError(PEER_LOST, f"the sender's rdma connection was fenced: {why}",
                                                      reservation.transfer_id), None)

    def _failed_msg(self, transfer_id: str, error: TransferError) -> list[bytes]:  # type: ignore[override]
        """FAILED; for the transfer that got its sender fenced, saying so (the sender reconnects at once)."""
        with self._rdma_lock:
            why = self._fenced_transfers.pop(transfer_id, None)
        if why is None:
            return super()._failed_msg(transfer_id, error)
        return wire.encode_control(wire.FAILED, {"transfer_id": transfer_id, **error.to_wire(), "fenced": True})

    @staticmethod
    def _fenced_msg(transfer_id: str, why: str) -> list[bytes]:
        return wire.encode_control(wire.FAILED, {"transfer_id": transfer_id, "reason": PEER_LOST, "fenced": True,
                                                 "message": f"this rdma connection was fenced ({why}); reconnect"})

    def _on_finish(self, reservation: Reservation, msg: dict[str, object]) -> None:
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
        self._peer_gone = False
        self._qp = self._verbs.new_qp(True)
        try:
            super().__init__(sender, address)
        except BaseException:
            self._close_qp()
            raise

    def _hello_extra(self) -> dict[str, Any]:
        return {"rdma": self._verbs.endpoint(self._qp)}

    def _on_welcome(self, reply: dict[str, Any]) -> None:
        remote = reply.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, f"the receiver at {self.address} is not an rdma receiver")
        try:
            with self._qp_lock:
                self._verbs.connect(self._qp, remote)
            self._remote_base, self._rkey = int(remote["addr"]), int(remote["rkey"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(UNAVAILABLE, f"the receiver at {self.address} sent a malformed RDMA endpoint: "
                                f"{exc!r}") from exc
        self._local_base = self._verbs.base

    # --- data path (the caller's thread) --------------------------------------------------------

    def transmit(self, transfer: OutgoingTransfer, layer: int, src: list[int], dst: list[int]) -> None:
        tid = transfer.transfer_id
        with self.cv:
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
        for s_first, d_first, count in paired_runs(src, dst):
            wr_id = self._post_slot(transfer)
            self._post(transfer, wr_id, self._local_base + _offset(self.layout, self.local_blocks, layer, kind, s_first),
                       count * unit, self._remote_base + _offset(self.layout, self.remote_blocks, layer, kind, d_first))
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

    def _post(self, transfer: OutgoingTransfer, wr_id: int, local: int, length: int, remote: int) -> None:
        failure: TransferError | None = None
        with self._qp_lock:
            refused = transfer._state.error or self._broken or (
                TransferError(CLOSED, "the connection is closed", transfer.transfer_id) if self._qp_closed else None)
            if refused is None:
                try:
                    self._verbs.post_write(self._qp, wr_id, local, length, remote, self._rkey)
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
        with self.cv:
            bad = next((c for c in completions if c.reason is not None), None)
            if bad is not None:  # before any held ABORT is released: those must now fence
                failure = TransferError(bad.reason or PEER_LOST, f"an RDMA WRITE to {self.address} failed: {bad.status}")
                self._break_locked(failure)
            for completion in completions:
                self._write_done_locked(completion.wr_id)
            if completions:
                self.cv.notify_all()
        if failure is not None:
            self._break(failure)
        return len(completions)

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
            self._outbox.append(wire.encode_control(wire.ABORT, body))
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
        if self._broken is not None:  # our QP is fenced; the receiver must fence its side before freeing
            body["fence"] = True
            self._queue_abort_locked(body)
        elif self._writes.get(transfer.transfer_id):
            self._held[transfer.transfer_id] = (body, time.monotonic() + self._drain_s)
            self._wakeup.set()  # the I/O thread reaps until they complete
        else:
            self._queue_abort_locked(body)

    def _release_locked(self, transfer: OutgoingTransfer) -> None:
        super()._release_locked(transfer)
        self._begun.discard(transfer.transfer_id)

    def _break_locked(self, error: TransferError) -> None:
        """The QP is unusable (error completion, WRITEs that never completed, a fencing receiver):
        fail every transfer on it; TcpSender.connect() makes a new connection (alive is False)."""
        if self._broken is None:
            log.error("KV sender: rdma connection to %s broken: %s", self.address, error.message)
            self._broken = error
        for body, _until in self._held.values():
            body["fence"] = True
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
        if parts[0] == wire.ACK and len(parts) == 3 and parts[2] == _BEGUN:
            with self.cv:
                transfer_id = parts[1].decode(errors="replace")
                if transfer_id in self._transfers:
                    self._begun.add(transfer_id)
                self.cv.notify_all()
            return
        if parts[0] == wire.FAILED and len(parts) == 2:
            msg = wire.decode_control(parts[1])
            if msg.get("fenced"):
                super()._on_reply(parts)  # the transfer it names fails with the receiver's reason
                self._break(TransferError(PEER_LOST, f"the KV receiver at {self.address} fenced this rdma "
                                          f"connection: {msg.get('message', '')}"))
                return
        super()._on_reply(parts)

    @property
    def alive(self) -> bool:
        self.poll_replies()  # a fencing notice that already arrived counts
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
                 verbs_factory: VerbsFactory | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                 **_tcp_only: Any) -> None:
        check_cache(layout, kv_cache)  # before anything is registered
        self.drain_timeout_s = check_deadline(drain_timeout_s)
        self.verbs = (verbs_factory or PyverbsVerbs)(kv_cache, False)
        try:
            super().__init__(layout, kv_cache, layout_tag=layout_tag, streams=1, frame_bytes=frame_bytes,
                             connect_timeout_s=connect_timeout_s, silence_timeout_s=silence_timeout_s,
                             telemetry=telemetry, keys=keys)
        except BaseException:
            self.verbs.close()
            raise

    def _open(self, address: str) -> TcpConnection:
        return RdmaConnection(self, address)

    def close(self) -> None:
        super().close()
        self.verbs.close()
