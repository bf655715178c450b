"""An EMULATED RDMA NIC, for tests only: not RDMA, and no substitute for a run on RDMA hardware.

This machine has no RDMA device (its kernel has no InfiniBand support), so the rdma transport's
own logic (handshake fields, posting, completions, piece digests, fencing, errors) is tested here
against this stand-in: LoopbackVerbs implements rdma_verbs.Verbs inside one process.

What it does:
- queue pairs get process-unique numbers and connect by number, only to queue pairs created in
  this same process (an endpoint from another process is unknown: connect() fails);
- the registered cache gives no remote access; grant(qp, ranges) makes one key per range, bound
  to that QP as a type-2 memory window is (or, with memory_windows=False, the fallback of a
  registration per range: bound to the "protection domain", so any QP of this receiver may use it);
  revoke() invalidates keys at once;
- a WRITE on a connected QP copies the bytes with ctypes.memmove from the sender's registered
  tensor into the receiver's, after checking that its rkey is a live key granted to the QP it
  arrives on (windows) and that the key's range covers the whole WRITE, and that the local range
  lies inside the sender's region; its completion goes to the QP's completion queue;
- a WRITE with any other key (the whole pool's, another reservation's, one copied to another QP,
  a revoked one, or one covering only part of the range) lands nothing: it completes with
  IBV_WC_REM_ACCESS_ERR, and as on RC both QPs go to ERR (the requester on the error completion,
  the responder on the access violation, where hardware raises IBV_EVENT_QP_ACCESS_ERR);
- a WRITE towards a QP that was fenced (ERR), destroyed or never connected back does not land:
  it completes with IBV_WC_RETRY_EXC_ERR after `retry_timeout_s` (on hardware the responder drops
  it and the requester's retries run out), and like RC the sending QP then goes to ERR, so its
  later WRITEs complete with IBV_WC_WR_FLUSH_ERR;
- `hold_writes = True` keeps posted WRITEs "on the wire" until release_writes(), so tests can
  look at the moments while WRITEs are outstanding; fence() and close_qp() flush held WRITEs.

What it does not model: timing and bandwidth, partial placement, PSN/GID/MTU semantics (only
exchanged and checked for presence), CUDA memory (CUDA tensors are refused), memory pinning, the
cost of binding windows (binds complete at once here) and the 2 GiB per-window limit of mlx5.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UNAVAILABLE, TransferError
from .rdma_verbs import Completion, completion_reason, path_mtu

_lock = threading.RLock()  # the whole "network": every verb runs under it
_network: dict[int, _QueuePair] = {}
_qpns = itertools.count(0x100)
_STATUS_WORDS = {
    "IBV_WC_SUCCESS": "success",
    "IBV_WC_RETRY_EXC_ERR": "transport retry counter exceeded",
    "IBV_WC_WR_FLUSH_ERR": "WR flush error",
    "IBV_WC_REM_ACCESS_ERR": "remote access error",
    "IBV_WC_LOC_PROT_ERR": "local protection error",
}


@dataclass
class _Write:
    wr_id: int
    local_addr: int
    length: int
    remote_addr: int
    rkey: int


@dataclass(frozen=True)
class _Window:
    qp: _QueuePair | None  # the QP it is bound to (a type-2 window); None: any QP of the region's owner
    addr: int
    length: int


@dataclass
class _QueuePair:
    verbs: LoopbackVerbs
    qpn: int
    psn: int
    state: str = "INIT"  # INIT -> RTS -> ERR, or CLOSED
    remote_qpn: int | None = None
    path_mtu: int | None = None
    completions: deque[tuple[float, Completion]] = field(default_factory=deque)  # (ready at, completion)
    held: list[_Write] = field(default_factory=list)


class LoopbackVerbs:
    """rdma_verbs.Verbs over an in-process emulated network (see the module docstring): tests only."""

    def __init__(self, kv_cache: torch.Tensor, remote_write: bool, *, mtu: int = 5,
                 retry_timeout_s: float = 0.2, memory_windows: bool = True) -> None:
        if kv_cache.is_cuda:
            raise TransferError(UNAVAILABLE, "the emulated NIC copies host memory only")
        self.tensor = kv_cache  # keeps the "registered" memory alive, as the real adapter does
        self.base = kv_cache.data_ptr()
        self.nbytes = kv_cache.numel() * kv_cache.element_size()
        self.remote_write = remote_write
        self.lkey = random.getrandbits(32)
        self.windows = memory_windows
        self.key_scope = "queue pair" if memory_windows else "protection domain"
        self.keys: dict[int, _Window] = {}  # live granted keys
        self.granted = 0  # keys granted so far (windows bound, or ranges registered)
        self.revoked = 0
        self.mtu, self.retry_timeout_s = mtu, retry_timeout_s
        self.hold_writes = False
        self.posted = 0  # WRITEs posted on this side's QPs
        self.landed = 0  # of them, WRITEs whose bytes were copied
        self.qps: list[_QueuePair] = []
        self.closed = False

    def new_qp(self, sends: bool) -> _QueuePair:
        with _lock:
            qp = _QueuePair(self, next(_qpns), random.getrandbits(24))
            _network[qp.qpn] = qp
            self.qps.append(qp)
            return qp

    def endpoint(self, qp: _QueuePair) -> dict[str, Any]:
        return {"qpn": qp.qpn, "psn": qp.psn, "lid": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
                "gid_index": 0, "mtu": self.mtu}

    def connect(self, qp: _QueuePair, remote: dict[str, Any]) -> None:
        with _lock:
            missing = [key for key in ("qpn", "psn", "lid", "gid", "gid_index", "mtu") if key not in remote]
            if missing:
                raise TransferError(UNAVAILABLE, f"emulated NIC: the peer's endpoint lacks {missing}")
            if int(remote["qpn"]) not in _network:
                raise TransferError(UNAVAILABLE, f"emulated NIC: no queue pair {remote['qpn']} in this process "
                                    "(the loopback connects endpoints of one process only)")
            qp.path_mtu = path_mtu(self.mtu, remote["mtu"])
            qp.remote_qpn, qp.state = int(remote["qpn"]), "RTS"

    def post_write(self, qp: _QueuePair, wr_id: int, local_addr: int, length: int, remote_addr: int,
                   rkey: int) -> None:
        with _lock:
            if qp.state == "CLOSED" or self.closed:  # real pyverbs would crash: the transport must not
                raise AssertionError("emulated NIC: post on a destroyed queue pair")
            self.posted += 1
            write = _Write(wr_id, local_addr, length, remote_addr, rkey)
            if not self.base <= local_addr <= local_addr + length <= self.base + self.nbytes:
                self._complete(qp, write, "IBV_WC_LOC_PROT_ERR")
            elif qp.state != "RTS":
                self._complete(qp, write, "IBV_WC_WR_FLUSH_ERR")
            elif self.hold_writes:
                qp.held.append(write)
            else:
                self._execute(qp, write)

    def grant(self, qp: _QueuePair, ranges: list[tuple[int, int]]) -> list[int]:
        with _lock:
            if not self.remote_write:
                raise TransferError(UNAVAILABLE, "emulated NIC: this region was registered without remote access")
            if self.windows and qp.state != "RTS":  # a bind is a work request on that QP: it flushes in ERR
                raise TransferError(UNAVAILABLE, f"emulated NIC: cannot bind a memory window on a queue pair in "
                                    f"state {qp.state}")
            for addr, length in ranges:
                if length <= 0 or not self.base <= addr <= addr + length <= self.base + self.nbytes:
                    raise TransferError(UNAVAILABLE, f"emulated NIC: range {addr:#x}+{length} is not inside the "
                                        "registered region")
            rkeys = []
            for addr, length in ranges:
                rkey = random.getrandbits(32)
                while rkey in self.keys or rkey == self.lkey:
                    rkey = random.getrandbits(32)
                self.keys[rkey] = _Window(qp if self.windows else None, addr, length)
                rkeys.append(rkey)
            self.granted += len(rkeys)
            return rkeys

    def revoke(self, rkeys: list[int]) -> None:
        with _lock:
            for rkey in rkeys:
                if self.keys.pop(rkey, None) is not None:
                    self.revoked += 1

    def release_writes(self) -> None:
        """Let held WRITEs reach their target (in order), as the wire would."""
        with _lock:
            for qp in self.qps:
                held, qp.held = qp.held, []
                for write in held:
                    if qp.state == "RTS":
                        self._execute(qp, write)
                    else:
                        self._complete(qp, write, "IBV_WC_WR_FLUSH_ERR")

    def _execute(self, qp: _QueuePair, write: _Write) -> None:
        target = _network.get(qp.remote_qpn or -1)
        if target is None or target.state != "RTS" or target.remote_qpn != qp.qpn:
            self._complete(qp, write, "IBV_WC_RETRY_EXC_ERR", delay=self.retry_timeout_s)
            return
        window = target.verbs.keys.get(write.rkey)
        allowed = window is not None and window.qp in (None, target) and (
            window.addr <= write.remote_addr <= write.remote_addr + write.length <= window.addr + window.length)
        if not allowed:
            target.state = "ERR"  # the responder's QP: an access violation is fatal to it too (RC)
            self._complete(qp, write, "IBV_WC_REM_ACCESS_ERR")
            return
        ctypes.memmove(write.remote_addr, write.local_addr, write.length)
        self.landed += 1
        self._complete(qp, write, "IBV_WC_SUCCESS")

    def _complete(self, qp: _QueuePair, write: _Write, status: str, delay: float = 0.0) -> None:
        if status != "IBV_WC_SUCCESS" and qp.state == "RTS":
            qp.state = "ERR"  # RC: an error completion leaves the QP in the error state
        words = f"{_STATUS_WORDS[status]} ({status}, emulated)"
        qp.completions.append((time.monotonic() + delay, Completion(write.wr_id, completion_reason(status), words)))

    def poll(self, qp: _QueuePair, max_entries: int) -> list[Completion]:
        with _lock:
            now, ready = time.monotonic(), list[Completion]()
            while qp.completions and len(ready) < max_entries and qp.completions[0][0] <= now:
                ready.append(qp.completions.popleft()[1])
            return ready

    def fence(self, qp: _QueuePair) -> None:
        with _lock:
            if qp.state != "CLOSED":
                qp.state = "ERR"
            self._flush(qp)

    def close_qp(self, qp: _QueuePair) -> None:
        with _lock:
            self._flush(qp)
            qp.state = "CLOSED"
            _network.pop(qp.qpn, None)

    def _flush(self, qp: _QueuePair) -> None:
        held, qp.held = qp.held, []
        for write in held:
            self._complete(qp, write, "IBV_WC_WR_FLUSH_ERR")

    def close(self) -> None:
        with _lock:
            for qp in self.qps:
                self.close_qp(qp)
            self.keys.clear()
            self.closed = True

    def state_of(self, qp_number: int) -> str:
        """A QP's state by number ("CLOSED" once destroyed), for tests."""
        with _lock:
            qp = _network.get(qp_number)
            return qp.state if qp is not None else "CLOSED"
