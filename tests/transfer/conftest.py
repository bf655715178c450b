"""The transport conformance suite runs every test once per transport.

tcp always runs. rdma runs only where an RDMA device and pyverbs are usable; elsewhere its
tests are skipped with the exact reason (for example "no RDMA device: /sys/class/infiniband
does not exist ..."), which `pytest -ra` prints.

test_conformance.py runs `conformance_transport`, which adds rdma-loopback. That one always
runs: the real rdma transport logic (zmq handshake, BEGIN/FINISH with piece digests, the
receiver's checks, deadlines, fencing) over an EMULATED in-process NIC
(worker/transfer/rdma_loopback.py) that copies bytes with memmove. It stands in for hardware this
machine does not have; it does not show that anything works on a real NIC.
"""

from __future__ import annotations

import pytest

from tandem.worker.transfer import probe


def _rdma_param() -> object:
    found = probe()
    marks = [pytest.mark.rdma]
    if not found.usable:
        marks.append(pytest.mark.skip(reason=f"rdma transport not tested here: {found.reason}"))
    return pytest.param("rdma", marks=marks, id="rdma")


@pytest.fixture(params=["tcp", _rdma_param()])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["tcp", _rdma_param(), pytest.param("rdma-loopback", id="rdma-loopback"),
                        "tcp-sealed", pytest.param("rdma-loopback-sealed", id="rdma-loopback-sealed")])
def conformance_transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)
