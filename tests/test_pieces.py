"""The lossy all-reduce's piece bookkeeping, estimator and pacing: pure code, seeded."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from averaging._datagrams import PIECE_ELEMENTS
from averaging._pacing import (
    BACKOFF,
    DATAGRAM_BYTES,
    FAST_START,
    INITIAL_RATE,
    MIN_SAMPLE,
    PROBE,
    Pacer,
)
from averaging._pieces import PieceMask, PieceReducer, contributor_codes
from swarm import ProtocolError

N_PIECES = 4
SIZE = N_PIECES * PIECE_ELEMENTS - 10  # the last piece is short


def piece(values: torch.Tensor, p: int) -> torch.Tensor:
    return values[p * PIECE_ELEMENTS : (p + 1) * PIECE_ELEMENTS]


def test_mask_round_trip_and_refusals() -> None:
    mask = PieceMask(11)
    assert mask.add(3) and mask.add(10) and not mask.add(3)
    assert mask.count == 2 and 3 in mask and 4 not in mask and 11 not in mask
    again = PieceMask.from_bytes(mask.to_bytes(), 11)
    assert again.pieces() == [3, 10] and again.count == 2
    assert PieceMask.full(11).complete and PieceMask.full(11).pieces() == list(range(11))
    with pytest.raises(ProtocolError):
        PieceMask.from_bytes(b"\x00", 11)  # one byte short
    with pytest.raises(ProtocolError):
        PieceMask.from_bytes(b"\x00\x08", 11)  # a bit beyond piece 10
    with pytest.raises(ValueError):
        mask.add(11)


@pytest.mark.parametrize("senders", [(0, 1, 2, 3), (1, 5, 70)])  # 70: beyond int64 bits
def test_contributor_codes_name_exactly_the_senders_of_each_piece(senders: tuple[int, ...]) -> None:
    rng = random.Random(7)
    n = 37
    masks = {s: PieceMask(n) for s in senders}
    for mask in masks.values():
        for p in range(n):
            if rng.random() < 0.6:
                mask.add(p)
    codes = contributor_codes(masks, n)
    for p in range(n):
        who = {s for s in senders if int(codes[p]) >> s & 1}
        assert who == {s for s, m in masks.items() if p in m}
    first = masks[senders[0]]
    assert [bool(b) for b in first.array()] == [p in first for p in range(n)]


def test_reducer_codes_agree_with_its_contributors() -> None:
    reducer = PieceReducer(SIZE, {0: 1.0, 1: 0.0, 2: 2.0})
    ones = torch.ones(PIECE_ELEMENTS)
    reducer.add(0, 0, ones)
    reducer.add(1, 1, ones)  # weight 0: in no piece's contributors
    reducer.add(2, 2, ones)
    reducer.add(0, 2, ones)
    reducer.finish()
    codes = reducer.contributor_codes()
    for p in range(N_PIECES):
        assert {s for s in range(3) if int(codes[p]) >> s & 1} == reducer.contributors(p)


def test_each_piece_is_the_mean_over_what_arrived_weights_renormalised() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = {s: torch.randn(SIZE, generator=gen) for s in range(3)}
    weights = {0: 1.0, 1: 2.0, 2: 0.5}
    reducer = PieceReducer(SIZE, weights)
    arrived = {0: range(N_PIECES), 1: [0, 2], 2: [0, 1]}
    for s, pieces in arrived.items():
        for p in pieces:
            assert reducer.add(s, p, piece(xs[s], p))
    assert not reducer.add(1, 0, piece(xs[1], 0))  # a duplicate adds nothing
    assert not reducer.complete([1])
    reducer.finish()
    result = reducer.result()
    for p in range(N_PIECES):
        who = {s for s, pieces in arrived.items() if p in pieces}
        assert reducer.contributors(p) == who
        want = sum(weights[s] * piece(xs[s], p) for s in who) / sum(weights[s] for s in who)
        assert torch.allclose(piece(result, p), want, atol=1e-6, rtol=0)
    assert not reducer.add(2, 3, piece(xs[2], 3))  # after finish: nothing more


def test_a_piece_without_weight_has_no_result() -> None:
    reducer = PieceReducer(SIZE, {0: 0.0, 1: 1.0})
    reducer.add(0, 0, piece(torch.ones(SIZE), 0))
    reducer.finish()
    assert not reducer.has_result(0) and reducer.contributors(0) == frozenset()
    assert not reducer.has_result(1)


def estimate(
    xs: dict[int, torch.Tensor], weights: dict[int, float], arrived: dict[int, list[int]]
) -> torch.Tensor:
    reducer = PieceReducer(SIZE, weights)
    for s, pieces in arrived.items():
        for p in pieces:
            reducer.add(s, p, piece(xs[s], p))
    reducer.finish()
    return reducer.result()


def mean_estimate(lose: str, trials: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator's mean over ``trials`` seeded draws, and ``g``. The
    paper's model: each member's values are ``g`` plus unit noise (unbiased
    estimates of one expected gradient). Members 1..3 lose pieces, the
    reducer's own (member 0) never: ``random`` loses each with probability
    0.3, ``positive`` loses the pieces whose values sum above 0 (a loss that
    depends on the values, which biases any estimator)."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(SIZE, generator=gen)
    weights = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}
    total = torch.zeros(SIZE, dtype=torch.float64)
    for _ in range(trials):
        xs = {s: g + torch.randn(SIZE, generator=gen) for s in weights}
        if lose == "random":
            lost = torch.rand(4, N_PIECES, generator=gen) < 0.3
        else:
            lost = torch.tensor(
                [
                    [bool(piece(xs[s], p).sum() > piece(g, p).sum()) for p in range(N_PIECES)]
                    for s in weights
                ]
            )
        arrived = {s: [p for p in range(N_PIECES) if s == 0 or not lost[s, p]] for s in weights}
        total += estimate(xs, weights, arrived).double()
    return total / trials, g.double()


def test_unbiased_for_the_expected_gradient_over_seeded_loss_patterns() -> None:
    """Per element within 5 standard errors of 3,000 estimates (each a
    weighted mean of unit-variance noise: variance at most 1), and the mean
    error over all elements within 5 standard errors of that average."""
    trials = 3000
    mean, g = mean_estimate("random", trials)
    error = mean - g
    assert error.abs().max() < 5 / trials**0.5
    assert abs(float(error.mean())) < 5 / (trials * SIZE) ** 0.5
    # Tight enough to catch a bias: a loss that depends on the values (here
    # losing the pieces that came out high) moves the mean error far beyond.
    biased, g = mean_estimate("positive", trials=300)
    assert float((biased - g).mean()) < -3 * 5 / (300 * SIZE) ** 0.5


def test_unbiased_for_the_group_mean_with_equal_weights_exactly() -> None:
    """Equal weights, every contribution lost independently with probability
    q: the expectation over all 2^4 arrival patterns (exact enumeration, given
    that something arrived) is exactly the group mean."""
    gen = torch.Generator().manual_seed(9)
    xs = {s: torch.randn(SIZE, generator=gen, dtype=torch.float32) for s in range(4)}
    weights = dict.fromkeys(xs, 1.0)
    q = 0.1
    expectation = torch.zeros(SIZE, dtype=torch.float64)
    mass = 0.0
    for pattern in itertools.product([True, False], repeat=4):
        if not any(pattern):
            continue
        p = 1.0
        for kept in pattern:
            p *= (1 - q) if kept else q
        arrived = {s: list(range(N_PIECES)) if pattern[s] else [] for s in xs}
        expectation += p * estimate(xs, weights, arrived).double()
        mass += p
    group_mean = sum(x.double() for x in xs.values()) / 4
    assert torch.allclose(expectation / mass, group_mean, atol=1e-6, rtol=0)


def test_pacer_starts_fast_and_settles_under_a_bottleneck() -> None:
    pacer = Pacer()
    # The fast start doubles while the datagrams arrive as fast as they left.
    rate = INITIAL_RATE
    pacer.report(1000, 1000, send_span=1000 * DATAGRAM_BYTES / rate, arrival_span=0.5)
    assert pacer.rate == INITIAL_RATE * FAST_START
    # A queue: 1000 datagrams sent in 0.1 s arrived over 0.2 s.
    assert pacer.report(1000, 1000, send_span=0.1, arrival_span=0.2)
    assert pacer.rate == pytest.approx(BACKOFF * 1000 * DATAGRAM_BYTES / 0.2)
    assert not pacer.fast_start
    # After it, a path that keeps up is probed gently.
    before = pacer.rate
    span = 1000 * DATAGRAM_BYTES / before
    assert not pacer.report(1000, 1000, send_span=span, arrival_span=span)
    assert pacer.rate == pytest.approx(before * PROBE)


def test_pacer_learns_random_loss_as_the_base_and_backs_off_only_above_it() -> None:
    pacer = Pacer()
    span = 1000 * DATAGRAM_BYTES / INITIAL_RATE
    # 10% random loss, no queue: the path's own loss, and the rate still grows.
    assert not pacer.report(1000, 900, send_span=span, arrival_span=span)
    assert pacer.base_loss == pytest.approx(0.1)
    assert pacer.rate == INITIAL_RATE * FAST_START
    # The same loss again: still no congestion.
    span = 1000 * DATAGRAM_BYTES / pacer.rate
    assert not pacer.report(1000, 905, send_span=span, arrival_span=span)
    # 30% lost without a queue (a drop-tail queue that overflowed): congestion,
    # and the rate drops to what came through, random loss added back.
    before = pacer.rate
    assert pacer.report(1000, 700, send_span=span, arrival_span=span)
    base = pacer.base_loss
    assert base is not None and base == pytest.approx(0.1 + 0.3 * (0.095 - 0.1))
    assert pacer.rate == pytest.approx(BACKOFF * 700 * DATAGRAM_BYTES / span / (1 - base))
    assert pacer.rate < before


def test_pacer_ignores_small_or_nonsense_reports_and_a_sender_short_of_cpu() -> None:
    pacer = Pacer()
    pacer.report(MIN_SAMPLE - 1, 0, send_span=1.0, arrival_span=0.0)  # too few: no change
    pacer.report(100, 101, send_span=1.0, arrival_span=1.0)  # nonsense: ignored
    pacer.report(100, 100, send_span=float("nan"), arrival_span=1.0)
    assert pacer.rate == INITIAL_RATE
    # Sent at a tenth of its rate (its CPU was busy): the path was not tested.
    span = 10 * 1000 * DATAGRAM_BYTES / INITIAL_RATE
    assert not pacer.report(1000, 1000, send_span=span, arrival_span=span)
    assert pacer.rate == INITIAL_RATE
    pacer.report(100, 0, send_span=1.0, arrival_span=0.0)  # nothing came through
    assert pacer.rate == INITIAL_RATE / 2
