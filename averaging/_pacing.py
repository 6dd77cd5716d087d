"""Pacing of the lossy all-reduce's datagrams from receiver reports: pure code.

UDP has no congestion control, and a sender that bursts a part at memory speed
fills the bottleneck's queue (a home uplink's, or the receiver's downlink's)
and loses most of it. So each peer paces the datagrams it sends to one remote
peer at a rate (bytes per second) kept per remote, learnt from what that
remote reported for earlier phases (``_lossy``): how many datagrams it got and
over how many seconds they arrived (first to last, by the kernel's receive
timestamps, so that a receiver busy with other work does not make the path
look slow), against how many were sent and over how many seconds.

Two signs that the rate is above what the path delivers (*congestion*):

- a queue: the datagrams took longer to arrive than to send (arrival span
  more than ``SLACK`` times the send span plus ``SLACK_SECONDS``); with
  kernel timestamps a path that keeps up shows spans equal to within a
  burst;
- loss above the path's own: ``base_loss``, the loss of the latest reports
  that showed no queue (a link's random loss, which no rate avoids), plus
  ``LOSS_MARGIN`` and three standard deviations of the report's sample.

The rule, one update per report of at least ``MIN_SAMPLE`` datagrams:

- Nothing received at all: halve.
- Congestion: the rate that came through the bottleneck is ``received
  bytes / arrival span``, divided by ``1 - base_loss`` (random loss after
  the bottleneck thins the arrivals without slowing them); set the rate
  to ``BACKOFF`` of it, which drains the queue the phase built, and leave
  the fast start.
- Otherwise, if the sender did send at its rate (a sender short of CPU
  learns nothing about the path): in the fast start double (from
  ``INITIAL_RATE``, a few reports reach any home link), after it probe up
  by ``PROBE``.

On a clean link the rate then cycles between ``BACKOFF`` and ``BACKOFF *
PROBE**2`` of the bottleneck (three reports: two probes, one back-off), and
the probe above the bottleneck by a few percent for one phase builds a queue
of a few percent of that phase, which the bottleneck's buffer holds: the
lossy mode fills the link without raising its loss rate. Random loss does
not slow the arrivals and is learnt as the base, so unlike loss-based
congestion control (CUBIC; the Mathis bound) the rate does not collapse on a
lossy link.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from swarm import PeerID

logger = logging.getLogger(__name__)

#: First rate towards a peer: 8 Mbit/s. A member sends to all others at
#: once, so a group of 4 starts at 24 Mbit/s: under a 50 Mbit/s link, and
#: 20% over a 20 Mbit/s one for the first phase of a run only; the fast
#: start reaches 64 Mbit/s per receiver in four reports (two rounds).
INITIAL_RATE = 1e6
MIN_RATE = 64e3
MAX_RATE = 5e9
#: Fast start: the factor per report until the first congestion.
FAST_START = 2.0
#: After it: the factor per report that finds out whether the path has more.
PROBE = 1.04
#: The share of the delivered rate to settle at after congestion.
BACKOFF = 0.95
#: A queue: arrival span > SLACK * send span + SLACK_SECONDS.
SLACK = 1.02
SLACK_SECONDS = 0.003
#: Loss this much (plus three standard deviations) above ``base_loss`` is congestion.
LOSS_MARGIN = 0.01
#: Weight of the newest report without congestion in ``base_loss``.
BASE_SMOOTHING = 0.3
#: A sender that sent at less than this share of its rate was short of CPU.
ACHIEVED = 0.8
#: Fewer datagrams than this say nothing about a rate.
MIN_SAMPLE = 16
#: Bytes on the wire per datagram the rate is counted in (a full piece).
DATAGRAM_BYTES = 1390


@dataclass
class Pacer:
    """The send rate towards one remote peer, bytes per second, and what the
    rule (module docstring) has learnt about the path."""

    rate: float = INITIAL_RATE
    #: Still in the fast start: no congestion seen yet.
    fast_start: bool = True
    #: The path's own loss rate, from reports without a queue (None: none yet).
    base_loss: float | None = None

    def report(self, sent: int, received: int, send_span: float, arrival_span: float) -> bool:
        """Update from one report: ``sent`` datagrams over ``send_span``
        seconds, ``received`` of them arriving over ``arrival_span`` seconds.
        Nonsense (negative, more received than sent, not finite) and samples
        under ``MIN_SAMPLE`` are ignored. Returns whether it saw congestion."""
        if (
            sent < MIN_SAMPLE
            or not 0 <= received <= sent
            or not (math.isfinite(send_span) and math.isfinite(arrival_span))
            or send_span < 0
            or arrival_span < 0
        ):
            return False
        if received == 0:
            self.rate = max(MIN_RATE, self.rate / 2)
            self.fast_start = False
            return True
        loss = 1 - received / sent
        queue = arrival_span > send_span * SLACK + SLACK_SECONDS
        base = self.base_loss
        lossy = base is not None and loss > base + LOSS_MARGIN + 3 * math.sqrt(
            max(base, 1.0 / sent) * (1 - base) / sent
        )
        if queue or lossy:
            kept = 1 - (base or 0.0)
            delivered = received * DATAGRAM_BYTES / max(arrival_span, 1e-6) / kept
            self.rate = min(MAX_RATE, max(MIN_RATE, BACKOFF * delivered))
            self.fast_start = False
            return True
        self.base_loss = loss if base is None else base + BASE_SMOOTHING * (loss - base)
        achieved = sent * DATAGRAM_BYTES / send_span if send_span > 0 else math.inf
        if achieved >= ACHIEVED * self.rate:
            factor = FAST_START if self.fast_start else PROBE
            self.rate = min(MAX_RATE, self.rate * factor)
        return False


class PacerRegistry:
    """One ``Pacer`` per remote peer, kept across rounds."""

    def __init__(self) -> None:
        self._pacers: dict[PeerID, Pacer] = {}

    def pacer(self, peer: PeerID) -> Pacer:
        pacer = self._pacers.get(peer)
        if pacer is None:
            pacer = self._pacers[peer] = Pacer()
        return pacer

    def sender_report(
        self, peer: PeerID, sent: int, received: int, send_span: float, arrival_span: float
    ) -> None:
        """What ``peer`` reported about the datagrams we sent it."""
        pacer = self.pacer(peer)
        before = pacer.rate
        congested = pacer.report(sent, received, send_span, arrival_span)
        # The timeline of each path's rates (benchmarks/allreduce.py --pacing-log).
        logger.debug(
            "pacing to %s: sent %d in %.3f s (%.1f Mbit/s), %d arrived in %.3f s"
            " (%.1f Mbit/s)%s: rate %.1f -> %.1f Mbit/s",
            peer.hex()[:8],
            sent,
            send_span,
            sent * DATAGRAM_BYTES * 8e-6 / send_span if send_span > 0 else 0.0,
            received,
            arrival_span,
            received * DATAGRAM_BYTES * 8e-6 / arrival_span if arrival_span > 0 else 0.0,
            ", congestion" if congested else "",
            before * 8e-6,
            pacer.rate * 8e-6,
        )
