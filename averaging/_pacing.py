"""Pacing of the lossy all-reduce's datagrams from receiver reports: pure code.

UDP has no congestion control, and a sender that bursts a part at memory speed
fills the bottleneck's queue (a home uplink's, or the receiver's downlink's)
and loses most of it. So each peer paces all the datagrams it sends at one
rate (bytes per second, ``Pacer``), learnt from what the remotes reported
about earlier flows (``_lossy``): how many datagrams each got and over how
many seconds they arrived (first to last, by the kernel's receive
timestamps, so that a receiver busy with other work does not make the path
look slow), against how many were sent and over how many seconds.

One rate for all flows, one schedule. A peer sends several flows at once
(our values of each part to its reducer; our reduced part back to each
member), and the two phases of a round overlap (our reduced part goes out
while our values may still be on their way to a slower reducer). Each burst
of any flow takes its turn on one timeline at the rate (``Schedule``), so
together they never exceed it, concurrent flows share it equally, and a
flow that ends leaves its share to the others; a flow reports for the
``share`` of the rate it had. Why not a rate per remote peer, as before: the
flows of one peer share its uplink, the usual bottleneck of a home link, and
independent rates that back off in one queue keep the shares that the queue
happened to give them (the fast start's first overshoot left the four peers
of a 50 Mbit/s bed at 8.5 to 18 Mbit/s per flow, and they stayed so), while
a round lasts as long as its slowest flow. With one rate a flow slower than
its share (a receiver's slow downlink) brings the whole rate down to what
keeps it at its path's speed: the phase cannot end before that flow does,
so the others lose nothing, and they load the other peers' downlinks less.

A flow's share is counted as an equal share of its phase's flows at most
(``flows``: the peers it sent to together). One that had more (its phase's
other flows had ended or not begun) and met a queue met it, as a rule, at
its receiver's downlink, which the phase's other senders fill too: divided
by the share it happened to have, its arrivals said that our whole rate was
what one sender of three gets of that downlink. On a 20 Mbit/s bed such
reports (83-100% of the rate) cut the rate to 7-10 Mbit/s 16 times in the 4
peers' 264 rounds of the tiny LM, each costing about four rounds of probing
back (issue 18's tenth pass). What keeps that flow at its path's speed when
the phase's flows run together is its arrivals times their number. A queue
on our own uplink is still seen: the phase's flow that ran longest had no
more than its equal share, and its report says so.

Two signs in a flow's report that the rate is above what its path delivers
(*congestion*):

- a queue: the datagrams took longer to arrive than to send (arrival span
  more than ``SLACK`` times the send span plus ``SLACK_SECONDS``); with
  kernel timestamps a path that keeps up shows spans equal to within a
  burst;
- loss above the path's own: ``Path.base_loss``, kept per remote peer, the
  loss of its latest reports that showed no queue (a link's random loss,
  which no rate avoids), plus ``LOSS_MARGIN`` and three standard deviations
  of the report's loss: the larger of a sample of independent datagrams'
  and the spread the path's reports without a queue showed
  (``Path.loss_variance``). Loss comes in bursts on many paths (on the test
  bed a segmented send crosses the links as one packet and is dropped
  whole: at 10% loss the reports' loss spread 3.1 points where independent
  drops would spread 0.8), and judged as independent drops, such a path's
  own loss looked like congestion every other report and held the rate at
  two thirds of the link.

The rule, one update per report of at least ``MIN_SAMPLE`` datagrams:

- Nothing received at all: nothing changes (``Pacer.report`` says why).
- Congestion: the rate that came through the flow's bottleneck is
  ``received bytes / arrival span``, divided by ``1 - base_loss`` (random
  loss after the bottleneck thins the arrivals without slowing them) and by
  the flow's share, but no more than an equal share of its phase's flows
  (below); set the rate to ``BACKOFF`` of it, which drains the queue the
  phase built, and leave the fast start.
- Otherwise: in the fast start multiply the rate by ``FAST_START`` (from
  ``INITIAL_RATE``, a few reports reach any home link), after it probe up:
  by ``PROBE`` for the first three reports after a congestion, then by
  twice as much more with each report that saw none (``MAX_PROBE`` at
  most), so that a rate knocked far below the path's (another peer's
  overshoot, a busy spell) climbs back in a few reports. A flow whose bursts
  left well behind their turns (``LATE``: its sender was short of CPU) says
  less: its bursts did go out at the rate, and no queue built up, but with
  gaps in which one could drain, so the rate grows by ``PROBE`` only. It
  still grows: held where it was, the rate of a peer whose machine stays
  busy would stay low for good, and a busy sender sends the more the higher
  the rate it catches up to (``MAX_LAG``); if the path cannot take it, the
  next report says so.

Stale reports. Each report names the rate of the flow's last burst
(``paced_at``) and is judged against that: one about a rate that another
report has changed since never raises the rate (a newer report already
spoke for a newer rate), and one that saw congestion lowers it at most to
its own back-off, so congestion on any flow counts. Judging a flow paced at
8 Mbit/s against a rate raised to 16 meanwhile looked like a sender short
of CPU and kept the rate from rising: that, not the CPU, held the senders
of issue 18's second pass at half the link.

On a clean link the rate then cycles between ``BACKOFF`` and about
``BACKOFF * PROBE**3`` of the bottleneck (a back-off, then probes until one
finds the queue), and the probe above the bottleneck by a few percent for
one phase builds a queue of a few percent of that phase, which the
bottleneck's buffer holds: the lossy mode fills the link without raising
its loss rate much. Random loss does not slow the arrivals and is learnt as
the base, so unlike loss-based congestion control (CUBIC; the Mathis bound)
the rate does not collapse on a lossy link.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from swarm import PeerID

from ._datagrams import FULL_DATAGRAM

logger = logging.getLogger(__name__)

#: First rate: 24 Mbit/s for all flows together, 8 Mbit/s to each of the
#: three others of a group of 4: under a 50 Mbit/s link, and 20% over a 20
#: Mbit/s one for the first phase of a run only; the fast start reaches 192
#: Mbit/s in four reports (two rounds).
INITIAL_RATE = 3e6
MIN_RATE = 64e3
MAX_RATE = 5e9
#: Fast start: the factor per report until the first congestion (at most
#: 50% over the bottleneck when it ends: doubling lost half of the phase
#: that found the bottleneck).
FAST_START = 1.5
#: After it: the factor of the first three reports after a congestion that
#: find out whether the path has more; from the fourth, its excess over 1
#: doubles with each report that saw no congestion, up to ``MAX_PROBE``.
PROBE = 1.04
MAX_PROBE = 1.25
#: The share of the delivered rate to settle at after congestion. A phase's
#: end drains what queue is left anyway; at 0.95 the link sat 5% idle for a
#: report after each back-off, and a 100 Mbit/s bed's lossy round filled
#: 88.3-90.1% of the link limit against 90.8-91.0% at 0.98 (three launches
#: each; data held 99.8-100% and 99.6-100%).
BACKOFF = 0.98
#: A queue: arrival span > SLACK * send span + SLACK_SECONDS.
SLACK = 1.02
SLACK_SECONDS = 0.003
#: Loss this much (plus three standard deviations) above ``base_loss`` is congestion.
LOSS_MARGIN = 0.01
#: Weight of the newest report without congestion in ``base_loss``.
BASE_SMOOTHING = 0.3
#: A flow whose bursts left later than their schedule for more than this
#: share of its span was sent by a sender short of CPU.
LATE = 0.2
#: A burst whose turn passed more than this many seconds ago (the sender's
#: CPU was busy) goes at once, and the schedule restarts from it rather than
#: catching up in one long burst at line rate.
MAX_LAG = 0.005
#: Fewer datagrams than this say nothing about a rate.
MIN_SAMPLE = 16
#: Bytes per datagram the rate is counted in (a full piece's datagram).
DATAGRAM_BYTES = FULL_DATAGRAM


@dataclass
class Path:
    """What reports taught about the path to one remote peer."""

    #: The path's own loss rate, from reports without a queue (None: none yet).
    base_loss: float | None = None
    #: How far those reports' loss strayed from ``base_loss`` (a variance).
    loss_variance: float = 0.0


@dataclass
class Pacer:
    """The send rate of all of a peer's flows together, bytes per second, and
    where the rule (module docstring) stands."""

    rate: float = INITIAL_RATE
    #: Still in the fast start: no congestion seen yet.
    fast_start: bool = True
    #: Probes since the last congestion (from the third, each raises more).
    probes: int = 0

    def report(
        self,
        path: Path,
        sent: int,
        received: int,
        send_span: float,
        arrival_span: float,
        paced_at: float,
        share: float = 1.0,
        late: float = 0.0,
        flows: int = 1,
    ) -> bool:
        """Update from one flow's report: ``sent`` datagrams over ``send_span``
        seconds, which were ``share`` of what the schedule sent at ``paced_at``
        bytes per second (``rate`` when the flow began), its bursts ``late``
        seconds behind their turns in all, one of ``flows`` that its phase
        sent together, ``received`` of them arriving over ``arrival_span``
        seconds, on ``path``. Nonsense (negative, more received than sent, not
        finite, a share outside (0, 1], fewer than one flow) and samples
        under ``MIN_SAMPLE`` are ignored, and so is a flow of which nothing
        arrived: that path is blocked (a firewall that admits no datagram) or
        gone, not slow, and says nothing about the rate. Returns whether it
        saw congestion."""
        if (
            sent < MIN_SAMPLE
            or not 0 < received <= sent
            or not all(map(math.isfinite, (send_span, arrival_span, paced_at, share, late)))
            or send_span < 0
            or arrival_span < 0
            or paced_at <= 0
            or not 0 < share <= 1
            or late < 0
            or flows < 1
        ):
            return False
        # Exact: ``paced_at`` is a value this pacer handed out, unchanged
        # unless a report changed it since.
        stale = paced_at != self.rate
        loss = 1 - received / sent
        queue = arrival_span > send_span * SLACK + SLACK_SECONDS
        base = path.base_loss
        lossy = False
        if base is not None:
            sample = max(base, 1.0 / sent) * (1 - base) / sent
            spread = math.sqrt(max(sample, path.loss_variance))
            margin = LOSS_MARGIN + 3 * spread
            lossy = loss > base + margin
            if not queue:
                # Every report without a queue shows how the path's own loss
                # strays, those judged congested too (else a path whose loss
                # comes in bursts could never learn that it does), each by
                # the margin at most: a policer's drops, which show no queue,
                # widen the margin by a share of itself, once, for the rate
                # backs off and the drops stop.
                deviation = min(abs(loss - base), margin) ** 2
                path.loss_variance += BASE_SMOOTHING * (deviation - path.loss_variance)
        if queue or lossy:
            kept = 1 - (base or 0.0)
            # More than an equal share: the queue was on this flow's own
            # path (module docstring).
            share = min(share, 1 / flows)
            delivered = received * DATAGRAM_BYTES / max(arrival_span, 1e-6) / kept / share
            self._lower(min(MAX_RATE, max(MIN_RATE, BACKOFF * delivered)), stale)
            return True
        path.base_loss = loss if base is None else base + BASE_SMOOTHING * (loss - base)
        if stale:
            return False
        if late <= LATE * send_span:
            self.rate = min(MAX_RATE, self.rate * self.probe_factor)
            self.probes += 1
        else:
            self.rate = min(MAX_RATE, self.rate * PROBE)
        return False

    @property
    def probe_factor(self) -> float:
        """What the next report without congestion multiplies the rate by."""
        if self.fast_start:
            return FAST_START
        return min(MAX_PROBE, 1 + (PROBE - 1) * 2 ** min(max(self.probes - 2, 0), 16))

    def _lower(self, rate: float, stale: bool) -> None:
        """After congestion: ``rate``, or where a newer report set a lower
        rate since the phase began, that one."""
        self.rate = min(self.rate, rate) if stale else rate
        self.fast_start = False
        self.probes = 0


@dataclass(frozen=True)
class Sending:
    """How one flow of datagrams was sent, for ``PacerRegistry.sender_report``."""

    datagrams: int
    #: Seconds from its first burst's turn to the end of its last one's.
    span: float
    #: The pacer's rate (bytes per second) at its last burst.
    paced_at: float
    #: The share of the schedule's rate it had (the other flows had the rest).
    share: float
    #: Seconds its bursts left behind their turns in all (the sender was busy).
    late: float
    #: The flows its phase sent together, this one included (one per peer).
    flows: int = 1


@dataclass
class Schedule:
    """When each burst of a peer's datagrams leaves: one timeline at the
    pacer's rate that all its flows share, whichever phase or round they
    belong to, so that together they never send faster than the rate.

    Bursts take turns in the order they are asked for: flows that each ask
    for their next burst once the last one left share the rate equally, and
    one that ends leaves its share to the others at once.
    """

    #: When the turn of the next burst comes (seconds, the caller's clock).
    next: float = -math.inf

    def reserve(self, now: float, size: int, rate: float) -> tuple[float, float]:
        """The turn of a burst of ``size`` bytes at ``rate`` bytes per second,
        asked for at ``now``: ``(start, late)``, ``start`` when it may leave
        and ``late`` how long before ``now`` minus ``MAX_LAG`` its turn came
        (0 when it is on time: what the sender lost by being busy elsewhere,
        or the time the timeline had nothing to send)."""
        start = self.next
        late = 0.0
        if start < now - MAX_LAG:
            late = now - MAX_LAG - start if math.isfinite(start) else 0.0
            start = now - MAX_LAG
        self.next = start + size / rate
        return start, late


class PacerRegistry:
    """A peer's ``Pacer`` and a ``Path`` per remote peer, kept across rounds.

    It also carries the reports that arrive a round late. A member reports
    what it got of a reducer's results with its next header to that peer
    (``_lossy``), not in a message of its own that the round would wait for:
    the reducer keeps what it sent each peer last (``results_sent``) until
    that report comes (``late_report``), and the member what it got from
    each (``results_got``, taken by ``take_got``). Only the last flow per
    peer is kept on either side: a report for any other is dropped, as a
    lost one would be.
    """

    def __init__(self) -> None:
        self.pacer = Pacer()
        self.schedule = Schedule()
        self._paths: dict[PeerID, Path] = {}
        self._unreported: dict[PeerID, tuple[int, Sending]] = {}
        self._got: dict[PeerID, tuple[int, int, float]] = {}
        #: Reports that came a round late and were fed to the pacer.
        self.late_reports = 0

    def path(self, peer: PeerID) -> Path:
        path = self._paths.get(peer)
        if path is None:
            path = self._paths[peer] = Path()
        return path

    def sender_report(
        self, peer: PeerID, sending: Sending, received: int, arrival_span: float
    ) -> None:
        """What ``peer`` reported about a flow we sent it: ``received`` of its
        datagrams arrived over ``arrival_span`` seconds (``Pacer.report``)."""
        pacer = self.pacer
        before = pacer.rate
        sent, span = sending.datagrams, sending.span
        congested = pacer.report(
            self.path(peer),
            sent,
            received,
            span,
            arrival_span,
            sending.paced_at,
            sending.share,
            sending.late,
            sending.flows,
        )
        # The timeline of the rate (benchmarks/allreduce.py --pacing-log).
        logger.debug(
            "pacing to %s: sent %d in %.3f s (%.1f Mbit/s, %.0f%% of %.1f, 1 of %d flows,"
            " %.3f s late),"
            " %d arrived in %.3f s (%.1f Mbit/s)%s: rate %.1f -> %.1f Mbit/s",
            peer.hex()[:8],
            sent,
            span,
            sent * DATAGRAM_BYTES * 8e-6 / span if span > 0 else 0.0,
            100 * sending.share,
            sending.paced_at * 8e-6,
            sending.flows,
            sending.late,
            received,
            arrival_span,
            received * DATAGRAM_BYTES * 8e-6 / arrival_span if arrival_span > 0 else 0.0,
            ", congestion" if congested else "",
            before * 8e-6,
            pacer.rate * 8e-6,
        )

    def results_sent(self, peer: PeerID, flow: int, sending: Sending) -> None:
        """We sent ``peer`` results in the flow numbered ``flow`` (its round);
        the report on it comes with ``peer``'s next header (``late_report``)."""
        self._unreported[peer] = (flow, sending)

    def late_report(self, peer: PeerID, flow: int, received: int, arrival_span: float) -> bool:
        """``peer`` says ``received`` datagrams of our flow ``flow`` arrived
        over ``arrival_span`` seconds. Fed to the pacer (``sender_report``)
        if it is the last flow we sent ``peer`` and not reported yet; returns
        whether it was. A later flow's report judges it as stale (``Pacer``):
        it may lower the rate, never raise it."""
        unreported = self._unreported.get(peer)
        if unreported is None or unreported[0] != flow:
            return False
        del self._unreported[peer]
        self.late_reports += 1
        self.sender_report(peer, unreported[1], received, arrival_span)
        return True

    def results_got(self, peer: PeerID, flow: int, received: int, arrival_span: float) -> None:
        """``received`` datagrams of ``peer``'s results in flow ``flow`` arrived
        over ``arrival_span`` seconds: to report with our next header to it."""
        self._got[peer] = (flow, received, arrival_span)

    def take_got(self, peer: PeerID) -> tuple[int, int, float] | None:
        """What we got of ``peer``'s last results and did not report yet."""
        return self._got.pop(peer, None)
