"""The swarm's real throughput: samples of completed global steps per second of wall time.

A global step (epoch) of a run is taken once the swarm has processed
``target_batch_size`` samples, so ``k`` epochs completed in ``t`` seconds are
``k * target_batch_size / t`` samples per second: everything the run spent on
them is in ``t`` (computing, matchmaking, the all-reduce).
The rate each peer publishes in its progress record is different: the samples
it computes per second while it computes, which averaging time does not slow
down. The command line shows that one as the *compute* rate.

``ThroughputMeter`` is pure: epochs and times in, rates out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Throughput:
    """What the meter measured over its window."""

    #: samples of completed global steps per second of wall time
    samples_per_second: float
    #: wall seconds per global step
    seconds_per_epoch: float
    #: epochs the figures were measured over
    epochs: int


class ThroughputMeter:
    """Measures a run's throughput from the epochs one peer sees it complete.

    ``observe(epoch, now)`` is called whenever this peer learns the run's epoch
    (after each global step). Only intervals over which the epoch advanced by
    exactly one count: when the epoch jumps (this peer downloaded the state of
    steps it did not see), nobody here knows when those steps happened, so the
    interval is left out rather than guessed. Rates are measured over the last
    ``window`` counted intervals, and over all of them for the run as a whole.
    ``target_batch_size`` must be at least 1 and ``window`` at least 1.
    """

    def __init__(self, target_batch_size: int, window: int = 10) -> None:
        if target_batch_size < 1 or window < 1:
            raise ValueError("target_batch_size and window must be at least 1")
        self.target_batch_size = target_batch_size
        self._recent: deque[float] = deque(maxlen=window)
        self._total_seconds = 0.0
        self._total_epochs = 0
        self._last: tuple[int, float] | None = None

    def observe(self, epoch: int, now: float) -> None:
        """Record that the run was at ``epoch`` at time ``now`` (seconds, monotonic)."""
        last = self._last
        if last is not None and epoch <= last[0]:
            return  # nothing new (or a stale reading: the run does not go back)
        self._last = (epoch, now)
        if last is None or epoch != last[0] + 1 or now <= last[1]:
            return
        self._recent.append(now - last[1])
        self._total_seconds += now - last[1]
        self._total_epochs += 1

    def recent(self) -> Throughput | None:
        """The throughput over the last ``window`` epochs; None until one was timed."""
        return self._rate(len(self._recent), sum(self._recent))

    def overall(self) -> Throughput | None:
        """The throughput over every epoch timed so far; None until one was."""
        return self._rate(self._total_epochs, self._total_seconds)

    def _rate(self, epochs: int, seconds: float) -> Throughput | None:
        if epochs == 0 or seconds <= 0:
            return None
        return Throughput(epochs * self.target_batch_size / seconds, seconds / epochs, epochs)
