"""Secure KV transfer (kvTransfer.secure, `--kv-keys`): same keys talk, anyone else is refused at once.

Real receivers and senders on 127.0.0.1, per transport (rdma skips with its reason where there is
no device, see conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tandem.worker.kv.keys import KVKeys
from tandem.worker.transfer import TransferError
from tandem.worker.transfer.conformance import TINY_LAYOUT, DoneWaiter, transport_pair

pytestmark = pytest.mark.timeout(60)

KEYS, OTHER = KVKeys.generate(), KVKeys.generate()


@contextmanager
def pair(transport: str, receiver_keys: KVKeys | None, sender_keys: KVKeys | None
         ) -> Iterator[tuple[object, object, torch.Tensor, torch.Tensor]]:
    with transport_pair(transport, src_blocks=16, dst_blocks=16, receiver_options={"keys": receiver_keys},
                        keys=sender_keys, connect_timeout_s=20) as p:
        yield p.receiver, p.sender, p.src, p.dst


def test_peers_with_the_same_keys_transfer_intact_blocks(transport: str) -> None:
    with pair(transport, KEYS, KEYS) as (receiver, sender, src, dst):
        done = DoneWaiter()
        receiver.expect("req", [4, 5, 6], 10.0, done)  # type: ignore[attr-defined]
        transfer = sender.connect(receiver.address).begin("req", [4, 5, 6], 10.0)  # type: ignore[attr-defined]
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, [0, 1, 2])
        transfer.finish()
        assert done.wait(5) is None
        assert torch.equal(dst[:, :, [4, 5, 6]], src[:, :, [0, 1, 2]])


@pytest.mark.parametrize(("receiver_keys", "sender_keys"), [(KEYS, OTHER), (KEYS, None), (None, KEYS)],
                         ids=["other-keys", "plain-sender", "plain-receiver"])
def test_a_peer_without_the_keys_is_refused_with_a_clear_error(
        transport: str, receiver_keys: KVKeys | None, sender_keys: KVKeys | None) -> None:
    with pair(transport, receiver_keys, sender_keys) as (receiver, sender, _, dst):
        started = time.monotonic()
        with pytest.raises(TransferError) as failed:
            sender.connect(receiver.address)  # type: ignore[attr-defined]
        assert failed.value.reason == "auth_failed"
        assert "kvTransfer.secure" in failed.value.message and receiver.address in failed.value.message  # type: ignore[attr-defined]
        # Refused by the security handshake, not by waiting out the 20 s connect timeout.
        assert time.monotonic() - started < 10
        assert not dst.any()
        # The receiver saw it too: counted under the same reason (its log says which side is secure).
        telemetry = receiver.telemetry  # type: ignore[attr-defined]
        limit = time.monotonic() + 5
        while telemetry.failures(transport, "auth_failed") < 1 and time.monotonic() < limit:
            time.sleep(0.05)
        assert telemetry.failures(transport, "auth_failed") >= 1
