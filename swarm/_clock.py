"""Wall clocks, injected wherever absolute time matters (DHT expirations).

Timeouts use trio's clock (so tests run on trio's mock clock); absolute
expiration times shared between peers use a ``WallClock``: a zero-argument
callable returning seconds since the Unix epoch. Tests pass a ``ManualClock``
to expire records or skew one peer's clock without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WallClock = Callable[[], float]

system_clock: WallClock = time.time


class ManualClock:
    """A wall clock that moves only when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
