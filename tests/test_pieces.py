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
    MAX_LAG,
    MAX_PROBE,
    MIN_SAMPLE,
    PROBE,
    Pacer,
    PacerRegistry,
    Path,
    Schedule,
    Sending,
)
from averaging._pieces import PieceMask, PieceReducer, contributor_codes
from swarm import PeerID, ProtocolError

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


def span_at(rate: float, datagrams: int = 1000) -> float:
    """Seconds that ``datagrams`` full datagrams take at ``rate`` bytes per second."""
    return datagrams * DATAGRAM_BYTES / rate


def test_pacer_starts_fast_and_settles_under_a_bottleneck() -> None:
    pacer, path = Pacer(), Path()
    # The fast start doubles while the datagrams arrive as fast as they left.
    span = span_at(INITIAL_RATE)
    pacer.report(path, 1000, 1000, span, span, paced_at=INITIAL_RATE)
    assert pacer.rate == INITIAL_RATE * FAST_START
    # A queue: 1000 datagrams sent in 0.1 s arrived over 0.2 s.
    assert pacer.report(path, 1000, 1000, 0.1, 0.2, paced_at=pacer.rate)
    assert pacer.rate == pytest.approx(BACKOFF * 1000 * DATAGRAM_BYTES / 0.2)
    assert not pacer.fast_start
    # After it, a path that keeps up is probed gently.
    before = pacer.rate
    span = span_at(before)
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=before)
    assert pacer.rate == pytest.approx(before * PROBE)


def test_pacer_learns_random_loss_per_path_and_backs_off_only_above_it() -> None:
    pacer, lossy, clean = Pacer(), Path(), Path()
    span = span_at(INITIAL_RATE)
    # 10% random loss, no queue: the path's own loss, and the rate still grows.
    assert not pacer.report(lossy, 1000, 900, span, span, paced_at=INITIAL_RATE)
    assert lossy.base_loss == pytest.approx(0.1)
    assert pacer.rate == INITIAL_RATE * FAST_START
    # The same loss again: still no congestion.
    span = span_at(pacer.rate)
    assert not pacer.report(lossy, 1000, 905, span, span, paced_at=pacer.rate)
    # Another path has none of it: the same loss there is congestion.
    clean.base_loss = 0.0
    rate = pacer.rate
    assert pacer.report(clean, 1000, 900, span, span, paced_at=rate)
    assert pacer.rate == pytest.approx(BACKOFF * 900 * DATAGRAM_BYTES / span)
    # 30% lost without a queue (a drop-tail queue that overflowed): congestion,
    # and the rate drops to what came through, random loss added back.
    before = pacer.rate
    span = span_at(before)
    assert pacer.report(lossy, 1000, 700, span, span, paced_at=before)
    base = lossy.base_loss
    assert base is not None and base == pytest.approx(0.1 + 0.3 * (0.095 - 0.1))
    assert pacer.rate == pytest.approx(BACKOFF * 700 * DATAGRAM_BYTES / span / (1 - base))
    assert pacer.rate < before


def test_pacer_ignores_nonsense_and_a_blocked_path_and_a_busy_sender_probes() -> None:
    pacer, path = Pacer(), Path()
    rate = INITIAL_RATE
    pacer.report(path, MIN_SAMPLE - 1, 0, 1.0, 0.0, paced_at=rate)  # too few
    pacer.report(path, 100, 101, 1.0, 1.0, paced_at=rate)  # more received than sent
    pacer.report(path, 100, 100, float("nan"), 1.0, paced_at=rate)
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=0.0)
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=float("inf"))
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=rate, share=0.0)
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=rate, share=1.5)
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=rate, flows=0)
    assert pacer.rate == INITIAL_RATE and path.base_loss is None
    pacer.report(path, 100, 100, 1.0, 1.0, paced_at=rate, late=-1.0)  # nonsense
    assert pacer.rate == INITIAL_RATE
    # Its bursts left half a span behind their turns (its CPU was busy): the
    # rate was tested in bursts only, and grows by a probe, not the fast start.
    span = 2 * span_at(INITIAL_RATE)
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=rate, late=span / 2)
    assert pacer.rate == pytest.approx(INITIAL_RATE * PROBE) and pacer.fast_start
    rate = pacer.rate
    # Nothing came through: a blocked path, whose flow must not slow the others.
    assert not pacer.report(path, 1000, 0, span_at(rate), 0.0, paced_at=rate)
    assert pacer.rate == rate and pacer.fast_start


def test_a_flow_reports_for_its_share_of_the_rate() -> None:
    """A flow paced at a third of the rate that delivered a third of the
    bottleneck says the whole rate was the bottleneck's; one that did send at
    its share of the rate was not short of CPU."""
    pacer, path = Pacer(rate=6e6, fast_start=False), Path()
    flow = 6e6 / 3
    # 1000 datagrams at 2 MB/s arrived at 1.5 MB/s: the phase's rate was
    # 3 x 1.5 MB/s at the bottleneck.
    assert pacer.report(path, 1000, 1000, span_at(flow), span_at(1.5e6), 6e6, share=1 / 3)
    assert pacer.rate == pytest.approx(BACKOFF * 4.5e6)
    rate = pacer.rate
    span = span_at(rate / 3)
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=rate, share=1 / 3)
    assert pacer.rate == pytest.approx(rate * PROBE)


def test_a_flow_alone_at_its_phase_end_backs_off_for_an_equal_share_only() -> None:
    """Issue 18's tenth pass: one of a phase's 3 flows, alone at its end (the
    others done), went at the whole rate of 6 MB/s and met a queue at its
    receiver's downlink, which two other senders filled too: a third of it
    came through. That is the path's speed for one flow of three, so the
    rate stays at what keeps each of the phase's flows there (3 x 2 MB/s),
    rather than falling to what one of them got (2 MB/s: the 20 Mbit/s bed
    ran at 7-10 Mbit/s for rounds after each such report)."""
    registry, peer = PacerRegistry(), PeerID(b"\x01" * 20)
    registry.pacer = Pacer(rate=6e6, fast_start=False)
    alone = Sending(1000, span_at(6e6), 6e6, share=1.0, late=0.0, flows=3)
    registry.sender_report(peer, alone, 1000, span_at(2e6))
    assert registry.pacer.rate == pytest.approx(BACKOFF * 6e6)
    # With a third of the rate its arrivals say the same.
    registry.pacer = Pacer(rate=6e6, fast_start=False)
    equal = Sending(1000, span_at(2e6), 6e6, share=1 / 3, late=0.0, flows=3)
    registry.sender_report(peer, equal, 1000, span_at(2e6 * 0.8))
    assert registry.pacer.rate == pytest.approx(BACKOFF * 3 * 2e6 * 0.8)
    # Less than an equal share (the flows of a phase overlapped the last
    # phase's): the share it had, as before.
    registry.pacer = Pacer(rate=6e6, fast_start=False)
    squeezed = Sending(1000, span_at(1e6), 6e6, share=1 / 6, late=0.0, flows=3)
    registry.sender_report(peer, squeezed, 1000, span_at(0.5e6))
    assert registry.pacer.rate == pytest.approx(BACKOFF * 6 * 0.5e6)


def test_pacer_judges_a_report_by_the_rate_its_phase_was_paced_at() -> None:
    """Two flows paced at the first rate overlap; the first report doubles
    the rate. The second, about a flow that did send at the rate it was paced
    at, is no sign of a sender short of CPU, and being stale it neither
    raises the rate again nor lowers it."""
    pacer, path = Pacer(), Path()
    first = pacer.rate
    span = span_at(first)
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=first)
    doubled = pacer.rate
    assert doubled == first * FAST_START
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=first)
    assert pacer.rate == doubled and pacer.fast_start
    # The next phase, paced at the doubled rate, doubles it again: the rate
    # is not held where a stale report found it.
    span = span_at(doubled)
    assert not pacer.report(path, 1000, 1000, span, span, paced_at=doubled)
    assert pacer.rate == doubled * FAST_START


def test_a_report_on_results_a_round_late_counts_once_for_the_last_flow_only() -> None:
    """A member reports what it got of a reducer's results with its next
    header: the reducer feeds it to its pacer once, if it is about the last
    flow it sent that peer; and judged against the rate of that flow, so a
    report that comes after the rate moved cannot raise it."""
    registry = PacerRegistry()
    peer, other = PeerID(bytes([1]) * 20), PeerID(bytes([2]) * 20)
    first = registry.pacer.rate
    span = span_at(first)
    registry.results_sent(peer, 7, Sending(1000, span, first, 1.0, 0.0))
    assert not registry.late_report(peer, 6, 1000, span)  # another round's flow
    assert not registry.late_report(other, 7, 1000, span)  # another peer
    assert registry.late_report(peer, 7, 1000, span) and registry.late_reports == 1
    assert registry.pacer.rate == first * FAST_START
    assert not registry.late_report(peer, 7, 1000, span)  # once only
    # Only the last flow sent to a peer waits for its report.
    raised = registry.pacer.rate
    registry.results_sent(peer, 8, Sending(1000, span_at(raised), raised, 1.0, 0.0))
    registry.results_sent(peer, 9, Sending(1000, span_at(raised), raised, 1.0, 0.0))
    assert not registry.late_report(peer, 8, 1000, span_at(raised))
    # Meanwhile a report in the round raised the rate: the late one is stale.
    registry.sender_report(other, Sending(1000, span_at(raised), raised, 1.0, 0.0), 1000, 0.0)
    assert registry.pacer.rate == raised * FAST_START
    assert registry.late_report(peer, 9, 1000, span_at(raised)) and registry.late_reports == 2
    assert registry.pacer.rate == raised * FAST_START
    # The member's side: what it got waits for its next header to that peer.
    assert registry.take_got(peer) is None
    registry.results_got(peer, 3, 5, 0.01)
    assert registry.take_got(other) is None
    assert registry.take_got(peer) == (3, 5, 0.01)
    assert registry.take_got(peer) is None


def test_a_stale_congested_report_lowers_the_rate_at_most_to_its_back_off() -> None:
    pacer, path = Pacer(rate=4e6, fast_start=False), Path()
    # A phase at 4 MB/s built a queue: delivered 2 MB/s.
    span = span_at(4e6)
    assert pacer.report(path, 1000, 1000, span, span_at(2e6), paced_at=4e6)
    assert pacer.rate == pytest.approx(BACKOFF * 2e6)
    lowered = pacer.rate
    # A report about an overlapping flow at 4 MB/s that delivered 3 MB/s
    # comes later: it must not raise the rate back.
    assert pacer.report(path, 1000, 1000, span, span_at(3e6), paced_at=4e6)
    assert pacer.rate == lowered
    # One that delivered less lowers it further.
    assert pacer.report(path, 1000, 1000, span, span_at(1e6), paced_at=4e6)
    assert pacer.rate == pytest.approx(BACKOFF * 1e6)


def test_the_probe_accelerates_until_a_congestion() -> None:
    pacer, path = Pacer(rate=1e6, fast_start=False), Path()
    factors = []
    for _ in range(7):
        before = pacer.rate
        span = span_at(before)
        assert not pacer.report(path, 1000, 1000, span, span, paced_at=before)
        factors.append(pacer.rate / before)
    expected = [PROBE, PROBE, PROBE, 2 * PROBE - 1, 4 * PROBE - 3, MAX_PROBE, MAX_PROBE]
    assert factors == pytest.approx(expected)
    # A congestion starts the probe over.
    rate = pacer.rate
    assert pacer.report(path, 1000, 1000, span_at(rate), 2 * span_at(rate), paced_at=rate)
    assert pacer.probe_factor == PROBE


def test_flows_on_one_schedule_take_turns_and_never_exceed_the_rate() -> None:
    """Three flows ask for bursts of 1,000 bytes at 1 MB/s, each as soon as
    its last one left: each burst starts 1 ms after the one before it,
    whichever flow it is for, and no flow's burst waits longer than the
    others' turns."""
    schedule = Schedule()
    rate = 1e6
    # (when a flow asks for its next burst, in which order, which flow)
    asks = [(0.0, i, flow) for i, flow in enumerate("abc")]
    starts: list[tuple[float, str]] = []
    for n in range(30):
        asks.sort()
        now, _, flow = asks.pop(0)
        start, late = schedule.reserve(now, 1000, rate)
        assert late == 0.0
        starts.append((start, flow))
        asks.append((max(start, now), 3 + n, flow))  # asks again once it left
    times = [t for t, _ in starts]
    assert times == pytest.approx([-MAX_LAG + i * 1e-3 for i in range(30)])
    assert [f for _, f in starts[:6]] == ["a", "b", "c", "a", "b", "c"]


def test_a_late_burst_goes_at_once_and_the_schedule_restarts_from_it() -> None:
    schedule = Schedule()
    start, late = schedule.reserve(10.0, 1000, 1e6)
    assert (start, late) == (10.0 - MAX_LAG, 0.0)  # an idle timeline: not late
    # Its turn came at 10.0 - MAX_LAG + 0.001; asked 50 ms later, the burst
    # goes at once, 50 ms behind its turn less the lag allowed.
    start, late = schedule.reserve(10.05, 1000, 1e6)
    assert start == pytest.approx(10.05 - MAX_LAG)
    assert late == pytest.approx(0.05 - 0.001)
    # The next turn follows that burst, not the turns that were missed.
    start, late = schedule.reserve(10.05, 1000, 1e6)
    assert start == pytest.approx(10.05 - MAX_LAG + 0.001) and late == 0.0


def test_a_path_whose_loss_comes_in_bursts_learns_its_spread() -> None:
    """Reports of a path with 10% loss in bursts stray by several points
    either way: after a few, a report 6 points over the base is the path's
    own loss, not congestion; loss three times the base still is."""
    pacer, path = Pacer(rate=4e6, fast_start=False), Path()
    rng = random.Random(7)
    congested = 0
    for _ in range(40):
        rate = pacer.rate
        span = span_at(rate)
        received = 1000 - round(1000 * rng.choice([0.05, 0.08, 0.10, 0.12, 0.15]))
        congested += pacer.report(path, 1000, received, span, span, paced_at=rate)
    assert path.base_loss == pytest.approx(0.1, abs=0.04)
    assert congested <= 4  # while it learns the spread
    rate = pacer.rate
    span = span_at(rate)
    assert not pacer.report(path, 1000, 840, span, span, paced_at=rate)
    assert pacer.report(path, 1000, 700, span, span, paced_at=pacer.rate)
