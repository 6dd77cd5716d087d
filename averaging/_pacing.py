"""Pacing of the lossy all-reduce's datagrams from receiver reports: pure code.

UDP has no congestion control, and a sender that bursts a part at memory speed
fills the bottleneck's queue (a home uplink's, or the receiver's downlink's)
and loses most of it. So each peer paces the datagrams it sends to one remote
peer at a rate (bytes per second) kept per remote, learnt from what that
remote reported for earlier rounds (``_lossy``): how many datagrams it got and
over how many seconds they arrived (first to last), against how many were
sent and over how many seconds.

The rule (one update per report, rounds of at least ``MIN_SAMPLE`` datagrams):

- If the datagrams arrived about as fast as they were sent (arrival span at
  most ``SLACK`` times the send span, plus a millisecond), the path kept up:
  the bottleneck is above our rate, so probe up by ``GROWTH``.
- Otherwise a queue built up: the rate that came through, ``received bytes /
  arrival span``, is what the bottleneck delivers; set the rate just under it
  (``BACKOFF``), so the next round leaves the queue empty. That rate includes
  random loss, which only makes it conservative by the loss rate.
- Nothing received at all: halve.

Random loss does not slow the arrivals, so unlike loss-based congestion
control (CUBIC; the Mathis bound) the rate does not collapse on a lossy link,
and on a clean link the rate stays at or below what the link delivered, so it
does not raise the loss rate there. The probe costs a round at up to
``GROWTH`` times the bottleneck, then the rate settles between ``BACKOFF`` and
``GROWTH * BACKOFF`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm import PeerID

#: First rate towards a peer: 20 Mbit/s (a home uplink shared by a few receivers).
INITIAL_RATE = 2.5e6
MIN_RATE = 64e3
MAX_RATE = 5e9
GROWTH = 1.25
BACKOFF = 0.95
SLACK = 1.1
#: Fewer datagrams than this say nothing about a rate.
MIN_SAMPLE = 16
#: Bytes on the wire per datagram the rate is counted in (a full piece).
DATAGRAM_BYTES = 1390


@dataclass
class Pacer:
    """The send rate towards one remote peer, bytes per second."""

    rate: float = INITIAL_RATE

    def report(self, sent: int, received: int, send_span: float, arrival_span: float) -> None:
        """Update from one report: ``sent`` datagrams over ``send_span``
        seconds, ``received`` of them arriving over ``arrival_span`` seconds.
        Nonsense (negative, more received than sent) is ignored."""
        if sent < MIN_SAMPLE or not 0 <= received <= sent or send_span < 0 or arrival_span < 0:
            return
        if received == 0:
            self.rate = max(MIN_RATE, self.rate / 2)
        elif arrival_span <= send_span * SLACK + 0.001:
            self.rate = min(MAX_RATE, self.rate * GROWTH)
        else:
            delivered = received * DATAGRAM_BYTES / arrival_span
            self.rate = min(MAX_RATE, max(MIN_RATE, BACKOFF * delivered))


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
        self.pacer(peer).report(sent, received, send_span, arrival_span)
