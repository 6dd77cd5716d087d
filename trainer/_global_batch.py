"""When the swarm has its target batch: the samples toward one epoch, estimated now.

DeDLOC's promise (Diskin et al. 2021, section 3.1) is that a global step
averages ``target_batch_size`` samples, give or take one local batch per peer.
Each peer decides alone when to stop adding to the current step, so the
decision must not wait for news: a peer that stopped only once it *read* that
the others had reported the target kept computing for a whole refresh (a DHT
store and read, hundreds of milliseconds under load), and so did every other
peer; with 8 peers a step averaged 34 times the target.

The rule here (hivemind's ``ProgressTracker`` extrapolates the same way): the
others' last records, each extrapolated at its rate from its time to now, plus
this peer's own samples. Two guards keep it honest:

- A record is extrapolated for at most ``horizon`` seconds: a live peer
  publishes every progress interval whatever its training thread does, so an
  older record is a peer that died or stalls, and counting its rate would end
  the step on samples nobody computed.
- A peer that stopped adding to an epoch (it is averaging it) says so in its
  record (``PeerProgress.stopped``): the others count exactly what it has,
  and from then on count it toward the next epoch at its rate. Without
  that, a peer whose record still showed the last epoch counted for
  nothing, and each peer filled the next target almost alone.

Pure code: the tracker computes ``Others`` at each reading, the optimizer asks
``total`` at each local step without crossing into trio.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm import PeerID

from ._progress import PeerProgress

__all__ = ["Others", "others_progress"]


@dataclass(frozen=True)
class Others:
    """The other live peers' samples toward ``epoch``, as of one reading."""

    epoch: int
    #: what they reported, each record extrapolated to the reading's time
    #: (for at most the horizon past the record's own time)
    samples: float
    #: (rate, seconds it may still be extrapolated) of each record that has a
    #: rate and is younger than the horizon
    rates: tuple[tuple[float, float], ...] = ()
    #: the same windows for the peers still adding whose rate is not measured
    #: yet (a record of rate 0 that did not stop): ``total`` counts them at a
    #: prior rate, the asking peer's own
    unmeasured: tuple[float, ...] = ()

    @property
    def rate(self) -> float:
        """The others' summed rate at the reading (samples per second)."""
        return sum(rate for rate, _ in self.rates)

    def total(self, mine: int, elapsed: float, prior: float = 0.0) -> float:
        """The swarm's samples toward ``epoch`` ``elapsed`` seconds after the
        reading: the others' extrapolated (those of unmeasured rate at
        ``prior`` samples per second), plus ``mine`` (exact)."""
        elapsed = max(0.0, elapsed)
        extra = sum(rate * min(elapsed, left) for rate, left in self.rates)
        extra += sum(prior * min(elapsed, left) for left in self.unmeasured)
        return self.samples + extra + mine


def others_progress(
    records: list[PeerProgress],
    *,
    me: PeerID,
    epoch: int,
    now: float,
    stale_after: float,
    horizon: float,
) -> Others:
    """``Others`` for ``epoch`` from ``records`` read at ``now`` (DHT time).

    A record at ``epoch`` counts ``samples + rate * min(horizon, now - time)``,
    (a rate not measured yet: see ``Others.unmeasured``), or exactly
    ``samples`` once it ``stopped`` (averaging: its count is
    final). A record one epoch behind is a peer finishing the step before
    ``epoch``: it counts from ``now`` on at its rate (the round that ends its
    step ends this one's at about the same time). Records of
    ``me``, of other epochs, and older than ``stale_after`` are left out.
    Raises nothing (a record dated in the future counts as just published).
    """
    samples = 0.0
    rates: list[tuple[float, float]] = []
    unmeasured: list[float] = []
    for r in records:
        if r.peer_id == me or now - r.time > stale_after:
            continue
        rate = r.samples_per_second
        if r.epoch == epoch - 1 and now - r.time < horizon:
            # finishing the step before ``epoch`` (whether or not it said it
            # stopped: a short round may end before it publishes again)
            if rate > 0:
                rates.append((rate, horizon))
            else:
                unmeasured.append(horizon)
        elif r.epoch == epoch and r.stopped:
            samples += r.samples
        elif r.epoch == epoch:
            since = max(0.0, now - r.time)
            samples += r.samples + rate * min(horizon, since)
            if since < horizon and rate > 0:
                rates.append((rate, horizon - since))
            elif since < horizon:
                unmeasured.append(horizon - since)
    return Others(epoch, samples, tuple(rates), tuple(unmeasured))
