"""``RoundTrips``: how long to wait for a DHT reply, learned from the replies. Pure code.

A fixed RPC timeout is wrong everywhere: on a LAN a reply takes a millisecond
and one second of waiting per dead contact is a thousand round trips lost; on
a slow home link 200 ms is normal and a tight fixed timeout drops live nodes.
So each reply's round trip is measured and two deadlines follow from it, as
TCP does for its retransmission timer (Jacobson and Karels, "Congestion
Avoidance and Control", 1988; RFC 6298):

- ``timeout``: ``srtt + 4 * rttvar``, clamped to ``[floor, cap]``. A request
  unanswered this long has failed: the contact is evicted from the routing
  table and left out of look-ups for a while.
- ``hedge_after``: ``srtt + 2 * rttvar``, clamped to ``[hedge_floor, timeout]``.
  A request unanswered this long is *late*: a look-up stops counting it as in
  flight and asks the next candidate in its place (a hedged request), while
  still taking the answer if it comes before ``timeout``. A dead contact then
  costs a look-up one ``hedge_after``, a few round trips, not one timeout.
- ``resend_after``: ``srtt + 4 * rttvar`` again, but clamped to
  ``[resend_floor, timeout / 2]``: a request unanswered this long is sent
  again (the protocol doubles the wait after each copy). A lost datagram then
  costs a request a few round trips, not the whole ``timeout``, whose floor
  is set high for slow and busy nodes.

Estimates are kept per contact address (a node far away keeps its own
estimate) and for all contacts together (the estimate for a contact never
heard from yet). Every sample is unambiguous: each copy of a request carries a
fresh message id, and an answer is timed from the copy it answers, so Karn's
rule has nothing to exclude. ``cap`` is the configured ``rpc_timeout``; with
no sample yet, both deadlines are ``cap``, so a bootstrap through unknown
contacts is as patient as before (its requests sent again after a quarter of it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

#: Smoothing gains of RFC 6298 (alpha = 1/8, beta = 1/4).
_GAIN = 1 / 8
_VAR_GAIN = 1 / 4


@dataclass
class _Estimate:
    srtt: float
    rttvar: float

    def update(self, sample: float) -> None:
        self.rttvar = (1 - _VAR_GAIN) * self.rttvar + _VAR_GAIN * abs(self.srtt - sample)
        self.srtt = (1 - _GAIN) * self.srtt + _GAIN * sample


class RoundTrips:
    """Smoothed round-trip times, per contact and overall, and the deadlines
    derived from them (see the module docstring).

    Raises ``ValueError`` if the bounds are not ``0 < hedge_floor <= floor <= cap``
    and ``0 < resend_floor <= floor``, or ``max_contacts < 1``.
    """

    def __init__(
        self,
        *,
        cap: float,
        floor: float = 0.1,
        hedge_floor: float = 0.01,
        resend_floor: float = 0.02,
        max_contacts: int = 4096,
    ) -> None:
        if not 0 < hedge_floor <= floor <= cap:
            raise ValueError(
                f"RoundTrips: need 0 < hedge_floor ({hedge_floor}) <= floor ({floor}) "
                f"<= cap ({cap})"
            )
        if not 0 < resend_floor <= floor:
            raise ValueError(
                f"RoundTrips: need 0 < resend_floor ({resend_floor}) <= floor ({floor})"
            )
        if max_contacts < 1:
            raise ValueError("RoundTrips: max_contacts must be at least 1")
        self.cap = cap
        self.floor = floor
        self.hedge_floor = hedge_floor
        self.resend_floor = resend_floor
        self._max_contacts = max_contacts
        self._overall: _Estimate | None = None
        #: per contact, least recently sampled first
        self._contacts: OrderedDict[Hashable, _Estimate] = OrderedDict()

    def sample(self, contact: Hashable, seconds: float) -> None:
        """Record that ``contact`` answered after ``seconds`` (negative counts as 0)."""
        seconds = max(0.0, seconds)
        for estimate, store in ((self._overall, None), (self._contacts.get(contact), contact)):
            if estimate is None:
                estimate = _Estimate(seconds, seconds / 2)
                if store is None:
                    self._overall = estimate
                else:
                    self._contacts[store] = estimate
                    if len(self._contacts) > self._max_contacts:
                        self._contacts.popitem(last=False)
            else:
                estimate.update(seconds)
        self._contacts.move_to_end(contact)

    def _estimate(self, contact: Hashable) -> _Estimate | None:
        return self._contacts.get(contact, self._overall)

    def timeout(self, contact: Hashable) -> float:
        """Seconds after which a request to ``contact`` has failed."""
        estimate = self._estimate(contact)
        if estimate is None:
            return self.cap
        return min(self.cap, max(self.floor, estimate.srtt + 4 * estimate.rttvar))

    def hedge_after(self, contact: Hashable) -> float:
        """Seconds after which a request to ``contact`` is late (see the module docstring)."""
        estimate = self._estimate(contact)
        if estimate is None:
            return self.cap
        timeout = self.timeout(contact)
        return min(timeout, max(self.hedge_floor, estimate.srtt + 2 * estimate.rttvar))

    def resend_after(self, contact: Hashable) -> float:
        """Seconds after which an unanswered request to ``contact`` is sent again."""
        timeout = self.timeout(contact)
        estimate = self._estimate(contact)
        if estimate is None:
            return timeout / 4
        rto = estimate.srtt + 4 * estimate.rttvar
        return min(timeout / 2, max(self.resend_floor, rto))

    def smoothed(self, contact: Hashable | None = None) -> float | None:
        """The smoothed round trip of ``contact`` (or overall, or None if unknown)."""
        estimate = self._overall if contact is None else self._estimate(contact)
        return None if estimate is None else estimate.srtt
