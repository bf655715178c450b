"""Sealed KV transfer (sealing.py, secrets from the model's control token): token holders transfer
intact blocks, with the payload encrypted on the wire; anyone else is refused at the handshake.

Real receivers and senders on 127.0.0.1, per transport (rdma skips with its reason where there is
no device, see conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from tandem.worker.transfer import TransferError, wire
from tandem.worker.transfer.conformance import TINY_LAYOUT, DoneWaiter, transport_pair
from tandem.worker.transfer.sealing import SealSecrets

pytestmark = pytest.mark.timeout(60)

TOKEN, OTHER = SealSecrets.from_tokens(["t" * 32]), SealSecrets.from_tokens(["o" * 32])


@contextmanager
def pair(transport: str, receiver_seal: SealSecrets | None, sender_seal: SealSecrets | None
         ) -> Iterator[tuple[object, object, torch.Tensor, torch.Tensor]]:
    with transport_pair(transport, src_blocks=16, dst_blocks=16, receiver_options={"seal": receiver_seal},
                        seal=sender_seal, connect_timeout_s=20) as p:
        yield p.receiver, p.sender, p.src, p.dst


def recorded(conn: Any) -> tuple[list[list[bytes]], Callable[..., object]]:
    """From now on, a copy of every message the connection hands zmq; and its own send, unrecorded."""
    sent: list[list[bytes]] = []
    original = conn.send

    def send(transfer: object, parts: list[bytes], stream: int | None = None) -> object:
        sent.append([bytes(p) for p in parts])
        return original(transfer, parts, stream)
    conn.send = send
    return sent, original


def test_token_holders_transfer_intact_blocks(transport: str) -> None:
    with pair(transport, TOKEN, TOKEN) as (receiver, sender, src, dst):
        for round_, (dst_ids, src_ids) in enumerate((([4, 5, 6], [0, 1, 2]), ([9, 3], [7, 8]))):
            done = DoneWaiter()
            receiver.expect(f"req{round_}", dst_ids, 10.0, done)  # type: ignore[attr-defined]
            transfer = sender.connect(receiver.address).begin(f"req{round_}", dst_ids, 10.0)  # type: ignore[attr-defined]
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, src_ids)
            transfer.finish()
            assert done.wait(5) is None
            assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])


# A wrong token is auth_failed (someone without it); no seal at all is version_mismatch (a rollout from a
# release before sealing, or another --kv-encryption): the alerts tell the two apart (docs/alerts.md).
@pytest.mark.parametrize(("receiver_seal", "sender_seal", "reason", "says"), [
    (TOKEN, OTHER, "auth_failed", "not signed with this model's control token"),
    (TOKEN, None, "version_mismatch", "does not seal KV"),
    (None, TOKEN, "version_mismatch", "does not seal KV (--kv-encryption none)"),
], ids=["other-token", "plain-sender", "plain-receiver"])
def test_a_peer_without_the_token_is_refused_with_a_clear_error(
        transport: str, receiver_seal: SealSecrets | None, sender_seal: SealSecrets | None, reason: str,
        says: str) -> None:
    with pair(transport, receiver_seal, sender_seal) as (receiver, sender, _, dst):
        started = time.monotonic()
        with pytest.raises(TransferError) as failed:
            sender.connect(receiver.address)  # type: ignore[attr-defined]
        assert failed.value.reason == reason
        assert says in failed.value.message and receiver.address in failed.value.message  # type: ignore[attr-defined]
        assert time.monotonic() - started < 10  # refused at the handshake, not by the 20 s connect timeout
        assert not dst.any()
        assert receiver.telemetry.failures(transport, reason) >= 1  # type: ignore[attr-defined]


def test_the_payload_is_encrypted_and_a_stranger_cannot_attach() -> None:
    """A plain zmq peer that copies a session id (sent in clear) gets no stream in that session, and a
    frame it sends there writes nothing; the legitimate transfer still completes intact."""
    with pair("tcp", TOKEN, TOKEN) as (receiver, sender, src, dst):
        conn = sender.connect(receiver.address)  # type: ignore[attr-defined]
        session = conn._control.getsockopt(zmq.IDENTITY).decode().split("/")[0]
        ctx = zmq.Context.instance()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(receiver.address)  # type: ignore[attr-defined]
        try:
            rogue.send_multipart(wire.encode_control(wire.ATTACH, {"session": session, "stream": 5}))
            done = DoneWaiter()
            receiver.expect("req", [1, 2], 10.0, done)  # type: ignore[attr-defined]
            time.sleep(0.2)
            telemetry = receiver.telemetry  # type: ignore[attr-defined]
            assert telemetry.failures("tcp", "auth_failed") >= 1
            transfer = conn.begin("req", [1, 2], 10.0)
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [3, 4])
            transfer.finish()
            assert done.wait(5) is None
            assert torch.equal(dst[:, :, [1, 2]], src[:, :, [3, 4]])
        finally:
            rogue.close()


def test_sealed_frames_carry_no_plaintext() -> None:
    """What the sender hands zmq for a sealed frame: the K and V parts are ciphertext plus a GCM tag."""
    with pair("tcp", TOKEN, TOKEN) as (receiver, sender, src, _):
        conn = sender.connect(receiver.address)  # type: ignore[attr-defined]
        sent, _ = recorded(conn)
        done = DoneWaiter()
        receiver.expect("req", [1], 10.0, done)  # type: ignore[attr-defined]
        transfer = conn.begin("req", [1], 10.0)
        transfer.send_layer(0, [2])
        frames = [parts for parts in sent if parts[0] == wire.DATA]
        k_plain = src[0, 0, 2].contiguous().view(torch.uint8).numpy().tobytes()
        assert frames and len(frames[0][4]) == len(k_plain) + 16 and k_plain not in frames[0][4]
        assert all(b"dst_block_ids" not in parts[1] for parts in sent if parts[0] == wire.BEGIN)
        transfer.abort()


def test_a_replayed_frame_is_refused_and_the_next_transfer_is_intact() -> None:
    """A sealed frame sent a second time inside its session (as someone on the path could) writes
    nothing: its transfer fails as corrupt, naming the replay, and the session goes on."""
    with pair("tcp", TOKEN, TOKEN) as (receiver, sender, src, dst):
        conn = sender.connect(receiver.address)  # type: ignore[attr-defined]
        sent, original = recorded(conn)
        done = DoneWaiter()
        receiver.expect("req", [1, 2], 10.0, done)  # type: ignore[attr-defined]
        transfer = conn.begin("req", [1, 2], 10.0)
        transfer.send_layer(0, [3, 4])
        frame = next(parts for parts in sent if parts[0] == wire.DATA)
        original(transfer, frame)  # the same sealed bytes again
        error = done.wait(5)
        assert error is not None and error.reason == "corrupt_frame" and "replay" in error.message
        transfer.abort()

        done = DoneWaiter()
        receiver.expect("req2", [5, 6], 10.0, done)  # type: ignore[attr-defined]
        transfer = conn.begin("req2", [5, 6], 10.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, [7, 8])
        transfer.finish()
        assert done.wait(5) is None
        assert torch.equal(dst[:, :, [5, 6]], src[:, :, [7, 8]])
