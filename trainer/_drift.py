"""Bounded drift under the lossy data plane: when to re-synchronise. Pure code.

With ``CollaborativeConfig(lossy=True)`` the members of a group no longer end a
gradient round with the same average: a piece whose reduced value did not come
back keeps the member's own gradient there. (A contribution lost on its way to
the reducer makes that piece's average noisier, but every member that gets
the piece back gets the same value: it moves nobody apart.) Each step then
moves the members' parameters apart a little, at random, and with nothing
pulling them together (a flat direction of the loss) the gap grows like a
random walk: without bound (Weintraub, Banner, Orda 2025, sec. on parameter
drift). The paper bounds it by broadcasting parameters
periodically; we re-synchronise by averaging parameters and optimizer state
over the reliable (TCP) all-reduce, which the trainer already does every
``state_averaging_interval`` epochs, and choose the period from the measured
loss:

    interval = the longest I on the ladder of state_averaging_interval
               with I <= DRIFT_BUDGET / loss (or 1)

and a re-synchronisation follows each epoch that is a multiple of it. The
ladder is ``state_averaging_interval`` divided again and again by its smallest
prime factor (10, 5, 1; 16, 8, 4, 2, 1): each rung divides the ones above, so
peers whose measurements put them on different rungs still meet at every
multiple of the longer period (DESIGN.md, "Scale": when to re-synchronise is
computed by one rule, from the epoch). ``loss`` is a moving average of the
fraction of (element, sender) contributions by which this peer's result may
differ from its group-mates' (``diverged_fraction``: the pieces of others'
parts that kept our own values, each missing the other senders' data; not
``lost_fraction``, which also counts contributions lost on the way to a
reducer and measured 14-17% at 10% packet loss with four members, putting
every run on a re-synchronisation per epoch). Between two
re-synchronisations each element then differs by about ``DRIFT_BUDGET`` of one
member's contribution in expectation, whatever the loss rate, so the gap a
re-synchronisation has to close stays of the same size: O(1) over any number
of steps, as in the paper (where the broadcast period is fixed; we differ in
adapting it to the measured loss and in averaging rather than broadcasting
from one root, so no member's local progress is thrown away).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from averaging import AllReduceResult

#: Expected lost contributions per element between two re-synchronisations.
DRIFT_BUDGET = 0.6
#: Weight of the newest measurement in the moving average of the loss.
LOSS_SMOOTHING = 0.1


def diverged_fraction(result: AllReduceResult, senders: int) -> float:
    """The fraction of (element, sender) contributions by which our result may
    differ from our group-mates': for each piece of another member's part
    that kept our own values (its reduced value did not come back), the other
    senders' data. Our own part is what the others get back: never counted.
    (A piece of another's part that only we delivered is counted too: from
    ``contributors`` alone it looks the same.) 0 for a group of one sender."""
    me = frozenset({result.local_index})

    def kept_ours(part: int, who: frozenset[int]) -> int:
        return senders - 1 if part != result.local_index and who == me else 0

    return _share(result, senders, kept_ours)


def lost_fraction(result: AllReduceResult, senders: int) -> float:
    """The fraction of (element, sender) contributions missing from our result,
    0 for an empty vector or a group of one sender."""
    return _share(result, senders, lambda part, who: senders - len(who))


def _share(
    result: AllReduceResult, senders: int, missing: Callable[[int, frozenset[int]], int]
) -> float:
    """The fraction of (element, sender) contributions of our result that
    ``missing(part, contributors)`` counts per element of each piece; 0 for
    an empty vector or a group of one sender."""
    if senders <= 1:
        return 0.0
    total = gone = 0
    chunk = result.chunk_elements
    for part, (start, end) in enumerate(result.part_bounds):
        for piece, who in enumerate(result.contributors[part]):
            size = min(chunk, end - start - piece * chunk)
            total += size * senders
            gone += size * missing(part, who)
    return gone / total if total else 0.0


class ResyncSchedule:
    """When the next re-synchronisation of parameters is due (module docstring).

    ``max_interval`` (>= 1): the longest period, the trainer's
    ``state_averaging_interval``.
    """

    def __init__(self, max_interval: int) -> None:
        if max_interval < 1:
            raise ValueError("a lossy run must re-synchronise: max_interval must be >= 1")
        self.max_interval = max_interval
        self.loss = 0.0

    def observe(self, loss: float) -> None:
        """One gradient round's ``diverged_fraction``."""
        if math.isfinite(loss) and 0 <= loss <= 1:
            self.loss += LOSS_SMOOTHING * (loss - self.loss)

    @property
    def interval(self) -> int:
        wanted = math.inf if self.loss <= 0 else DRIFT_BUDGET / self.loss
        for rung in ladder(self.max_interval):
            if rung <= wanted:
                return rung
        return 1

    def due(self, epoch: int) -> bool:
        """Whether to re-synchronise after global step ``epoch``."""
        return epoch % self.interval == 0


def ladder(interval: int) -> list[int]:
    """``interval``, then each rung divided by its smallest prime factor, down to 1."""
    rungs = [interval]
    while rungs[-1] > 1:
        n = rungs[-1]
        factor = next(f for f in range(2, n + 1) if n % f == 0)
        rungs.append(n // factor)
    return rungs
