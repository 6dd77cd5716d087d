"""Session frames, without sockets: encode, tamper, decode."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import ProtocolError
from swarm._framing import (
    CHUNK_SIZE,
    HEADER_BLOCK_SIZE,
    Frame,
    FrameDecoder,
    FrameEncoder,
    FrameKind,
)

KEY = bytes(range(32))
MAX = 8 * 2**20


def encode(
    kind: FrameKind, payload: bytes, *, encrypt: bool, encoder: FrameEncoder | None = None
) -> bytes:
    encoder = encoder or FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    return b"".join(bytes(b) for b in encoder.encode(kind, payload))


def decoder(encrypt: bool, max_frame_size: int = MAX) -> FrameDecoder:
    return FrameDecoder(KEY, encrypt=encrypt, max_frame_size=max_frame_size)


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize(
    "size", [0, 1, 100, 64 * 1024, 64 * 1024 + 1, CHUNK_SIZE, CHUNK_SIZE + 1, 3 * CHUNK_SIZE + 5]
)
def test_round_trip_in_random_splits(encrypt: bool, size: int) -> None:
    rng = random.Random(size)
    payload = rng.randbytes(size)
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    wire = encode(FrameKind.BYTES, payload, encrypt=encrypt, encoder=encoder)
    wire += encode(FrameKind.EOF, b"", encrypt=encrypt, encoder=encoder)
    # Encrypted: each 1 MiB chunk carries its own tag; plaintext: one tag per payload.
    chunks = -(-size // CHUNK_SIZE) if encrypt else int(size > 0)
    assert len(wire) == 2 * HEADER_BLOCK_SIZE + size + 16 * chunks
    dec = decoder(encrypt)
    frames: list[Frame] = []
    offset = 0
    while offset < len(wire):
        step = rng.choice([1, 7, 21, 1000, 1 << 17])
        frames += dec.feed(wire[offset : offset + step])
        offset += step
    assert frames == [Frame(FrameKind.BYTES, payload), Frame(FrameKind.EOF, b"")]


def test_byte_at_a_time() -> None:
    encoder = FrameEncoder(KEY, encrypt=True, max_frame_size=MAX)
    wire = b"".join(
        encode(k, p, encrypt=True, encoder=encoder)
        for k, p in [
            (FrameKind.OPEN, b"\x91\xa4echo"),
            (FrameKind.MESSAGE, b"\x01"),
            (FrameKind.EOF, b""),
        ]
    )
    dec = decoder(True)
    frames = [f for i in range(len(wire)) for f in dec.feed(wire[i : i + 1])]
    assert [f.kind for f in frames] == [FrameKind.OPEN, FrameKind.MESSAGE, FrameKind.EOF]


@pytest.mark.parametrize("encrypt", [True, False])
def test_nudges_are_authenticated_consumed_and_never_handed_out(encrypt: bool) -> None:
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    wire = encoder.nudge() + encode(FrameKind.MESSAGE, b"\x01", encrypt=encrypt, encoder=encoder)
    wire += encoder.nudge() + encoder.nudge()
    wire += encode(FrameKind.EOF, b"", encrypt=encrypt, encoder=encoder) + encoder.nudge()
    assert len(encoder.nudge()) == HEADER_BLOCK_SIZE
    dec = decoder(encrypt)
    frames = [f for i in range(len(wire)) for f in dec.feed(wire[i : i + 1])]
    assert frames == [Frame(FrameKind.MESSAGE, b"\x01"), Frame(FrameKind.EOF, b"")]
    # a nudge is a frame of the session like any other: its nonce counts
    forged = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX).nudge()
    with pytest.raises(ProtocolError):
        dec.feed(forged)


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_nudge_with_a_payload_is_refused(encrypt: bool) -> None:
    wire = encode(FrameKind.NUDGE, b"x", encrypt=encrypt)
    with pytest.raises(ProtocolError, match="nudge"):
        decoder(encrypt).feed(wire)


def test_encrypted_mode_hides_the_payload_plaintext_mode_does_not() -> None:
    secret = b"the gradients of our model" * 10
    assert secret not in encode(FrameKind.BYTES, secret, encrypt=True)
    assert secret in encode(FrameKind.BYTES, secret, encrypt=False)


@pytest.mark.parametrize("encrypt", [True, False])
def test_every_flipped_byte_is_refused(encrypt: bool) -> None:
    wire = encode(FrameKind.MESSAGE, b"hello world", encrypt=encrypt)
    for position in range(len(wire)):
        tampered = bytearray(wire)
        tampered[position] ^= 0x80
        with pytest.raises(ProtocolError):
            decoder(encrypt).feed(bytes(tampered))


@pytest.mark.parametrize("encrypt", [True, False])
def test_large_and_small_frames_alternate_in_one_session(encrypt: bool) -> None:
    # Large plaintext payloads are authenticated piece by piece as they arrive,
    # small ones in one pass: both must take their nonces in wire order.
    rng = random.Random(7)
    sent = [
        Frame(FrameKind.BYTES, rng.randbytes(size))
        for size in (200_000, 10, 64 * 1024, 0, 3, CHUNK_SIZE + 7, 64 * 1024 - 1, 5)
    ]
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    wire = b"".join(
        encode(frame.kind, bytes(frame.payload), encrypt=encrypt, encoder=encoder)
        for frame in sent
    )
    dec = decoder(encrypt)
    frames: list[Frame] = []
    for offset in range(0, len(wire), 50_000):
        frames += dec.feed(wire[offset : offset + 50_000])
    assert frames == sent


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_flipped_bit_anywhere_in_a_large_frame_is_refused(encrypt: bool) -> None:
    payload = random.Random(3).randbytes(300_000)
    wire = encode(FrameKind.BYTES, payload, encrypt=encrypt)
    positions = [0, HEADER_BLOCK_SIZE - 1, HEADER_BLOCK_SIZE, len(wire) // 2, len(wire) - 17]
    positions += [*random.Random(4).sample(range(len(wire)), 20), len(wire) - 1]
    for position in positions:
        tampered = bytearray(wire)
        tampered[position] ^= 0x01
        dec = decoder(encrypt)
        with pytest.raises(ProtocolError):
            for offset in range(0, len(tampered), 4096):  # pieces, as from a socket
                assert not dec.feed(bytes(tampered[offset : offset + 4096]))


@pytest.mark.parametrize("encrypt", [True, False])
def test_tampered_late_chunk_delivers_nothing(encrypt: bool) -> None:
    payload = bytes(3 * CHUNK_SIZE)
    wire = bytearray(encode(FrameKind.BYTES, payload, encrypt=encrypt))
    wire[-100] ^= 1
    dec = decoder(encrypt)
    with pytest.raises(ProtocolError):
        dec.feed(bytes(wire))
    with pytest.raises(ProtocolError):  # the decoder stays failed
        dec.next_buffer()


@pytest.mark.parametrize("encrypt", [True, False])
def test_reordered_replayed_or_dropped_frames_are_refused(encrypt: bool) -> None:
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    first = encode(FrameKind.MESSAGE, b"\x01", encrypt=encrypt, encoder=encoder)
    second = encode(FrameKind.MESSAGE, b"\x02", encrypt=encrypt, encoder=encoder)
    for wire in (second + first, first + first, second):
        with pytest.raises(ProtocolError):
            decoder(encrypt).feed(wire)


def test_keys_are_per_direction() -> None:
    wire = encode(FrameKind.MESSAGE, b"\x01", encrypt=True)
    with pytest.raises(ProtocolError):
        FrameDecoder(bytes(32), encrypt=True, max_frame_size=MAX).feed(wire)


@pytest.mark.parametrize("encrypt", [True, False])
def test_oversized_frame_is_refused_after_its_header(encrypt: bool) -> None:
    big = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    wire = encode(FrameKind.BYTES, bytes(5000), encrypt=encrypt, encoder=big)
    dec = decoder(encrypt, max_frame_size=4096)
    with pytest.raises(ProtocolError, match="max_frame_size"):
        dec.feed(wire[:HEADER_BLOCK_SIZE])  # refused before any payload arrives
    small = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=4096)
    with pytest.raises(ValueError, match="max_frame_size"):
        next(iter(small.encode(FrameKind.BYTES, bytes(5000))))


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_protocol_error(data: bytes, encrypt: bool) -> None:
    dec = decoder(encrypt)
    with contextlib.suppress(ProtocolError):
        dec.feed(data)


@given(st.data(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_truncated_or_garbled_frames_raise_only_protocol_error(
    data: st.DataObject, encrypt: bool
) -> None:
    payload = data.draw(st.binary(max_size=200))
    wire = encode(FrameKind.MESSAGE, payload, encrypt=encrypt)
    cut = data.draw(st.integers(0, len(wire)))
    junk = data.draw(st.binary(max_size=60))
    garbled = wire[:cut] + junk
    try:
        frames = decoder(encrypt).feed(garbled)
    except ProtocolError:
        return
    # Whatever decodes without error is exactly what was sent.
    assert frames in ([], [Frame(FrameKind.MESSAGE, payload)])


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("size", [1, 64 * 1024, CHUNK_SIZE + 1, 2 * CHUNK_SIZE + 3])
def test_payload_goes_into_the_callers_buffer(encrypt: bool, size: int) -> None:
    """A raw payload offered a buffer that fits is decoded into it (the frame
    holds a view of it); a message, or a payload too large, is not."""
    payload = random.Random(size).randbytes(size)
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    wire = encode(FrameKind.BYTES, payload, encrypt=encrypt, encoder=encoder)
    wire += encode(FrameKind.MESSAGE, b"\x01", encrypt=encrypt, encoder=encoder)
    wire += encode(FrameKind.BYTES, payload, encrypt=encrypt, encoder=encoder)
    dec = decoder(encrypt)
    into = memoryview(bytearray(size + 10))
    small = memoryview(bytearray(size - 1))
    frames: list[Frame] = []
    view = memoryview(wire)
    offers = [into, into, small]
    while view.nbytes:
        buffer = dec.next_buffer(offers[len(frames)])
        count = min(buffer.nbytes, view.nbytes, 1 << 16)
        buffer[:count] = view[:count]
        view = view[count:]
        frame = dec.advance(count)
        if frame is not None:
            frames.append(frame)
    first, message, last = frames
    assert isinstance(first.payload, memoryview) and first.payload.obj is into.obj
    assert bytes(first.payload) == payload
    assert message == Frame(FrameKind.MESSAGE, b"\x01")
    assert last == Frame(FrameKind.BYTES, payload)


@pytest.mark.parametrize("encrypt", [True, False])
def test_released_buffer_is_no_longer_written(encrypt: bool) -> None:
    """After ``release``, the part of the payload already in the caller's buffer
    moves into the decoder's memory; the frame completes without the buffer."""
    size = 2 * CHUNK_SIZE + 3
    payload = random.Random(1).randbytes(size)
    wire = encode(FrameKind.BYTES, payload, encrypt=encrypt)
    dec = decoder(encrypt)
    into = memoryview(bytearray(size))
    half = len(wire) // 2
    view = memoryview(wire)[:half]
    while view.nbytes:
        buffer = dec.next_buffer(into)
        count = min(buffer.nbytes, view.nbytes)
        buffer[:count] = view[:count]
        view = view[count:]
        assert dec.advance(count) is None
    dec.release(into)
    into[:] = bytes(size)
    assert dec.feed(wire[half:]) == [Frame(FrameKind.BYTES, payload)]


@pytest.mark.parametrize("encrypt", [True, False])
def test_progress_sees_the_payload_in_place_as_it_fills(encrypt: bool) -> None:
    """``progress`` reports, in order, how much of a payload is in its final
    place in the caller's buffer: every received piece in plaintext, every
    decrypted chunk when encrypted; it stops once the buffer is released."""
    size = 2 * CHUNK_SIZE + 3
    payload = random.Random(2).randbytes(size)
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=MAX)
    one = encode(FrameKind.BYTES, payload, encrypt=encrypt, encoder=encoder)
    wire = one + encode(FrameKind.BYTES, payload, encrypt=encrypt, encoder=encoder)
    dec = decoder(encrypt)
    into = memoryview(bytearray(size))
    seen: list[int] = []

    def progress(view: memoryview, done: int) -> None:
        assert view.obj is into.obj and view.nbytes == size
        assert bytes(view[:done]) == payload[:done]  # in place, and final
        seen.append(done)

    view = memoryview(wire)
    frame = None
    while frame is None:
        buffer = dec.next_buffer(into, progress)
        count = min(buffer.nbytes, view.nbytes, 100_000)
        buffer[:count] = view[:count]
        view = view[count:]
        frame = dec.advance(count)
    assert seen == sorted(set(seen)) and seen[-1] == size
    if encrypt:
        assert seen == [CHUNK_SIZE, 2 * CHUNK_SIZE, size]
    else:
        assert len(seen) == -(-size // 100_000)
    # The second frame: released two thirds in, it is watched no more.
    seen.clear()
    first = view.nbytes * 2 // 3
    while first > 0:
        buffer = dec.next_buffer(into, progress)
        count = min(buffer.nbytes, first)
        buffer[:count] = view[:count]
        view, first = view[count:], first - count
        assert dec.advance(count) is None
    watched = len(seen)
    assert watched > 0
    dec.release(into)
    assert dec.feed(view) == [Frame(FrameKind.BYTES, payload)]
    assert len(seen) == watched
