"""The handshake state machine, without sockets: feed bytes, get bytes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import Identity, ProtocolError
from swarm._handshake import Handshake

A = Identity.from_seed(b"a" * 32)
B = Identity.from_seed(b"b" * 32)
C = Identity.from_seed(b"c" * 32)


def seeded(seed: int) -> random.Random:
    return random.Random(seed)


def pair(
    *,
    dialer: Identity = A,
    listener: Identity = B,
    encrypt_dialer: bool = True,
    encrypt_listener: bool = True,
    key_dialer: bytes | None = None,
    key_listener: bytes | None = None,
    seed: int = 0,
) -> tuple[Handshake, Handshake]:
    rng = seeded(seed)
    d = Handshake(
        dialer,
        initiator=True,
        encrypt=encrypt_dialer,
        expected_peer=listener.peer_id,
        swarm_key=key_dialer,
        random_bytes=rng.randbytes,
    )
    listener_hs = Handshake(
        listener,
        initiator=False,
        encrypt=encrypt_listener,
        swarm_key=key_listener,
        random_bytes=rng.randbytes,
    )
    return d, listener_hs


def run(d: Handshake, listener: Handshake, *, byte_at_a_time: bool = False) -> list[bytes]:
    """Drive both sides to completion; return the messages M1, M2, M3."""

    def deliver(hs: Handshake, data: bytes) -> bytes:
        if not byte_at_a_time:
            return hs.receive_data(data)
        out = b""
        for i in range(len(data)):
            out += hs.receive_data(data[i : i + 1])
        return out

    m1 = d.start()
    m2 = deliver(listener, m1)
    m3 = deliver(d, m2)
    assert deliver(listener, m3) == b""
    return [m1, m2, m3]


@pytest.mark.parametrize(
    ("enc_d", "enc_l"), [(True, True), (False, False), (True, False), (False, True)]
)
def test_happy_path_agrees_on_keys_and_identities(enc_d: bool, enc_l: bool) -> None:
    d, listener = pair(encrypt_dialer=enc_d, encrypt_listener=enc_l)
    run(d, listener)
    assert d.complete and listener.complete
    assert d.result.remote_peer == B.peer_id
    assert listener.result.remote_peer == A.peer_id
    # Encrypted if either side asks for it.
    assert d.result.encrypt == listener.result.encrypt == (enc_d or enc_l)
    assert d.result.send_key == listener.result.receive_key
    assert d.result.receive_key == listener.result.send_key
    assert d.result.send_key != d.result.receive_key
    assert d.result.transcript_hash == listener.result.transcript_hash


def test_byte_at_a_time_gives_the_same_result() -> None:
    whole = pair(seed=7)
    run(*whole)
    split = pair(seed=7)
    run(*split, byte_at_a_time=True)
    assert whole[0].result == split[0].result
    assert whole[1].result == split[1].result


def test_fresh_randomness_gives_fresh_keys() -> None:
    first, second = pair(seed=1), pair(seed=2)
    run(*first)
    run(*second)
    assert first[0].result.send_key != second[0].result.send_key


def test_wrong_expected_peer_is_refused() -> None:
    rng = seeded(3)
    d = Handshake(A, initiator=True, expected_peer=C.peer_id, random_bytes=rng.randbytes)
    listener = Handshake(B, initiator=False, random_bytes=rng.randbytes)
    m2 = listener.receive_data(d.start())
    with pytest.raises(ProtocolError, match="expected peer"):
        d.receive_data(m2)
    assert not d.complete
    with pytest.raises(ProtocolError):  # failed for good
        d.receive_data(b"\x00")


@pytest.mark.parametrize("message", [1, 2])
def test_every_flipped_byte_is_refused(message: int) -> None:
    """A single flipped bit anywhere in M2 (checked by the dialer) or M3
    (checked by the listener) fails the handshake, or leaves it waiting for
    bytes that never come (a flipped length prefix); it never completes."""
    _, m2, m3 = run(*pair(seed=11))
    original = [m2, m3][message - 1]
    for position in range(len(original)):
        d, listener = pair(seed=11)
        sent_m2 = listener.receive_data(d.start())
        assert sent_m2 == m2
        tampered = bytearray(original)
        tampered[position] ^= 0x04
        if message == 1:
            target, data = d, bytes(tampered)
        else:
            assert d.receive_data(m2) == m3
            target, data = listener, bytes(tampered)
        try:
            target.receive_data(data)
        except ProtocolError:
            continue
        assert not target.complete, f"tampered byte {position} was accepted"
        assert position < 2, "only the length prefix may leave it waiting"


def test_tampered_m1_is_detected_by_the_dialer() -> None:
    d, listener = pair(seed=5)
    m1 = bytearray(d.start())
    m1[-3] ^= 0x01  # inside the dialer's nonce
    m2 = listener.receive_data(bytes(m1))
    with pytest.raises(ProtocolError, match="signature"):
        d.receive_data(m2)


def test_replayed_listener_reply_is_refused() -> None:
    """An M2 recorded from one handshake does not complete another."""
    _, recorded_m2, _ = run(*pair(seed=21))
    d, _ = pair(seed=22)
    d.start()
    with pytest.raises(ProtocolError, match="signature"):
        d.receive_data(recorded_m2)


def test_reflected_signature_is_refused() -> None:
    """A peer cannot answer a dialer with the dialer's own M3 material: the
    listener and dialer signatures carry different labels and transcripts."""
    d1, l1 = pair(dialer=A, listener=B, seed=31)
    _, _m2, m3 = run(d1, l1)
    # A man in the middle posing as A's listener replays A's own M3 as the
    # listener's answer in a new handshake where A dials "A".
    d2 = Handshake(A, initiator=True, expected_peer=A.peer_id, random_bytes=seeded(32).randbytes)
    d2.start()
    with pytest.raises(ProtocolError):
        d2.receive_data(m3)


def test_low_order_ephemeral_key_is_refused() -> None:
    from swarm._wire import pack, unpack

    d, listener = pair(seed=41)
    m1 = d.start()
    fields = unpack(m1[2:])
    fields[1] = bytes(32)  # the all-zero point
    payload = pack(fields)
    forged = len(payload).to_bytes(2, "big") + payload
    with pytest.raises(ProtocolError):
        m2 = listener.receive_data(forged)
        d.receive_data(m2)


def test_swarm_key_must_match() -> None:
    key = b"k" * 32
    ok = pair(key_dialer=key, key_listener=key, seed=51)
    run(*ok)
    assert ok[0].result.send_key == ok[1].result.receive_key
    plain = pair(seed=51)
    run(*plain)
    assert plain[0].result.send_key != ok[0].result.send_key  # the key is mixed in

    d, listener = pair(key_dialer=b"x" * 32, key_listener=key, seed=52)
    with pytest.raises(ProtocolError, match="swarm"):
        d.receive_data(listener.receive_data(d.start()))

    d, listener = pair(key_dialer=None, key_listener=key, seed=53)
    with pytest.raises(ProtocolError, match="private swarm"):
        d.receive_data(listener.receive_data(d.start()))

    d, listener = pair(key_dialer=key, key_listener=None, seed=54)
    with pytest.raises(ProtocolError, match="swarm"):
        d.receive_data(listener.receive_data(d.start()))


def test_bytes_after_the_handshake_are_kept() -> None:
    d, listener = pair(seed=61)
    m2 = listener.receive_data(d.start())
    m3 = d.receive_data(m2)
    assert listener.receive_data(m3 + b"session bytes") == b""
    assert listener.complete
    assert listener.unused_data == b"session bytes"


def test_oversized_or_empty_message_is_refused() -> None:
    listener = Handshake(B, initiator=False)
    with pytest.raises(ProtocolError):
        listener.receive_data(b"GET / HTTP/1.1\r\n")
    listener = Handshake(B, initiator=False)
    with pytest.raises(ProtocolError):
        listener.receive_data(b"\x00\x00")


@given(st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    for hs in (Handshake(B, initiator=False), Handshake(A, initiator=True)):
        hs.start()
        try:
            hs.receive_data(data)
        except ProtocolError:
            continue
        assert not hs.complete


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_truncated_or_garbled_messages_raise_only_protocol_error(data: st.DataObject) -> None:
    m1, m2, m3 = run(*pair(seed=71))
    which = data.draw(st.sampled_from([1, 2, 3]))
    original = [m1, m2, m3][which - 1]
    cut = data.draw(st.integers(0, len(original)))
    junk = data.draw(st.binary(max_size=40))
    garbled = original[:cut] + junk
    d, listener = pair(seed=71)
    if which == 1:
        target = listener
    elif which == 2:
        d.start()
        target = d
    else:
        listener.receive_data(d.start())
        target = listener
    try:
        target.receive_data(garbled)
    except ProtocolError:
        return
    if target.complete:  # only possible if the junk left the message intact
        assert garbled.startswith(original)
