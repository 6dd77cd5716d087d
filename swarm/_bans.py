"""Local bans of misbehaving peers, with a backoff that grows per offence.

Pure bookkeeping: no sockets, no tasks. The connection layer and the DHT
protocol ask ``is_banned`` before they serve or dial someone and call
``offend`` when a peer proved that it breaks the protocol (a frame that does
not authenticate after a completed handshake, a forged DHT record, NaN or a
malformed part in an all-reduce).

A ban is *local*: nobody else learns of it, so a liar cannot get an honest
peer banned across the swarm, and an honest peer that was banned by mistake
(a corrupting middlebox) is only ignored by the peers it spoke to, for a while.
The first offence bans for ``BanConfig.base``; each further offence while the
peer is remembered doubles the period, up to ``BanConfig.cap``. A peer with
no offence for ``BanConfig.forget_after`` seconds after its ban ended starts
from the base period again.

Keys are anything hashable: peer ids (a proven identity) or ``(host, port)``
addresses (a DHT sender whose datagrams do not verify has no proven id). The
clock is injected: trio's clock (``trio.current_time``) in the connection
layer, the asyncio loop's in the DHT; tests pass a ``ManualClock``-like
callable or run on trio's mock clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ._errors import ConfigError

Clock = Callable[[], float]


@dataclass(frozen=True)
class BanConfig:
    """How long offenders are banned (seconds).

    Defaults: 30 s for a first offence, doubling per repeat up to one hour; an
    offender is forgotten after an hour of good behaviour; at most
    ``max_entries`` offenders are remembered (the oldest-expiring are forgotten
    first, so a flood of fresh identities cannot grow memory without bound).
    ``base=0`` disables banning.
    """

    base: float = 30.0
    cap: float = 3600.0
    forget_after: float = 3600.0
    max_entries: int = 10_000

    def __post_init__(self) -> None:
        for name in ("base", "cap", "forget_after"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"BanConfig.{name}={value} must be a finite number >= 0")
        if self.cap < self.base:
            raise ConfigError(f"BanConfig.cap={self.cap} must be at least base={self.base}")
        if self.max_entries < 1:
            raise ConfigError(f"BanConfig.max_entries={self.max_entries} must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.base > 0


@dataclass
class _Entry:
    offences: int
    until: float  # banned while now < until
    reason: str


class BanList:
    """Who is banned until when, and how often they offended."""

    def __init__(self, config: BanConfig | None = None, *, clock: Clock) -> None:
        self.config = config if config is not None else BanConfig()
        self._clock = clock
        self._entries: dict[Hashable, _Entry] = {}

    @classmethod
    def disabled(cls) -> BanList:
        """A ban list that bans nobody (for components used on their own)."""
        return cls(BanConfig(base=0.0), clock=lambda: 0.0)

    def offend(self, key: Hashable, reason: str) -> float:
        """Record an offence by ``key``; return the ban's length in seconds.

        The n-th remembered offence bans for ``base * 2**(n-1)`` seconds, at
        most ``cap``, counted from now (an offence during a ban extends it).
        """
        config = self.config
        if not config.enabled:
            return 0.0
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None or now >= entry.until + config.forget_after:
            entry = _Entry(0, now, reason)
        entry.offences += 1
        period = min(config.cap, config.base * 2.0 ** min(entry.offences - 1, 64))
        entry.until = max(entry.until, now + period)
        entry.reason = reason
        self._entries[key] = entry
        if len(self._entries) > config.max_entries:
            self._evict(now)
        return period

    def is_banned(self, key: Hashable) -> bool:
        """True while ``key`` serves a ban."""
        entry = self._entries.get(key)
        return entry is not None and self._clock() < entry.until

    def remaining(self, key: Hashable) -> float:
        """Seconds left of ``key``'s ban (0 if it is not banned)."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else max(0.0, entry.until - self._clock())

    def offences(self, key: Hashable) -> int:
        """How many offences of ``key`` are remembered."""
        entry = self._entries.get(key)
        if entry is None or self._clock() >= entry.until + self.config.forget_after:
            return 0
        return entry.offences

    def reason(self, key: Hashable) -> str | None:
        """The last offence of a banned ``key``, for log lines and refusals."""
        return self._entries[key].reason if self.is_banned(key) else None

    def banned(self) -> list[Hashable]:
        """Everyone banned right now."""
        now = self._clock()
        return [key for key, entry in self._entries.items() if now < entry.until]

    def _evict(self, now: float) -> None:
        forget = self.config.forget_after
        self._entries = {k: e for k, e in self._entries.items() if now < e.until + forget}
        excess = len(self._entries) - self.config.max_entries
        if excess > 0:
            for key in sorted(self._entries, key=lambda k: self._entries[k].until)[:excess]:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
