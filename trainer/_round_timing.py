"""``RoundTiming``: matchmaking time and averaging timeout from measured rounds.

Fixed numbers are wrong both ways: on fast links a group forms in a few tens
of milliseconds and every step waits out a matchmaking window sized for slow
ones; on slow links the all-reduce outlasts a timeout sized for fast ones and
every round fails (hivemind's users ask for adaptive ones, its issue #676).

The rule, the same shape as TCP's retransmission timer (RFC 6298):

- Each successful round reports how long its group took to gather and how
  long its all-reduce took. Each is smoothed (``mean``, gain 1/8) with its mean
  deviation (``deviation``, gain 1/4).
- The gathering time is the LEADER's view, the same for every member
  (``Group.gathered``: from the leader opening its lobby to admitting the
  last member; ``settle``). Each peer's own view is wrong for this: the
  leader is the peer that began first, and a follower that began last waits
  almost nothing for its group, so at 2 peers the late peer's window shrank
  to the floor and the next time it was the one to begin first, its partner
  came after the window had closed (2 peers were slower with adaptation than
  without: 0.505 vs 0.32 s/epoch). The leader saw the partner come late.
- A DHT look-up takes O(log N) hops, so matchmaking time is scaled from the
  swarm size of the measurements to the current one: by
  ``log2(N_now + 1) / log2(N_measured + 1)`` (never below 1: a swarm that
  shrank keeps the measured margin).
- ``matchmaking_time = clamp(margin * (mean + 4 deviation) * scale, floor,
  configured)`` and ``averaging_timeout = clamp(matchmaking_time + 2 *
  request_timeout + margin * (mean + 4 deviation of the all-reduce), floor,
  configured)``.
- A round whose group did not form whole (none formed, or fewer members
  than the peers expected on a one-dimensional grid, where one group holds
  everyone; on a larger grid nobody knows a group's share in advance) or
  whose all-reduce timed out says the bounds were
  too short: ``missed`` doubles both (up to the configured values), like
  TCP's timer after a loss, until a whole round is measured again. Without it a window that
  shrank below the spread of the peers' arrival times would stay there: the
  late peers miss every round, and their misses are never measured.
- Before the first measurement, and whenever ``adaptive`` is off, the
  configured values are used as they are: they are the upper bounds and the
  overrides.

Pure: times and sizes in, seconds out; the caller measures with its clock.
The trainer (``CollaborativeOptimizer``, ``adaptive_timing``) sizes each
gradient round's matchmaking window and all-reduce timeout from it; the state
round keeps the configured values (it moves more than the gradients do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from averaging import Group, MatchmakingConfig
from swarm import ConfigError

_GAIN = 1 / 8
_DEVIATION_GAIN = 1 / 4


@dataclass(frozen=True)
class RoundTimingConfig:
    """Bounds of the adaptive rule. Raises ``ConfigError`` if inconsistent."""

    #: the configured matchmaking time and averaging timeout: upper bounds
    matchmaking_time: float
    averaging_timeout: float
    #: the matchmaking's per-request timeout (its bound is time + 2 of these)
    request_timeout: float
    #: False: always use the configured values
    adaptive: bool = True
    #: the shortest matchmaking time and averaging timeout the rule may give
    floor: float = 0.5
    #: a factor on top of mean + 4 deviations
    margin: float = 1.5

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.matchmaking_time:
            raise ConfigError(
                f"RoundTimingConfig: floor ({self.floor}s) must be positive and at most "
                f"matchmaking_time ({self.matchmaking_time}s)"
            )
        bound = self.matchmaking_time + 2 * self.request_timeout
        if self.averaging_timeout <= bound:
            raise ConfigError(
                f"RoundTimingConfig: averaging_timeout ({self.averaging_timeout}s) must exceed "
                f"matchmaking_time + 2 * request_timeout ({bound}s)"
            )
        if self.margin < 1:
            raise ConfigError("RoundTimingConfig: margin must be at least 1")


class _Smoothed:
    def __init__(self, sample: float) -> None:
        self.mean = sample
        self.deviation = sample / 2

    def update(self, sample: float) -> None:
        self.deviation += _DEVIATION_GAIN * (abs(self.mean - sample) - self.deviation)
        self.mean += _GAIN * (sample - self.mean)

    @property
    def high(self) -> float:
        return self.mean + 4 * self.deviation


class RoundTiming:
    """Matchmaking time and averaging timeout that follow measured rounds
    (see the module docstring)."""

    @classmethod
    def for_rounds(
        cls,
        matchmaking: MatchmakingConfig,
        *,
        averaging_timeout: float,
        matchmaking_lead: float,
        progress_interval: float,
        adaptive: bool = True,
    ) -> RoundTiming:
        """The trainer's timing: ``matchmaking``'s window and ``averaging_timeout``
        are the upper bounds. The floor is ``matchmaking_lead +
        progress_interval`` (a peer may begin matchmaking that long before the
        target, and the others learn of the target a progress read after it),
        and never below half a second or a poll (a window shorter than a poll
        lets followers miss it). Raises ``ConfigError`` as the config does."""
        floor = max(0.5, matchmaking.poll_interval, matchmaking_lead + progress_interval)
        return cls(
            RoundTimingConfig(
                matchmaking_time=matchmaking.matchmaking_time,
                averaging_timeout=averaging_timeout,
                request_timeout=matchmaking.request_timeout,
                adaptive=adaptive,
                floor=min(matchmaking.matchmaking_time, floor),
            )
        )

    def __init__(self, config: RoundTimingConfig) -> None:
        self.config = config
        self._matchmaking: _Smoothed | None = None
        self._allreduce: _Smoothed | None = None
        self._measured_peers = 1
        #: doubled by each ``missed`` round, reset by each whole one
        self._backoff = 1.0

    def observe(self, *, matchmaking: float, allreduce: float, swarm_size: int) -> None:
        """Record a round whose group formed whole after ``matchmaking`` seconds
        and whose all-reduce took ``allreduce`` seconds, in a swarm of
        ``swarm_size`` peers. Raises ``ValueError`` for negative or non-finite
        times or a size below 1."""
        for value in (matchmaking, allreduce):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"round times must be finite and >= 0, got {value}")
        if swarm_size < 1:
            raise ValueError(f"swarm_size must be at least 1, got {swarm_size}")
        if self._matchmaking is None or self._allreduce is None:
            self._matchmaking, self._allreduce = _Smoothed(matchmaking), _Smoothed(allreduce)
        else:
            self._matchmaking.update(matchmaking)
            self._allreduce.update(allreduce)
        self._measured_peers = swarm_size
        self._backoff = 1.0

    def missed(self) -> None:
        """Record a round whose group did not form whole within the window, or
        whose all-reduce timed out: the matchmaking time and the all-reduce's
        share of the timeout double (up to the configured values) until
        ``observe``."""
        self._backoff = min(2 * self._backoff, 2.0**16)

    def matchmaking_time(self, swarm_size: int) -> float:
        """How long a leader waits for its group, in a swarm of ``swarm_size``."""
        config = self.config
        if not config.adaptive or self._matchmaking is None:
            return config.matchmaking_time
        scale = max(1.0, math.log2(swarm_size + 1) / math.log2(self._measured_peers + 1))
        wanted = config.margin * self._matchmaking.high * scale * self._backoff
        return min(config.matchmaking_time, max(config.floor, wanted))

    def averaging_timeout(self, swarm_size: int) -> float:
        """How long a whole round (matchmaking and all-reduce) may take."""
        config = self.config
        if not config.adaptive or self._allreduce is None:
            return config.averaging_timeout
        bound = self.matchmaking_time(swarm_size) + 2 * config.request_timeout
        wanted = bound + config.margin * self._allreduce.high * self._backoff
        return min(config.averaging_timeout, max(bound + config.floor, wanted))

    def settle(
        self,
        group: Group | None,
        allreduce: float | None,
        *,
        wanted: int,
        one_group: bool,
        swarm_size: int,
    ) -> None:
        """Record how a round went: ``group`` is the group it formed (None: none
        formed), ``allreduce`` the seconds its all-reduce took (None: it timed
        out). ``wanted`` is how many members a whole group has (the expected
        peers, at most the target group size), which only ``one_group`` (a
        one-dimensional grid) lets anyone know. A whole round with the leader's
        ``Group.gathered`` is measured (``observe``); one without it (a leader
        that predates it) changes nothing; any other is ``missed``."""
        if group is None or allreduce is None or (one_group and group.size < wanted):
            self.missed()
        elif group.gathered is not None:
            self.observe(matchmaking=group.gathered, allreduce=allreduce, swarm_size=swarm_size)
