"""KV transfer between prefill and decode workers: one interface, tcp (pyzmq) and rdma (pyverbs).

Decode side (owns the destination blocks):

    from tandem.worker.transfer import make_receiver, TransferError, TransferTelemetry
    telemetry = TransferTelemetry(registry, model=..., role="decode", pool=...)  # one per process
    recv = make_receiver("auto", layout, kv_cache, host="0.0.0.0", port=0, layout_tag=None, telemetry=telemetry)
    recv.address                     # "tcp://HOST:PORT": give it to the router / prefill side
    recv.transport                   # "tcp" or "rdma" (what auto picked)
    recv.expect(transfer_id, block_ids, deadline_s, on_done)
        # on_done(transfer_id, None) once every (layer, K/V, block) arrived and verified;
        # on_done(transfer_id, TransferError) on timeout, sender death, corrupt frame, abort.
        # After either, nothing more is written into those blocks: free or admit them.
        # Runs on the receiver's I/O thread: keep it short (hand off to the engine loop).
    recv.cancel(transfer_id, reason=None) -> bool  # drop a reservation yourself (no callback); with a
        # reason ("abandoned", "timeout") a still-pending transfer also counts as failed
    recv.prompt_digest(transfer_id) -> bytes | None  # what the sender's BEGIN declared its KV was computed
        # from (wire.prompt_digest); known inside on_done. Compare it with your own prompt's before you
        # use or cache the blocks: the transport does not judge it.
    recv.close()                      # pending reservations get on_done(..., TransferError("closed"))

Prefill side (owns the source blocks):

    sender = make_sender("auto", layout, kv_cache, layout_tag=None, telemetry=telemetry)
    conn = sender.connect(recv_address)   # handshake; TransferError("layout_mismatch"|"connect_failed")
    t = conn.begin(transfer_id, dst_block_ids, deadline_s, prompt_digest=wire.prompt_digest(prompt))
        # dst ids: the decode's reservation; prompt_digest: which token ids this KV is computed from
    t.send_layer(layer, src_block_ids, dst_start=0)  # as each layer is computed (pipelining);
        # src_block_ids[i] -> dst_block_ids[dst_start + i]; call it per layer, or per chunk.
        # Source blocks of a CPU cache go out zero-copy: keep them unchanged until finish()
        # returns or the transfer fails. One thread drives a given transfer at a time.
    t.finish() -> TransferResult(transfer_id, bytes_sent, seconds, frames)  # waits for the ack
    t.abort(message)                  # give up; the receiver frees at once
    sender.close()

Every failure is a TransferError with `.reason` in errors.REASONS (also the `reason` label of
KV_TRANSFER_FAILURES); bad arguments (block ids out of range, negative deadline) raise
ValueError at once. `choose_transport("auto")` says which transport runs here and why.
Wire format, checks and tuning: docs/transfer.md.
"""

from __future__ import annotations

from .errors import REASONS, TransferError
from .interface import KVConnection, KVReceiver, KVSender, KVTransfer
from .rdma_probe import RdmaProbe, probe
from .select import TRANSPORTS, choose_transport, make_receiver, make_sender
from .telemetry import TransferTelemetry
from .tracking import DoneCallback

__all__ = [
    "REASONS", "TRANSPORTS", "DoneCallback", "KVConnection", "KVReceiver", "KVSender", "KVTransfer",
    "RdmaProbe", "TransferError", "TransferTelemetry", "choose_transport", "make_receiver", "make_sender",
    "probe",
]
