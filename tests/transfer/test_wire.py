"""Wire format and frame checks: pure functions, no sockets."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from tandem.worker.kv.layout import KVLayout
from tandem.worker.transfer import TransferError, wire
from tandem.worker.transfer.blocks import ascending_runs, read_blocks, write_blocks
from tandem.worker.transfer.conformance import TINY_LAYOUT, make_cache
from tandem.worker.transfer.tracking import Reservation, check_data_frame

UNIT = TINY_LAYOUT.bytes_per_block_layer_kv


def frame(payload: bytearray, dst: list[int], layer: int = 0, kind: int = 0,
          tid: bytes = b"t") -> tuple[bytes, bytes]:
    ids = struct.pack(f"<{len(dst)}i", *dst)
    digest = wire.frame_digest(0, layer, kind, len(dst), len(payload), tid, ids, payload)
    return wire.pack_header(0, layer, kind, len(dst), len(payload), digest), ids


def random_payload(blocks: int, seed: int = 0) -> bytearray:
    return bytearray(torch.randint(0, 256, (blocks * UNIT,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(seed)).tolist())


def test_header_round_trip() -> None:
    header = wire.pack_header(7, 2, 1, 3, 3 * UNIT, (1 << 63, 2))
    parsed = wire.unpack_header(header)
    assert (parsed.seq, parsed.layer, parsed.kind, parsed.block_count, parsed.byte_count, parsed.digest) == (
        7, 2, 1, 3, 3 * UNIT, (1 << 63, 2))
    with pytest.raises(ValueError, match="header"):
        wire.unpack_header(header[:-1])


@pytest.mark.parametrize("damage", ["flip-bit", "swap-rows", "truncate-tail"])
def test_digest_notices_damage(damage: str) -> None:
    payload = random_payload(40)  # 40 * 128 B: several 4 KiB rows and a tail
    before = wire.frame_digest(0, 0, 0, 40, len(payload), b"t", b"ids", payload)
    damaged = bytearray(payload)
    if damage == "flip-bit":
        damaged[4097] ^= 0x01
    elif damage == "swap-rows":
        damaged[0:4096], damaged[4096:8192] = payload[4096:8192], payload[0:4096]
    else:
        damaged[-1] ^= 0x80
    assert wire.frame_digest(0, 0, 0, 40, len(payload), b"t", b"ids", damaged) != before


def test_digest_covers_header_fields_and_ids() -> None:
    payload = random_payload(2)
    base = wire.frame_digest(0, 0, 0, 2, len(payload), b"t", b"\x01\x00\x00\x00", payload)
    assert wire.frame_digest(0, 1, 0, 2, len(payload), b"t", b"\x01\x00\x00\x00", payload) != base
    assert wire.frame_digest(0, 0, 0, 2, len(payload), b"t", b"\x02\x00\x00\x00", payload) != base
    assert wire.frame_digest(0, 0, 0, 2, len(payload), b"u", b"\x01\x00\x00\x00", payload) != base


def test_moving_bytes_between_parts_changes_the_digest() -> None:
    # The same bytes split differently (ids vs payload, K vs V) must not digest the same.
    payload = random_payload(2)
    whole = wire.frame_digest(0, 0, wire.KV, 2, len(payload), b"t", b"", payload[:UNIT], payload[UNIT:])
    moved = wire.frame_digest(0, 0, wire.KV, 2, len(payload), b"t", b"", payload[:UNIT + 4], payload[UNIT + 4:])
    into_ids = wire.frame_digest(0, 0, wire.KV, 2, len(payload), b"t", payload[:4], payload[4:UNIT], payload[UNIT:])
    assert len({whole, moved, into_ids}) == 3


def test_check_data_frame_accepts_a_good_frame_and_names_the_problem_otherwise() -> None:
    payload = random_payload(2)
    header, ids = frame(payload, [5, 6])
    dst = check_data_frame(TINY_LAYOUT, wire.unpack_header(header), b"t", memoryview(bytearray(ids)),
                           memoryview(payload))
    assert dst == [5, 6]
    with pytest.raises(TransferError) as short:
        check_data_frame(TINY_LAYOUT, wire.unpack_header(header), b"t", memoryview(bytearray(ids)),
                         memoryview(payload[:-4]))
    assert short.value.reason == "invalid_frame" and "bytes" in short.value.message
    payload[3] ^= 0xFF
    with pytest.raises(TransferError) as corrupt:
        check_data_frame(TINY_LAYOUT, wire.unpack_header(header), b"t", memoryview(bytearray(ids)),
                         memoryview(payload))
    assert corrupt.value.reason == "corrupt_frame"


def test_the_ack_flag_is_digested_and_unknown_flags_are_refused() -> None:
    payload = random_payload(2)
    ids = struct.pack("<2i", 5, 6)
    plain = wire.frame_digest(0, 0, 0, 2, len(payload), b"t", ids, payload)
    flagged = wire.frame_digest(0, 0, 0, 2, len(payload), b"t", ids, payload, flags=wire.ACK_ME)
    assert plain != flagged  # a flag flipped in transit is a corrupt frame, not a lost acknowledgement
    header = wire.pack_header(0, 0, 0, 2, len(payload), flagged, wire.ACK_ME)
    assert wire.unpack_header(header).flags == wire.ACK_ME
    assert check_data_frame(TINY_LAYOUT, wire.unpack_header(header), b"t", memoryview(bytearray(ids)),
                            memoryview(payload)) == [5, 6]
    odd = wire.pack_header(0, 0, 0, 2, len(payload), wire.frame_digest(0, 0, 0, 2, len(payload), b"t", ids, payload,
                                                                       flags=4), 4)
    with pytest.raises(TransferError) as unknown:
        check_data_frame(TINY_LAYOUT, wire.unpack_header(odd), b"t", memoryview(bytearray(ids)), memoryview(payload))
    assert unknown.value.reason == "invalid_frame" and "flags" in unknown.value.message


def test_hello_checks_name_both_hashes() -> None:
    other = KVLayout("conformance", "bfloat16", 4, 3, 2, 8)
    refusal = wire.check_hello(TINY_LAYOUT, None, "tcp", wire.hello(other, None, "s", "tcp"))
    assert refusal is not None and refusal.reason == "layout_mismatch"
    assert TINY_LAYOUT.layout_hash() in refusal.message and other.layout_hash() in refusal.message
    assert "dtype=bfloat16" in refusal.message
    old = {**wire.hello(TINY_LAYOUT, None, "s", "tcp"), "protocol": 0}
    version = wire.check_hello(TINY_LAYOUT, None, "tcp", old)
    assert version is not None and version.reason == "version_mismatch"
    assert wire.check_hello(TINY_LAYOUT, "a", "tcp", wire.hello(TINY_LAYOUT, None, "s", "tcp")) is None
    assert wire.check_hello(TINY_LAYOUT, None, "tcp", wire.hello(TINY_LAYOUT, None, "s", "tcp")) is None


def test_an_older_sender_is_refused_saying_its_kv_is_not_bound_to_a_prompt() -> None:
    old = {**wire.hello(TINY_LAYOUT, None, "s", "tcp"), "protocol": wire.PROMPT_DIGEST_SINCE - 1}
    refusal = wire.check_hello(TINY_LAYOUT, None, "tcp", old)
    assert refusal is not None and refusal.reason == "version_mismatch"
    assert "which prompt" in refusal.message and "neither uses nor caches" in refusal.message
    newer = {**old, "protocol": wire.PROTOCOL_VERSION + 1}
    refusal = wire.check_hello(TINY_LAYOUT, None, "tcp", newer)
    assert refusal is not None and "which prompt" not in refusal.message


def test_prompt_digest_is_blake2b_of_the_count_and_int64_ids() -> None:
    """Pinned: prefill and decode workers of different builds must compute the same digest."""
    tokens = [0, 1, 511, 2**31 - 1, 7]
    expected = hashlib.blake2b(struct.pack("<Q", 5) + struct.pack("<5q", *tokens), digest_size=32,
                               person=b"tandem-kv-prompt").digest()
    assert wire.prompt_digest(tokens) == expected
    assert wire.prompt_digest(tuple(tokens)) == expected
    assert len(expected) == wire.PROMPT_DIGEST_BYTES


@pytest.mark.parametrize("other", [[1, 2, 3, 4], [1, 2, 4, 3], [1, 2, 3, 4, 0], [], [1, 2, 3, 4 + 2**32]],
                         ids=["one-token-differs", "swapped", "longer", "empty", "wraps-at-32-bits"])
def test_prompt_digests_of_different_prompts_differ(other: list[int]) -> None:
    assert wire.prompt_digest([1, 2, 3, 5]) != wire.prompt_digest(other)


@pytest.mark.parametrize("tokens", [[2**63], [-(2**63) - 1], [1.5]], ids=["too-big", "too-small", "not-int"])
def test_prompt_digest_refuses_what_is_no_token_id(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match="int64"):
        wire.prompt_digest(tokens)  # type: ignore[arg-type]


def test_begin_carries_the_prompt_digest_as_hex() -> None:
    digest = wire.prompt_digest([3, 4])
    assert wire.decode_prompt_digest(wire.encode_prompt_digest(digest)) == digest
    assert wire.encode_prompt_digest(None) == {} and wire.decode_prompt_digest({}) is None
    with pytest.raises(ValueError, match="32 bytes"):
        wire.encode_prompt_digest(digest[:31])
    for bad in ("zz" * 32, "ab" * 33, 7, ["ab"]):
        with pytest.raises(ValueError, match="malformed prompt digest"):
            wire.decode_prompt_digest({"prompt_digest": bad})


def test_reservation_tracks_every_layer_kind_and_block() -> None:
    reservation = Reservation("t", torch.tensor([9, 3, 5]), num_layers=2, deadline=1e18, on_done=lambda *_: None)
    assert reservation.missing == 2 * 2 * 3
    for layer in range(2):
        for kind in (0, 1):
            positions = reservation.positions(layer, kind, torch.tensor([5, 9, 3]))
            assert positions == [2, 0, 1]
            reservation.mark(layer, kind, positions, 3 * UNIT)
    assert reservation.complete and reservation.bytes_received == 12 * UNIT
    with pytest.raises(TransferError, match="twice"):
        reservation.positions(0, 0, torch.tensor([9]))


@pytest.mark.parametrize(("ids", "problem"), [([9, 4], "outside"), ([9, 9], "repeats")])
def test_reservation_rejects_foreign_or_repeated_blocks(ids: list[int], problem: str) -> None:
    reservation = Reservation("t", torch.tensor([9, 3, 5]), num_layers=1, deadline=1e18, on_done=lambda *_: None)
    with pytest.raises(TransferError, match=problem):
        reservation.positions(0, 0, torch.tensor(ids))


def test_ascending_runs() -> None:
    assert ascending_runs(torch.tensor([3, 4, 5, 9, 1, 2])) == [(3, 3), (9, 1), (1, 2)]
    assert ascending_runs(torch.tensor([7])) == [(7, 1)]


@pytest.mark.parametrize("src_ids", [[2, 3, 4], [4, 0, 2]], ids=["one-run-zero-copy", "scattered-gather"])
def test_read_then_write_moves_exact_blocks(src_ids: list[int]) -> None:
    src = make_cache(TINY_LAYOUT, 6, random=True)
    dst = make_cache(TINY_LAYOUT, 6, random=False)
    payload = read_blocks(src, 1, 1, torch.tensor(src_ids))
    assert len(payload) == 3 * UNIT
    write_blocks(dst, 1, 1, torch.tensor([5, 1, 0]), memoryview(bytearray(payload)))
    assert torch.equal(dst[1, 1, [5, 1, 0]], src[1, 1, src_ids])
    dst[1, 1, [5, 1, 0]] = 0
    assert not dst.any()


def test_a_kv_frame_counts_for_both_k_and_v() -> None:
    reservation = Reservation("t", torch.tensor([1, 2]), num_layers=1, deadline=1e18, on_done=lambda *_: None)
    positions = reservation.positions(0, wire.KV, torch.tensor([1, 2]))
    reservation.mark(0, wire.KV, positions, 4 * UNIT)
    assert reservation.complete
    with pytest.raises(TransferError, match="twice"):
        reservation.positions(0, wire.V, torch.tensor([2]))


def test_swapping_k_and_v_parts_changes_the_digest() -> None:
    k, v = random_payload(33, seed=1), random_payload(33, seed=2)
    assert (wire.frame_digest(0, 0, wire.KV, 33, 2 * len(k), b"t", b"", k, v)
            != wire.frame_digest(0, 0, wire.KV, 33, 2 * len(k), b"t", b"", v, k))


def test_io_thread_sleeps_until_just_past_the_earliest_deadline_and_at_most_a_second() -> None:
    from tandem.worker.transfer.zmqutil import poll_timeout_ms

    assert poll_timeout_ms([], now=0.0) == 1000  # nothing due: look around once a second
    assert poll_timeout_ms([0.25, 0.0625], now=0.0) == 63  # the earliest (62.5 ms), rounded up
    assert poll_timeout_ms([30.0], now=0.0) == 1000  # far off: still once a second
    assert poll_timeout_ms([-1.0], now=0.0) == 0  # already passed: do not sleep
