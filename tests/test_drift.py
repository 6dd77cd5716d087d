"""Bounded drift under the lossy data plane (``trainer._drift``): pure code, seeded.

Two members train on a flat landscape (their gradients are pure noise, so
nothing pulls their parameters together), averaging gradients through a lossy
all-reduce at 10% packet loss: a piece whose contribution or result is lost
leaves a member with its own gradient there. Without re-synchronisation the
gap between them is a random walk and grows without bound; with the
``ResyncSchedule`` it stays bounded over thousands of steps.
"""

from __future__ import annotations

import pytest
import torch

from averaging import AllReduceResult
from averaging._datagrams import PIECE_ELEMENTS
from trainer import ResyncSchedule, lost_fraction
from trainer._drift import ladder

SIZE = 64 * PIECE_ELEMENTS
PIECES = SIZE // PIECE_ELEMENTS // 2  # per part: two parts, one per member
LOSS = 0.10
LR = 0.1


def result_of(member: int, kept_own: torch.Tensor) -> AllReduceResult:
    """Member ``member``'s all-reduce result: piece p of part j has both
    members' data, or only the member's own where ``kept_own[j, p]``."""
    both, own = frozenset({0, 1}), frozenset({member})
    return AllReduceResult(
        group_id=b"g",
        local_index=member,
        part_bounds=((0, SIZE // 2), (SIZE // 2, SIZE)),
        chunk_elements=PIECE_ELEMENTS,
        contributors=tuple(
            tuple(own if kept_own[j, p] else both for p in range(PIECES)) for j in range(2)
        ),
        failed_senders=frozenset(),
        failed_reducers=frozenset(),
        timed_out=False,
    )


def simulate(steps: int, resync: bool, seed: int = 3) -> tuple[list[float], list[int]]:
    """The drift (RMS of the parameters' difference) after each step, and
    the intervals the schedules chose."""
    gen = torch.Generator().manual_seed(seed)
    x = [torch.zeros(SIZE), torch.zeros(SIZE)]
    schedules = [ResyncSchedule(10), ResyncSchedule(10)]
    drift, intervals = [], []
    for epoch in range(1, steps + 1):
        grads = [torch.randn(SIZE, generator=gen) for _ in range(2)]
        mean = (grads[0] + grads[1]) / 2
        for i in range(2):
            # A piece of member i's result is its own gradient when the other's
            # contribution was lost on the way to the reducer, or the result
            # on the way back: 1 - (1 - loss)^2 of the pieces.
            kept_own = torch.rand(2, PIECES, generator=gen) < 1 - (1 - LOSS) ** 2
            mask = kept_own.reshape(-1).repeat_interleave(PIECE_ELEMENTS)
            x[i] -= LR * torch.where(mask, grads[i], mean)
            schedules[i].observe(lost_fraction(result_of(i, kept_own), senders=2))
        due = [s.due(epoch) for s in schedules]
        intervals.append(schedules[0].interval)
        drift.append(float((x[0] - x[1]).pow(2).mean().sqrt()))  # before any re-sync
        if resync and any(due):
            # the averaging of parameters over the reliable all-reduce
            average = (x[0] + x[1]) / 2
            x = [average.clone(), average.clone()]
    return drift, intervals


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


def test_drift_stays_bounded_at_ten_percent_loss_and_grows_without_resync() -> None:
    steps = 2000
    bounded, intervals = simulate(steps, resync=True)
    free, _ = simulate(steps, resync=False)
    assert set(intervals[100:]) == {5}  # 10% loss: every 5 epochs
    early, late = max(bounded[100:1000]), max(bounded[1000:])
    # Bounded: the second half of the run drifts no further than the first
    # (a random walk would be sqrt(2) further at the end of each half).
    assert late < 1.25 * early
    # The bound in numbers: between re-synchronisations at most 5 steps, each
    # moving an element apart by LR * (own - mean) on about 19% of the pieces.
    assert late < LR * 5**0.5 * 2
    # Without re-synchronisation the gap is a random walk: far beyond it, and growing.
    assert free[-1] > 5 * late
    assert min(free[-100:]) > 1.3 * max(free[400:500])
