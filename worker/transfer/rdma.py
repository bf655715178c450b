"""The rdma transport (pyverbs, RC queue pairs). UNTESTED on hardware in this repository's CI.

Same control plane as tcp (zmq: handshake, BEGIN/FINISH/ABORT, deadlines, peer-death
detection); the blocks themselves move by RDMA WRITE:

- the decode side registers its whole KV-cache tensor as one memory region (a CUDA tensor is
  registered directly, which needs GPUDirect RDMA: nvidia_peermem loaded) and sends the
  region's address and rkey plus its QP number, LID and GID in the handshake reply;
- the prefill side registers its own cache (the WRITE source), connects an RC QP per
  connection, and for each send_layer() posts one signaled WRITE per run of blocks that is
  contiguous on both sides, straight into the reserved destination blocks;
- finish() waits for every WRITE's completion (on RC that means the data is placed in the
  receiver's memory), then sends FINISH over zmq with a digest of every piece. The receiver
  recomputes the digests over the reserved blocks and only then reports the transfer done.

Frame checks therefore happen after the bytes land, in blocks that only this transfer owns
and that nobody reads until the check passes; a failed check releases them like any other
failure. The rkey covers the whole pool, so a peer that passed the handshake is trusted not to
write outside its reservation: keep the RDMA network to the model's own pods (the operator's
kvTransfer.rdmaResource and secure settings).

This machine has no RDMA device, so only import, discovery and the "unavailable" errors run
in tests here; see docs/transfer.md for how to run the conformance suite on RDMA hardware.
"""

from __future__ import annotations

import importlib
import random
import struct
import threading
import time
from typing import Any

import torch

from tandem.worker.kv.keys import KVKeys
from tandem.worker.kv.layout import KVLayout

from . import wire
from .blocks import ascending_runs, read_blocks
from .errors import CORRUPT_FRAME, INCOMPLETE, PEER_LOST, TIMEOUT, UNAVAILABLE, TransferError
from .rdma_probe import RdmaProbe, load_pyverbs, probe
from .tcp_receiver import TcpReceiver
from .tcp_sender import OutgoingTransfer, TcpConnection, TcpSender
from .telemetry import TransferTelemetry
from .tracking import Reservation

_QP_DEPTH = 512  # outstanding WRITEs per connection before we wait for completions
_GID_INDEX = 0


def _require_rdma(found: RdmaProbe | None = None) -> tuple[Any, Any, str, int]:
    """(pyverbs enums, pyverbs modules namespace, device, port) of a usable device, or raise UNAVAILABLE."""
    found = found or probe()
    if not found.usable:
        raise TransferError(UNAVAILABLE, found.reason)
    load_pyverbs()
    port = next(p for p in found.ports if p.active)
    modules = pyverbs_modules()
    return modules["enums"], modules, port.device, port.port


def pyverbs_modules() -> dict[str, Any]:
    """The pyverbs modules this transport uses (enums live in pyverbs.libibverbs_enums in 59)."""
    load_pyverbs()
    modules = {name: importlib.import_module(f"pyverbs.{name}")
               for name in ("device", "pd", "mr", "cq", "qp", "wr", "addr")}
    modules["enums"] = importlib.import_module("pyverbs.libibverbs_enums")
    return modules


def rts_attributes(m: dict[str, Any], port: int, mtu: int, psn: int, remote: dict[str, Any]) -> Any:
    """QP attributes for INIT -> RTR -> RTS towards `remote` (the settings of ibv_rc_pingpong)."""
    attr = m["qp"].QPAttr(port_num=port)
    attr.path_mtu = mtu
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    route = m["addr"].GlobalRoute(dgid=m["addr"].GID(str(remote["gid"])), sgid_index=_GID_INDEX)
    attr.ah_attr = m["addr"].AHAttr(port_num=port, is_global=1, gr=route, dlid=int(remote["lid"]))
    attr.dest_qp_num = int(remote["qpn"])
    attr.rq_psn = psn
    attr.sq_psn = int(remote["psn"])
    return attr


def write_request(m: dict[str, Any], wr_id: int, local_addr: int, length: int, lkey: int, rkey: int,
                  remote_addr: int) -> Any:
    """One signaled RDMA WRITE of [local_addr, +length) to remote_addr."""
    e = m["enums"]
    sge = m["wr"].SGE(local_addr, length, lkey)
    wr = m["wr"].SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                        send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


class _Verbs:
    """One device context, protection domain and the cache's memory region."""

    def __init__(self, kv_cache: torch.Tensor, remote_write: bool) -> None:
        self.e, self.m, self.device, self.port = _require_rdma()
        self.ctx = self.m["device"].Context(name=self.device)
        self.pd = self.m["pd"].PD(self.ctx)
        access = self.e.IBV_ACCESS_LOCAL_WRITE
        if remote_write:
            access |= self.e.IBV_ACCESS_REMOTE_WRITE
        nbytes = kv_cache.numel() * kv_cache.element_size()
        try:
            self.mr = self.m["mr"].MR(self.pd, nbytes, access, address=kv_cache.data_ptr())
        except Exception as exc:
            where = "GPU memory (is nvidia_peermem loaded?)" if kv_cache.is_cuda else "host memory"
            raise TransferError(UNAVAILABLE, f"cannot register the KV cache ({nbytes} bytes of {where}) "
                                f"with {self.device}: {exc}") from exc
        self.base = kv_cache.data_ptr()
        self.port_attr = self.ctx.query_port(self.port)
        self.gid = str(self.ctx.query_gid(self.port, _GID_INDEX).gid)

    def close(self) -> None:
        """Release the region, domain and context (pyverbs closes their dependents too)."""
        self.ctx.close()

    def new_qp(self) -> tuple[Any, Any, int]:
        cq = self.m["cq"].CQ(self.ctx, 2 * _QP_DEPTH, None, None, 0)
        cap = self.m["qp"].QPCap(max_send_wr=_QP_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = self.m["qp"].QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        attr = self.m["qp"].QPAttr(port_num=self.port)
        attr.qp_access_flags = self.e.IBV_ACCESS_LOCAL_WRITE | self.e.IBV_ACCESS_REMOTE_WRITE
        qp = self.m["qp"].QP(self.pd, init, attr)  # created in INIT
        return qp, cq, random.getrandbits(24)

    def endpoint(self, qp: Any, psn: int) -> dict[str, Any]:
        return {"qpn": qp.qp_num, "psn": psn, "lid": self.port_attr.lid, "gid": self.gid, "port": self.port}

    def connect(self, qp: Any, psn: int, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS towards the remote endpoint."""
        qp.to_rts(rts_attributes(self.m, self.port, self.port_attr.active_mtu, psn, remote))


def _offset(layout: KVLayout, num_blocks: int, layer: int, kind: int, block: int) -> int:
    return int(((layer * 2 + kind) * num_blocks + block) * layout.bytes_per_block_layer_kv)


class RdmaReceiver(TcpReceiver):
    """Decode side: registers kv_cache, lets senders WRITE into reservations, verifies at FINISH."""

    transport = "rdma"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                 layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                 keys: KVKeys | None = None) -> None:
        self._verbs = _Verbs(kv_cache, remote_write=True)
        self._qps: dict[str, tuple[Any, Any]] = {}
        super().__init__(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                         keys=keys)

    def _welcome_extra(self, session_id: str, peer: dict[str, object]) -> dict[str, object]:
        remote = peer.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, "the sender sent no RDMA endpoint in its handshake")
        qp, cq, psn = self._verbs.new_qp()
        self._verbs.connect(qp, psn, remote)
        self._qps[session_id] = (qp, cq)
        return {"rdma": {**self._verbs.endpoint(qp, psn), "addr": self._verbs.base,
                         "rkey": self._verbs.mr.rkey}}

    def _session_closed(self, session_id: str) -> None:
        qp_cq = self._qps.pop(session_id, None)
        if qp_cq is not None:
            for resource in qp_cq:
                resource.close()

    def close(self) -> None:
        super().close()
        self._verbs.close()

    def _on_finish(self, reservation: Reservation, msg: dict[str, object]) -> None:
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


class RdmaConnection(TcpConnection):
    """One RC QP to a receiver; the zmq socket carries only control messages."""

    transport = "rdma"

    def __init__(self, sender: RdmaSender, address: str) -> None:
        self._verbs = sender.verbs
        self._qp, self._cq, self._psn = self._verbs.new_qp()
        self._cq_lock = threading.Lock()
        self._next_wr = 0
        self._outstanding: dict[int, OutgoingTransfer] = {}  # wr_id -> transfer
        self._pieces: dict[str, list[list[Any]]] = {}
        super().__init__(sender, address)

    def _hello_extra(self) -> dict[str, Any]:
        return {"rdma": self._verbs.endpoint(self._qp, self._psn)}

    def _on_welcome(self, reply: dict[str, Any]) -> None:
        remote = reply.get("rdma")
        if not isinstance(remote, dict):
            raise TransferError(UNAVAILABLE, f"the receiver at {self.address} is not an rdma receiver")
        self._verbs.connect(self._qp, self._psn, remote)
        self._remote_base, self._rkey = int(remote["addr"]), int(remote["rkey"])

    def transmit(self, transfer: OutgoingTransfer, layer: int, src: list[int], dst: list[int]) -> None:
        for kind in (wire.K, wire.V):
            self._write(transfer, layer, kind, src, dst)

    def _write(self, transfer: OutgoingTransfer, layer: int, kind: int, src: list[int], dst: list[int]) -> None:
        unit = self.layout.bytes_per_block_layer_kv
        src_list, dst_list = src, dst
        start = 0
        for _first, length in ascending_runs(dst):  # split further where the source is not contiguous
            for s_first, s_length in ascending_runs(src_list[start:start + length]):
                d_first = dst_list[start]
                wr_id = self._post_slot(transfer)
                self._qp.post_send(write_request(
                    self._verbs.m, wr_id,
                    self._verbs.base + _offset(self.layout, self.local_blocks, layer, kind, s_first),
                    s_length * unit, self._verbs.mr.lkey, self._rkey,
                    self._remote_base + _offset(self.layout, self.remote_blocks, layer, kind, d_first)))
                start += s_length
        pieces = self._pieces.setdefault(transfer.transfer_id, [])
        payload = read_blocks(self.kv_cache, layer, kind, src)
        ids = struct.pack(f"<{len(dst_list)}i", *dst_list)
        digest = wire.frame_digest(len(pieces), layer, kind, len(dst_list), len(payload), transfer.raw_id, ids,
                                   payload)
        pieces.append([layer, kind, dst_list, list(digest)])
        with self.cv:
            transfer._state.next_seq += 1
            transfer._state.bytes_sent += len(payload)

    def _post_slot(self, transfer: OutgoingTransfer) -> int:
        while True:
            with self._cq_lock:
                if len(self._outstanding) < _QP_DEPTH:
                    self._next_wr += 1
                    self._outstanding[self._next_wr] = transfer
                    return self._next_wr
            self._reap(transfer)

    def _reap(self, transfer: OutgoingTransfer) -> None:
        """Poll completions once; a failed WRITE fails its transfer (the QP is then unusable)."""
        if time.monotonic() >= transfer.deadline:
            self.fail(transfer, TransferError(TIMEOUT, "deadline passed waiting for RDMA completions",
                                              transfer.transfer_id), tell_receiver=True)
        if transfer.error is not None:
            raise transfer.error
        with self._cq_lock:
            count, completions = self._cq.poll(num_entries=64)
            for wc in completions[:count]:
                owner = self._outstanding.pop(wc.wr_id, None)
                if owner is not None and wc.status != self._verbs.e.IBV_WC_SUCCESS:
                    self.fail(owner, TransferError(PEER_LOST, f"RDMA WRITE failed with status {wc.status}",
                                                   owner.transfer_id), tell_receiver=True)
        if count == 0:
            time.sleep(0.0001)

    def prepare_finish(self, transfer: OutgoingTransfer) -> dict[str, Any]:
        while True:
            with self._cq_lock:
                pending = any(owner is transfer for owner in self._outstanding.values())
            if not pending:
                break
            self._reap(transfer)
        return {"pieces": self._pieces.pop(transfer.transfer_id, [])}


class RdmaSender(TcpSender):
    """Prefill side of the rdma transport; see tandem.worker.transfer for the API."""

    transport = "rdma"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, layout_tag: str | None = None,
                 connect_timeout_s: float = 5.0, telemetry: TransferTelemetry | None = None,
                 keys: KVKeys | None = None, **_tcp_only: Any) -> None:
        self.verbs = _Verbs(kv_cache, remote_write=False)
        super().__init__(layout, kv_cache, layout_tag=layout_tag, streams=1, connect_timeout_s=connect_timeout_s,
                         telemetry=telemetry, keys=keys)

    def _open(self, address: str) -> TcpConnection:
        return RdmaConnection(self, address)

    def close(self) -> None:
        super().close()
        self.verbs.close()
