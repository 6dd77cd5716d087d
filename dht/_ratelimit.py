"""Per-source request rate limits: token buckets keyed by address or node id. Pure code.

A DHT node answers every request synchronously (one signature check, one
signature), so the cost of a request is paid by the receiver. ``RateLimiter``
keeps one token bucket per source (a UDP address before the datagram is
decoded, the proven node id after) and refuses a request when that source's
bucket is empty. A flood from one source therefore costs the node at most
``burst`` requests at once and ``rate`` per second after, and never empties
the buckets of other sources. A third set of buckets bounds the reply bytes
sent to each address, so a forged source address cannot aim the node's
(larger) replies at a victim.

Time comes from an injected monotonic clock, so tests can freeze or step it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from swarm._errors import ConfigError

from ._messages import MAX_DATAGRAM_SIZE

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
    #: reply bytes per second to one address, and at once. A ``find_value``
    #: reply can be 400 times the size of its request; a request with a
    #: forged source address must not turn a node into an amplifier aimed at
    #: that address. An honest reader gets one reply per look-up.
    reply_bytes_per_second: float = 1 * 2**20
    reply_bytes_burst: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigError("RequestRateLimit.rate must be > 0 datagrams per second")
        if self.burst < 1:
            raise ConfigError("RequestRateLimit.burst must be at least 1 datagram")
        if self.max_sources < 1:
            raise ConfigError("RequestRateLimit.max_sources must be at least 1")
        if not self.reply_bytes_per_second > 0 or self.reply_bytes_burst < MAX_DATAGRAM_SIZE:
            raise ConfigError(
                "RequestRateLimit: reply_bytes_per_second must be > 0 and reply_bytes_burst "
                f"at least {MAX_DATAGRAM_SIZE}, the largest datagram"
            )


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second of ``clock``."""

    __slots__ = ("_capacity", "_rate", "_tokens", "_updated")

    def __init__(self, capacity: int, rate: float, now: float) -> None:
        self._capacity = float(capacity)
        self._rate = rate
        self._tokens = float(capacity)
        self._updated = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Spend ``amount`` tokens if there are as many; True if they were spent."""
        if now > self._updated:
            self._tokens = min(self._capacity, self._tokens + (now - self._updated) * self._rate)
            self._updated = now
        if self._tokens >= amount:
            self._tokens -= amount
            return True
        return False


class RateLimiter:
    """One ``TokenBucket`` of ``capacity`` refilled at ``rate`` per source, at
    most ``max_sources`` of them (the least recently seen is forgotten)."""

    def __init__(
        self, capacity: int, rate: float, max_sources: int, clock: MonotonicClock
    ) -> None:
        self._capacity = capacity
        self._rate = rate
        self._max_sources = max_sources
        self._clock = clock
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    @classmethod
    def for_requests(cls, limit: RequestRateLimit, clock: MonotonicClock) -> RateLimiter:
        """Datagrams per source."""
        return cls(limit.burst, limit.rate, limit.max_sources, clock)

    @classmethod
    def for_reply_bytes(cls, limit: RequestRateLimit, clock: MonotonicClock) -> RateLimiter:
        """Reply bytes per destination address."""
        return cls(limit.reply_bytes_burst, limit.reply_bytes_per_second, limit.max_sources, clock)

    def allow(self, source: Hashable, amount: float = 1.0) -> bool:
        """True if ``source`` may spend ``amount`` more now (and count it)."""
        now = self._clock()
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = TokenBucket(self._capacity, self._rate, now)
            if len(self._buckets) > self._max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        return bucket.take(now, amount)

    def tracked(self) -> int:
        return len(self._buckets)
