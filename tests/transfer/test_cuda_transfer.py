"""The tcp transport between KV caches on a CUDA device (skipped, with the reason, where there is none).

A GPU cache is gathered into a host staging buffer on the sender and scattered from the verified
payload on the receiver (worker/transfer/blocks.py); these tests are the only ones that run that path.
"""

from __future__ import annotations

import pytest
import torch

from tandem.worker.transfer.conformance import (
    TINY_LAYOUT,
    DoneWaiter,
    build_receiver,
    build_sender,
    make_cache,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")]


@pytest.mark.parametrize(("src_device", "dst_device"), [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_blocks_land_where_the_reservation_says_on_the_gpu(src_device: str, dst_device: str) -> None:
    src = make_cache(TINY_LAYOUT, 32, random=True).to(src_device)
    dst = make_cache(TINY_LAYOUT, 40, random=False).to(dst_device)
    src_ids, dst_ids = [3, 1, 7, 8, 9, 30], [20, 2, 5, 6, 31, 39]  # out of order: gathered and scattered
    receiver = build_receiver("tcp", TINY_LAYOUT, dst)
    sender = build_sender("tcp", TINY_LAYOUT, src)
    try:
        done = DoneWaiter()
        receiver.expect("gpu-1", dst_ids, 10.0, done)
        transfer = sender.connect(receiver.address).begin("gpu-1", dst_ids, 10.0)
        for layer in reversed(range(TINY_LAYOUT.num_layers)):
            transfer.send_layer(layer, src_ids)
        transfer.finish()
        assert done.wait(5) is None
    finally:
        sender.close()
        receiver.close()
    assert torch.equal(dst[:, :, dst_ids].cpu(), src[:, :, src_ids].cpu())
    untouched = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert not dst[:, :, untouched].any(), "blocks outside the reservation were written"
