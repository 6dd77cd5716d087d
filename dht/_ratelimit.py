"""Per-source request rate limits: token buckets keyed by address or node id. Pure code.

A DHT node answers every request synchronously (one signature check, one
signature), so the cost of a request is paid by the receiver. ``RateLimiter``
keeps one token bucket per source (a UDP address before the datagram is
decoded, the proven node id after) and refuses a request when that source's
bucket is empty. A flood from one source therefore costs the node at most
``burst`` requests at once and ``rate`` per second after, and never empties
the buckets of other sources.

Time comes from an injected monotonic clock, so tests can freeze or step it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from swarm._errors import ConfigError

MonotonicClock = Callable[[], float]


@dataclass(frozen=True)
class RequestRateLimit:
    """How many datagrams one source may send to a node.

    The same limit applies separately to each source UDP address (checked
    before the signature, so a flood costs no cryptography) and to each proven
    node id (so one key spread over many ports is still one source).
    """

    #: sustained datagrams per second per source. A look-up sends one request
    #: per contacted node, so an honest peer stays far below this.
    rate: float = 500.0
    #: datagrams a source may send at once; covers pushing a few hundred
    #: records to a newly joined neighbour (Kademlia paper, section 2.5).
    burst: int = 1000
    #: most sources tracked at once; beyond it the least recently seen source
    #: is forgotten (and starts again with a full bucket), bounding memory.
    max_sources: int = 4096

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigError("RequestRateLimit.rate must be > 0 datagrams per second")
        if self.burst < 1:
            raise ConfigError("RequestRateLimit.burst must be at least 1 datagram")
        if self.max_sources < 1:
            raise ConfigError("RequestRateLimit.max_sources must be at least 1")


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second of ``clock``."""

    __slots__ = ("_capacity", "_rate", "_tokens", "_updated")

    def __init__(self, capacity: int, rate: float, now: float) -> None:
        self._capacity = float(capacity)
        self._rate = rate
        self._tokens = float(capacity)
        self._updated = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one; True if it was spent."""
        if now > self._updated:
            self._tokens = min(self._capacity, self._tokens + (now - self._updated) * self._rate)
            self._updated = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class RateLimiter:
    """One ``TokenBucket`` per source, at most ``limit.max_sources`` of them."""

    def __init__(self, limit: RequestRateLimit, clock: MonotonicClock) -> None:
        self._limit = limit
        self._clock = clock
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def allow(self, source: Hashable) -> bool:
        """True if ``source`` may send one more datagram now (and count it)."""
        now = self._clock()
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = TokenBucket(self._limit.burst, self._limit.rate, now)
            if len(self._buckets) > self._limit.max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        return bucket.take(now)

    def tracked(self) -> int:
        return len(self._buckets)
