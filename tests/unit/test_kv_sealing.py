"""The sealed KV handshake and AEAD (worker/transfer/sealing.py), as pure functions: who gets a session,
and that nothing sealed opens under another key, nonce or associated data."""

from __future__ import annotations

import pytest

from tandem.worker.transfer import sealing
from tandem.worker.transfer.sealing import SealError, SealSecrets, SenderHandshake, accept_hello, seal_welcome

TOKEN, OTHER = "a" * 32, "b" * 32


def session(sender: SealSecrets, receiver: SealSecrets, extra: dict[str, object] | None = None) -> tuple:
    hs = SenderHandshake(sender, "s1")
    accepted = accept_hello(receiver, "s1", hs.hello_fields())
    send, _replies, opened = hs.complete(seal_welcome(accepted, extra or {}))
    return send, accepted.opener, opened


def test_token_holders_agree_on_keys_and_the_welcome_box_opens() -> None:
    send, opener, opened = session(SealSecrets.from_tokens([TOKEN]), SealSecrets.from_tokens([TOKEN]), {"rkey": 7})
    assert opened == {"rkey": 7}
    counter = send.next_counter()
    sealed = send.seal(counter, sealing.K_PART, b"kv bytes", b"header")
    out = bytearray(len(b"kv bytes"))
    opener.open_into(counter, sealing.K_PART, sealed, b"header", memoryview(out))
    assert bytes(out) == b"kv bytes" and b"kv bytes" not in sealed
    assert opener.open_body(b"B", send.seal_body(b"B", b'{"x":1}')) == b'{"x":1}'


def test_a_receiver_accepts_any_of_its_tokens_during_a_rotation() -> None:
    _, _, opened = session(SealSecrets.from_tokens([OTHER]), SealSecrets.from_tokens([TOKEN, OTHER]), {"ok": 1})
    assert opened == {"ok": 1}


def test_a_hello_without_the_token_gets_no_session() -> None:
    hello = SenderHandshake(SealSecrets.from_tokens([OTHER]), "s1").hello_fields()
    with pytest.raises(SealError, match="not signed with this model's control token"):
        accept_hello(SealSecrets.from_tokens([TOKEN]), "s1", hello)
    with pytest.raises(SealError, match="does not seal"):
        accept_hello(SealSecrets.from_tokens([TOKEN]), "s1", {})
    with pytest.raises(SealError, match="not signed"):  # a HELLO replayed under another session id
        accept_hello(SealSecrets.from_tokens([OTHER]), "s2", hello)


def test_a_welcome_from_a_receiver_without_the_token_is_refused() -> None:
    hs = SenderHandshake(SealSecrets.from_tokens([TOKEN]), "s1")
    forged = accept_hello(SealSecrets.from_tokens([OTHER]), "s1",
                          SenderHandshake(SealSecrets.from_tokens([OTHER]), "s1").hello_fields())
    with pytest.raises(SealError, match="WELCOME is not signed"):
        hs.complete(seal_welcome(forged, {}))
    with pytest.raises(SealError, match="not sealed"):
        hs.complete({"num_blocks": 4})


@pytest.mark.parametrize("change", ["data", "aad", "counter", "part"])
def test_nothing_sealed_opens_when_anything_about_it_changed(change: str) -> None:
    send, opener, _ = session(SealSecrets.from_tokens([TOKEN]), SealSecrets.from_tokens([TOKEN]))
    counter = send.next_counter()
    sealed = bytearray(send.seal(counter, sealing.K_PART, b"kv bytes", b"header"))
    aad, part = b"header", sealing.K_PART
    if change == "data":
        sealed[0] ^= 1
    elif change == "aad":
        aad = b"headex"
    elif change == "counter":
        counter += 1
    else:
        part = sealing.V_PART
    with pytest.raises(SealError, match="failed authentication"):
        opener.open_into(counter, part, bytes(sealed), aad, memoryview(bytearray(8)))


def test_two_sessions_with_the_same_token_have_different_keys() -> None:
    secrets = SealSecrets.from_tokens([TOKEN])
    send, _, _ = session(secrets, secrets)
    _, other_opener, _ = session(secrets, secrets)
    sealed = send.seal(0, sealing.K_PART, b"kv bytes", b"h")
    with pytest.raises(SealError):
        other_opener.open_into(0, sealing.K_PART, sealed, b"h", memoryview(bytearray(8)))


def test_counters_never_repeat_and_secrets_never_print() -> None:
    send, _, _ = session(SealSecrets.from_tokens([TOKEN]), SealSecrets.from_tokens([TOKEN]))
    assert len({send.next_counter() for _ in range(1000)}) == 1000
    assert TOKEN not in repr(SealSecrets.from_tokens([TOKEN]))


def test_a_sealed_control_message_opens_once() -> None:
    """Copied off the wire and sent again in its session, a sealed message is refused as a replay."""
    send, opener, _ = session(SealSecrets.from_tokens([TOKEN]), SealSecrets.from_tokens([TOKEN]))
    begin = send.seal_body(b"B", b'{"transfer_id":"r1"}')
    assert opener.open_body(b"B", begin) == b'{"transfer_id":"r1"}'
    with pytest.raises(SealError, match="already received: a replay"):
        opener.open_body(b"B", begin)


def test_the_replay_window_takes_interleaved_counters_once_each() -> None:
    """Streams interleave, so counters arrive out of order: each is accepted once, in any order, while
    it is within the window of the newest; further behind it cannot be told from a replay."""
    window = sealing.ReplayWindow()
    for counter in (5, 3, 9, 4, 0, 8, 1):
        window.accept(counter)
    for counter in (5, 3, 0, 9):
        with pytest.raises(SealError, match="a replay"):
            window.accept(counter)
    window.accept(2)  # never seen, still inside the window
    window.accept(9 + sealing.WINDOW)  # the newest moves: 9 is now the oldest counter kept
    with pytest.raises(SealError, match="possible replay"):
        window.accept(6)
    with pytest.raises(SealError, match="already received"):
        window.accept(9 + sealing.WINDOW)
    window.accept(8 + sealing.WINDOW)  # inside the window, never seen
    window.accept(10 * sealing.WINDOW)  # a jump past the whole window forgets everything behind it
    with pytest.raises(SealError, match="possible replay"):
        window.accept(10 + sealing.WINDOW)


def test_a_forged_part_does_not_move_the_window() -> None:
    """Only authenticated messages are recorded: garbage with a far-future counter cannot push real
    messages out of the window."""
    send, opener, _ = session(SealSecrets.from_tokens([TOKEN]), SealSecrets.from_tokens([TOKEN]))
    forged = sealing.COUNTER.pack(10**9) + bytes(40)
    with pytest.raises(SealError, match="failed authentication"):
        opener.open_body(b"B", forged)
    assert opener.replay.newest == -1
    assert opener.open_body(b"B", send.seal_body(b"B", b"{}")) == b"{}"
