"""Timeouts that adapt: matchmaking time and averaging timeout follow the
measured rounds, within the configured values (pure code)."""

from __future__ import annotations

import math

import pytest

from swarm import ConfigError
from trainer import RoundTiming, RoundTimingConfig

CONFIG = RoundTimingConfig(matchmaking_time=5.0, averaging_timeout=60.0, request_timeout=2.0)


def test_the_configured_values_hold_until_rounds_are_measured() -> None:
    timing = RoundTiming(CONFIG)
    assert timing.matchmaking_time(100) == 5.0
    assert timing.averaging_timeout(100) == 60.0
    fixed = RoundTiming(RoundTimingConfig(5.0, 60.0, 2.0, adaptive=False))
    fixed.observe(matchmaking=0.1, allreduce=0.2, swarm_size=8)
    assert (fixed.matchmaking_time(8), fixed.averaging_timeout(8)) == (5.0, 60.0)


def test_fast_rounds_shorten_both_and_slow_ones_are_capped() -> None:
    timing = RoundTiming(CONFIG)
    timing.observe(matchmaking=0.4, allreduce=2.0, swarm_size=16)
    # mean 0.4, deviation 0.2: 1.5 * (0.4 + 0.8) = 1.8 s
    assert timing.matchmaking_time(16) == pytest.approx(1.8)
    # 1.8 + 2 * 2 + 1.5 * (2.0 + 4 * 1.0) = 14.8 s
    assert timing.averaging_timeout(16) == pytest.approx(14.8)
    # a swarm 16 times larger: look-ups have log2(257)/log2(17) times the hops
    assert timing.matchmaking_time(256) == pytest.approx(1.8 * math.log2(257) / math.log2(17))
    assert timing.matchmaking_time(4) == pytest.approx(1.8)  # never below the measurement
    for _ in range(50):
        timing.observe(matchmaking=30.0, allreduce=300.0, swarm_size=16)
    assert timing.matchmaking_time(16) == 5.0
    assert timing.averaging_timeout(16) == 60.0


def test_the_floor_holds_on_very_fast_links() -> None:
    timing = RoundTiming(CONFIG)
    for _ in range(20):
        timing.observe(matchmaking=0.001, allreduce=0.001, swarm_size=4)
    assert timing.matchmaking_time(4) == 0.5
    assert timing.averaging_timeout(4) == pytest.approx(0.5 + 4.0 + 0.5)


def test_a_missed_round_doubles_the_window_until_a_whole_round_is_measured() -> None:
    timing = RoundTiming(CONFIG)
    timing.missed()  # before any measurement: the configured values hold
    assert timing.matchmaking_time(4) == 5.0
    timing.observe(matchmaking=0.4, allreduce=2.0, swarm_size=4)
    assert timing.matchmaking_time(4) == pytest.approx(1.8)
    timing.missed()
    assert timing.matchmaking_time(4) == pytest.approx(3.6)
    timing.missed()
    assert timing.matchmaking_time(4) == 5.0  # capped by the configured time
    timing.observe(matchmaking=0.4, allreduce=2.0, swarm_size=4)
    # mean 0.4, deviation 0.15: 1.5 * (0.4 + 0.6), no longer doubled
    assert timing.matchmaking_time(4) == pytest.approx(1.5)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="averaging_timeout"):
        RoundTimingConfig(matchmaking_time=5.0, averaging_timeout=9.0, request_timeout=2.0)
    with pytest.raises(ConfigError, match="floor"):
        RoundTimingConfig(5.0, 60.0, 2.0, floor=6.0)
    timing = RoundTiming(CONFIG)
    with pytest.raises(ValueError):
        timing.observe(matchmaking=-1.0, allreduce=1.0, swarm_size=4)
    with pytest.raises(ValueError):
        timing.observe(matchmaking=1.0, allreduce=math.nan, swarm_size=4)
    with pytest.raises(ValueError):
        timing.observe(matchmaking=1.0, allreduce=1.0, swarm_size=0)
