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
this peer's own samples. Four guards keep it honest:

- A record is extrapolated for at most ``horizon`` seconds: a live peer
  publishes every progress interval whatever its training thread does, so an
  older record is a peer that died or stalls, and counting its rate would end
  the step on samples nobody computed.
- A peer that stopped adding to an epoch (it is averaging it) says so in its
  record (``PeerProgress.stopped``): the others count exactly what it has,
  and from then on count it toward the next epoch at its rate. Without
  that, a peer whose record still showed the last epoch counted for
  nothing, and each peer filled the next target almost alone.
- A peer whose round for the epoch began counts exactly the weight it
  announced to this peer (``Others.settled``): the all-reduce streams of a
  group formed ahead of the step carry it at once, while its record says
  so only a refresh later, and meanwhile extrapolating it at its rate ended
  the others' steps short (two peers: 0.74x the target).
- A live peer that still adds to the epoch adds at least one micro-batch
  (``PeerProgress.batch``): a peer decides whether to stop only after a
  batch, so none ends a step with nothing in it. Extrapolation alone lags
  at an epoch's start, when every peer is computing its first batch and none
  has published it yet: with 8 peers whose batches together made the target,
  the fastest computed 2-3 batches before the others' counts showed, and a
  step averaged 1.5 times the target.

Pure code: the tracker computes ``Others`` at each reading, the optimizer asks
``total`` at each local step without crossing into trio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swarm import PeerID

from ._progress import PeerProgress

__all__ = ["Expected", "Others", "others_progress"]


@dataclass(frozen=True)
class Expected:
    """What one other peer adds to an epoch, as of one reading."""

    #: its samples at the reading (its record extrapolated to the reading's
    #: time, for at most the horizon past the record's own time)
    samples: float
    #: samples per second it adds after the reading; None: not measured yet
    #: (its first step), counted at a prior rate, the asking peer's own
    rate: float | None = None
    #: seconds after the reading it may still be extrapolated (0: it adds
    #: nothing more: it stopped, or its record is older than the horizon)
    left: float = 0.0
    #: its micro-batch (0: not published, the asking peer's own is assumed):
    #: a peer still adding counts for at least one
    batch: int = 0
    #: whose record it is (None: not known)
    peer: PeerID | None = None

    def at(self, elapsed: float, prior: float, prior_batch: int) -> float:
        """Its samples ``elapsed`` (>= 0) seconds after the reading."""
        if self.left <= 0:
            return self.samples
        rate = prior if self.rate is None else self.rate
        extrapolated = self.samples + rate * min(elapsed, self.left)
        return max(extrapolated, float(self.batch or prior_batch))


@dataclass(frozen=True)
class Others:
    """The other live peers' samples toward ``epoch``, as of one reading."""

    epoch: int
    peers: tuple[Expected, ...] = ()

    @property
    def samples(self) -> float:
        """What they had at the reading (no floors, no extrapolation past it)."""
        return sum(p.samples for p in self.peers)

    @property
    def rates(self) -> tuple[tuple[float, float], ...]:
        """(rate, seconds it may still be extrapolated) of each peer still
        adding whose rate is measured."""
        return tuple((p.rate, p.left) for p in self.peers if p.left > 0 and p.rate is not None)

    @property
    def unmeasured(self) -> tuple[float, ...]:
        """The same windows for the peers still adding whose rate is not measured."""
        return tuple(p.left for p in self.peers if p.left > 0 and p.rate is None)

    @property
    def rate(self) -> float:
        """The others' summed rate at the reading (samples per second)."""
        return sum(rate for rate, _ in self.rates)

    def settled(self, final: Mapping[PeerID, float]) -> Others:
        """These peers, with those in ``final`` counted at exactly that many
        samples and no more (they stopped adding to ``epoch``: their group's
        round began with that weight, which the readings show only later);
        a peer of ``final`` without a record yet is added."""
        if not final:
            return self
        peers = [p for p in self.peers if p.peer is None or p.peer not in final]
        peers += [Expected(samples, peer=peer) for peer, samples in final.items()]
        return Others(self.epoch, tuple(peers))

    def total(self, mine: int, elapsed: float, prior: float = 0.0, prior_batch: int = 0) -> float:
        """The swarm's samples toward ``epoch`` ``elapsed`` seconds after the
        reading: the others' extrapolated (those of unmeasured rate at
        ``prior`` samples per second), each still adding counted for at least
        one micro-batch (``prior_batch`` for one that did not publish its
        own), plus ``mine`` (exact)."""
        elapsed = max(0.0, elapsed)
        return sum(p.at(elapsed, prior, prior_batch) for p in self.peers) + mine


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
    peers: list[Expected] = []
    for r in records:
        if r.peer_id == me or now - r.time > stale_after:
            continue
        rate = r.samples_per_second if r.samples_per_second > 0 else None
        if r.epoch == epoch - 1 and now - r.time < horizon:
            # finishing the step before ``epoch`` (whether or not it said it
            # stopped: a short round may end before it publishes again)
            peers.append(Expected(0.0, rate, horizon, r.batch, r.peer_id))
        elif r.epoch == epoch and r.stopped:
            peers.append(Expected(float(r.samples), peer=r.peer_id))
        elif r.epoch == epoch:
            since = max(0.0, now - r.time)
            measured = 0.0 if rate is None else rate
            samples = r.samples + measured * min(horizon, since)
            peers.append(Expected(samples, rate, max(0.0, horizon - since), r.batch, r.peer_id))
    return Others(epoch, tuple(peers))
