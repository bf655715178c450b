"""The pyverbs calls the rdma transport makes, checked against the real pyverbs where it imports.

Without an RDMA device nothing can be registered or connected, but pyverbs' own objects (QP
attributes, address handles, work requests) can be built: these tests build exactly the ones
rdma.py posts, so a renamed class or keyword fails here rather than on the first RDMA machine.
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
    from tandem.worker.transfer.rdma import pyverbs_modules, rts_attributes, write_request

    m = pyverbs_modules()
    remote = {"qpn": 17, "psn": 99, "lid": 3, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "port": 1}
    attr = rts_attributes(m, port=1, mtu=m["enums"].IBV_MTU_4096, psn=5, remote=remote)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (17, 5, 99)
    write = write_request(m, wr_id=7, local_addr=0x1000, length=4096, lkey=11, rkey=12, remote_addr=0x2000)
    assert write.wr_id == 7


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
