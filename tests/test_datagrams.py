"""The lossy all-reduce's datagrams (``averaging._datagrams``): pure code, no network.

Every way a datagram can be wrong is dropped, counted under its reason, and
never handed out; a valid one comes out exactly as sealed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from averaging._datagrams import (
    HEADER,
    MAX_DATAGRAM_SIZE,
    PIECE_ELEMENTS,
    DatagramOpener,
    DatagramSealer,
    Kind,
    Pair,
    group_tag,
    key_label,
    peek_route,
)
from swarm._handshake import HandshakeResult, exported_key

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


def test_offset_off_the_grid_or_wrong_count_is_dropped() -> None:
    datagram = bytearray(sealed_pieces()[1])
    fields = list(HEADER.unpack_from(datagram))
    for index, value in ((7, fields[7] + 1), (8, fields[8] - 1), (7, 10 * PIECE_ELEMENTS)):
        changed = list(fields)
        changed[index] = value
        opener = DatagramOpener(KEY, PAIR)
        assert opener.open(HEADER.pack(*changed) + bytes(datagram[HEADER.size :])) is None
        assert opener.dropped == {"misplaced": 1}


def test_replays_and_duplicates_are_dropped_and_the_first_copy_stays() -> None:
    opener = DatagramOpener(KEY, PAIR)
    first = sealed_pieces()[0]
    assert opener.open(first) is not None
    assert opener.open(first) is None  # the same datagram again
    sealer = DatagramSealer(KEY, PAIR)
    sealer.seq = 100
    again = sealer.seal(0, torch.zeros(PIECE_ELEMENTS))  # same piece, new number
    assert opener.open(again) is None
    assert opener.dropped == {"replayed": 1, "duplicate": 1} and opener.received == 1


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
    data = bytearray(original)
    for position, xor in edits:
        data[position % len(data)] ^= xor
    if cut is not None:
        data = data[:cut]
    opener = DatagramOpener(KEY, PAIR)
    opened = opener.open(bytes(data))
    if bytes(data) == original:
        assert opened is not None
    else:
        assert opened is None and sum(opener.dropped.values()) == 1


@given(data=st.binary(max_size=1500))
@_FUZZ
def test_random_bytes_are_dropped(data: bytes) -> None:
    opener = DatagramOpener(KEY, PAIR)
    assert opener.open(data) is None
    peek_route(data)
