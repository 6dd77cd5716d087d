"""The lossy all-reduce's datagrams (``averaging._datagrams``): pure code, no network.

Every way a datagram can be wrong is dropped, counted under its reason, and
never handed out; a valid one comes out exactly as sealed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from averaging._datagrams import (
    HEADER,
    MAX_CONTROL_MESSAGE,
    MAX_DATAGRAM_SIZE,
    PIECE_ELEMENTS,
    ControlOpener,
    ControlSealer,
    DatagramOpener,
    DatagramSealer,
    Kind,
    Pair,
    group_tag,
    key_label,
    peek_route,
)
from swarm import ConfigError
from swarm._handshake import HandshakeResult, exported_key
from swarm._wire import pack

KEY = bytes(range(32))
PAIR = Pair(
    Kind.PART, group_tag(b"group"), 12345, part=2, sender=1, part_size=2 * PIECE_ELEMENTS + 5
)
VALUES = torch.linspace(-1, 1, PAIR.part_size)


def sealed_pieces(pair: Pair = PAIR, key: bytes = KEY) -> list[bytes]:
    sealer = DatagramSealer(key, pair)
    out = []
    for piece in range(pair.num_pieces):
        a, b = pair.piece_bounds(piece)
        out.append(sealer.seal(piece, VALUES[a:b]))
    return out


def test_pieces_round_trip_and_fit_one_frame() -> None:
    opener = DatagramOpener(KEY, PAIR)
    datagrams = sealed_pieces()
    assert PAIR.num_pieces == 3
    assert max(len(d) for d in datagrams) <= MAX_DATAGRAM_SIZE
    assert len(datagrams[0]) == HEADER.size + 4 * PIECE_ELEMENTS + 16
    for datagram in reversed(datagrams):  # reordered: each goes to its offset
        assert peek_route(datagram) == (Kind.PART, 2, 1)
        opened = opener.open(datagram)
        assert opened is not None
        piece, values = opened
        a, b = PAIR.piece_bounds(piece)
        assert torch.equal(torch.from_numpy(values.copy()), VALUES[a:b])
    assert opener.received == 3 and not opener.dropped


def other(**changes: object) -> Pair:
    return dataclasses.replace(PAIR, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("datagram", "reason"),
    [
        (sealed_pieces()[0][:-1], "misplaced"),  # truncated by one byte
        (sealed_pieces()[0][:20], "malformed"),
        (sealed_pieces()[0] + bytes(MAX_DATAGRAM_SIZE), "malformed"),
        (b"XX" + sealed_pieces()[0][2:], "malformed"),
        (sealed_pieces(other(group_tag=group_tag(b"another group")))[0], "misrouted"),
        (sealed_pieces(other(round=54321))[0], "misrouted"),
        (sealed_pieces(other(part=3))[0], "misrouted"),
        (sealed_pieces(other(sender=0))[0], "misrouted"),
        (sealed_pieces(other(kind=Kind.RESULT))[0], "misrouted"),
        (sealed_pieces(key=bytes(32))[0], "forged"),  # another key: another round or session
    ],
    ids=[
        "truncated",
        "short",
        "oversized",
        "magic",
        "group",
        "round",
        "part",
        "sender",
        "kind",
        "key",
    ],
)
def test_wrong_datagrams_are_dropped(datagram: bytes, reason: str) -> None:
    opener = DatagramOpener(KEY, PAIR)
    assert opener.open(datagram) is None
    assert opener.dropped == {reason: 1} and opener.received == 0


def test_an_index_past_the_part_or_a_size_not_the_pieces_is_dropped() -> None:
    full, last = sealed_pieces()[1], sealed_pieces()[2]
    for datagram, index in ((full, 3), (full, 10 * PIECE_ELEMENTS), (full, 2), (last, 1)):
        fields = list(HEADER.unpack_from(datagram))
        fields[-1] = index
        opener = DatagramOpener(KEY, PAIR)
        assert opener.open(HEADER.pack(*fields) + datagram[HEADER.size :]) is None
        assert opener.dropped == {"misplaced": 1}


def test_replays_are_dropped_undecrypted_and_the_first_copy_stays() -> None:
    opener = DatagramOpener(KEY, PAIR)
    first = sealed_pieces()[0]
    assert opener.open(first) is not None
    assert opener.open(first) is None  # the same datagram again
    # another datagram for the piece: only the key's holder makes one that
    # opens, and its sealer never would (below); it is not even decrypted
    again = DatagramSealer(KEY, PAIR).seal(0, torch.zeros(PIECE_ELEMENTS))
    assert opener.open(again) is None
    assert opener.dropped == {"replayed": 2} and opener.received == 1


def test_a_sealer_seals_each_piece_once_its_number_being_the_nonce() -> None:
    sealer = DatagramSealer(KEY, PAIR)
    sealer.seal(1, VALUES[PIECE_ELEMENTS : 2 * PIECE_ELEMENTS])
    with pytest.raises(ValueError, match="nonce"):
        sealer.seal(1, VALUES[PIECE_ELEMENTS : 2 * PIECE_ELEMENTS])
    with pytest.raises(ValueError):
        sealer.seal(3, VALUES[:5])
    assert sealer.sealed == 1


# The module's own filter of this expected warning is undone by pytest's
# per-test warning capture (the module was imported inside another one).
@pytest.mark.filterwarnings("ignore:invalid value encountered in dot:RuntimeWarning")
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("piece", [0, 2])  # a full piece and the part's short last one
def test_nonfinite_values_are_dropped(bad_value: float, piece: int) -> None:
    sealer = DatagramSealer(KEY, PAIR)
    start, end = PAIR.piece_bounds(piece)
    bad = torch.zeros(end - start)
    bad[end - start - 1] = bad_value
    opener = DatagramOpener(KEY, PAIR)
    assert opener.open(sealer.seal(piece, bad)) is None
    assert opener.dropped == {"nonfinite": 1} and opener.received == 0


def test_the_largest_finite_values_are_kept() -> None:
    """The finiteness check must not mistake large finite values for infinite."""
    big = torch.full((PIECE_ELEMENTS,), float(np.finfo(np.float32).max))
    big[::2] *= -1
    opened = DatagramOpener(KEY, PAIR).open(DatagramSealer(KEY, PAIR).seal(0, big))
    assert opened is not None and np.array_equal(opened[1], big.numpy())


def test_sealer_refuses_pieces_out_of_range() -> None:
    sealer = DatagramSealer(KEY, PAIR)
    with pytest.raises(ValueError):
        sealer.seal(3, torch.zeros(5))
    with pytest.raises(ValueError):
        sealer.seal(0, torch.zeros(5))


def test_both_ends_export_the_same_key_and_labels_separate_keys() -> None:
    d2l, l2d = bytes(32), bytes([1]) * 32
    dialer = HandshakeResult(b"\0" * 32, b"", True, d2l, l2d, b"t" * 32)  # type: ignore[arg-type]
    listener = HandshakeResult(b"\0" * 32, b"", True, l2d, d2l, b"t" * 32)  # type: ignore[arg-type]
    label = key_label(Kind.PART, b"group", 7)
    key = exported_key(dialer, dialer=True, label=label)
    assert key == exported_key(listener, dialer=False, label=label)
    assert key != exported_key(dialer, dialer=True, label=key_label(Kind.RESULT, b"group", 7))
    assert key != exported_key(dialer, dialer=True, label=key_label(Kind.PART, b"group", 8))
    assert key not in (d2l, l2d)


def _altered(original: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    """``original`` with each ``(position, xor)`` of ``edits`` applied (the
    position wrapped), then cut to ``cut`` bytes."""
    data = bytearray(original)
    for position, xor in edits:
        data[position % len(data)] ^= xor
    return bytes(data if cut is None else data[:cut])


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(
    piece=st.integers(0, 2),
    edits=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 1400),
)
@_FUZZ
def test_any_altered_datagram_is_never_accepted(
    piece: int, edits: list[tuple[int, int]], cut: int | None
) -> None:
    original = sealed_pieces()[piece]
    data = _altered(original, edits, cut)
    opener = DatagramOpener(KEY, PAIR)
    opened = opener.open(data)
    if data == original:
        assert opened is not None
    else:
        assert opened is None and sum(opener.dropped.values()) == 1


@given(data=st.binary(max_size=1500))
@_FUZZ
def test_random_bytes_are_dropped(data: bytes) -> None:
    opener = DatagramOpener(KEY, PAIR)
    assert opener.open(data) is None
    peek_route(data)


# control copies: a pair's small control messages as datagrams

CONTROL = dataclasses.replace(PAIR, kind=Kind.REDUCER_CONTROL)
REPORT = ["report", 3, 0.25, [[0, b"\x07"], [1, b"\x05"]]]
MARKER = ["sent", 3, 0.5]


def sealed_control(pair: Pair = CONTROL, key: bytes = KEY) -> list[bytes]:
    sealer = ControlSealer(key, pair)
    return [sealer.seal(REPORT), sealer.seal(MARKER)]


def test_control_messages_round_trip_once_and_copies_are_not_replays() -> None:
    opener = ControlOpener(KEY, CONTROL)
    report, marker = sealed_control()
    assert peek_route(report) == (Kind.REDUCER_CONTROL, 2, 1)
    assert opener.open(marker) == MARKER  # reordered: each stands alone
    assert opener.open(report) == REPORT
    assert opener.open(report) is None and opener.open(marker) is None
    assert opener.copies == 2 and not opener.dropped
    # the same sequence number with other contents: a replay, not a copy
    other = ControlSealer(KEY, CONTROL).seal(MARKER)
    assert opener.open(other) is None and opener.dropped == {"replayed": 1}


def other_control(**changes: object) -> Pair:
    return dataclasses.replace(CONTROL, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("datagram", "reason"),
    [
        (sealed_control()[0][:-1], "forged"),  # truncated by one byte: the tag fails
        (sealed_control()[0][:20], "malformed"),
        (sealed_control()[0] + bytes(MAX_DATAGRAM_SIZE), "malformed"),
        (b"XX" + sealed_control()[0][2:], "malformed"),
        (sealed_control(other_control(group_tag=group_tag(b"another group")))[0], "misrouted"),
        (sealed_control(other_control(round=54321))[0], "misrouted"),
        (sealed_control(other_control(part=3))[0], "misrouted"),
        (sealed_control(other_control(sender=0))[0], "misrouted"),
        (sealed_control(other_control(kind=Kind.SENDER_CONTROL))[0], "misrouted"),
        (sealed_pieces()[0], "misrouted"),  # a piece of values is not a control message
        (sealed_control(key=bytes(32))[0], "forged"),
    ],
    ids=[
        "truncated",
        "short",
        "oversized",
        "magic",
        "group",
        "round",
        "part",
        "sender",
        "direction",
        "values",
        "key",
    ],
)
def test_wrong_control_datagrams_are_dropped(datagram: bytes, reason: str) -> None:
    opener = ControlOpener(KEY, CONTROL)
    assert opener.open(datagram) is None
    assert opener.dropped == {reason: 1}


def seal_control_bytes(payload: bytes, seq: int) -> bytes:
    """A control datagram of ``CONTROL`` around any ``payload``, as only the
    key's holder can seal one."""
    p = CONTROL
    header = HEADER.pack(b"S", 2, p.kind, p.group_tag, p.round, p.part, p.sender, seq)
    return header + AESGCM(KEY).encrypt(seq.to_bytes(12, "little"), payload, header)


def test_a_control_datagram_whose_message_does_not_decode_is_dropped() -> None:
    opener = ControlOpener(KEY, CONTROL)
    assert opener.open(seal_control_bytes(pack(MARKER), 0)) == MARKER  # as ControlSealer does
    assert opener.open(seal_control_bytes(pack(MARKER)[:-1], 1)) is None  # a document cut short
    assert opener.open(seal_control_bytes(pack(MARKER) + b"\x00", 2)) is None  # and one more
    assert opener.dropped == {"malformed": 2}


def test_control_sealer_refuses_long_messages_and_other_kinds() -> None:
    sealer = ControlSealer(KEY, CONTROL)
    assert len(sealer.seal(["x", b"y" * (MAX_CONTROL_MESSAGE - 20)])) <= MAX_DATAGRAM_SIZE
    with pytest.raises(ValueError):
        sealer.seal(["x", b"y" * MAX_CONTROL_MESSAGE])
    with pytest.raises(ConfigError):
        ControlSealer(KEY, PAIR)


@given(
    which=st.integers(0, 1),
    edits=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 1400),
)
@_FUZZ
def test_any_altered_control_datagram_is_never_accepted(
    which: int, edits: list[tuple[int, int]], cut: int | None
) -> None:
    original = sealed_control()[which]
    data = _altered(original, edits, cut)
    opener = ControlOpener(KEY, CONTROL)
    opened = opener.open(data)
    if data == original:
        assert opened == [REPORT, MARKER][which]
    else:
        assert opened is None and sum(opener.dropped.values()) == 1


@given(data=st.binary(max_size=1500))
@_FUZZ
def test_random_bytes_are_no_control_message(data: bytes) -> None:
    opener = ControlOpener(KEY, CONTROL)
    assert opener.open(data) is None
