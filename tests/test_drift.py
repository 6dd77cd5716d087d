"""Bounded drift under the lossy data plane (``trainer._drift``): pure code, seeded.

Two members train on a flat landscape (their gradients are pure noise, so
nothing pulls their parameters together), averaging gradients through a lossy
all-reduce at 10% packet loss: member j reduces part j; a contribution lost
on its way to the reducer leaves the reducer's own data in that piece's
average (the same for both members), and a reduced piece lost on its way back
leaves the other member with its own gradient there (the members now differ).
Without re-synchronisation the gap between them is a random walk and grows
without bound; with the ``ResyncSchedule`` it stays bounded over thousands of
steps, whether each re-synchronisation is exact or itself lossy (as the
trainer's are: it then contracts the gap rather than closing it).
"""

from __future__ import annotations

import pytest
import torch

from averaging import AllReduceResult
from averaging._datagrams import PIECE_ELEMENTS
from trainer import ResyncSchedule, diverged_fraction, kept_own_fraction, lost_fraction
from trainer._drift import ladder

SIZE = 64 * PIECE_ELEMENTS
PIECES = SIZE // PIECE_ELEMENTS // 2  # per part: two parts, one per member
LOSS = 0.10
LR = 0.1


def result_of(member: int, who: list[list[frozenset[int]]]) -> AllReduceResult:
    """Member ``member``'s all-reduce result: ``who[j][p]`` is in piece p of part j."""
    return AllReduceResult(
        group_id=b"g",
        local_index=member,
        part_bounds=((0, SIZE // 2), (SIZE // 2, SIZE)),
        chunk_elements=PIECE_ELEMENTS,
        contributors=tuple(tuple(part) for part in who),
        failed_senders=frozenset(),
        failed_reducers=frozenset(),
        timed_out=False,
    )


def lossy_average(
    values: list[torch.Tensor], gen: torch.Generator, loss: float = LOSS
) -> tuple[list[torch.Tensor], list[list[list[frozenset[int]]]]]:
    """The two members' results of one lossy all-reduce of ``values`` (a
    gradient round or a re-synchronisation alike), and each one's
    contributors: ``who[i][j][p]`` for piece p of part j at member i. A
    contribution to a reducer is lost with probability ``loss``, and so is a
    reduced piece on its way back."""
    mean = (values[0] + values[1]) / 2
    out = [torch.empty(SIZE), torch.empty(SIZE)]
    both = frozenset({0, 1})
    who: list[list[list[frozenset[int]]]] = [[[], []], [[], []]]
    for j in range(2):  # part j, reduced by member j
        reducer, other = j, 1 - j
        part = slice(j * SIZE // 2, (j + 1) * SIZE // 2)
        lost_in = torch.rand(PIECES, generator=gen) < loss  # other's data to the reducer
        lost_back = torch.rand(PIECES, generator=gen) < loss  # the result to the other
        to_elements = lambda mask: mask.repeat_interleave(PIECE_ELEMENTS)  # noqa: E731
        value = torch.where(to_elements(lost_in), values[reducer][part], mean[part])
        out[reducer][part] = value
        out[other][part] = torch.where(to_elements(lost_back), values[other][part], value)
        for p in range(PIECES):
            reduced = frozenset({reducer}) if lost_in[p] else both
            who[reducer][j].append(reduced)
            who[other][j].append(frozenset({other}) if lost_back[p] else reduced)
    return out, who


def simulate(
    steps: int, resync: str | None, seed: int = 3, resync_loss: float = LOSS
) -> tuple[list[float], list[int], list[float]]:
    """The drift (RMS of the parameters' difference) after each step, the
    intervals the schedules chose, and the share of its values each
    re-synchronisation left member 0 (``kept_own_fraction``). ``resync``:
    None (never), ``"exact"`` (an average that nothing is lost from, as over
    TCP) or ``"lossy"`` (over the lossy plane, as the trainer does)."""
    gen = torch.Generator().manual_seed(seed)
    x = [torch.zeros(SIZE), torch.zeros(SIZE)]
    schedules = [ResyncSchedule(10), ResyncSchedule(10)]
    drift, intervals, kept = [], [], []
    for epoch in range(1, steps + 1):
        grads = [torch.randn(SIZE, generator=gen) for _ in range(2)]
        step, who = lossy_average(grads, gen)
        for i in range(2):
            x[i] -= LR * step[i]
            schedules[i].observe(diverged_fraction(result_of(i, who[i]), senders=2))
        due = [s.due(epoch) for s in schedules]
        intervals.append(schedules[0].interval)
        drift.append(float((x[0] - x[1]).pow(2).mean().sqrt()))  # before any re-sync
        if resync == "exact" and any(due):
            average = (x[0] + x[1]) / 2
            x = [average.clone(), average.clone()]
        elif resync == "lossy" and any(due):
            x, who = lossy_average(x, gen, loss=resync_loss)
            kept.append(kept_own_fraction(result_of(0, who[0])))
    return drift, intervals, kept


def test_the_schedule_follows_the_measured_loss() -> None:
    assert ladder(10) == [10, 5, 1] and ladder(16) == [16, 8, 4, 2, 1] and ladder(1) == [1]
    schedule = ResyncSchedule(10)
    assert schedule.interval == 10  # nothing lost (yet): the longest period
    for _ in range(30):
        schedule.observe(0.095)  # about 10% packet loss, two members
    assert schedule.interval == 5 and schedule.due(15) and not schedule.due(16)
    for _ in range(30):
        schedule.observe(0.3)
    assert schedule.interval == 1
    with pytest.raises(ValueError):
        ResyncSchedule(0)


def test_only_pieces_that_kept_our_own_values_count_as_divergence() -> None:
    """Piece 0 of member 0's own part lost member 1's data on the way in: both
    members get the same average back, so it is lost data but no divergence.
    Piece 1 of member 1's part did not come back to member 0: it kept its own
    values, missing member 1's, and the members now differ there."""
    both, me, other = frozenset({0, 1}), frozenset({0}), frozenset({1})
    who = [[me] + [both] * (PIECES - 1), [both, me] + [both] * (PIECES - 2)]
    result = result_of(0, who)
    piece = 1 / (2 * PIECES)  # one piece of the 2 * PIECES, one of the two senders missing
    assert lost_fraction(result, senders=2) == pytest.approx(2 * piece / 2)
    assert diverged_fraction(result, senders=2) == pytest.approx(piece / 2)
    # the reducer's value that came back holding only the reducer's data is no divergence
    assert diverged_fraction(result_of(0, [[both] * PIECES, [other] * PIECES]), senders=2) == 0
    assert diverged_fraction(result, senders=1) == 0


def test_drift_stays_bounded_at_ten_percent_loss_and_grows_without_resync() -> None:
    steps = 2000
    bounded, intervals, _ = simulate(steps, resync="exact")
    free, _, _ = simulate(steps, resync=None)
    # 10% loss: a tenth of the pieces of the other's part keep our own values,
    # 2.5% of the (element, sender) contributions: every 10 epochs (counting
    # the data lost on the way in as well put it at every 5)
    assert set(intervals[100:]) == {10}
    early, late = max(bounded[100:1000]), max(bounded[1000:])
    # Bounded: the second half of the run drifts no further than the first
    # (a random walk would be sqrt(2) further at the end of each half).
    assert late < 1.25 * early
    # The bound in numbers: between re-synchronisations at most 10 steps, each
    # moving a tenth of the elements apart by LR * (own - the average).
    assert late < LR * 10**0.5
    # Without re-synchronisation the gap is a random walk: far beyond it, and growing.
    assert free[-1] > 5 * late
    assert min(free[-100:]) > 1.3 * max(free[400:500])


def test_lossy_resynchronisations_contract_the_drift_and_keep_it_bounded() -> None:
    """The re-synchronisations themselves over the lossy plane (the trainer's
    way): each leaves the two members apart only where a reduced piece did
    not come back (10% of the other's part), so the gap shrinks geometrically
    (by sqrt(0.1) in RMS at most, ``_drift``) rather than to 0, and the drift
    stays within the bound ``W / (1 - sqrt(c))`` of the exact ones' ``W``."""
    steps = 2000
    lossy, intervals, kept = simulate(steps, resync="lossy")
    exact, _, _ = simulate(steps, resync="exact")
    free, _, _ = simulate(steps, resync=None)
    # the state rounds do not feed the schedule: the same period as before
    assert set(intervals[100:]) == {10}
    # each re-synchronisation left member 0 its own values on a tenth of the
    # other's part: 5% of its vector (199 rounds, 32 pieces lost or not each)
    assert len(kept) == steps // 10 and 0.03 < sum(kept) / len(kept) < 0.07
    early, late = max(lossy[100:1000]), max(lossy[1000:])
    assert late < 1.25 * early  # bounded: no growth from one half to the next
    c = LOSS  # two members: the share of a piece's results that do not come back
    assert late < LR * 10**0.5 / (1 - c**0.5)  # the module's bound on the exact one's
    # and for two members, whose gap gets independent zero-mean increments,
    # the variances add: W / sqrt(1 - c), 1.05 times the exact ones' drift
    assert late < 1.15 * max(exact[1000:])
    assert free[-1] > 5 * late


def test_a_resynchronisation_that_contracts_nothing_leaves_a_random_walk() -> None:
    """The test above fails if the re-synchronisation does not contract the
    gap: with every datagram of the re-synchronisations lost, each member
    keeps its own values and the drift grows as without re-synchronising."""
    steps = 2000
    nothing, _, kept = simulate(steps, resync="lossy", resync_loss=1.0)
    free, _, _ = simulate(steps, resync=None)
    assert all(k == 0.5 for k in kept)  # the other's whole part kept our own values
    assert min(nothing[-100:]) > 1.3 * max(nothing[400:500])
    assert nothing[-1] > 0.5 * free[-1]
