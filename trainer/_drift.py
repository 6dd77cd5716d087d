"""Bounded drift under the lossy data plane: when to re-synchronise. Pure code.

With ``CollaborativeConfig(lossy=True)`` the members of a group no longer end a
gradient round with the same average: a piece whose reduced value did not come
back keeps the member's own gradient there. (A contribution lost on its way to
the reducer makes that piece's average noisier, but every member that gets
the piece back gets the same value: it moves nobody apart.) Each step then
moves the members' parameters apart a little, at random, and with nothing
pulling them together (a flat direction of the loss) the gap grows like a
random walk: without bound (Weintraub, Banner, Orda 2025, sec. on parameter
drift). The paper bounds it by re-broadcasting parameters periodically over
the same lossy network; we re-synchronise by averaging them over the lossy
plane too, and choose the period from the measured loss:

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
member's contribution in expectation, whatever the loss rate.

What a re-synchronisation carries. Only the parameters (and floating-point
buffers, such as BatchNorm's running statistics) integrate the differences
step after step. The optimizer's moments are moving averages of the
gradients each member applied (Adam's m and v, SGD's momentum): their gap is
a moving average of the gradients' gaps, which contracts by the decay rate
every step and stays bounded by itself. So a re-synchronisation averages the
parameters and buffers in the gradient round itself, appended to the
gradients (they "ride": one all-reduce of up to twice the gradient's bytes,
no matchmaking or state round of their own; ``_riding`` in the optimizer),
and the whole state (the moments too) is averaged in a state round only
every ``state_averaging_interval`` epochs, as over TCP. The ride is the
parameters before the step: each member then steps from the group's
average with the gradients it got back. Parameters too large for one
staging chunk (``state_chunk_elements``) do not ride; those runs
re-synchronise the whole state in state rounds, as before. On the bed
(docs/lossy-plane.md, twenty-first pass), a state round of a 328k-parameter
language model with AdamW took 3-4 s at 20 Mbit/s, three steps' time.

What a lossy re-synchronisation leaves. Per element, every member that got
the reduced value back holds the very same value (the reducer's weighted mean
of the contributions that reached it, sent as raw float32); a member whose
piece did not come back keeps its own (``kept_own_fraction``). Either way
every member's new value lies between the old extremes, so the spread of an
element (the largest gap between two members) never grows, and it falls to 0
unless some member kept its own. With each of the n - 1 members other than the
piece's reducer missing the result with probability q, independently of the
values (random loss),

    E[spread after^2] <= c * E[spread before^2],   c = 1 - (1 - q)^(n - 1)

(c = q for two members; 0.27 for four at 10% loss), where an exact
re-synchronisation has c = 0. If W is the RMS spread that the gradient rounds
add between two re-synchronisations (the budget above), the RMS spread R_k
just before the k-th obeys R_(k+1) <= sqrt(c) R_k + W (Minkowski), so

    R <= W / (1 - sqrt(c))   after any number of steps, approached geometrically

against R <= W with exact re-synchronisations: 1.46 W for two members at 10%
loss, 2.1 W for four (looser than it need be: for two members, whose gap gets
independent zero-mean increments, the variances add and R <= W / sqrt(1 - c),
1.05 W). The drift stays O(1) over any number of steps, as in the paper
(where the broadcast period is fixed; we differ in adapting it to the
measured loss and in averaging rather than broadcasting from one root, so no
member's local progress is thrown away). Only floating-point state with a
shape is averaged (``_state_tensors``); step counts and other integer state
never travel in a re-synchronisation: every member counts the same global
steps, so they stay equal whatever is lost. A link that loses everything (q =
1) contracts nothing, as an exact re-synchronisation over TCP would then fail.
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
    if senders <= 1:
        return 0.0
    me = frozenset({result.local_index})
    others = (senders - 1) / senders

    def kept_ours(part: int, who: frozenset[int]) -> float:
        return others if part != result.local_index and who == me else 0.0

    return _share(result, kept_ours)


def kept_own_fraction(result: AllReduceResult) -> float:
    """The fraction of the elements of our result that kept our own values
    because their reduced value did not come back (pieces of other members'
    parts holding our data alone, or nobody's): after a re-synchronisation,
    where we may still differ from our group-mates; every other element
    equals theirs wherever they got it back too. 0 for an empty vector."""
    me = frozenset({result.local_index})

    def kept(part: int, who: frozenset[int]) -> float:
        return 1.0 if part != result.local_index and who <= me else 0.0

    return _share(result, kept)


def lost_fraction(result: AllReduceResult, senders: int) -> float:
    """The fraction of (element, sender) contributions missing from our result,
    0 for an empty vector or a group of one sender."""
    if senders <= 1:
        return 0.0
    return _share(result, lambda part, who: (senders - len(who)) / senders)


def _share(result: AllReduceResult, weight: Callable[[int, frozenset[int]], float]) -> float:
    """The mean over the elements of our result of ``weight(part,
    contributors)`` of each one's piece; 0 for an empty vector."""
    total = 0
    share = 0.0
    chunk = result.chunk_elements
    for part, (start, end) in enumerate(result.part_bounds):
        for piece, who in enumerate(result.contributors[part]):
            size = min(chunk, end - start - piece * chunk)
            total += size
            share += size * weight(part, who)
    return share / total if total else 0.0


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
