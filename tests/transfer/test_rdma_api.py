"""The pyverbs calls the rdma transport makes, checked against the real pyverbs where it imports.

Without an RDMA device nothing can be registered or connected, but pyverbs' own objects (QP
attributes, address handles, work requests) can be built: these tests build exactly the ones
rdma_verbs.py posts, so a renamed class or keyword fails here rather than on the first RDMA machine.
Where pyverbs does not import (the default here: see hack/build_pyverbs.sh), they skip and say why.
"""

from __future__ import annotations

import pytest

from tandem.worker.transfer import TransferError, choose_transport, make_receiver
from tandem.worker.transfer.conformance import TINY_LAYOUT, make_cache
from tandem.worker.transfer.rdma_probe import load_pyverbs


def pyverbs_problem() -> str | None:
    try:
        load_pyverbs()
    except TransferError as exc:
        return str(exc.message)
    return None


needs_pyverbs = pytest.mark.skipif(pyverbs_problem() is not None, reason=f"{pyverbs_problem()}")


@needs_pyverbs
def test_device_listing_without_a_device_is_a_clear_no() -> None:
    import pyverbs.device

    from tandem.worker.transfer import probe

    try:
        devices = pyverbs.device.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError("Failed to get devices list") here
        assert "device" in str(exc).lower()
    else:
        assert isinstance(devices, list)
    found = probe()
    assert found.pyverbs and found.pyverbs_problem is None
    if not found.usable:
        assert found.reason.startswith(("no RDMA device", "RDMA device found", "libibverbs"))


@needs_pyverbs
def test_the_work_requests_and_qp_attributes_rdma_posts_can_be_built() -> None:
    from tandem.worker.transfer.rdma_verbs import post_write_request, pyverbs_modules, rts_attributes

    m = pyverbs_modules()
    e = m["enums"]
    remote = {"qpn": 17, "psn": 99, "lid": 3, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "gid_index": 3,
              "mtu": 3}
    attr = rts_attributes(m, port=1, mtu=e.ibv_mtu.IBV_MTU_1024, psn=5, remote=remote, gid_index=3)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (17, 5, 99, 3)
    assert (attr.ah_attr.sgid_index, attr.ah_attr.hop_limit, attr.ah_attr.dlid) == (3, 64, 3)
    posted = []

    class Qp:  # stands in for a connected QP: there is no device to make one on
        def post_send(self, wr: object) -> None:
            posted.append((wr.wr_id, wr.opcode, wr.send_flags))  # type: ignore[attr-defined]

    post_write_request(m, Qp(), wr_id=7, local_addr=0x1000, length=4096, lkey=11, rkey=12, remote_addr=0x2000)
    assert posted == [(7, e.ibv_wr_opcode.IBV_WR_RDMA_WRITE, e.ibv_send_flags.IBV_SEND_SIGNALED)]


@needs_pyverbs
def test_the_qualified_enum_names_rdma_uses_resolve() -> None:
    """Cython >= 3.1 drops the module-level copies of named cpdef enums: only qualified names are used."""
    from tandem.worker.transfer.rdma_verbs import pyverbs_modules

    m = pyverbs_modules()
    e = m["enums"]
    for enum, name in (("ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE"), ("ibv_access_flags", "IBV_ACCESS_REMOTE_WRITE"),
                       ("ibv_wr_opcode", "IBV_WR_RDMA_WRITE"), ("ibv_send_flags", "IBV_SEND_SIGNALED"),
                       ("ibv_qp_type", "IBV_QPT_RC"),
                       ("ibv_qp_state", "IBV_QPS_ERR"), ("ibv_qp_attr_mask", "IBV_QP_STATE"),
                       ("ibv_gid_type_sysfs", "IBV_GID_TYPE_SYSFS_ROCE_V2"), ("ibv_mtu", "IBV_MTU_1024"),
                       # scoped memory keys: type-2 windows bound with BIND_MW work requests
                       ("ibv_access_flags", "IBV_ACCESS_MW_BIND"), ("ibv_wr_opcode", "IBV_WR_BIND_MW"),
                       ("ibv_mw_type", "IBV_MW_TYPE_2"), ("ibv_device_cap_flags", "IBV_DEVICE_MEM_WINDOW_TYPE_2A"),
                       ("ibv_device_cap_flags", "IBV_DEVICE_MEM_WINDOW_TYPE_2B")):
        assert isinstance(int(getattr(getattr(e, enum), name)), int)
    assert e.ibv_wc_status(12).name == "IBV_WC_RETRY_EXC_ERR"
    assert "retry" in m["cq"].cqe_status_to_str(12).lower()
    init = m["qp"].QPInitAttr(qp_type=e.ibv_qp_type.IBV_QPT_RC, sq_sig_all=1,
                              cap=m["qp"].QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1))
    assert init.sq_sig_all == 1
    assert m["qp"].QPAttr(qp_state=e.ibv_qp_state.IBV_QPS_ERR).qp_state == e.ibv_qp_state.IBV_QPS_ERR
    assert isinstance(e.IBV_LINK_LAYER_ETHERNET, int)  # an anonymous enum: stays module-level
    bind = m["wr"].SendWR(wr_id=3, opcode=e.ibv_wr_opcode.IBV_WR_BIND_MW,
                          send_flags=e.ibv_send_flags.IBV_SEND_SIGNALED)  # no SGE: as rdma_verbs builds it
    assert bind.opcode == e.ibv_wr_opcode.IBV_WR_BIND_MW and hasattr(bind, "set_bind_wr")
    bind.close()
    assert hasattr(m["mr"], "MW") and hasattr(m["mr"], "MWBindInfo")


def test_asking_for_rdma_without_it_says_why() -> None:
    found_problem = None
    try:
        kind, _ = choose_transport("rdma")
    except TransferError as exc:
        found_problem = exc
    else:
        pytest.skip(f"rdma is usable here ({kind}); the refusal cannot be shown")
    assert found_problem.reason == "unavailable"
    with pytest.raises(TransferError) as refused:
        make_receiver("rdma", TINY_LAYOUT, make_cache(TINY_LAYOUT, 4, random=False))
    assert refused.value.reason == "unavailable" and str(found_problem.message) in str(refused.value)
