"""The worker-side KV glue over the real tcp transport: what the engine's layer callback and the
final catch-up send must land, block for block, in the decode worker's cache.

The engine is not run here (the end-to-end tests do that); LayerWrite notices are produced the way
the engine produces them, including chunked prefill and a prefix-cache hit whose blocks the
callback never sees.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from tandem.worker.engine import LayerWrite
from tandem.worker.kv.layout import KVLayout
from tandem.worker.server.kv_link import KVIntake, KVShipper
from tandem.worker.transfer.errors import TransferError
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender
from tandem.worker.transfer.wire import prompt_digest

LAYOUT = KVLayout(model="kv-link-test", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 32


def cache(fill: bool) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape) if fill else torch.zeros(shape)


@pytest.fixture
def pair() -> Any:
    src, dst = cache(True), cache(False)
    receiver = TcpReceiver(LAYOUT, dst)
    sender = TcpSender(LAYOUT, src)
    yield src, dst, receiver, sender
    sender.close()
    receiver.close()


def expect(receiver: TcpReceiver, transfer_id: str, blocks: list[int]) -> tuple[threading.Event, list[Any]]:
    done, outcome = threading.Event(), []

    def on_done(_tid: str, err: TransferError | None) -> None:
        outcome.append(err)
        done.set()

    receiver.expect(transfer_id, blocks, 10.0, on_done)
    return done, outcome


@pytest.mark.parametrize(("prompt_len", "cached", "chunks"), [
    (10, 0, [10]),  # one step, partial last block
    (23, 0, [6, 9, 8]),  # chunked prefill, chunk edges inside blocks
    (22, 8, [14]),  # two blocks came from the prefix cache: never in a layer callback
    (16, 0, [16]),  # exact multiple of the block size
])
def test_layer_by_layer_and_catch_up_land_every_block(pair: Any, prompt_len: int, cached: int,
                                                      chunks: list[int]) -> None:
    src, dst, receiver, sender = pair
    n_blocks = -(-prompt_len // LAYOUT.block_size)
    src_blocks = [3, 7, 8, 9, 15, 2][:n_blocks]  # a prefill worker's blocks are rarely contiguous
    dst_blocks = [20, 21, 22, 25, 26, 27][:n_blocks]
    done, outcome = expect(receiver, "t", dst_blocks)
    shipper = KVShipper(sender, LAYOUT.num_layers, LAYOUT.block_size)
    shipper.begin("r", receiver.address, "t", dst_blocks, prompt_len, 10.0)
    pos = cached
    for size in chunks:
        first = pos // LAYOUT.block_size
        last = -(-(pos + size) // LAYOUT.block_size)
        for layer in range(LAYOUT.num_layers):
            shipper.on_layer(layer, [LayerWrite("r", src_blocks[first:last], pos, pos + size)])
        pos += size
    assert pos == prompt_len
    shipper.finish("r", src_blocks)
    assert done.wait(10) and outcome == [None]
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(dst[:, :, d], src[:, :, s])


def test_layout_mismatch_is_refused_before_anything_is_sent(pair: Any) -> None:
    _src, _dst, receiver, _sender = pair
    other = KVLayout(model="another-model", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    stranger = TcpSender(other, torch.zeros(3, 2, NUM_BLOCKS, 4, 2, 8))
    try:
        shipper = KVShipper(stranger, 3, 4)
        with pytest.raises(TransferError) as info:
            shipper.begin("r", receiver.address, "t", [1, 2], 8, 5.0)
        assert info.value.reason == "layout_mismatch"
    finally:
        stranger.close()


def test_too_few_reserved_blocks_is_a_clear_error(pair: Any) -> None:
    _src, _dst, receiver, sender = pair
    with pytest.raises(ValueError, match="reserved 1 blocks, the prompt needs 3"):
        KVShipper(sender, LAYOUT.num_layers, LAYOUT.block_size).begin("r", receiver.address, "t", [5], 9, 5.0)


@pytest.mark.parametrize("declared", [prompt_digest(list(range(50, 60))), None], ids=["bound", "unbound"])
def test_the_intake_gets_the_prompt_digest_the_shipper_declared(pair: Any, declared: bytes | None) -> None:
    """The prefill side's digest of its prompt travels with the KV; the decode side's reservation holds it
    once the transfer arrived (the decode handler compares it with its request's prompt)."""
    _src, dst, receiver, sender = pair
    src_blocks = [3, 7, 8]

    async def scenario() -> None:
        intake = KVIntake(receiver, lambda request_id: None)
        res = intake.open("r", [20, 21, 22], 10.0)
        shipper = KVShipper(sender, LAYOUT.num_layers, LAYOUT.block_size)
        await asyncio.to_thread(shipper.begin, "r", receiver.address, res.transfer_id, res.block_ids, 10, 10.0,
                                declared)
        await asyncio.to_thread(shipper.finish, "r", src_blocks)
        assert await asyncio.wait_for(res.outcome, 10) is None
        assert res.prompt_digest == declared
        assert intake.claim("r") is res

    asyncio.run(scenario())
    assert dst[:, :, [20, 21, 22]].any()
