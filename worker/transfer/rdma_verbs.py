"""The interface between the rdma transport and a NIC, and its implementation on pyverbs.

The transport (rdma.py) needs few verbs: queue pairs that WRITE into a peer's registered cache,
their completions, a way to fence one (move it to ERR), and scoped memory keys: the receiver
grants a peer's QP remote-write access to a list of byte ranges (one reservation's blocks) and
revokes them when the reservation ends. The cache's own registration gives no remote access.
`Verbs` is that interface.
`PyverbsVerbs` implements it on a real device and is the only code in Tandem that touches
pyverbs; rdma_loopback.LoopbackVerbs implements it in-process for tests. UNTESTED on RDMA hardware
here (no device), memory windows included: tests/transfer/test_rdma_api.py builds the pyverbs
objects it posts where pyverbs imports.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import INVALID_FRAME, PEER_LOST, UNAVAILABLE, TransferError
from .rdma_probe import (
    DEVICE_ENV,
    choose_gid_index,
    gid_index_override,
    load_pyverbs,
    pick_port,
    probe,
    read_gids,
)

log = logging.getLogger(__name__)

QP_DEPTH = 512  # outstanding WRITEs per connection before the sender waits for completions
BIND_BATCH = 64  # window binds a receiver posts before it waits for their completions
BIND_TIMEOUT_S = 2.0  # a batch of binds that has not completed by then fails the grant
MAX_WINDOW_BYTES = 1 << 31  # mlx5 binds at most 2 GiB per window (its KLM limit): callers split longer ranges
_HOP_LIMIT = 64  # routed RoCEv2 needs more than GlobalRoute's default of 1
# Completion statuses that mean our own request was wrong (address, key, length): a local bug.
_LOCAL_BUGS = frozenset({"IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_PROT_ERR",
                         "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR"})


@dataclass(frozen=True)
class Completion:
    wr_id: int
    reason: str | None  # None: the WRITE completed; else the TransferError reason of its failure
    status: str  # the status in words


class Verbs(Protocol):
    """One registered cache (base/lkey) and its queue pairs. Not thread-safe: callers lock."""

    base: int
    lkey: int
    key_scope: str  # what a granted key is bound to, in words: "queue pair" (type-2 windows) or "protection domain"

    def new_qp(self, sends: bool) -> Any: ...
    def endpoint(self, qp: Any) -> dict[str, Any]: ...
    def connect(self, qp: Any, remote: dict[str, Any]) -> None: ...
    def post_write(self, qp: Any, wr_id: int, local_addr: int, length: int, remote_addr: int, rkey: int) -> None: ...
    def poll(self, qp: Any, max_entries: int) -> list[Completion]: ...
    def fence(self, qp: Any) -> None: ...  # to ERR: no further WRITE from or into this QP lands
    # Remote-write access for the peer on `qp` to each (address, length) range: one rkey per range.
    def grant(self, qp: Any, ranges: list[tuple[int, int]]) -> list[int]: ...
    # Once this returns, a WRITE with any of these keys fails (IBV_WC_REM_ACCESS_ERR at its sender).
    def revoke(self, rkeys: list[int]) -> None: ...
    def close_qp(self, qp: Any) -> None: ...
    def close(self) -> None: ...


VerbsFactory = Callable[[torch.Tensor, bool], Verbs]  # (kv_cache, remote_write) -> Verbs


def completion_reason(status_name: str) -> str | None:
    """The TransferError reason for a work completion status (its ibv_wc_status name)."""
    if status_name == "IBV_WC_SUCCESS":
        return None
    return INVALID_FRAME if status_name in _LOCAL_BUGS else PEER_LOST  # retry, flush, remote abort...


def path_mtu(local: int, remote: object) -> int:
    """The MTU both ports can carry (ibv_mtu values: 1 = 256 ... 5 = 4096)."""
    if not isinstance(remote, int) or not 1 <= remote <= 5:
        raise TransferError(UNAVAILABLE, f"the peer sent no valid RDMA MTU ({remote!r})")
    return min(local, remote)


# --- the pyverbs adapter: the only code here that needs an RDMA device -----------------------

def pyverbs_modules() -> dict[str, Any]:
    """The pyverbs modules this transport uses (enums live in pyverbs.libibverbs_enums in 59)."""
    load_pyverbs()
    modules = {name: importlib.import_module(f"pyverbs.{name}")
               for name in ("device", "pd", "mr", "cq", "qp", "wr", "addr")}
    modules["enums"] = importlib.import_module("pyverbs.libibverbs_enums")
    return modules


def rts_attributes(m: dict[str, Any], port: int, mtu: int, psn: int, remote: dict[str, Any],
                   gid_index: int) -> Any:
    """QP attributes for INIT -> RTR -> RTS towards `remote` (timeouts and retries of
    ibv_rc_pingpong; PSNs as rdma-core's tests/base.py: rq_psn ours, sq_psn theirs, on both ends)."""
    attr = m["qp"].QPAttr(port_num=port)
    attr.path_mtu = mtu
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    route = m["addr"].GlobalRoute(dgid=m["addr"].GID(str(remote["gid"])), sgid_index=gid_index,
                                  hop_limit=_HOP_LIMIT)
    attr.ah_attr = m["addr"].AHAttr(port_num=port, is_global=1, gr=route, dlid=int(remote["lid"]))
    attr.dest_qp_num = int(remote["qpn"])
    attr.rq_psn = psn
    attr.sq_psn = int(remote["psn"])
    return attr


def post_write_request(m: dict[str, Any], qp: Any, wr_id: int, local_addr: int, length: int, lkey: int,
                       rkey: int, remote_addr: int) -> None:
    """Post one signaled RDMA WRITE of [local_addr, +length) to remote_addr.

    pyverbs 59 never frees an SGE or SendWR by itself (their `__dealloc` lacks the trailing
    underscores) and close() frees without clearing the pointer: close each exactly once, after
    ibv_post_send copied the request into the send queue.
    """
    sge = m["wr"].SGE(local_addr, length, lkey)
    try:
        e = m["enums"]  # SIGNALED is pyverbs' default too; the QP also has sq_sig_all=1
        wr = m["wr"].SendWR(wr_id=wr_id, opcode=e.ibv_wr_opcode.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                            send_flags=e.ibv_send_flags.IBV_SEND_SIGNALED)
        try:
            wr.set_wr_rdma(rkey, remote_addr)
            qp.post_send(wr)
        finally:
            wr.close()
    finally:
        sge.close()


def _choose_device() -> tuple[str, int]:
    """The (device, port) the probe found usable (it honours TANDEM_RDMA_DEVICE), or raise UNAVAILABLE."""
    found = probe()
    if not found.usable:
        raise TransferError(UNAVAILABLE, found.reason)
    chosen = pick_port([p for p in found.ports if p.active], os.environ.get(DEVICE_ENV, ""))
    if isinstance(chosen, str):
        raise TransferError(UNAVAILABLE, chosen)
    return chosen.device, chosen.port


@dataclass
class _PyverbsQP:
    qp: Any
    cq: Any
    psn: int


class PyverbsVerbs:
    """Verbs on a real device through pyverbs: context, protection domain, the cache's region."""

    def __init__(self, kv_cache: torch.Tensor, remote_write: bool, *, modules: dict[str, Any] | None = None,
                 device: tuple[str, int] | None = None) -> None:
        self.tensor: torch.Tensor | None = kv_cache  # the region points into it: keep it alive as long
        self.ctx: Any = None
        self._granted: dict[int, Any] = {}  # rkey -> its MW (or, without type-2 windows, its MR)
        self.device, self.port = device or _choose_device()
        self.m = modules or pyverbs_modules()
        self.e = self.m["enums"]
        try:
            self._open(kv_cache, remote_write)
        except BaseException:
            self.close()
            raise

    def _open(self, kv_cache: torch.Tensor, remote_write: bool) -> None:
        m, e = self.m, self.e
        try:
            self.ctx = m["device"].Context(name=self.device)
            self.pd = m["pd"].PD(self.ctx)
            self.port_attr = self.ctx.query_port(self.port)
            link = "Ethernet" if self.port_attr.link_layer == e.IBV_LINK_LAYER_ETHERNET else "InfiniBand"
            roce_v2 = e.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2
            gids = read_gids(self.ctx, self.port, int(self.port_attr.gid_tbl_len), roce_v2)
            self.gid_index = choose_gid_index(gids, link, gid_index_override())
            self.gid = next(gid for index, gid, _type in gids if index == self.gid_index)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(UNAVAILABLE, f"cannot open RDMA device {self.device} port {self.port}: "
                                f"{type(exc).__name__}: {exc}") from exc
        # The cache's own registration gives no remote access: a peer writes only through a key that
        # grant() made for its reservation. Type-2 windows need the region registered with MW_BIND.
        self.windows = remote_write and self._has_type2_windows()
        self.key_scope = "queue pair" if self.windows else "protection domain"
        access = e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
        if self.windows:
            access |= e.ibv_access_flags.IBV_ACCESS_MW_BIND
        nbytes = kv_cache.numel() * kv_cache.element_size()
        try:
            self.mr = m["mr"].MR(self.pd, nbytes, access, address=kv_cache.data_ptr())
        except Exception as exc:
            where = ("GPU memory (is nvidia_peermem loaded?)" if kv_cache.is_cuda
                     else "host memory (is `ulimit -l` / RLIMIT_MEMLOCK large enough to pin it?)")
            raise TransferError(UNAVAILABLE, f"cannot register the KV cache ({nbytes} bytes of {where}) "
                                f"with {self.device}: {exc}") from exc
        self.base, self.lkey = kv_cache.data_ptr(), int(self.mr.lkey)

    def _has_type2_windows(self) -> bool:
        """Whether the device binds type-2 memory windows (2A or 2B) and has any to give."""
        try:
            attr = self.ctx.query_device()
            flags = self.e.ibv_device_cap_flags
            mask = int(flags.IBV_DEVICE_MEM_WINDOW_TYPE_2A) | int(flags.IBV_DEVICE_MEM_WINDOW_TYPE_2B)
            usable = bool(int(attr.device_cap_flags) & mask) and int(attr.max_mw) > 0
        except Exception as exc:  # an old provider or pyverbs: registrations per range still work
            log.warning("KV transfer: cannot query %s for memory windows (%s); registering per range",
                        self.device, exc)
            return False
        if not usable:
            log.warning("KV transfer: %s has no type-2 memory windows; a peer's keys are registrations per "
                        "range (bound to the protection domain, not to the peer's queue pair)", self.device)
        return usable

    def close(self) -> None:
        """Release QPs, CQs, windows, regions, domain and context (Context.close closes its dependents first)."""
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self._granted = {}
        self.tensor = None

    def new_qp(self, sends: bool) -> _PyverbsQP:
        m, e = self.m, self.e
        depth = QP_DEPTH if sends else BIND_BATCH  # a receiver's QP posts only window binds
        cq = None
        try:
            cq = m["cq"].CQ(self.ctx, 2 * depth, None, None, 0)
            cap = m["qp"].QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = m["qp"].QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
            attr = m["qp"].QPAttr(port_num=self.port)
            attr.qp_access_flags = (e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
                                    | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE)
            return _PyverbsQP(m["qp"].QP(self.pd, init, attr), cq, random.getrandbits(24))  # created in INIT
        except Exception as exc:
            if cq is not None:
                cq.close()
            raise TransferError(UNAVAILABLE, f"cannot create an RDMA queue pair on {self.device}: {exc}") from exc

    def endpoint(self, qp: _PyverbsQP) -> dict[str, Any]:
        return {"qpn": qp.qp.qp_num, "psn": qp.psn, "lid": self.port_attr.lid, "gid": self.gid,
                "gid_index": self.gid_index, "mtu": int(self.port_attr.active_mtu)}

    def connect(self, qp: _PyverbsQP, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS towards the remote endpoint, at the smaller of both MTUs."""
        mtu = path_mtu(int(self.port_attr.active_mtu), remote.get("mtu"))
        try:
            qp.qp.to_rts(rts_attributes(self.m, self.port, mtu, qp.psn, remote, self.gid_index))
        except Exception as exc:
            raise TransferError(UNAVAILABLE, f"cannot connect an RDMA queue pair to GID {remote.get('gid')} "
                                f"QP {remote.get('qpn')}: {type(exc).__name__}: {exc}") from exc

    def post_write(self, qp: _PyverbsQP, wr_id: int, local_addr: int, length: int, remote_addr: int,
                   rkey: int) -> None:
        try:
            post_write_request(self.m, qp.qp, wr_id, local_addr, length, self.lkey, rkey, remote_addr)
        except Exception as exc:
            raise TransferError(PEER_LOST, f"ibv_post_send failed: {exc}") from exc

    def poll(self, qp: _PyverbsQP, max_entries: int) -> list[Completion]:
        try:
            count, wcs = qp.cq.poll(num_entries=max_entries)
        except Exception as exc:
            raise TransferError(PEER_LOST, f"polling the RDMA completion queue failed: {exc}") from exc
        return [self._completion(wc) for wc in wcs[:count]]

    def _completion(self, wc: Any) -> Completion:
        status = self.e.ibv_wc_status(wc.status)
        words = f"{self.m['cq'].cqe_status_to_str(wc.status)} ({status.name}, vendor error {wc.vendor_err:#x})"
        return Completion(int(wc.wr_id), completion_reason(status.name), words)

    def fence(self, qp: _PyverbsQP) -> None:
        try:
            qp.qp.modify(self.m["qp"].QPAttr(qp_state=self.e.ibv_qp_state.IBV_QPS_ERR),
                         self.e.ibv_qp_attr_mask.IBV_QP_STATE)
        except Exception as exc:
            raise TransferError(PEER_LOST, f"cannot move the queue pair to ERR: {exc}") from exc

    def grant(self, qp: _PyverbsQP, ranges: list[tuple[int, int]]) -> list[int]:
        """Type-2 windows bound on `qp` (usable only by its peer), else a registration per range."""
        made: list[tuple[int, Any]] = []
        try:
            if self.windows:
                for start in range(0, len(ranges), BIND_BATCH):
                    made.extend(self._bind_windows(qp, ranges[start:start + BIND_BATCH]))
            else:
                access = self.e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE | self.e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
                for addr, length in ranges:
                    mr = self.m["mr"].MR(self.pd, length, access, address=addr)
                    made.append((int(mr.rkey), mr))
        except Exception as exc:
            for _rkey, obj in made:
                self._release(obj)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(UNAVAILABLE, f"cannot grant {len(ranges)} memory keys on {self.device}: "
                                f"{type(exc).__name__}: {exc}") from exc
        self._granted.update(made)
        return [rkey for rkey, _obj in made]

    def _bind_windows(self, qp: _PyverbsQP, ranges: list[tuple[int, int]]) -> list[tuple[int, Any]]:
        """Allocate and bind one window per range with BIND_MW work requests, then wait for them."""
        m, e = self.m, self.e
        access = e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
        bound: list[tuple[int, Any]] = []
        try:
            for n, (addr, length) in enumerate(ranges):
                mw = m["mr"].MW(self.pd, e.ibv_mw_type.IBV_MW_TYPE_2)
                bound.append((0, mw))
                wr = m["wr"].SendWR(wr_id=n, opcode=e.ibv_wr_opcode.IBV_WR_BIND_MW,
                                    send_flags=e.ibv_send_flags.IBV_SEND_SIGNALED)
                try:
                    wr.set_bind_wr(mw, m["mr"].MWBindInfo(self.mr, addr, length, access))
                    qp.qp.post_send(wr)
                    bound[-1] = (int(wr.rkey), mw)  # the window's new key (set_bind_wr increments it)
                finally:
                    wr.close()
            self._wait_binds(qp, len(ranges))
        except BaseException:
            for _rkey, mw in bound:
                self._release(mw)
            raise
        return bound

    def _wait_binds(self, qp: _PyverbsQP, count: int) -> None:
        until, seen = time.monotonic() + BIND_TIMEOUT_S, 0
        while seen < count:
            for completion in self.poll(qp, count - seen):
                seen += 1
                if completion.reason is not None:
                    raise TransferError(UNAVAILABLE, f"binding a memory window failed: {completion.status}")
            if seen < count and time.monotonic() >= until:
                raise TransferError(UNAVAILABLE, f"{count - seen} memory window binds did not complete "
                                    f"within {BIND_TIMEOUT_S:g}s")

    def revoke(self, rkeys: list[int]) -> None:
        """Deallocate the windows (or deregister the regions): their keys are invalid once this returns."""
        failed = [rkey for rkey in rkeys if not self._release(self._granted.pop(rkey, None))]
        if failed:
            raise TransferError(PEER_LOST, f"could not invalidate {len(failed)} memory keys on {self.device}")

    @staticmethod
    def _release(obj: Any) -> bool:
        if obj is None:
            return True
        try:
            obj.close()
        except Exception:
            log.exception("KV transfer: invalidating a memory key failed")
            return False
        return True

    def close_qp(self, qp: _PyverbsQP) -> None:
        for resource in (qp.qp, qp.cq):
            try:
                resource.close()
            except Exception:
                log.exception("KV transfer: closing an RDMA queue pair failed")
